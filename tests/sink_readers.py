"""Read back what the metric sinks wrote: TensorBoard event files (TensorBoard's own reader) and a
W&B offline run directory (RUN_DIR/wandb/offline-run-*/run-<id>.wandb) without W&B's servers.

The .wandb file is W&B's transaction log: a 7-byte header (":W&B", magic, version), then LevelDB-log
framed records (32 KiB blocks; each chunk: crc32c, length, type FULL/FIRST/MIDDLE/LAST) holding
protobuf `Record`s (wandb.proto.wandb_internal_pb2). W&B 0.31 no longer ships a Python reader.
"""
import glob
import json
import os
import struct

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body
            pending = b""


def tensorboard_events(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows them (a resumed run's purged steps gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_scalars(logdir: str) -> dict[str, dict[int, float]]:
    """{tag: {step: value}}; each step must appear once."""
    out = {}
    for tag, events in tensorboard_events(logdir).items():
        out[tag] = dict(events)
        assert len(out[tag]) == len(events), f"{tag}: a step logged twice"
    return out


def read_offline_run(run_dir: str) -> dict:
    """{"run_id", "project", "config": {...}, "history": [{key: value, ...} per logged row]}."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    out = {"run_id": None, "project": None, "config": {}, "history": []}
    for chunk in _chunks(data):
        rec = pb.Record()
        rec.ParseFromString(chunk)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run_id"], out["project"] = rec.run.run_id, rec.run.project
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in rec.history.item})
    return out

"""A run on a 4-device CPU mesh (fsdp 4) with 2 actor processes (run by sharded_publish_test.py).

`python sharded_publish_checks.py RUN_DIR BUCKET_BYTES STEPS [EVAL_ON]` runs `cadence train` in this
process and prints one JSON line: per device, the largest array and the bytes of arrays not laid
out on the mesh (whole copies live on one device), counted from jax.live_arrays() at every
publication, every bucket the weight server builds, and every few milliseconds while a held-out
evaluation runs (every 10 steps and at the end; run.eval_on=EVAL_ON, default auto: the actor
processes evaluate); how often the learner gathered the whole model (LearnerProcesses.gather);
the largest parameter shard; whether a separate process fetching weights at a publication got
exactly the learner's values; the rewards and the evaluations.
"""
from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import subprocess
import sys
import threading

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from cadence.launch.cluster import learner_group  # noqa: E402
from cadence.launch.config import load_config  # noqa: E402
from cadence.launch.metrics import read_metrics  # noqa: E402
from cadence.launch.run import pipeline as pipeline_mod  # noqa: E402
from cadence.launch.run.train import train  # noqa: E402
from cadence.learner import weight_stream  # noqa: E402

FETCH = """
import hashlib, json, sys, zmq
from cadence.protocols.weights_wire import WeightClient
c = WeightClient(sys.argv[1], ctx=zmq.Context())
v, named = c.fetch(-1, timeout=60)
print(json.dumps({"version": v, "sha": {p: hashlib.sha256(a.tobytes()).hexdigest() for p, a in named}}))
"""


def per_device() -> tuple[dict, dict]:
    """(largest array bytes, bytes of buffers that belong to no array laid out on several devices)
    per device: a whole copy lives on one device; a shard's single-device view shares its buffer."""
    arrays = []
    for array in jax.live_arrays():
        try:  # the learner thread may delete (donate) an array while we look
            arrays.append((len(array.sharding.device_set) == 1,
                           [(s.device.id, s.data.unsafe_buffer_pointer(), s.data.nbytes) for s in array.addressable_shards]))
        except (RuntimeError, TypeError):  # deleted: "has been deleted", or its buffers already None
            continue
    on_mesh = {(d, ptr) for one, shards in arrays if not one for d, ptr, _ in shards}
    largest, single, seen = collections.Counter(), collections.Counter(), set()
    for one, shards in arrays:
        for d, ptr, n in shards:
            largest[d] = max(largest[d], n)
            if one and (d, ptr) not in on_mesh and (d, ptr) not in seen:
                seen.add((d, ptr))
                single[d] += n
    return largest, single


def main(run_dir: str, bucket_bytes: int, steps: int, eval_on: str = "auto") -> None:
    assert len(jax.devices()) == 4
    peaks = {"largest": collections.Counter(), "single": collections.Counter(), "samples": 0}
    shard = {"bytes": 0}
    fetched = {}

    lock = threading.Lock()

    def record():
        with lock:
            _record()

    def _record():
        largest, single = per_device()
        for d in range(4):
            peaks["largest"][d] = max(peaks["largest"][d], largest[d])
            peaks["single"][d] = max(peaks["single"][d], single[d])
        peaks["samples"] += 1

    bucket = weight_stream.ShardStream.bucket

    def counted_bucket(self, k):
        out = bucket(self, k)
        record()  # the bucket's pieces are alive now, on their devices
        return out

    weight_stream.ShardStream.bucket = counted_bucket
    publish = pipeline_mod.Pipeline.publish

    def counted_publish(self, params, version, remote=None):
        publish(self, params, version, remote)
        record()
        leaves = jax.tree.leaves(params)
        if version == 3:  # a separate process fetches this version as an actor does
            want = {p: hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()
                    for p, x in zip(self.layout.paths, leaves)}
            env = {**os.environ, "PYTHONPATH": ROOT}
            out = subprocess.run([sys.executable, "-c", FETCH, self.weight_server.endpoint], env=env,
                                 capture_output=True, text=True, timeout=120)
            got = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr}
            fetched.update(version=got.get("version"), same=got.get("sha") == want, error=got.get("error"),
                           largest_leaf_bytes=max(x.nbytes for x in leaves))

    pipeline_mod.Pipeline.publish = counted_publish
    evaluate, evals = pipeline_mod.Pipeline.evaluate, {"calls": 0, "samples": 0}

    def watched_evaluate(self, version):  # counts live arrays while the actors evaluate
        done = threading.Event()

        def watch():
            while not done.wait(0.005):
                record()
                evals["samples"] += 1

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            evals["calls"] += 1
            return evaluate(self, version)
        finally:
            done.set()
            watcher.join()

    pipeline_mod.Pipeline.evaluate = watched_evaluate
    gather, gathers = learner_group.LearnerProcesses.gather, {"calls": 0}

    def counted_gather(self, params):  # the whole model onto this process (what eval_on=learner does)
        gathers["calls"] += 1
        out = gather(self, params)
        record()
        return out

    learner_group.LearnerProcesses.gather = counted_gather
    start = learner_group.LearnerProcesses.start.__func__

    def started(cls, cfg, model_cfg):  # the largest parameter shard one device holds, from the layout
        procs = start(cls, cfg, model_cfg)
        layout = procs.layout
        shard["bytes"] = max(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                             for x, s in zip(jax.tree.leaves(layout.abstract), jax.tree.leaves(layout.params)))
        return procs

    learner_group.LearnerProcesses.start = classmethod(started)
    cfg = load_config(overrides=[
        "actors.processes=2", f"actors.weights_bucket_mb={bucket_bytes / 2**20}", f"run.steps={steps}",
        "learner.sft.steps=30", "task.heldout_size=32", "run.eval_every=10", "run.progress=false",
        "actors.heartbeat_timeout_seconds=60", f"run.eval_on={eval_on}"])
    summary = train(cfg, run_dir)
    rows = [m for m in read_metrics(run_dir) if m["step"] > 0]
    k = max(1, len(rows) // 4)
    print(json.dumps({
        "largest_per_device": [peaks["largest"][d] for d in range(4)],
        "single_device_per_device": [peaks["single"][d] for d in range(4)],
        "samples": peaks["samples"], "largest_shard_bytes": shard["bytes"], "bucket_bytes": bucket_bytes,
        "fetched": fetched, "steps": summary["steps"],
        "weights_sent": rows[-1].get("actors/weights_sent", 0),
        "reward_first": float(np.mean([m["reward/mean"] for m in rows[:k]])),
        "reward_last": float(np.mean([m["reward/mean"] for m in rows[-k:]])),
        "gathers": gathers["calls"], "actor_evals": evals["calls"], "eval_samples": evals["samples"],
        "eval_steps": [m["step"] for m in read_metrics(run_dir) if "eval/reward" in m],
        "final_eval": summary.get("final_eval"),
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])

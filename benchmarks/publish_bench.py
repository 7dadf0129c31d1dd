"""Seconds per weight publication to 2 actor processes: a learner on one device vs fsdp 4 (the
old whole-model gather, and the new bucketed stream of its shards), same model; and the largest
bytes any device holds during a publication vs its shard of the model. One JSON line.

    python benchmarks/publish_bench.py [--d-model 512 --layers 8 --versions 8 --bucket-mb 16]

Runs on 4 CPU devices in this process (jax_num_cpu_devices); the 2 actor processes are real
processes fetching with the WeightClient actors use, over ipc:// sockets. A publication's time
runs from server.publish to both processes holding the version, assembled whole.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402
import zmq  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from cadence.learner import sharding  # noqa: E402
from cadence.learner.config import MeshConfig  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.models.llama import abstract_params  # noqa: E402
from cadence.learner.models.named_arrays import ParamLayout  # noqa: E402
from cadence.learner.weight_stream import ShardStream  # noqa: E402
from cadence.protocols.weights_wire import WeightServer  # noqa: E402

ACTOR = """
import sys, zmq
from cadence.protocols.weights_wire import WeightClient
client, have = WeightClient(sys.argv[1], ctx=zmq.Context()), -1
print("ready", flush=True)
while have < int(sys.argv[2]):
    got = client.fetch(have, timeout=300)
    if got is not None:
        have = got[0]
        print(have, flush=True)
"""


def per_device_max() -> tuple[int, int]:
    """(largest bytes of live arrays on any one device, largest single array on any device)."""
    held, largest, seen = {}, 0, set()
    for array in jax.live_arrays():
        try:
            shards = [(s.device.id, s.data.unsafe_buffer_pointer(), s.data.nbytes) for s in array.addressable_shards]
        except (RuntimeError, TypeError):  # deleted meanwhile
            continue
        for d, ptr, n in shards:
            largest = max(largest, n)
            if (d, ptr) not in seen:
                seen.add((d, ptr))
                held[d] = held.get(d, 0) + n
    return max(held.values()), largest


def run_mode(mode: str, params, versions: int, bucket_bytes: int, layout) -> dict:
    ctx = zmq.Context()
    sock_dir = tempfile.mkdtemp(prefix="cadence-pub-")
    server = WeightServer(f"ipc://{sock_dir}/w", ctx=ctx).start()
    paths = ParamLayout(params).paths
    peaks = {"device": 0, "array": 0}
    base = per_device_max()[0]

    def record():
        held, largest = per_device_max()
        peaks["device"], peaks["array"] = max(peaks["device"], held), max(peaks["array"], largest)

    def source(p):
        if mode == "fsdp4_stream":
            stream = ShardStream(p, paths, None, bucket_bytes)
            build = stream.bucket

            def counted(k):
                out = build(k)
                record()
                return out

            stream.bucket = counted
            return stream
        return None

    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    actors = [subprocess.Popen([sys.executable, "-c", ACTOR, server.endpoint, str(versions)], env=env,
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for a in actors:
        assert a.stdout.readline().strip() == "ready"
    seconds = []
    try:
        for v in range(1, versions + 1):
            p = params  # each version built anew from the learner's arrays (as after an update)
            t0 = time.perf_counter()
            if mode == "fsdp4_stream":
                server.publish_source(v, source(p))
            else:  # today's path: whole on one device (a gather on fsdp 4), then host arrays
                whole = sharding.gather(p, layout) if layout is not None else p
                record()
                server.publish(v, lambda w=whole: ParamLayout(w).named(w))
            for a in actors:
                while int(a.stdout.readline()) < v:
                    pass
            seconds.append(time.perf_counter() - t0)
            record()
            del p
    finally:
        for a in actors:
            a.wait(60)
        server.stop()
        ctx.destroy(linger=0)
    # beyond the params themselves: what a publication adds on the fullest device
    return {"seconds_per_publication": round(float(np.median(seconds[1:] or seconds)), 4),
            "peak_device_bytes": peaks["device"], "extra_device_bytes": peaks["device"] - base,
            "largest_array_bytes": peaks["array"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=8192, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                      d_ff=4 * args.d_model, max_seq_len=64)
    _, abstract = abstract_params(cfg)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), abstract)
    whole_bytes = sharding.tree_bytes(abstract)
    layout = sharding.make_layout(MeshConfig(fsdp=4), abstract)
    bucket = int(args.bucket_mb * (1 << 20))
    out = {"bench": "publish", "params": sum(x.size for x in jax.tree.leaves(abstract)),
           "whole_bytes": whole_bytes, "shard_bytes": sharding.shard_bytes(abstract, layout.params),
           "bucket_bytes": bucket, "actor_processes": 2, "versions": args.versions}
    one = jax.device_put(host, jax.devices()[0])
    out["one_device"] = run_mode("one_device", one, args.versions, bucket, None)
    del one
    sharded = layout.place(host)
    out["fsdp4_gather"] = run_mode("fsdp4_gather", sharded, args.versions, bucket, layout)
    out["fsdp4_stream"] = run_mode("fsdp4_stream", sharded, args.versions, bucket, layout)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

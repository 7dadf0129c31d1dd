"""Distributed weight sync through Cadence's SGLang engine vs a bare torch.distributed broadcast (CPU, gloo).

    python benchmarks/weight_sync_bench.py [--d-model 512 --layers 8 --vocab 8192]

Cadence: engine.sync_weights(params, v) with sync="distributed" to one receiver, everything a
sync does: drain, per-bucket HTTP announcement, JAX->torch through DLPack, kernel transposes,
the broadcast, and the receiver loading the tensors by name into a transformers Llama (the
stand-in of tests/actors/dist_receiver.py: main SGLang needs CUDA). Bare: the same tensors,
already torch, broadcast from rank 0 to a process that only receives them (no HTTP, no JAX, no
load). Same machine, same run, median of repeats. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def bare_receiver(address: str, port: int, shapes_file: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    shapes = json.load(open(shapes_file))
    timeout = datetime.timedelta(seconds=300)
    store, rank, world = next(c10d.rendezvous(f"tcp://{address}:{port}", 1, 2, timeout=timeout))
    pg, _ = c10d._new_process_group_helper(2, 1, [], c10d.Backend("gloo"), c10d.PrefixStore("bare", store),
                                           group_name="bare", timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    bufs = [torch.empty(s) for s in shapes]
    for _ in range(rounds):
        for w in [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]:
            w.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bucket-mb", type=float, default=32.0)  # best of 4-512 on 2 CPU cores (GPUs: see gpu_sglang.sh)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bare-receiver", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_receiver:
        a, p, f, r = args.bare_receiver
        return bare_receiver(a, int(p), f, int(r))

    from actors.config import SGLangConfig
    from actors.sglang.engine import SGLangEngine
    from actors.sglang.server import free_port
    from actors.sglang.weight_broadcast import UpdateGroup, bucket_tensors
    from learner.models.config import ModelConfig
    from learner.models.hf_export import export_checkpoint, hf_tensors
    from learner.models.llama import init_params

    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=8,
                      d_ff=4 * args.d_model, max_seq_len=256)
    work = tempfile.mkdtemp(prefix="cadence-wsync-")
    _, params = init_params(cfg, 0)
    export_checkpoint(cfg, params, os.path.join(work, "start"))
    tensors = hf_tensors(cfg, params)
    gb = sum(t.value.nbytes for t in tensors) / 1e9

    # Cadence: the engine against one stand-in receiver.
    port = free_port()
    receiver = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/actors/dist_receiver.py"),
                                 "--model-path", os.path.join(work, "start"), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(0.2)
        sg = SGLangConfig(urls=(f"http://127.0.0.1:{port}",), sync="distributed", dist_backend="gloo",
                          dist_bucket_mb=args.bucket_mb, request_timeout_s=300.0)
        eng = SGLangEngine(sg, max_new_tokens=1, eos_id=2, pad_id=0, work_dir=os.path.join(work, "engine"),
                           export_fn=lambda p, d: None, tensors_fn=lambda p: hf_tensors(cfg, p))
        t0 = time.perf_counter()
        eng.sync_weights(params, 0)  # forms the group
        first = time.perf_counter() - t0
        cadence = []
        for v in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            eng.sync_weights(params, v)
            cadence.append(time.perf_counter() - t0)
        buckets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info").read())["updates"]
        buckets //= args.repeats + 1
        eng.close()
    finally:
        receiver.kill()

    # Bare: the same tensors as torch, rank 0 -> a receive-only process.
    pairs = bucket_tensors(tensors, None, "gloo")
    torch_tensors = [t.clone() for _, t in pairs]
    shapes_file = os.path.join(work, "shapes.json")
    json.dump([list(t.shape) for t in torch_tensors], open(shapes_file, "w"))
    group = UpdateGroup("gloo", "127.0.0.1", 0, 2, "bare", 300)
    peer = subprocess.Popen([sys.executable, __file__, "--bare-receiver", "127.0.0.1", str(group.port), shapes_file,
                             str(args.repeats + 1)])
    group.join()
    bare = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        group.broadcast([(None, t) for t in torch_tensors])
        bare.append(time.perf_counter() - t0)
    peer.wait()
    group.close()
    bare = bare[1:]
    c, b = statistics.median(cadence), statistics.median(bare)
    print(json.dumps({"bench": "weight_sync_distributed", "backend": "gloo", "params_m": round(gb / 4e-3, 1),
                      "gb": round(gb, 3), "buckets": buckets, "first_sync_with_group_s": round(first, 3),
                      "cadence_s": round(c, 3), "bare_broadcast_s": round(b, 3), "ratio_bare_over_cadence": round(b / c, 3),
                      "cadence_gb_per_s": round(gb / c, 2), "bare_gb_per_s": round(gb / b, 2)}))


if __name__ == "__main__":
    main()

"""Distributed weight sync through Cadence's SGLang engine vs a bare torch.distributed broadcast.

    python benchmarks/weight_sync_bench.py [--d-model 512 --layers 8 --vocab 8192]      # CPU, gloo
    python benchmarks/weight_sync_bench.py --backend nccl --preset llama-1b --dist-dtype bfloat16 \
        --receiver-dtype bfloat16 --kl                                                  # one GPU

Cadence: engine.sync_weights(params, v) with sync="distributed" to one receiver, everything a
sync does: drain, per-bucket HTTP announcement, JAX->torch through DLPack, kernel transposes and
casts, the broadcast, and the receiver loading the tensors by name into a transformers Llama (the
stand-in of tests/actors/dist_receiver.py, which plays main SGLang's receive code). Bare: the same
tensors, already torch, broadcast from rank 0 to a process that only receives them (no HTTP, no
JAX, no load). Same machine, same transport, same run, median of repeats. Also: the sender's
preparation alone (transposes, casts, DLPack for every bucket), and with --kl the logits of the
receiver after the sync against the learner's JAX model on the same tokens (KL(server || learner)
per position: every tensor must have arrived, and what is left is the two frameworks' numerics).
Prints one JSON line.

One GPU, nccl: NCCL refuses two ranks of one group on the same device ("Duplicate GPU"), so the
learner and the receiver get different NCCL_HOSTIDs and NCCL treats them as two hosts: the bytes
go GPU -> host -> TCP over loopback -> host -> GPU, for Cadence and the bare broadcast alike. On
separate GPUs (NVLink, InfiniBand) the transport is faster; the ratio is what Cadence adds.
"""
from __future__ import annotations

import argparse
import datetime
import io
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
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the GPU is shared with torch and the receiver

# Shapes of real checkpoints (random weights: only sizes matter to a sync).
PRESETS = {
    "llama-1b": dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                     rope_theta=500000.0, tie_embeddings=True, max_seq_len=2048),  # Llama 3.2 1B
}


def random_params(cfg):
    """(graphdef, params) with N(0, 0.02) weights and unit norms, one small jitted fill per shape.

    init_params compiles the whole model's initialization as one program: 76 s for the 1B shape
    on an H200 (XLA compile time; 36 s of work on 2 CPU cores). Only sizes matter to a sync."""
    import functools

    import jax
    import jax.numpy as jnp

    from cadence.learner.models.llama import abstract_params

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    graphdef, abstract = abstract_params(cfg)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(abstract))))

    def fill(path, leaf):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(leaf.shape, leaf.dtype)
        return normal(next(keys), leaf.shape, leaf.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(fill, abstract)


def one_gpu_nccl_env(role: str) -> dict:
    """Env for a process of a one-GPU nccl run: its own NCCL host id, several sockets on loopback."""
    env = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
    return {**env, **{k: os.environ[k] for k in env if k in os.environ}, "NCCL_HOSTID": f"cadence-bench-{role}"}


def bare_receiver(address: str, port: int, spec_file: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    spec = json.load(open(spec_file))
    timeout = datetime.timedelta(seconds=300)
    store, rank, world = next(c10d.rendezvous(f"tcp://{address}:{port}", 1, 2, timeout=timeout))
    pg, _ = c10d._new_process_group_helper(2, 1, [], c10d.Backend(spec["backend"]), c10d.PrefixStore("bare", store),
                                           group_name="bare", timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    bufs = [torch.empty(s, dtype=getattr(torch, d), device=spec["device"]) for s, d in zip(spec["shapes"], spec["dtypes"])]
    for _ in range(rounds):
        for w in [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]:
            w.wait()
    if spec["device"] == "cuda":
        torch.cuda.synchronize()  # nccl's wait() only orders streams: exiting earlier breaks rank 0's sends
    dist.destroy_process_group(pg)


def wait_healthy(port: int, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stand-in receiver did not start (exit {proc.poll()})")
            time.sleep(0.2)


def logits_kl(port: int, graphdef, params, vocab: int, batch: int = 4, length: int = 64) -> dict:
    """KL(server || learner) per position on random tokens, and the largest logit difference."""
    import jax.numpy as jnp
    import numpy as np

    from cadence.learner.models.llama import forward

    tokens = np.random.default_rng(0).integers(0, vocab, size=(batch, length))
    req = urllib.request.Request(f"http://127.0.0.1:{port}/stand_in/logits.npy",
                                 data=json.dumps({"input_ids": tokens.tolist()}).encode(),
                                 headers={"Content-Type": "application/json"})
    server = np.load(io.BytesIO(urllib.request.urlopen(req, timeout=300).read()), allow_pickle=False)
    learner = np.asarray(forward(graphdef, params, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(length), tokens.shape),
                                 jnp.ones(tokens.shape, bool)), np.float64)
    server = server.astype(np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ls, ll = log_softmax(server), log_softmax(learner)
    kl = (np.exp(ls) * (ls - ll)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "logit_max_abs_diff": float(np.abs(server - learner).max()),
            "logit_std": float(learner.std()), "argmax_agree": float((server.argmax(-1) == learner.argmax(-1)).mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--device", default="", help="the receivers' device (default: cuda for nccl, else cpu)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="", help="a real model's shape instead of the sizes below")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dist-dtype", default="", help="dtype on the wire ('' = the params' float32)")
    ap.add_argument("--receiver-dtype", default="float32")
    ap.add_argument("--bucket-mb", type=float, default=32.0)  # best of 4-512 on 2 CPU cores
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kl", action="store_true", help="compare the receiver's logits with the learner's after the sync")
    ap.add_argument("--bare-receiver", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_receiver:
        a, p, f, r = args.bare_receiver
        return bare_receiver(a, int(p), f, int(r))
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")

    import torch

    one_gpu = args.backend == "nccl" and torch.cuda.device_count() == 1
    if one_gpu:
        os.environ.update(one_gpu_nccl_env("learner"))
    peer_env = {**os.environ, **(one_gpu_nccl_env("receiver") if one_gpu else {})}

    import jax

    from cadence.actors.config import SGLangConfig
    from cadence.actors.sglang.engine import SGLangEngine
    from cadence.actors.sglang.server import free_port
    from cadence.actors.sglang.weight_broadcast import UpdateGroup, bucket_tensors, plan_buckets, sent_nbytes
    from cadence.learner.models import hf_config
    from cadence.learner.models.config import ModelConfig
    from cadence.learner.models.hf_export import hf_tensors
    from cadence.learner.models.llama import count_params

    if args.preset:
        cfg = ModelConfig(**PRESETS[args.preset])
    else:
        cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=8,
                          d_ff=4 * args.d_model, max_seq_len=256)
    work = tempfile.mkdtemp(prefix="cadence-wsync-")
    t0 = time.perf_counter()
    graphdef, params = random_params(cfg)
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0
    os.makedirs(os.path.join(work, "start"))
    with open(os.path.join(work, "start", "config.json"), "w") as f:  # no weights: the receiver starts random
        json.dump(hf_config.hf_from_model_config(cfg), f)
    tensors = hf_tensors(cfg, params)
    dtype = args.dist_dtype or None
    wire_gb = sum(sent_nbytes(t, dtype) for t in tensors) / 1e9
    out = {"bench": "weight_sync_distributed", "backend": args.backend, "device": device,
           "jax_device": str(jax.devices()[0]), "params_m": round(count_params(params) / 1e6, 1),
           "wire_dtype": args.dist_dtype or "float32", "receiver_dtype": args.receiver_dtype,
           "wire_gb": round(wire_gb, 3), "bucket_mb": args.bucket_mb, "init_s": round(init_s, 2)}
    if one_gpu:
        env = one_gpu_nccl_env("learner")
        out["transport"] = ("one GPU: nccl between two NCCL host ids, TCP over loopback with host staging, "
                            f"{env['NCCL_SOCKET_NTHREADS']} threads x {env['NCCL_NSOCKS_PERTHREAD']} sockets")
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))

    # The sender's preparation alone: every bucket's transposes, casts and DLPack handoff.
    buckets = plan_buckets(tensors, int(args.bucket_mb * (1 << 20)), dtype)
    prep = []
    for _ in range(3):
        t0 = time.perf_counter()
        for b in buckets:
            pairs = bucket_tensors(b, dtype, args.backend)
            if device == "cuda":
                torch.cuda.synchronize()
            del pairs
        prep.append(time.perf_counter() - t0)
    out.update(buckets=len(buckets), sender_prep_s=round(min(prep), 3))

    # Cadence: the engine against one stand-in receiver.
    port = free_port()
    log = open(os.path.join(work, "receiver.log"), "w")
    receiver = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/actors/dist_receiver.py"),
                                 "--model-path", os.path.join(work, "start"), "--port", str(port),
                                 "--device", device, "--dtype", args.receiver_dtype],
                                stdout=log, stderr=subprocess.STDOUT, env=peer_env)
    try:
        wait_healthy(port, receiver)
        sg = SGLangConfig(urls=(f"http://127.0.0.1:{port}",), sync="distributed", dist_backend=args.backend,
                          dist_dtype=args.dist_dtype, dist_bucket_mb=args.bucket_mb, request_timeout_s=300.0)
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
        updates = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info").read())["updates"]
        out.update(first_sync_with_group_s=round(first, 3), cadence_s=round(statistics.median(cadence), 3),
                   cadence_all_s=[round(c, 3) for c in cadence], announced_buckets=updates // (args.repeats + 1))
        if args.kl:
            out.update(logits_kl(port, graphdef, params, cfg.vocab_size))
        eng.close()
        print("cadence side done:", json.dumps(out), file=sys.stderr, flush=True)  # kept if the bare part is cut
    except BaseException:
        log.flush()
        sys.stderr.write(open(log.name).read()[-4000:])
        raise
    finally:
        receiver.kill()
        receiver.wait()

    # Bare: the same tensors as torch, rank 0 -> a receive-only process.
    torch_tensors = [t.clone() for b in buckets for _, t in bucket_tensors(b, dtype, args.backend)]
    spec_file = os.path.join(work, "spec.json")
    json.dump({"backend": args.backend, "device": device, "shapes": [list(t.shape) for t in torch_tensors],
               "dtypes": [str(t.dtype).removeprefix("torch.") for t in torch_tensors]}, open(spec_file, "w"))
    group = UpdateGroup(args.backend, "127.0.0.1", 0, 2, "bare", 300)
    peer = subprocess.Popen([sys.executable, __file__, "--bare-receiver", "127.0.0.1", str(group.port), spec_file,
                             str(args.repeats + 1)], env=peer_env)
    group.join()
    bare = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        group.broadcast([(None, t) for t in torch_tensors])
        bare.append(time.perf_counter() - t0)
    peer.wait()
    group.close()
    c, b = out["cadence_s"], statistics.median(bare[1:])
    out.update(bare_broadcast_s=round(b, 3), ratio_bare_over_cadence=round(b / c, 3),
               cadence_gb_per_s=round(wire_gb / c, 2), bare_gb_per_s=round(wire_gb / b, 2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""HF checkpoint load and export: time and peak memory vs a bare safetensors read of the same files.

Builds a random Qwen2-style checkpoint (default ~100M params, fp32, 4 shards) in a temp dir, then
runs each phase in a fresh subprocess so peak RSS is the phase's own:
  bare:   safetensors ``safe_open(...).get_tensor`` of every tensor into NumPy (nothing else).
  load:   ``hf_load.load_checkpoint`` (config, name mapping, transpose, cast, device_put).
  export: load, then ``hf_export.export_checkpoint`` (its extra peak over the loaded state is the
          streaming cost: about one shard, never a second full copy).
Page cache is warmed first and each timing is the best of --repeats. Goal: load <= 1.5x bare.
Prints one JSON line. Run: `.venv/bin/python benchmarks/hf_load_bench.py [--layers 12 --d-model 768]`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_mb() -> float:
    # Peak RSS of this process (Linux VmHWM; ru_maxrss would carry the parent's peak across exec).
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # KiB


def _phase(name: str, ckpt: str, out: str) -> dict:
    """Runs in a subprocess: one phase, reports seconds and peak RSS (MB) above the import baseline."""
    import jax  # noqa: F401  (imported before the baseline so both phases pay it equally)
    from safetensors import safe_open

    from cadence.learner.models import hf_export, hf_load

    base = _rss_mb()
    t0 = time.perf_counter()
    if name == "bare":
        arrays = []
        for file in sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors")):
            with safe_open(os.path.join(ckpt, file), framework="np") as f:
                arrays.extend(f.get_tensor(k) for k in f.keys())
        n = sum(a.nbytes for a in arrays)
        return {"seconds": time.perf_counter() - t0, "peak_mb": _rss_mb() - base, "bytes": n}
    cfg, _, params = hf_load.load_checkpoint(ckpt)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    loaded_peak = _rss_mb()
    if name == "load":
        return {"seconds": load_s, "peak_mb": loaded_peak - base}
    t1 = time.perf_counter()
    hf_export.export_checkpoint(cfg, params, out, max_shard_bytes=int(os.environ["BENCH_SHARD_BYTES"]))
    return {"seconds": time.perf_counter() - t1, "peak_mb": _rss_mb() - base,
            "extra_peak_mb": _rss_mb() - loaded_peak}


def _run_phase(name: str, ckpt: str, out: str, shard_bytes: int) -> dict:
    env = {**os.environ, "BENCH_SHARD_BYTES": str(shard_bytes), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run([sys.executable, __file__, "--phase", name, "--ckpt", ckpt, "--out", out],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shards", type=int, default=4, help="approximate number of safetensors shards")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--phase", choices=["bare", "load", "export"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(_phase(args.phase, args.ckpt, args.out)))
        return

    from cadence.learner.models.config import ModelConfig
    from cadence.learner.models.hf_random import write_random_checkpoint
    from cadence.learner.models.llama import count_params, init_params

    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=12,
                      n_kv_heads=4, d_ff=args.d_ff, max_seq_len=4096, qkv_bias=True)
    n_params = count_params(init_params(cfg, 0)[1])
    shard_bytes = 4 * n_params // args.shards + 1
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "out")
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt, cfg, tokenizer=False, max_shard_bytes=shard_bytes)
        build_s = time.perf_counter() - t0
        _run_phase("bare", ckpt, out, shard_bytes)  # warm the page cache
        results = {}
        for name in ("bare", "load", "export"):
            runs = [_run_phase(name, ckpt, out, shard_bytes) for _ in range(args.repeats)]
            results[name] = min(runs, key=lambda r: r["seconds"])
        n_shards = len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])
    bare, load, export = results["bare"], results["load"], results["export"]
    print(json.dumps({
        "bench": "hf_load",
        "params": n_params,
        "checkpoint_mb": round(bare["bytes"] / 2**20, 1),
        "shards": n_shards,
        "build_seconds": round(build_s, 2),
        "bare_read_seconds": round(bare["seconds"], 3),
        "load_seconds": round(load["seconds"], 3),
        "load_vs_bare": round(load["seconds"] / bare["seconds"], 2),
        "export_seconds": round(export["seconds"], 3),
        "bare_read_peak_mb": round(bare["peak_mb"], 1),
        "load_peak_mb": round(load["peak_mb"], 1),
        "export_extra_peak_mb": round(export["extra_peak_mb"], 1),
        "goal_load_vs_bare": 1.5,
    }))


if __name__ == "__main__":
    main()

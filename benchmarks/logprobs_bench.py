"""Chunked log-probs (learner.logits_chunk) vs whole [B, T, V] logits: peak memory and tokens/s.

One GRPO gradient of one SmolLM2-135M-shaped microbatch (30 layers, d 576, 9/3 heads, d_ff 1536,
vocab 49,152, tied embeddings; random init, float32): GRPOTrainStep's jitted accumulate (value_and_grad
of the loss plus the gradient sum), 8 rows x 1024 tokens, 960 of them completion.
  unchunked   learner.logits_chunk=0: the [8, 1024, 49152] float32 logits (1.6 GB) and their softmax
  chunked     learner.logits_chunk=--chunk: [8, C, V] at a time, recomputed in the backward pass
Each variant runs in its own process (so peak RSS is its own): XLA's compiled memory analysis
(temp + arguments + outputs - donated aliases) and the process's peak RSS over one gradient; then
tokens/s, both variants in one process run alternately (median of --repeats rounds; the load of
a shared machine drifts over minutes). The executed run ("run") has --layers 2: at 30 layers one
8 x 1024 gradient needs ~40 GB of activations on XLA's CPU backend whichever variant (more than the
24 GB reference machine), and the logits part that chunking changes does not depend on depth; the
30-layer shape is compiled only, for XLA's memory analysis ("full_depth_xla", --xla-layers).
Prints one JSON line.
Run: `python benchmarks/logprobs_bench.py [--layers 2] [--xla-layers 30] [--batch 8] [--seq 1024]
[--chunk 128]` (about 10 minutes on 2 cores).
`--shape builtin`: the built-in model (127k params, vocab 64) at the default run's microbatch,
32 x 16 tokens, with a chunk (8) that does split it: what chunking costs where logits are tiny.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = 64  # prompt tokens per row; the rest of the row is completion (scored)


def model_config(shape: str, layers: int):
    from cadence.learner.models.config import ModelConfig

    if shape == "builtin":
        return ModelConfig()
    return ModelConfig(vocab_size=49152, d_model=576, n_layers=layers, n_heads=9, n_kv_heads=3, d_ff=1536,
                       max_seq_len=2048, rope_theta=100000.0, tie_embeddings=True)


def microbatch(batch: int, seq: int, vocab: int):
    import numpy as np

    from cadence.learner.batching import Microbatch

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, vocab, size=(batch, seq)).astype(np.int32)
    loss_mask = np.zeros((batch, seq), np.float32)
    loss_mask[:, min(PROMPT, seq // 2):] = 1.0
    return Microbatch(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
        mask=np.ones((batch, seq), bool),
        loss_mask=loss_mask,
        behavior_logprobs=(-3.0 * rng.random((batch, seq)) * loss_mask).astype(np.float32),
        advantages=np.where(np.arange(batch) % 2, 1.0, -1.0).astype(np.float32),
    )


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _setup(args, chunk: int):
    """(compiled accumulate step, its call arguments but the gradient buffer, step, model config,
    compile seconds) of one variant."""
    import jax

    from cadence.learner.config import LearnerConfig
    from cadence.learner.models import llama
    from cadence.learner.steps import make_train_step

    mcfg = model_config(args.shape, args.layers)
    graphdef, params = llama.init_params(mcfg, 0)
    jax.block_until_ready(params)
    cfg = LearnerConfig(batch_size=args.batch, microbatch_size=args.batch, group_size=args.batch,
                        logits_chunk=chunk, remat=args.remat)
    step = make_train_step(graphdef, cfg)
    mb = microbatch(args.batch, args.seq, mcfg.vocab_size)
    packed, n, s = step._prepare(params, [mb], float(mb.loss_mask.sum()), None)
    t0 = time.perf_counter()
    compiled = step._accumulate.lower(params, step._zeros(params), packed[0], n, s).compile()
    return compiled, (params, packed[0], n, s), step, mcfg, time.perf_counter() - t0


def _run(compiled, step, call) -> tuple[float, object]:
    """Seconds of one gradient (a fresh gradient buffer each time: the step donates it)."""
    import jax

    params, packed, n, s = call
    grads = step._zeros(params)
    jax.block_until_ready(grads)
    t0 = time.perf_counter()
    grads, stats = compiled(params, grads, packed, n, s)
    jax.block_until_ready((grads, stats))
    return time.perf_counter() - t0, stats


def child(args) -> dict:
    """One variant in this process: compile and XLA's memory analysis, then (unless compile-only)
    one gradient, for the process's peak RSS."""
    import jax

    from cadence.learner.models import llama

    rss_before = rss_mb()
    compiled, call, step, mcfg, compile_s = _setup(args, args.logits_chunk)
    mem = compiled.memory_analysis()
    peak = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    out = {"logits_chunk": args.logits_chunk, "xla_temp_mb": round(mem.temp_size_in_bytes / 2**20, 1),
           "xla_peak_mb": round(peak / 2**20, 1), "compile_s": round(compile_s, 1),
           "model_params": llama.count_params(call[0]), "vocab": mcfg.vocab_size,
           "device": jax.devices()[0].device_kind}
    if args.compile_only:
        return out
    seconds, stats = _run(compiled, step, call)
    return {**out, "rss_peak_mb": round(rss_mb(), 1), "rss_before_mb": round(rss_before, 1),
            "first_step_s": round(seconds, 3),
            # equal in both variants (a check that the two compute the same loss)
            "metrics": {k: round(float(v), 5) for k, v in zip(step.metric_keys, jax.device_get(stats))
                        if k in ("loss", "pg_loss", "logprob_diff_abs")}}


def time_both(args) -> dict:
    """Both variants compiled in one process and run alternately, so a drifting load on a shared
    machine hits them alike; seconds per gradient of each of --repeats rounds."""
    variants = {name: _setup(args, chunk) for name, chunk in (("unchunked", 0), ("chunked", args.chunk))}
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (compiled, call, step, _, _) in variants.items():
            times[name].append(_run(compiled, step, call)[0])
    return {name: [round(t, 3) for t in ts] for name, ts in times.items()}


def run_variants(args, layers: int, compile_only: bool) -> tuple[dict, dict]:
    """Both variants, each in its own process; {"unchunked": {...}, "chunked": {...}, ratios}."""
    cmd = [sys.executable, __file__, "--shape", args.shape, "--layers", str(layers), "--batch", str(args.batch),
           "--seq", str(args.seq), "--remat", args.remat, "--repeats", str(args.repeats)]
    cmd += ["--compile-only"] * compile_only
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {}
    for name, chunk in (("unchunked", 0), ("chunked", args.chunk)):
        proc = subprocess.run(cmd + ["--logits-chunk", str(chunk)], env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{name} variant ({layers} layers) failed:\n{proc.stderr[-4000:]}")
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    u, c = out["unchunked"], out["chunked"]
    res = {"layers": None if args.shape == "builtin" else layers, "model_params": u["model_params"]}
    for name in ("unchunked", "chunked"):
        res[name] = {k: v for k, v in out[name].items() if k not in ("device", "model_params", "vocab")}
    res["xla_peak_ratio"] = round(c["xla_peak_mb"] / u["xla_peak_mb"], 3)
    res["xla_peak_saved_mb"] = round(u["xla_peak_mb"] - c["xla_peak_mb"], 1)
    if not compile_only:
        res["rss_peak_ratio"] = round(c["rss_peak_mb"] / u["rss_peak_mb"], 3)
        res["rss_peak_saved_mb"] = round(u["rss_peak_mb"] - c["rss_peak_mb"], 1)
        proc = subprocess.run(cmd + ["--time-both", "--chunk", str(args.chunk)], env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"timing ({layers} layers) failed:\n{proc.stderr[-4000:]}")
        times = json.loads(proc.stdout.strip().splitlines()[-1])
        tokens = args.batch * args.seq
        for name in ("unchunked", "chunked"):
            res[name]["step_s"] = times[name]
            res[name]["tokens_per_s"] = round(tokens / statistics.median(times[name]), 1)
        res["tokens_per_s_ratio"] = round(res["chunked"]["tokens_per_s"] / res["unchunked"]["tokens_per_s"], 3)
    return res, u


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("smollm2", "builtin"), default="smollm2")
    ap.add_argument("--layers", type=int, default=2, help="smollm2: decoder layers of the executed run")
    ap.add_argument("--xla-layers", type=int, default=30,
                    help="smollm2: layers of the compile-only memory analysis (0: skip it)")
    ap.add_argument("--batch", type=int, default=None, help="rows (default 8; builtin 32)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 1024; builtin 16)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="learner.logits_chunk of the chunked variant (default 128; builtin 8)")
    ap.add_argument("--remat", default="none", help="learner.remat for both variants")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds, median (default 2; builtin 30)")
    ap.add_argument("--logits-chunk", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--time-both", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    small = args.shape == "builtin"
    for key, big, little in (("batch", 8, 32), ("seq", 1024, 16), ("chunk", 128, 8), ("repeats", 2, 30)):
        if getattr(args, key) is None:
            setattr(args, key, little if small else big)
    if args.time_both:
        print(json.dumps(time_both(args)))
        return
    if args.logits_chunk is not None:
        print(json.dumps(child(args)))
        return
    run, u = run_variants(args, args.layers, compile_only=False)
    line = {"bench": "logprobs_chunked", "device": u["device"], "shape": args.shape, "vocab": u["vocab"],
            "batch": args.batch, "seq_len": args.seq, "chunk": args.chunk, "remat": args.remat, "run": run}
    if not small and args.xla_layers:
        line["full_depth_xla"] = run_variants(args, args.xla_layers, compile_only=True)[0]
    print(json.dumps(line))


if __name__ == "__main__":
    main()

"""The KV cache in bfloat16 (`engine.kv_dtype`) vs the model's float32, on SmolLM2-135M's shape:
generated tokens/s, the process's peak resident memory, and how far greedy decoding moves.

Each dtype runs in a process of its own (the peak, VmHWM, is per process): the model loaded (the
converted SmolLM2 checkpoint when benchmarks/real_model.py prepared it, else a random init of its
shape), one warm-up call, then timed generate calls of `--batch` rows, `--prompt-len` prompt
tokens and `--new-tokens` new ones, sampling at temperature 1 with EOS disabled (every row makes
every token), then one greedy call whose tokens and log-probs both sides write out. Baseline: the
float32 cache in the same run. Prints one JSON line.
Run: `python benchmarks/kv_dtype_bench.py [--batch 32 --prompt-len 96 --new-tokens 256]`.
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


def vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def one(args) -> None:
    import jax
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from model_shapes import SHAPES  # noqa: E402  (benchmarks/)

    from cadence.actors.engine import EngineConfig, JaxEngine
    from cadence.learner.models import llama
    from cadence.learner.models.config import ModelConfig

    ckpt = os.path.join(os.environ.get("CADENCE_CACHE", os.path.expanduser("~/.cache/cadence")),
                        "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(ckpt, "config.json")):
        from cadence.learner.models.hf_load import load_checkpoint

        cfg, graphdef, params = load_checkpoint(ckpt, ModelConfig(path=ckpt))
        source = "checkpoint"
    else:
        cfg = ModelConfig(**SHAPES["smollm2-135m"], max_seq_len=2048)
        graphdef, params = llama.init_params(cfg, 0)
        source = "random"
    before = vm_hwm_mb()
    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=args.new_tokens, batch_buckets=(args.batch,),
                                                   prompt_bucket=args.prompt_len, kv_dtype=args.one),
                       eos_id=cfg.vocab_size, pad_id=0)
    prompts = np.random.default_rng(0).integers(10, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    engine.generate(params, prompts, jax.random.key(0))
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        r = engine.generate(params, prompts, jax.random.key(1 + i))
        times.append(time.perf_counter() - t0)
    greedy = engine.generate(params, prompts, jax.random.key(0), greedy=True)
    np.savez(args.out, tokens=greedy.tokens, logprobs=greedy.logprobs)
    print(json.dumps({"kv_dtype": args.one or cfg.compute_dtype, "source": source,
                      "tokens_per_s": round(r.num_tokens / float(np.median(times)), 1),
                      "peak_mb": round(vm_hwm_mb()), "peak_mb_before_generate": round(before),
                      "kv_cache_mb": round(2 * cfg.n_layers * args.batch * (args.prompt_len + args.new_tokens - 1)
                                           * cfg.n_kv_heads * cfg.head_dim
                                           * (2 if args.one in ("bfloat16", "float16") else 4) / 2**20)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        return one(args)
    import numpy as np

    runs, outs = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for dtype in ("float32", "bfloat16"):
            outs[dtype] = os.path.join(d, f"{dtype}.npz")
            cmd = [sys.executable, __file__, "--one", dtype, "--out", outs[dtype], "--batch", str(args.batch),
                   "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                   "--repeats", str(args.repeats)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            if r.returncode:
                sys.exit(r.stderr[-3000:])
            runs[dtype] = json.loads(r.stdout.strip().splitlines()[-1])
        a, b = np.load(outs["float32"]), np.load(outs["bfloat16"])
        same = a["tokens"] == b["tokens"]
        first_diff = [int(np.argmin(row)) if not row.all() else row.size for row in same]
        # log-probs of the greedy tokens before each row's first differing token
        agree = np.arange(same.shape[1])[None, :] < np.asarray(first_diff)[:, None]
        dlp = np.abs(a["logprobs"] - b["logprobs"])[agree]
    f32, bf16 = runs["float32"], runs["bfloat16"]
    print(json.dumps({"bench": "kv_dtype", "batch": args.batch, "prompt_len": args.prompt_len,
                      "new_tokens": args.new_tokens, "source": f32["source"], "float32": f32, "bfloat16": bf16,
                      "peak_saved_mb": f32["peak_mb"] - bf16["peak_mb"],
                      "speed_ratio": round(bf16["tokens_per_s"] / f32["tokens_per_s"], 3),
                      "greedy_tokens_equal_before_first_difference": round(float(np.mean(first_diff)) / same.shape[1], 3),
                      "greedy_rows_identical": int(sum(d == same.shape[1] for d in first_diff)),
                      "max_abs_logprob_diff_while_equal": round(float(dlp.max()) if dlp.size else 0.0, 5),
                      "mean_abs_logprob_diff_while_equal": round(float(dlp.mean()) if dlp.size else 0.0, 6)}))


if __name__ == "__main__":
    main()

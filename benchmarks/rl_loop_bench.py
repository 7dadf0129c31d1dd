"""The whole RL loop at a real model's shape: `cadence train` in this process (engine and learner
on one device, threads), a Llama-shaped model at random init, packed microbatches and chunked
log-probs; one JSON line with the time per update split into generation and learner, the learner's
tokens/s and MFU, and the device's peak memory (JAX's count; the process's peak RSS on a CPU).

    python benchmarks/rl_loop_bench.py --preset 0.5b --steps 8            # on a GPU
    python benchmarks/rl_loop_bench.py --preset tiny --steps 3 --max-new-tokens 64   # CPU dry run

The baseline is the learner alone on the same shapes (gpu_check.sh's rl_packed parts, same call):
the loop's learner tokens/s below that is time lost to sharing the device with generation. The
sort task's prompts are short and a random-init policy rarely samples EOS, so completions run to
--max-new-tokens: generation here is the long-completion worst case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from learner_scale_bench import PEAK_TFLOPS, PRESETS, peak_bytes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=8, help="updates (the first two, compiling, are not timed)")
    p.add_argument("--batch", type=int, default=64, help="samples per update")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--microbatch-tokens", type=int, default=8192)
    p.add_argument("--logits-chunk", type=int, default=128)
    p.add_argument("--remat", choices=["none", "block", "full"], default="block")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()

    import jax

    from cadence.launch.cli import main as cadence

    shape = PRESETS[args.preset]
    run_dir = tempfile.mkdtemp(prefix="rl-loop-")
    overrides = [f"model.{k}={v}" for k, v in shape.items()] + [
        f"model.max_seq_len={args.max_new_tokens + 64}", f"model.param_dtype={args.dtype}",
        f"model.compute_dtype={args.dtype}", f"engine.max_new_tokens={args.max_new_tokens}",
        f"learner.batch_size={args.batch}", f"learner.group_size={args.group}",
        f"learner.microbatch_tokens={args.microbatch_tokens}", f"learner.logits_chunk={args.logits_chunk}",
        f"learner.remat={args.remat}", "learner.sft.steps=0", f"run.steps={args.steps}",
        "run.eval_every=0", "task.heldout_size=16", f"run.dir={run_dir}", "run.log_every=1",
        "checkpoint.every_steps=100000",
    ]
    rc = cadence(["train", *overrides])
    if rc != 0:
        raise SystemExit(f"cadence train exited {rc}")
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in records if "learner/train_seconds" in r]
    timed = steps[2:] or steps  # the first updates compile the learner's step and the engine
    wall = [b["wall_time"] - a["wall_time"] for a, b in zip(timed, timed[1:])]
    train_s = statistics.median(r["learner/train_seconds"] for r in timed)
    tokens = statistics.median(r["tokens"] for r in timed)
    kind = jax.devices()[0].device_kind
    from cadence.learner.models import llama
    from cadence.learner.models.config import ModelConfig

    n = llama.count_params(llama.abstract_params(ModelConfig(**shape))[1])
    peak = PEAK_TFLOPS.get(kind)
    mfu = (6 * n * tokens / train_s / (peak * 1e12)) if peak else None
    print(json.dumps({
        "bench": "rl_loop", "preset": args.preset, "device": kind, "params": n,
        "updates_timed": len(timed), "samples_per_update": args.batch, "max_new_tokens": args.max_new_tokens,
        "tokens_per_update": tokens,
        "seconds_per_update": statistics.median(wall) if wall else None,
        "learner_seconds": train_s, "learner_tokens_per_s": tokens / train_s, "learner_mfu": mfu,
        # actors/generate_seconds is cumulative: its growth per update is the engine's time per update
        "generate_seconds_per_update": ((timed[-1]["actors/generate_seconds"] - timed[0]["actors/generate_seconds"])
                                        / (len(timed) - 1)) if len(timed) > 1 else None,
        "gen_tokens_per_s": statistics.median(r.get("actors/tokens_per_second", float("nan")) for r in timed),
        "learner_wait_seconds": statistics.median(r.get("learner/wait_seconds", 0.0) for r in timed),
        "peak_device_bytes": peak_bytes(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    main()

"""Skipping groups without a signal (learner.skip_zero_advantage) vs computing every microbatch:
seconds per GRPO update at a real model's shape, the same groups, the same run.

Setup: SmolLM2-135M's shape (random init, float32; what an update computes does not depend on the
weights), the decision-rule config's batch (4 prompts x G 8 = 32 samples), prompts of ~70 tokens
and completions lognormal around 55 tokens (clipped to [8, 64]) as SmolLM2's word problems gave,
packed microbatches of 256 tokens. --flat K of the 4 groups have all-equal rewards (zero
advantage), as a sparse reward makes them: at SmolLM2's 5% sampled reward, 1 - 0.95^8 = 34% of
groups have a signal, so K = 3 (75% flat) is near the start of its runs and K = 2 later.
Both sides lay out the same groups the same way (flat groups in microbatches of their own), so
the difference is the skipped gradient passes alone; the sides alternate, each figure is the
median of --repeats updates after a warm-up (compilation). Also reported: the two sides' loss
and gradient norm (they must agree) and the baseline's time per microbatch.
Prints one JSON line. Run: `python benchmarks/skip_flat_bench.py [--flat 3] [--repeats 2]`
(~6 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from cadence.learner.config import LearnerConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.packing import layout_microbatches  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep, has_signal  # noqa: E402
from cadence.learner.steps.scoring import llama_logits  # noqa: E402
from cadence.protocols.testing import rollout_group  # noqa: E402
from bench_timing import alternating_updates  # noqa: E402
from model_shapes import SHAPES  # noqa: E402

GROUPS, G, PAD, PROMPT, NEW = 4, 8, 0, 70, 64


def make_groups(flat: int, vocab: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(GROUPS):
        prompt = [1] + [int(x) for x in rng.integers(2, vocab, PROMPT - 1)]
        lengths = np.clip(rng.lognormal(np.log(55), 0.3, G), 8, NEW).astype(int)
        comps = [[int(x) for x in rng.integers(2, vocab, n)] for n in lengths]
        behav = [[float(-rng.exponential()) for _ in c] for c in comps]
        rewards = [0.0] * G if i < flat else [1.0] + [0.0] * (G - 1)
        out.append(rollout_group(f"g{i}", "bench", prompt, comps, behav, rewards, 0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flat", type=int, default=3, help=f"groups (of {GROUPS}) with all-equal rewards")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per side")
    parser.add_argument("--microbatch-tokens", type=int, default=256)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    args = parser.parse_args()

    seq_len = -(-(PROMPT + NEW) // 8) * 8  # launch.config.seq_len's rounding
    mcfg = ModelConfig(**SHAPES[args.shape], max_seq_len=seq_len)
    graphdef, params = llama.init_params(mcfg, 0)
    groups = make_groups(args.flat, mcfg.vocab_size)
    base = dict(batch_size=GROUPS * G, microbatch_size=8, group_size=G, microbatch_tokens=args.microbatch_tokens)
    steps = {name: GRPOTrainStep(llama_logits(graphdef), LearnerConfig(**base, skip_zero_advantage=skip))
             for name, skip in (("all", False), ("skip", True))}
    mbs, stats = layout_microbatches(groups, seq_len, 8, args.microbatch_tokens, PAD, steps["all"].cfg.grpo,
                                     separate_flat=True)
    states = {name: step.init(params) for name, step in steps.items()}
    del params
    median, first = alternating_updates(steps, states, (mbs, stats), args.repeats)

    signal = [has_signal(mb) for mb in mbs]
    out = {
        "bench": "skip_flat", "device": jax.devices()[0].device_kind, "shape": args.shape,
        "batch": GROUPS * G, "flat_groups": f"{args.flat}/{GROUPS}", "seq_len": seq_len,
        "microbatch_tokens": args.microbatch_tokens, "microbatches": len(mbs),
        "skipped_microbatches": signal.count(False), "completion_tokens": int(stats["num_tokens"]),
        "repeats": args.repeats,
    }
    for name in steps:
        t = median[name]
        out[name] = {"s_per_update": round(t, 2), "samples_per_s": round(GROUPS * G / t, 3)}
    out["all"]["s_per_microbatch"] = round(out["all"]["s_per_update"] / len(mbs), 2)
    out["speedup"] = round(out["all"]["s_per_update"] / out["skip"]["s_per_update"], 2)
    out["first_update"] = {k: {"loss": m["loss"], "grad_norm": m["grad_norm"]} for k, m in first.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

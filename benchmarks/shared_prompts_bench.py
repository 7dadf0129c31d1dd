"""Shared prompts (learner.share_prompts, rows of learner.row_tokens) vs the packed layout with a
prompt copy per completion: seconds per GRPO update at a real model's shape, same groups, same run.

Setup: skip_flat_bench.py's batch (SmolLM2-135M's shape, random init, float32; 4 prompts of ~70
tokens x G 8 completions around 55 tokens), every group with a signal. Both sides get the same
token budget per microbatch (--microbatch-tokens, default 512, the decision-rule config's):
  packed   rows of seq_len (136: prompt + 64 new tokens), 3 a microbatch, each completion behind
           its own copy of the prompt (learner.microbatch_tokens alone);
  shared   one row of 512 a microbatch, each group's completions behind one copy of its prompt
           (learner.share_prompts=true, learner.row_tokens=512).
Each figure is the median of --repeats updates after a warm-up (compilation), the sides
alternating; also reported: tokens laid out, microbatches, row fill, and both sides' loss and
gradient norm on the first update (they must agree).
Prints one JSON line. Run: `python benchmarks/shared_prompts_bench.py [--repeats 2]` (~6 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from cadence.learner.config import LearnerConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.packing import layout_microbatches  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402
from cadence.learner.steps.scoring import llama_logits  # noqa: E402
from bench_timing import alternating_updates  # noqa: E402
from model_shapes import SHAPES  # noqa: E402
from skip_flat_bench import GROUPS, NEW, PAD, PROMPT, G, make_groups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per side")
    parser.add_argument("--microbatch-tokens", type=int, default=512)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    args = parser.parse_args()

    seq_len = -(-(PROMPT + NEW) // 8) * 8  # launch.config.seq_len's rounding
    budget = args.microbatch_tokens
    mcfg = ModelConfig(**SHAPES[args.shape], max_seq_len=seq_len)
    graphdef, params = llama.init_params(mcfg, 0)
    groups = make_groups(0, mcfg.vocab_size)
    base = dict(batch_size=GROUPS * G, microbatch_size=8, group_size=G, microbatch_tokens=budget)
    sides = {"packed": (LearnerConfig(**base), seq_len),
             "shared": (LearnerConfig(**base, share_prompts=True, row_tokens=budget), budget)}
    steps, layouts = {}, {}
    for name, (cfg, row) in sides.items():
        cfg.validate()
        steps[name] = GRPOTrainStep(llama_logits(graphdef), cfg)
        layouts[name] = layout_microbatches(groups, row, 8, budget, PAD, cfg.grpo, share_prompts=cfg.share_prompts)
    states = {name: step.init(params) for name, step in steps.items()}
    del params
    median, first = alternating_updates(steps, states, layouts, args.repeats)

    out = {"bench": "shared_prompts", "device": jax.devices()[0].device_kind, "shape": args.shape,
           "batch": GROUPS * G, "prompt_tokens": PROMPT, "seq_len": seq_len, "microbatch_tokens": budget,
           "completion_tokens": int(layouts["packed"][1]["num_tokens"]), "repeats": args.repeats}
    for name in steps:
        mbs, stats = layouts[name]
        t = median[name]
        laid_out = int(sum((mb.mask != 0).sum() for mb in mbs))
        out[name] = {"row": sides[name][1], "microbatches": len(mbs), "tokens_laid_out": laid_out,
                     "row_fill": round(stats["row_fill"], 3), "s_per_update": round(t, 2),
                     "samples_per_s": round(GROUPS * G / t, 3)}
    out["shared"]["shared_prompt_tokens"] = layouts["shared"][1]["shared_prompt_tokens"]
    out["speedup"] = round(out["packed"]["s_per_update"] / out["shared"]["s_per_update"], 2)
    out["first_update"] = {k: {"loss": m["loss"], "grad_norm": m["grad_norm"]} for k, m in first.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

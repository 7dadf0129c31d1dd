"""Packed vs padded microbatches: real tokens per second of the learner update on a long-tail mix.

Setup: a Llama of ~2M parameters (d_model 192, 4 layers, 4 heads / 2 KV heads, d_ff 512, vocab
2048; float32), batch 64 samples (16 groups of 4), prompts 16-48 tokens, completions lognormal
(median ~90) clipped to [30, 512], so seq_len = 48 + 512 = 560. Both sides run GRPOTrainStep.update
on the same groups with the same microbatch shape [8, 560]:
  padded   learner.microbatch_tokens=0: build_microbatches, one sample per row, 8 microbatches;
  packed   learner.microbatch_tokens=8*560: pack_microbatches, samples first-fit into the rows.
Each update is timed from the host groups (layout + host->device + accumulate + apply + metrics),
after a warm-up update (compilation); the sides alternate so a noisy neighbour hits both alike,
and each figure is the median. real tokens = prompt + completion tokens (no padding), the same
count on both sides. The first update's loss of both sides is reported too (they must agree).
Prints one JSON line. Run: `python benchmarks/packing_bench.py [--repeats 3] [--batch 64]` (~4 min on
2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.config import LearnerConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.packing import pack_microbatches, rows_per_microbatch  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402
from cadence.learner.steps.scoring import llama_logits  # noqa: E402
from cadence.protocols.testing import rollout_group  # noqa: E402

GROUP, PAD, ROWS = 4, 0, 8
PROMPT_MIN, PROMPT_MAX, COMPLETION_MIN, COMPLETION_MAX = 16, 48, 30, 512


def make_groups(num_groups: int, vocab: int, seed: int = 0) -> list:
    """Groups with a long-tail completion length mix: lognormal(log 90, 0.8) clipped to [30, 512]."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(num_groups):
        prompt = [1] + [int(x) for x in rng.integers(2, vocab, rng.integers(PROMPT_MIN, PROMPT_MAX))]
        lengths = np.clip(rng.lognormal(np.log(90), 0.8, GROUP), COMPLETION_MIN, COMPLETION_MAX).astype(int)
        comps = [[int(x) for x in rng.integers(2, vocab, n)] for n in lengths]
        behav = [[float(-rng.exponential()) for _ in c] for c in comps]
        groups.append(rollout_group(f"g{i}", "t", prompt, comps, behav, [float(rng.random() < 0.5) for _ in comps], 0))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="samples per update (multiple of 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per side")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=192)
    args = parser.parse_args()

    mcfg = ModelConfig(vocab_size=2048, d_model=args.d_model, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                       d_ff=int(args.d_model * 8 / 3) // 32 * 32, max_seq_len=PROMPT_MAX + COMPLETION_MAX)
    seq_len = -(-(PROMPT_MAX + COMPLETION_MAX) // 8) * 8  # launch.config.seq_len's rounding
    graphdef, params = llama.init_params(mcfg, 0)
    fwd = llama_logits(graphdef, "none")  # what the learner uses: chunked log-probs (logits_chunk)
    groups = make_groups(args.batch // GROUP, mcfg.vocab_size)
    base = dict(batch_size=args.batch, microbatch_size=ROWS, group_size=GROUP)
    padded_step = GRPOTrainStep(fwd, LearnerConfig(**base))
    packed_cfg = LearnerConfig(**base, microbatch_tokens=ROWS * seq_len)
    packed_cfg.validate()
    packed_step = GRPOTrainStep(fwd, packed_cfg)
    rows = rows_per_microbatch(packed_cfg.microbatch_tokens, seq_len)

    sides = {
        "padded": (padded_step, lambda: build_microbatches(groups, seq_len, ROWS, PAD, padded_step.cfg.grpo)),
        "packed": (packed_step, lambda: pack_microbatches(groups, seq_len, rows, PAD, packed_step.cfg.grpo)),
    }
    states = {name: step.init(params) for name, (step, _) in sides.items()}
    first_loss, info, seconds = {}, {}, {name: [] for name in sides}

    def one_update(name: str) -> float:
        step, layout = sides[name]
        start = time.perf_counter()
        mbs, stats = layout()
        # the update donates the state's Adam moments: keep the state it returns
        states[name], metrics = step.update(states[name], mbs, stats["num_tokens"])  # host floats: synced
        elapsed = time.perf_counter() - start
        info[name] = (len(mbs), stats)
        first_loss.setdefault(name, metrics["loss"])
        return elapsed

    for name in sides:  # warm-up: compiles (and the loss of the same params on both layouts)
        one_update(name)
    for _ in range(args.repeats):
        for name in sides:
            seconds[name].append(one_update(name))

    real = sum(len(g.prompt_tokens) * len(g.rewards) + len(g.completion_tokens.values) for g in groups)
    lengths = np.concatenate([g.completion_tokens.lengths for g in groups])
    out = {
        "bench": "packing",
        "device": jax.devices()[0].device_kind,
        "model": {"params": llama.count_params(params), "d_model": mcfg.d_model, "layers": mcfg.n_layers,
                  "heads": f"{mcfg.n_heads}/{mcfg.n_kv_heads}", "d_ff": mcfg.d_ff, "vocab": mcfg.vocab_size},
        "batch": args.batch, "seq_len": seq_len, "microbatch_shape": [ROWS, seq_len],
        "completion_len": {"min": int(lengths.min()), "median": float(np.median(lengths)),
                           "mean": round(float(lengths.mean()), 1), "max": int(lengths.max())},
        "real_tokens_per_update": int(real),
        "repeats": args.repeats,
    }
    for name in sides:
        t = statistics.median(seconds[name])
        num_mb, stats = info[name]
        out[name] = {"microbatches": num_mb, "computed_tokens": num_mb * ROWS * seq_len,
                     "s_per_update": round(t, 3), "real_tokens_per_s": round(real / t, 1),
                     "compiles": sides[name][0].cache_sizes()}
    out["packed"]["row_fill"] = round(info["packed"][1]["row_fill"], 3)
    out["speedup"] = round(out["packed"]["real_tokens_per_s"] / out["padded"]["real_tokens_per_s"], 2)
    out["first_loss"] = {k: float(v) for k, v in first_loss.items()}
    out["first_loss_abs_diff"] = float(abs(first_loss["packed"] - first_loss["padded"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

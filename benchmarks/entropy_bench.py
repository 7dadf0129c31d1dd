"""The entropy's cost at a 32k vocabulary: GRPOTrainStep.update with and without the exact entropy.

Setup: a 2-layer Llama (d_model 64) with a 32,000-token vocabulary, batch 128 (16 groups of 8),
microbatch 32, seq_len 16: each microbatch's logits are [32, 16, 32000] float32 (65 MB).
  ours        GRPOTrainStep.update at the default entropy_coef = 0: log-probs only (one
              logsumexp), the metric is entropy_sampled (mean -log pi of the sampled tokens)
  exact       the same step with the exact entropy in the metrics (what every step computed
              before: softmax over [M, T, V] and sum p * z), entropy_coef still 0
  bare        one jax.jit of value_and_grad(the log-prob-only loss) + Adam over the whole batch
Also the compiled accumulate step's temporary memory (XLA memory_analysis) with and without.
Prints one JSON line. Run: `python benchmarks/entropy_bench.py [--vocab 32000] [--repeats 6]`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_timing import median_seconds  # noqa: E402
from learner_bench import BATCH, GROUP, MICROBATCH, PAD, SEQ_LEN, bare_update, make_groups  # noqa: E402

from cadence.learner.algorithms.grpo import grpo_token_loss  # noqa: E402
from cadence.learner.batching import build_microbatches, pack_microbatch  # noqa: E402
from cadence.learner.config import LearnerConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402


class ExactEntropyStep(GRPOTrainStep):
    """The step as it was: the exact entropy in every step's metrics, needed or not."""

    def loss_fn(self, params, mb, num_tokens, num_sequences=None, proximal_logprobs=None):
        logprobs, entropy = self._score(params, mb.tokens, mb.positions, mb.mask, entropy=True)[:2]
        return grpo_token_loss(logprobs, mb.behavior_logprobs, mb.advantages, mb.loss_mask, num_tokens,
                               self.cfg.grpo, entropy=entropy, num_sequences=num_sequences)


def temp_bytes(step: GRPOTrainStep, params, packed, n) -> int | None:
    grads = step._zeros(params)
    compiled = step._accumulate.lower(params, grads, packed, n, n).compile()
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--inner", type=int, default=2)
    args = ap.parse_args()

    mcfg = dataclasses.replace(ModelConfig(), vocab_size=args.vocab)
    graphdef, params = llama.init_params(mcfg, 0)
    cfg = LearnerConfig(batch_size=BATCH, microbatch_size=MICROBATCH, group_size=GROUP)
    logits_fn = functools.partial(llama.forward, graphdef)
    ours, exact = GRPOTrainStep(logits_fn, cfg), ExactEntropyStep(logits_fn, cfg)
    microbatches, stats = build_microbatches(make_groups(args.vocab), SEQ_LEN, MICROBATCH, PAD, cfg.grpo)
    (full,), _ = build_microbatches(make_groups(args.vocab), SEQ_LEN, BATCH, PAD, cfg.grpo)
    n = stats["num_tokens"]

    states = {"ours": ours.init(params), "exact": exact.init(params)}
    metrics = {}

    def run(name, step):
        def call():
            states[name], metrics[name] = step.update(states[name], microbatches, n)
        return call

    bare = bare_update(ours, params, full, n)

    times = {"ours": [], "exact": [], "bare": []}
    for _ in range(3):  # interleaved, so a noisy neighbour hits all three alike
        times["ours"].append(median_seconds(run("ours", ours), max(1, args.repeats // 3), args.inner, warmup=1))
        times["exact"].append(median_seconds(run("exact", exact), max(1, args.repeats // 3), args.inner, warmup=1))
        times["bare"].append(median_seconds(bare, max(1, args.repeats // 3), args.inner, warmup=1))
    t = {k: statistics.median(v) for k, v in times.items()}
    packed = jax.device_put(pack_microbatch(microbatches[0]))
    nn = jax.device_put(np.float32(n))
    tokens = BATCH * SEQ_LEN
    print(json.dumps({
        "bench": "entropy_cost", "device": jax.devices()[0].device_kind, "vocab": args.vocab,
        "model_params": llama.count_params(params), "batch": BATCH, "microbatch": MICROBATCH,
        "seq_len": SEQ_LEN,
        "ours_ms": round(1e3 * t["ours"], 1), "exact_entropy_ms": round(1e3 * t["exact"], 1),
        "bare_ms": round(1e3 * t["bare"], 1),
        "ours_tokens_per_s": round(tokens / t["ours"], 1), "bare_tokens_per_s": round(tokens / t["bare"], 1),
        "ratio_vs_bare": round(t["bare"] / t["ours"], 3),
        "exact_entropy_over_ours": round(t["exact"] / t["ours"], 3),
        "accumulate_temp_bytes": {"ours": temp_bytes(ours, params, packed, nn),
                                  "exact_entropy": temp_bytes(exact, params, packed, nn)},
        "logits_bytes_per_microbatch": MICROBATCH * SEQ_LEN * args.vocab * 4,
        "entropy_exact": round(metrics["exact"]["entropy"], 4),
        "entropy_sampled": round(metrics["ours"]["entropy_sampled"], 4),
    }))


if __name__ == "__main__":
    main()

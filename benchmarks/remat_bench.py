"""learner.remat at a real model's shape on this backend: XLA's temporary bytes of one packed
microbatch's GRPO gradient and its seconds, none / block / full compiled in one process and run
alternately (a drifting load hits them alike; `none` is the bare baseline). One JSON line.

    python benchmarks/remat_bench.py --preset smollm2 --microbatch-tokens 256 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from learner_scale_bench import make_groups  # noqa: E402
from model_shapes import SHAPES  # noqa: E402

from cadence.learner.batching import pack_microbatch  # noqa: E402
from cadence.learner.config import LearnerConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.packing import layout_microbatches  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402
from cadence.learner.steps.scoring import llama_logits  # noqa: E402

PRESETS = {"smollm2": "smollm2-135m"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--microbatch-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    mcfg = ModelConfig(**SHAPES[PRESETS[args.preset]], max_seq_len=args.seq_len)
    graphdef, params = llama.init_params(mcfg, 0, None)
    groups = make_groups(32, 4, args.seq_len, mcfg.vocab_size, lengths="mix")
    variants = {}
    for remat in ("none", "block", "full"):
        cfg = LearnerConfig(batch_size=32, microbatch_size=4, group_size=4, remat=remat,
                            microbatch_tokens=args.microbatch_tokens)
        step = GRPOTrainStep(llama_logits(graphdef, remat), cfg)
        mbs, stats = layout_microbatches(groups, args.seq_len, 4, args.microbatch_tokens, 0, cfg.grpo)
        packed = jnp.asarray(pack_microbatch(mbs[0]))
        step._metric_keys = tuple(sorted(jax.eval_shape(step.loss_fn, params, mbs[0], jnp.float32(1.0))[1]))
        n = jnp.float32(stats["num_tokens"])
        compiled = step._accumulate.lower(params, params, packed, n, n).compile()
        variants[remat] = (compiled, packed, n, compiled.memory_analysis().temp_size_in_bytes)
    seconds = {remat: [] for remat in variants}
    for _ in range(args.repeats + 1):  # the first round warms up
        for remat, (compiled, packed, n, _) in variants.items():
            grads = jax.tree.map(jnp.zeros_like, params)
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, grads, packed, n, n))
            seconds[remat].append(time.perf_counter() - t0)
    out = {"bench": "remat", "preset": args.preset, "microbatch_tokens": args.microbatch_tokens}
    for remat, (*_, temp) in variants.items():
        out[f"{remat}_temp_mb"] = round(temp / 1e6, 1)
        out[f"{remat}_seconds"] = round(statistics.median(seconds[remat][1:]), 3)
    for remat in ("block", "full"):
        out[f"{remat}_vs_none_seconds"] = round(out[f"{remat}_seconds"] / out["none_seconds"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

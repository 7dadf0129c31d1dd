"""Adam's step at a real model's shape: the learner's three programs (clip in place, moments in
place, params from them: learner.steps.grpo_step.AdamInParts) against optax's chain in one jitted
program over the same donated buffers (the bare baseline), same run. XLA's temporary bytes of
each, and the seconds of a step (median of --repeats). One JSON line.

    python benchmarks/adam_apply_bench.py --preset smollm2-135m --repeats 5
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

from model_shapes import SHAPES  # noqa: E402

from cadence.learner.config import LearnerConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402
from cadence.learner.steps.scoring import llama_logits  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    graphdef, params = llama.init_params(ModelConfig(**SHAPES[args.preset], max_seq_len=64), 0)
    step = GRPOTrainStep(llama_logits(graphdef), LearnerConfig(batch_size=8, group_size=4))
    one = jax.jit(step._apply_impl, donate_argnums=(1, 2))  # the optax chain in one program
    grads_like = jax.jit(lambda p: jax.tree.map(lambda x: 1e-3 * jnp.ones_like(x), p))
    out = {"bench": "adam_apply", "preset": args.preset,
           "param_mb": round(sum(x.nbytes for x in jax.tree.leaves(params)) / 1e6, 1)}
    for name, fn in (("one_program", one), ("parts", step._apply)):
        opt_state, seconds = step._init_opt(params), []
        for _ in range(args.repeats + 1):  # the first compiles
            grads = grads_like(params)
            jax.block_until_ready(grads)
            t0 = time.perf_counter()
            new_params, opt_state, _ = fn(params, opt_state, grads)
            jax.block_until_ready(new_params)
            seconds.append(time.perf_counter() - t0)
            params = new_params
        g = jax.eval_shape(grads_like, params)  # lowering needs shapes only
        programs = ([(one, (params, opt_state, g))] if fn is one else
                    [(fn.clip, (g,)), (fn.moments, (params, opt_state, g)), (fn.params, (params, opt_state, g))])
        temps = [prog.lower(*a).compile().memory_analysis().temp_size_in_bytes for prog, a in programs]
        out[f"{name}_temp_mb"] = round(max(temps) / 1e6, 1)
        out[f"{name}_seconds"] = round(statistics.median(seconds[1:]), 3)
    out["parts_vs_one_program"] = round(out["parts_seconds"] / out["one_program_seconds"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

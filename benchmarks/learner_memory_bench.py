"""Host memory of GRPO updates at a real model's shape on the CPU: each update's peak resident
size and the size after it, against the learner state's own bytes (params, Adam moments and the
gradient accumulator), measured in the same run. One JSON line.

    python benchmarks/learner_memory_bench.py --preset smollm2 --microbatch-tokens 512 --updates 2
    python benchmarks/learner_memory_bench.py --microbatch-tokens 256 --units 2 [--unit-dtype float32]
    MALLOC_MMAP_THRESHOLD_=33554432 python benchmarks/learner_memory_bench.py ...  # glibc as before

Linux only (reads /proc/self/status; resets VmHWM through /proc/self/clear_refs before each update).
docs/results/smollm2_memory.md has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from learner_scale_bench import PRESETS, make_groups  # noqa: E402
from model_shapes import SHAPES as REAL  # noqa: E402

SHAPES = {**PRESETS, "smollm2": REAL["smollm2-135m"]}


def resident_mb() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                out[line.split(":")[0]] = int(line.split()[1]) // 1024
    return out["VmRSS"], out["VmHWM"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--microbatch-tokens", type=int, default=512, help="0: padded rows of --microbatch")
    p.add_argument("--microbatch", type=int, default=4)
    p.add_argument("--remat", choices=["none", "block", "full"], default="none")
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--units", type=int, default=0, help="the noise scale's units of whole groups (a run's default: 2)")
    p.add_argument("--unit-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the units' own gradient buffer (float32: as before 2026-12-07)")
    args = p.parse_args()

    from cadence.launch.host_memory import fix_mmap_threshold
    from cadence.learner.config import LearnerConfig
    from cadence.learner.models import llama
    from cadence.learner.models.config import ModelConfig
    from cadence.learner.packing import layout_microbatches
    from cadence.learner.steps import grpo_step
    from cadence.learner.steps.grpo_step import GRPOTrainStep
    from cadence.learner.steps.scoring import llama_logits

    mmap_fixed = fix_mmap_threshold()  # what `cadence train` does at start
    rss0, _ = resident_mb()
    mcfg = ModelConfig(**SHAPES[args.preset], max_seq_len=args.seq_len)
    cfg = LearnerConfig(batch_size=args.batch, microbatch_size=args.microbatch, group_size=args.group,
                        remat=args.remat, microbatch_tokens=args.microbatch_tokens)
    cfg.validate()
    graphdef, params = llama.init_params(mcfg, 0, None)
    grpo_step.UNIT_DTYPE = jax.numpy.dtype(args.unit_dtype)  # read when the unit buffer is traced
    step = GRPOTrainStep(llama_logits(graphdef, args.remat), cfg)
    state = step.init(params)
    del params
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    rss_init, _ = resident_mb()
    groups = make_groups(args.batch, args.group, args.seq_len, mcfg.vocab_size, lengths="mix")
    mbs, stats = layout_microbatches(groups, args.seq_len, args.microbatch, args.microbatch_tokens, 0, cfg.grpo,
                                     units=args.units)
    units = stats.get("unit_microbatches")
    peaks, after, seconds = [], [], []
    for _ in range(args.updates):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM: each update's own peak
        t0 = time.perf_counter()
        state, _ = step.update(state, mbs, stats["num_tokens"], units=units)
        jax.block_until_ready(state.params)
        seconds.append(round(time.perf_counter() - t0, 1))
        rss, hwm = resident_mb()
        peaks.append(hwm)
        after.append(rss)
    print(json.dumps({
        "bench": "learner_memory", "preset": args.preset, "microbatch_tokens": args.microbatch_tokens,
        "microbatch": args.microbatch, "remat": args.remat, "microbatches": len(mbs),
        "units": units, "unit_dtype": args.unit_dtype if units and max(units) > 1 else None,
        "real_tokens": int(sum(int((np.asarray(mb.mask) > 0).sum()) for mb in mbs)),
        "mmap_threshold_fixed": mmap_fixed, "env_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        # the baseline: what the learner state itself is (params + 2 moments + gradients)
        "state_mb": round(4 * param_bytes / 2**20), "rss_start_mb": rss0, "rss_after_init_mb": rss_init,
        "peak_mb": peaks, "rss_after_update_mb": after, "update_seconds": seconds,
    }))


if __name__ == "__main__":
    main()

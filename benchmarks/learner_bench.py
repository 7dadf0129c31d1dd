"""Learner speed: tokens/s of GRPOTrainStep.update vs a bare jitted train step.

Setup: the default ModelConfig (learner.models.llama), seq_len 16 (6 prompt + 10 completion
tokens), batch 128 samples (16 groups of 8), microbatch 32, the default GRPO loss and Adam.
Baseline: one jax.jit of value_and_grad(the same loss) + the same optax update + apply_updates over
the whole [128, 16] batch already on the device: no accumulation, no host work beyond
block_until_ready. Ours: GRPOTrainStep.update on the host microbatches from build_microbatches (host ->
device copies, 4 accumulate calls, apply, fetching the metrics). Both after warm-up; each figure is
the median over repeats. tokens are all B x T sequence tokens the step processes.
Prints one JSON line. Run: `.venv/bin/python benchmarks/learner_bench.py [--repeats 15] [--inner 5]`.

Sharded (`--devices 4 --fsdp 2 --tensor 2`, CPU devices made by XLA): both sides run on the same
mesh; ours is GRPOTrainStep with the learner's Layout (params and Adam split by the logical-axis
rules, microbatch rows over data x fsdp), the bare step is one jax.jit with the same in/out
shardings over the whole batch. `--model` picks a larger model for it (default: the 127k one).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _devices_from_argv() -> int:
    # XLA fixes the CPU device count when JAX starts: read --devices before anything touches it.
    for i, arg in enumerate(sys.argv):
        if arg == "--devices" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 1


if _devices_from_argv() > 1:
    jax.config.update("jax_num_cpu_devices", _devices_from_argv())

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_timing import median_seconds  # noqa: E402  (benchmarks/ is the script's own dir)

from cadence.learner import sharding  # noqa: E402
from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.config import LearnerConfig, MeshConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402
from cadence.protocols.messages import RolloutGroup  # noqa: E402
from cadence.protocols.testing import rollout_group  # noqa: E402

SEQ_LEN, PROMPT_LEN, BATCH, MICROBATCH, GROUP = 16, 6, 128, 32, 8
PAD = 0


def make_groups(vocab: int, seed: int = 0) -> list[RolloutGroup]:
    """BATCH / GROUP groups filling every row: PROMPT_LEN prompt + (SEQ_LEN - PROMPT_LEN) completion."""
    rng = np.random.default_rng(seed)
    n_completion = SEQ_LEN - PROMPT_LEN
    groups = []
    for i in range(BATCH // GROUP):
        prompt = [1] + [int(x) for x in rng.integers(3, vocab, PROMPT_LEN - 1)]
        comps = [[int(x) for x in rng.integers(3, vocab, n_completion)] for _ in range(GROUP)]
        behav = [[float(-rng.exponential()) for _ in c] for c in comps]
        groups.append(rollout_group(f"p{i}", "bench", prompt, comps, behav, [float(rng.random() < 0.5) for _ in comps], 0))
    return groups


def bare_update(step: GRPOTrainStep, params, full, num_tokens: int, layout=None):
    """The bare baseline: one jax.jit of value_and_grad(step.loss_fn) + the same optax update over
    the whole batch `full` already on the device(s); on a mesh, the same shardings and activation
    constraints. Returns a call that runs one update and waits."""
    tx = step.optimizer

    def bare_impl(params, opt_state, batch, n):
        (_, _), grads = jax.value_and_grad(step.loss_fn, has_aux=True)(params, batch, n)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if layout is None:
        bare_step = jax.jit(bare_impl)
        full_dev = jax.device_put(full)
        n_dev = jax.device_put(np.float32(num_tokens))
    else:  # the same mesh, shardings and activation constraints, one program for the whole batch
        p, o = layout.params, layout.opt_state(tx)
        rows = type(full)(*([layout.batch] * len(full)))
        bare_step = jax.jit(bare_impl, in_shardings=(p, o, rows, layout.replicated), out_shardings=(p, o))
        full_dev = type(full)(*layout.put_batch([np.asarray(x) for x in full]))
        n_dev = layout.scalar(num_tokens)
    state = {"p": params, "o": step.init(params).opt_state}

    def bare():
        state["p"], state["o"] = bare_step(state["p"], state["o"], full_dev, n_dev)
        jax.block_until_ready(state["p"])

    return bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats (median reported)")
    parser.add_argument("--inner", type=int, default=5, help="updates per timed repeat")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices (> 1: a sharded mesh)")
    parser.add_argument("--data", type=int, default=1, help="mesh data axis")
    parser.add_argument("--fsdp", type=int, default=-1, help="mesh fsdp axis (-1: the rest)")
    parser.add_argument("--tensor", type=int, default=1, help="mesh tensor axis")
    parser.add_argument("--microbatch", type=int, default=MICROBATCH,
                        help="rows per microbatch (on a mesh they split over data x fsdp: 128 on 4 "
                             "devices is the one-device default's 32 rows per device)")
    parser.add_argument("--model", choices=["tiny", "small"], default="tiny",
                        help="tiny: the default 127k model; small: d256 x 4 layers, vocab 256 (3.7M)")
    args = parser.parse_args()

    mcfg = ModelConfig() if args.model == "tiny" else ModelConfig(
        vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=1024)
    mesh_cfg = MeshConfig(data=args.data, fsdp=args.fsdp, tensor=args.tensor)
    _, abstract = llama.abstract_params(mcfg)
    layout = sharding.make_layout(mesh_cfg, abstract)  # None on one device: the plain program
    graphdef, params = llama.init_params(mcfg, 0, None if layout is None else layout.params)
    cfg = LearnerConfig(batch_size=BATCH, microbatch_size=args.microbatch, group_size=GROUP, mesh=mesh_cfg)
    cfg.validate()
    logits_fn = functools.partial(llama.forward, graphdef)
    step = GRPOTrainStep(logits_fn, cfg, layout=layout)

    groups = make_groups(mcfg.vocab_size)
    t0 = time.perf_counter()
    microbatches, stats = build_microbatches(groups, SEQ_LEN, args.microbatch, PAD, cfg.grpo)
    batching_s = time.perf_counter() - t0
    (full,), _ = build_microbatches(groups, SEQ_LEN, BATCH, PAD, cfg.grpo)
    num_tokens = stats["num_tokens"]

    # Ours: the full host API.
    state = {"s": step.init(params)}

    def ours():
        state["s"], _ = step.update(state["s"], microbatches, num_tokens)

    bare = bare_update(step, params, full, num_tokens, layout)

    # A second bare baseline on a mesh: the same microbatch accumulation as ours (one jitted
    # value_and_grad per microbatch already on the devices, then the optimizer step), without
    # Cadence's host side; ours / it is what Cadence adds, bare / it what microbatching costs.
    if layout is None:
        bare_mb = None
    else:
        tx, n_dev = step.optimizer, layout.scalar(num_tokens)
        bare_state = {"p": params, "o": step.init(params).opt_state}
        mb_dev = [type(mb)(*layout.put_batch([np.asarray(x) for x in mb])) for mb in microbatches]
        rows = type(full)(*([layout.batch] * len(full)))
        p, o = layout.params, layout.opt_state(tx)
        grad_mb = jax.jit(lambda params, g, batch, n: jax.tree.map(
            jnp.add, g, jax.grad(lambda q: step.loss_fn(q, batch, n)[0])(params)),
            in_shardings=(p, p, rows, layout.replicated), out_shardings=p, donate_argnums=(1,))
        zeros = jax.jit(lambda params: jax.tree.map(jnp.zeros_like, params), in_shardings=(p,), out_shardings=p)
        apply_mb = jax.jit(lambda params, opt_state, g: (lambda u: (optax.apply_updates(params, u[0]), u[1]))(
            tx.update(g, opt_state, params)), in_shardings=(p, o, p), out_shardings=(p, o), donate_argnums=(2,))

        def bare_mb():
            g = zeros(bare_state["p"])
            for mb in mb_dev:
                g = grad_mb(bare_state["p"], g, mb, n_dev)
            bare_state["p"], bare_state["o"] = apply_mb(bare_state["p"], bare_state["o"], g)
            jax.block_until_ready(bare_state["p"])

    # Interleave them so a noisy neighbour hits all alike; keep the median of each.
    ours_s, bare_s, mb_s = [], [], []
    for _ in range(3):
        ours_s.append(median_seconds(ours, max(1, args.repeats // 3), args.inner, warmup=2))
        bare_s.append(median_seconds(bare, max(1, args.repeats // 3), args.inner, warmup=2))
        if bare_mb is not None:
            mb_s.append(median_seconds(bare_mb, max(1, args.repeats // 3), args.inner, warmup=2))
    ours_t, bare_t = statistics.median(ours_s), statistics.median(bare_s)
    mb_t = statistics.median(mb_s) if mb_s else None
    tokens = BATCH * SEQ_LEN
    print(json.dumps({
        "bench": "learner_update",
        "device": jax.devices()[0].device_kind, "devices": len(jax.devices()),
        "mesh": None if layout is None else dict(layout.mesh.shape),
        "model_params": llama.count_params(params),
        "batch": BATCH, "microbatch": args.microbatch, "seq_len": SEQ_LEN,
        "tokens_per_update": tokens, "completion_tokens_per_update": num_tokens,
        "ours_tokens_per_s": round(tokens / ours_t, 1),
        "bare_tokens_per_s": round(tokens / bare_t, 1),
        "ratio": round(bare_t / ours_t, 3),
        "ours_ms": round(1e3 * ours_t, 3), "bare_ms": round(1e3 * bare_t, 3),
        "bare_microbatched_tokens_per_s": None if mb_t is None else round(tokens / mb_t, 1),
        "ratio_vs_bare_microbatched": None if mb_t is None else round(mb_t / ours_t, 3),
        "build_microbatches_ms": round(1e3 * batching_s, 3),
        "compiles": step.cache_sizes(),
    }))


if __name__ == "__main__":
    main()

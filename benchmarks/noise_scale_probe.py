"""The gradient noise scale at FIXED params, from many fresh batches: what the controller's online
estimate should read, and what one update of staleness does to it. One JSON line.

From a run's checkpoint (params and Adam's moments), the params one update later (an update on a
batch of its own) are differentiated on batches drawn two ways:
  fresh: from those params themselves (on-policy, every importance ratio 1);
  stale: from the checkpoint's params, one update older (what an asynchronous run with
         actors.max_staleness = 1 trains on, the correction's ratio against them).
Per batch, the whole-group units' gradients as the train step forms them and the batch's; per
batch (|G|^2, tr Sigma) by the controller's two-batch estimator (learner/controller/noise.py),
averaged over the batches of each B (no EMA), B_noise = mean tr / mean |G|^2, with standard
errors. Also in Adam's metric (norms weighted by 1 / (sqrt(nu_hat) + eps), the checkpoint's
second moment): the noise scale of a preconditioned step.

    python benchmarks/noise_scale_probe.py --run RUN_DIR --checkpoint STEP --samples 16384 --batch-sizes 64 256
    python benchmarks/noise_scale_probe.py ... --set learner.grpo.clip_low=0.99 \
        --set learner.grpo.clip_high=100 --set learner.grpo.dual_clip=0   # the objective without its clip

RUN_DIR: a GRPO run with checkpoints, e.g. a fixed run of `cadence experiment decision-rule`
(docs/controller.md has the sort-6 figures); ~1 min a probe at sort-6's size on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="run directory (config.yaml, checkpoints/)")
    p.add_argument("--checkpoint", required=True, help="checkpoint step under RUN/checkpoints")
    p.add_argument("--samples", type=int, default=16384, help="samples per batch size and side")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[128])
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="an override of the run's config (repeatable)")
    args = p.parse_args()

    from cadence.actors.actor_loop import Actor
    from cadence.actors.engine import JaxEngine
    from cadence.actors.prompt_stream import PromptStream
    from cadence.actors.tasks.registry import make_task
    from cadence.launch.config import Config, seq_len as config_seq_len
    from cadence.launch.config_loader import build
    from cadence.learner import optimizer as optim
    from cadence.learner.checkpoint import Checkpointer
    from cadence.learner.controller.noise import two_batch_estimate
    from cadence.learner.models.policy import build_policy
    from cadence.learner.packing import layout_microbatches, packed_row_len
    from cadence.learner.steps import make_train_step
    from cadence.learner.steps.grpo_step import LearnerState
    from cadence.protocols.weights import InProcessWeights

    cfg = build(Config(), [os.path.join(args.run, "config.yaml")], args.overrides)
    policy = build_policy(cfg)
    ts = make_train_step(policy.graphdef, cfg.learner, completion_budget=cfg.engine.max_new_tokens,
                         temperature=cfg.engine.temperature)
    template = ts.init(policy.params)
    with tempfile.TemporaryDirectory() as tmp:  # that one step alone: restore_latest then picks it
        shutil.copytree(os.path.join(args.run, "checkpoints", args.checkpoint), os.path.join(tmp, args.checkpoint))
        step, arrays, _ = Checkpointer(tmp, cfg.checkpoint).restore_latest(
            {"params": template.params, "opt_state": template.opt_state})
    before, opt = arrays["params"], arrays["opt_state"]
    hyper = optim.get_hyperparams(opt)
    adam = next(s for s in jax.tree.leaves(opt, is_leaf=lambda x: hasattr(x, "nu")) if hasattr(s, "nu"))
    count = float(np.asarray(adam.count))
    precond = [1.0 / (np.sqrt(np.asarray(v, np.float64) / (1 - hyper["b2"] ** count)) + hyper["eps"])
               for v in jax.tree.leaves(adam.nu)]

    def norms(tree) -> tuple[float, float]:
        leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
        return (sum(float(np.sum(x * x)) for x in leaves),
                sum(float(np.sum(x * x * w)) for x, w in zip(leaves, precond)))

    task = make_task(cfg.task, policy.tokenizer)
    G = cfg.learner.group_size
    engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, policy.tokenizer.eos_id,
                       policy.tokenizer.pad_id)
    stream = PromptStream(task)
    L = packed_row_len(cfg.learner, config_seq_len(cfg, task.max_prompt_len))

    def layout(groups, units: int = 0):
        return layout_microbatches(groups, L, min(cfg.learner.microbatch_size, len(groups) * G),
                                   cfg.learner.microbatch_tokens, policy.tokenizer.pad_id, cfg.learner.grpo,
                                   units=units)

    # one update on a batch of its own: the params the probes differentiate at
    first = Actor("probe", engine, task, None, InProcessWeights(before, 0), G, 1, args.seed)
    mbs, stats = layout(first.step(stream.take(cfg.learner.batch_size // G)))
    after, _ = ts.update(LearnerState(before, jax.tree.map(jnp.copy, opt), int(step)), mbs, stats["num_tokens"])
    params = after.params

    def probe(actor, b: int) -> dict:
        rows = {"euclid": [], "adam": []}
        for _ in range(args.samples // b):
            mbs, stats = layout(actor.step(stream.take(b // G)), units=cfg.controller.noise_units or 2)
            n = stats["num_tokens"]
            ends = np.cumsum([0, *(stats.get("unit_microbatches") or [len(mbs)])])
            samples = stats.get("unit_samples") or [b]
            parts, shares = [], []
            for a, e in zip(ends[:-1], ends[1:]):  # each unit's gradient, normalized by the whole batch
                parts.append(ts.accumulate_gradients(params, mbs[a:e], n)[0])
                shares.append(sum(float(np.asarray(mb.loss_mask).sum()) for mb in mbs[a:e]) / n)
            big = norms(jax.tree.map(lambda *xs: sum(xs), *parts))
            small = [norms(jax.tree.map(lambda x, s=s: x / s, u)) for u, s in zip(parts, shares)]
            for i, key in enumerate(rows):
                est = two_batch_estimate([q[i] for q in small], samples, big[i], b)
                if est is not None:
                    rows[key].append(est)
        out = {}
        for key, ests in rows.items():
            g2, tr = np.array([e[0] for e in ests]), np.array([e[1] for e in ests])
            se = lambda x: float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else None  # noqa: E731
            out[key] = {"batches": len(ests), "grad_sq": float(g2.mean()), "grad_sq_se": se(g2),
                        "trace_sigma": float(tr.mean()), "trace_sigma_se": se(tr),
                        "noise_scale": float(tr.mean() / g2.mean()) if g2.mean() > 0 else None}
        return out

    result = {"bench": "noise_scale_probe", "run": os.path.abspath(args.run), "checkpoint": int(step),
              "samples_per_point": args.samples, "overrides": args.overrides, "adam_step": count, "lr": hyper.get("learning_rate"),
              "fresh": {}, "stale": {}}
    for b in args.batch_sizes:
        fresh = Actor("fresh", engine, task, None, InProcessWeights(params, 0), G, 1, args.seed + 1)
        stale = Actor("stale", engine, task, None, InProcessWeights(before, 0), G, 1, args.seed + 2)
        result["fresh"][b], result["stale"][b] = probe(fresh, b), probe(stale, b)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

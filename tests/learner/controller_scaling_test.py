"""Rescaling on B -> kB: exactly the rule's lr, betas and eps, Adam moments kept, no recompilation."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cadence.learner.batching import build_microbatches
from cadence.learner.config import LearnerConfig, OptimizerConfig, PPOConfig
from cadence.learner.controller import (BatchSizeController, ControllerConfig, Generation, rescale, scaled_learner,
                                       scaled_optimizer)
from cadence.learner.loop import LearnerLoop, LoopSettings, observation
from cadence.learner.steps.grpo_step import GRPOTrainStep
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.testing import rollout_group

V, T, D, PAD = 12, 8, 8, 0
BASE = {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.99, "eps": 1e-8}


def logits_fn(params, tokens, positions, mask):
    del mask
    return jnp.tanh(params["embed"][tokens] + params["pos"][positions]) @ params["head"]  # [B, T, V]


def groups(n, seed, g=4):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        comps = [[int(x) for x in rng.integers(2, V, rng.integers(1, 6))] for _ in range(g)]
        out.append(rollout_group(f"g{i}", "t", [1, 2], comps, [[-1.0] * len(c) for c in comps],
                         [float(x) for x in rng.random(g)], 0))
    return out


@pytest.mark.parametrize("k", [2.0, 0.5, 4.0, 0.25])
def test_rule_values(k):
    s = rescale(BASE, k, "sqrt")
    assert s["learning_rate"] == pytest.approx(1e-3 * math.sqrt(k), rel=1e-12)
    assert s["b1"] == pytest.approx(0.9**k, rel=1e-12) and s["b2"] == pytest.approx(0.99**k, rel=1e-12)
    assert s["eps"] == pytest.approx(1e-8 / math.sqrt(k), rel=1e-12)
    lin = rescale(BASE, k, "linear")
    assert lin == {**BASE, "learning_rate": pytest.approx(1e-3 * k)}
    assert rescale(BASE, k, "none") == BASE
    # from the reference point, B -> kB -> B is the identity
    back = rescale(BASE, 1.0, "sqrt")
    assert back == pytest.approx(BASE)


def test_scaled_optimizer_for_fixed_batch_runs():
    opt = scaled_optimizer(OptimizerConfig(lr=1e-3, b1=0.9, b2=0.99, eps=1e-8), 128, 512, "sqrt")
    assert (opt.lr, opt.b1, opt.b2, opt.eps) == pytest.approx((2e-3, 0.9**4, 0.99**4, 5e-9))
    with pytest.raises(ValueError, match="scaling"):
        rescale(BASE, 2.0, "cubic")


def test_a_ceiling_stops_the_rule_and_says_how_much_lr_it_withholds():
    """Past max_k the rule keeps k = max_k's values (all four); below it nothing changes; the
    shortfall is the rule's lr over the lr given."""
    from cadence.learner.controller.scaling import lr_shortfall, max_k

    for k, scaling in ((8.0, "sqrt"), (4.0, "linear"), (2.0, "sqrt"), (0.5, "sqrt"), (16.0, "none")):
        free, capped = rescale(BASE, k, scaling), rescale(BASE, k, scaling, max_k=2.0)
        assert capped == rescale(BASE, min(k, 2.0), scaling)
        rule = {"sqrt": math.sqrt(k), "linear": k, "none": 1.0}[scaling]
        given = {"sqrt": math.sqrt(min(k, 2.0)), "linear": min(k, 2.0), "none": 1.0}[scaling]
        assert lr_shortfall(k, scaling, 2.0) == pytest.approx(rule / given, rel=1e-12)
        assert free["learning_rate"] == pytest.approx(capped["learning_rate"] * lr_shortfall(k, scaling, 2.0))
        assert lr_shortfall(k, scaling, 0.0) == 1.0  # no ceiling
    assert rescale(BASE, 4.0, "sqrt", max_k=0.5) == rescale(BASE, 1.0, "sqrt")  # never below the reference's own
    assert max_k(256, 128) == 2.0 and max_k(0, 128) == 0.0
    opt = scaled_optimizer(OptimizerConfig(lr=1e-3, b1=0.9, b2=0.99, eps=1e-8), 128, 512, "sqrt",
                           max_scaled_batch_size=256)
    assert (opt.lr, opt.b1, opt.b2, opt.eps) == pytest.approx((1e-3 * math.sqrt(2), 0.81, 0.99**2, 1e-8 / math.sqrt(2)))
    with pytest.raises(ValueError, match="max_scaled_batch_size"):
        ControllerConfig(max_scaled_batch_size=-1).validate()


def test_the_controller_and_the_experiments_fixed_runs_share_the_ceiling(tmp_path):
    """A fixed run of an experiment trains with the values a controller would give that B under
    the ceiling, and the controller run (its reference point its start B) stops at the same B."""
    from cadence.launch.config import load_config
    from cadence.launch.experiments import common

    base = load_config(overrides=["learner.batch_size=128", "controller.max_scaled_batch_size=256"])
    opts = {b: common.fixed_batch_config(base, b, "sqrt", 0, base_batch_size=128, max_samples=1024,
                                         eval_samples=512, run_dir=str(tmp_path / str(b))).learner.optimizer
            for b in (64, 256, 512)}
    assert opts[512] == opts[256] and opts[64].lr == pytest.approx(base.learner.optimizer.lr / math.sqrt(2))
    start = dataclasses.replace(base.learner, batch_size=64, optimizer=opts[64])  # as the experiment's controller run
    ctrl = BatchSizeController(dataclasses.replace(base.controller, enabled=True), start)
    for b in (256, 512):
        assert ctrl.hyperparams_for(b) == pytest.approx({"learning_rate": opts[b].lr, "b1": opts[b].b1,
                                                         "b2": opts[b].b2, "eps": opts[b].eps})
    assert ctrl.lr_shortfall(512) == pytest.approx(math.sqrt(2)) and ctrl.lr_shortfall(256) == pytest.approx(1.0)
    # a controller run started past the ceiling (512: capped values, off the rule's curve) rescales
    # from the experiment's reference point, so a shrink gets the fixed runs' values too
    from cadence.launch.experiments.decision_rule import run_controller

    cfg512 = common.fixed_batch_config(base, 512, "sqrt", 0, base_batch_size=128, max_samples=1024,
                                       eval_samples=512, run_dir=str(tmp_path / "c"))
    cfg512 = dataclasses.replace(cfg512, controller=dataclasses.replace(
        cfg512.controller, enabled=True, min_batch_size=64, max_batch_size=512, base_batch_size=0))
    high = run_controller(base, cfg512, 128)
    for b in (64, 256, 512):
        assert high.hyperparams_for(b) == pytest.approx({"learning_rate": opts[b].lr, "b1": opts[b].b1,
                                                         "b2": opts[b].b2, "eps": opts[b].eps})


def test_scaled_learner_scales_the_ppo_critic_with_the_policy():
    lc = LearnerConfig(algorithm="ppo", optimizer=OptimizerConfig(lr=1e-3, b1=0.9, b2=0.99, eps=1e-8),
                       ppo=PPOConfig(critic_lr=3e-3))
    for scaling, factor in (("sqrt", 2.0), ("linear", 4.0), ("none", 1.0)):
        out = scaled_learner(lc, 128, 512, scaling)
        assert out.optimizer == scaled_optimizer(lc.optimizer, 128, 512, scaling)
        assert out.ppo.critic_lr == pytest.approx(3e-3 * factor)  # the ratio to the policy's lr kept
    grpo = scaled_learner(dataclasses.replace(lc, algorithm="grpo"), 128, 512, "sqrt")
    assert grpo.ppo == lc.ppo and grpo.optimizer.lr == pytest.approx(2e-3)


class GrowCurve:
    """Generation that is free until far beyond B: doubling B doubles throughput."""

    def observe(self, *a):
        pass

    def predict(self, c):
        return 100.0 * c

    def curve(self):
        return None


def test_controller_change_applied_through_the_loop_keeps_moments_and_compiles_nothing():
    cfg = LearnerConfig(batch_size=8, microbatch_size=4, group_size=4, optimizer=OptimizerConfig(lr=1e-3))
    ts = GRPOTrainStep(logits_fn, cfg)
    rng = np.random.default_rng(0)
    params = {"embed": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
              "pos": jnp.asarray(rng.normal(size=(T, D)), jnp.float32),
              "head": jnp.asarray(rng.normal(size=(D, V)), jnp.float32)}
    state = ts.init(params)
    gate = AdmissionGate(8, 1)
    loop = LearnerLoop(ts, None, gate, None, LoopSettings(4, 4, T, PAD, cfg.grpo))
    ccfg = ControllerConfig(enabled=True, window=2, dwell=0, min_batch_size=4, max_batch_size=64,
                            warmup_steps=5, min_ess=0.0, max_clip_frac=1.0)  # estimators fed by hand
    ctrl = BatchSizeController(ccfg, cfg, generation=GrowCurve())
    ctrl.noise.update([1.5, 1.5], 1.0, 4, 8)  # |G|^2 0.5, tr 4: B_noise 8, so B 8 -> 16 pays 25%
    ctrl.learner.observe(8, 0.001)
    ctrl.learner.observe(16, 0.001)  # fixed cost only: a larger B is free on the learner too

    decision = None
    for step in (1, 2):
        mbs, stats = build_microbatches(groups(loop.batch_size // 4, step), T, 4, PAD, cfg.grpo)
        state, m = ts.update(state, mbs, stats["num_tokens"])
        m.update(batch_size=loop.batch_size)
        decision = ctrl.update(observation(step, m, Generation(step * 1.0, 0.0, 0.0, concurrency=2)))
    assert decision is not None and decision.batch_size == 16, decision
    assert decision.concurrency == 4  # actors follow B
    sizes = ts.cache_sizes()
    mu_before = jax.tree.map(np.asarray, state.opt_state)
    state = loop.apply(state, decision)
    assert loop.batch_size == 16 and gate.batch_size == 16
    got = ts.get_hyperparams(state)
    want = rescale(BASE, 2.0, "sqrt")
    for name in ("learning_rate", "b1", "b2", "eps"):
        assert got[name] == float(np.float32(want[name])), name  # exact, in the state's float32
    # Adam's moments and count are the same arrays as before the change
    adam_before = [s for s in jax.tree.leaves(mu_before, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                   if isinstance(s, optax.ScaleByAdamState)]
    adam_after = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                  if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam_before) == len(adam_after) == 1
    for a, b in zip(jax.tree.leaves(adam_before), jax.tree.leaves(adam_after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the next update runs at B = 16 (4 microbatches) with the new values and compiles nothing
    mbs, stats = build_microbatches(groups(4, 9), T, 4, PAD, cfg.grpo)
    state, m = ts.update(state, mbs, stats["num_tokens"])
    assert m["num_microbatches"] == 4 and m["learning_rate"] == float(np.float32(want["learning_rate"]))
    assert ts.cache_sizes() == sizes


def test_fixed_batch_with_another_base_applies_the_rule_once():
    from cadence.launch.config import load_config
    from cadence.learner.controller import FixedBatchSize, Observation, make_controller

    cfg = load_config(overrides=["learner.batch_size=64", "controller.base_batch_size=16"])
    ctrl = make_controller(cfg.controller, cfg.learner, cfg.actors)
    d = ctrl.update(Observation(step=1, batch_size=64))
    assert d.batch_size is None and d.hyperparams.as_kwargs() == pytest.approx(
        rescale({"learning_rate": cfg.learner.optimizer.lr, "b1": cfg.learner.optimizer.b1,
                 "b2": cfg.learner.optimizer.b2, "eps": cfg.learner.optimizer.eps}, 4.0, "sqrt"))
    fixed = make_controller(dataclasses.replace(cfg.controller, base_batch_size=0), cfg.learner, cfg.actors)
    assert isinstance(fixed, FixedBatchSize) and fixed.update(Observation(step=1, batch_size=64)) is None

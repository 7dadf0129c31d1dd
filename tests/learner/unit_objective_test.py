"""The noise scale's units on stale batches (ControllerConfig.noise_objective): measured on the
objective without its clip in a pass of their own, the update itself unchanged; who asks for
which (the controller), and how the loop hands it to the estimator."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from cadence.learner.config import GRPOConfig, LearnerConfig, OptimizerConfig
from cadence.learner.controller import BatchSizeController, ControllerConfig, FixedBatchSize, GradientNorms
from cadence.learner.controller.noise import NoiseScaleEstimator
from cadence.learner.loop import observation
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig
from cadence.learner.packing import layout_microbatches
from cadence.learner.steps.grpo_step import GRPOTrainStep
from cadence.protocols.testing import random_groups

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
T, PAD, G = 24, 0, 4
# No clip in reach: ratios in (1e-6, 1e9) keep the unclipped branch and its exact gradient.
OPEN = dict(clip_low=0.999999, clip_high=1e9, dual_clip=0.0)


def _cfg(**grpo):
    return LearnerConfig(batch_size=16, microbatch_size=4, group_size=G, microbatch_tokens=2 * T,
                         optimizer=OptimizerConfig(lr=1e-2), grpo=dataclasses.replace(GRPOConfig(), **grpo))


def _norm_sq(tree) -> float:
    return sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def model():
    return llama.init_params(MODEL, 0)


@pytest.fixture(scope="module")
def batch():
    # random behaviour log-probs (mean -1) against a fresh model's (~ -3.5): most ratios far below
    # 1 - clip_low, so the coupled clip binds wherever the advantage is negative
    mbs, stats = layout_microbatches(random_groups(4, 33, MODEL.vocab_size, G), T, 4, 2 * T, PAD, GRPOConfig(),
                                     units=2)
    assert len(stats["unit_microbatches"]) == 2 and max(stats["unit_microbatches"]) > 1
    return mbs, stats


def test_unclipped_units_are_the_open_objectives_and_the_update_is_the_trained_one(model, batch):
    graphdef, params = model
    mbs, stats = batch
    units, n = stats["unit_microbatches"], stats["num_tokens"]
    forward = functools.partial(llama.forward, graphdef)
    step = GRPOTrainStep(forward, _cfg())
    state, m = step.update(step.init(params), mbs, n, units=units, unit_objective="unclipped")
    assert m["clip_frac"] > 0.1  # the clip binds: the two objectives' gradients differ
    reference = GRPOTrainStep(forward, _cfg(**OPEN))
    ends = np.cumsum([0, *units])
    for k, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        g, _ = reference.accumulate_gradients(params, mbs[a:b], n)  # normalized by the whole batch's tokens
        # summed in bf16 (UNIT_DTYPE): on this 30k-parameter model rounding g alone moves |g|^2 by ~3e-4
        assert m["unit_grad_norm_sq"][k] == pytest.approx(_norm_sq(g), rel=1e-3)
    whole, _ = reference.accumulate_gradients(params, mbs, n)
    assert m["unit_batch_grad_norm_sq"] == pytest.approx(_norm_sq(whole), rel=1e-5)
    # the trained update is the clipped objective's, as without the pass
    trained, mt = step.update(step.init(params), mbs, n, units=units)
    assert "unit_batch_grad_norm_sq" not in mt and mt["grad_norm_sq"] == pytest.approx(m["grad_norm_sq"], rel=1e-6)
    assert mt["loss"] == pytest.approx(m["loss"], rel=1e-6)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(trained.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-7)
    assert not np.allclose(mt["unit_grad_norm_sq"], m["unit_grad_norm_sq"], rtol=0.01)
    assert m["grad_norm_sq"] != pytest.approx(m["unit_batch_grad_norm_sq"], rel=0.01)


def test_units_of_one_microbatch_each_and_corrections_that_cannot_clip(model, batch):
    graphdef, params = model
    mbs, stats = batch
    n = stats["num_tokens"]
    forward = functools.partial(llama.forward, graphdef)
    step, reference = GRPOTrainStep(forward, _cfg()), GRPOTrainStep(forward, _cfg(**OPEN))
    ones = [1] * len(mbs)  # each microbatch a unit: the trained pass needs no buffer, the open one does
    _, m = step.update(step.init(params), mbs, n, units=ones, unit_objective="unclipped")
    want = [_norm_sq(reference.accumulate_gradients(params, [mb], n)[0]) for mb in mbs]
    np.testing.assert_allclose(m["unit_grad_norm_sq"], want, rtol=1e-3)
    assert m["unit_grad_norm_sq"] != pytest.approx(m["microbatch_grad_norm_sq"], rel=0.01)
    # the decoupled correction's ratio is 1 at one minibatch: nothing to drop, no pass
    decoupled = GRPOTrainStep(forward, _cfg(correction="decoupled"))
    _, d = decoupled.update(decoupled.init(params), mbs, n, units=stats["unit_microbatches"],
                            unit_objective="unclipped")
    _, dt = decoupled.update(decoupled.init(params), mbs, n, units=stats["unit_microbatches"])
    assert "unit_batch_grad_norm_sq" not in d and d["unit_grad_norm_sq"] == dt["unit_grad_norm_sq"]
    with pytest.raises(ValueError, match="unit_objective"):
        step.update(step.init(params), mbs, n, units=ones, unit_objective="clipped")


def test_the_controller_asks_for_the_unclipped_units_on_stale_batches_every_noise_every():
    learner = LearnerConfig(batch_size=16, microbatch_size=4, group_size=G)

    def asks(**kw):
        ctrl = BatchSizeController(ControllerConfig(enabled=True, min_batch_size=8, **kw), learner, 1, True)
        return [ctrl.gradient_objective(step, off_policy) for step in (1, 2, 3, 4) for off_policy in (False, True)]

    assert asks(noise_every=1) == ["trained", "unclipped"] * 4
    assert asks(noise_every=2) == ["trained", None, "trained", "unclipped"] * 2
    assert asks() == ["trained", None] * 3 + ["trained", "unclipped"]  # every 4th stale update
    assert asks(noise_objective="trained", noise_every=1) == ["trained", "trained"] * 4
    assert FixedBatchSize(16, 4).gradient_objective(2, True) is None
    for bad, field in ((dict(noise_objective="clipped"), "noise_objective"), (dict(noise_every=0), "noise_every")):
        with pytest.raises(ValueError, match=field):
            ControllerConfig(**bad).validate()


def test_observation_carries_the_units_batch_norm_and_skips_unmeasured_updates():
    base = {"batch_size": 16, "grad_norm_sq": 4.0, "microbatch_grad_norm_sq": [2.0, 2.0],
            "microbatch_tokens": [10.0, 10.0], "unit_grad_norm_sq": [1.0, 1.5], "unit_share": [0.5, 0.5],
            "unit_samples": [8, 8]}
    grads = observation(3, {**base, "unit_batch_grad_norm_sq": 0.5, "noise/measured": 1}).gradients
    assert grads.unit_batch_grad_norm_sq == 0.5 and grads.unit_grad_norm_sq == (1.0, 1.5)
    assert observation(3, base).gradients.unit_batch_grad_norm_sq is None
    assert observation(3, {**base, "noise/measured": 0}).gradients is None


def test_the_estimate_compares_the_units_with_their_own_objectives_batch():
    # units of 8 samples in a batch of 16: tr = (S - big) / (1/8 - 1/16), |G|^2 = big - tr / 16
    norms = GradientNorms(9.0, (1.0, 1.0), (10.0, 10.0), unit_grad_norm_sq=(0.25, 0.5), unit_share=(0.5, 0.5),
                          unit_samples=(8, 8), unit_batch_grad_norm_sq=1.0)
    est = NoiseScaleEstimator(decay=0.0)
    assert est.update_from_gradients(norms, 16)
    s = np.mean([0.25 / 0.25, 0.5 / 0.25])  # each unit's mean gradient: contribution / share
    trace = (s - 1.0) / (1 / 8 - 1 / 16)
    assert est.trace_sigma == pytest.approx(trace) and est.grad_sq == pytest.approx(1.0 - trace / 16)
    trained = NoiseScaleEstimator(decay=0.0)  # the trained gradient's 9.0 would give another answer
    trained.update_from_gradients(dataclasses.replace(norms, unit_batch_grad_norm_sq=None), 16)
    assert trained.trace_sigma != pytest.approx(est.trace_sigma)

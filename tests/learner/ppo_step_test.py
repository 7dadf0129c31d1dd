"""PPOTrainStep on a tiny real Llama: microbatch accumulation, critic modes, reference KL, no
recompilation, and (slow) PPO learning the 6-digit sorting task through the real pipeline."""

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from grpo_step_test import PAD, T, V, make_groups  # noqa: E402  (shared stand-in groups)

from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.config import LearnerConfig, OptimizerConfig, PPOConfig  # noqa: E402
from cadence.learner.steps import make_train_step  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.steps.ppo_step import PPOState, PPOTrainStep  # noqa: E402


@pytest.fixture(scope="module")
def model():
    mcfg = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=T)
    return llama.init_params(mcfg, 0)


def _cfg(microbatch_size=4, **ppo):
    return LearnerConfig(algorithm="ppo", batch_size=16, microbatch_size=microbatch_size, group_size=4,
                         optimizer=OptimizerConfig(lr=1e-2), ppo=dataclasses.replace(PPOConfig(), **ppo))


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_accumulated_gradient_equals_full_batch_gradient(model, critic):
    graphdef, params = model
    groups = make_groups(4, seed=2)
    grads = []
    for mbsize in (4, 16):
        step = make_train_step(graphdef, _cfg(mbsize, critic=critic, kl_coef=0.1))
        assert isinstance(step, PPOTrainStep)
        state = step.init(params)
        # Non-zero head so values (and the value loss gradient into the trunk) are not trivial.
        state = state._replace(critic_params={**state.critic_params, "head": {
            "w": np.linspace(-1, 1, 16).astype(np.float32), "b": np.float32(0.1)}})
        mbs, stats = build_microbatches(groups, T, mbsize, PAD, step.cfg.grpo)
        g, _, info = step.accumulate_gradients(state, mbs, stats["num_tokens"])
        grads.append((g, info))
    (g4, i4), (g16, i16) = grads
    assert i4 == pytest.approx(i16, rel=1e-5, abs=1e-7)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g16)):
        # float32 sums in another order: error relative to the leaf's scale (the separate critic's
        # embedding gradient reaches ~36, where 2e-6 absolute is below float32 resolution)
        scale = float(np.abs(np.asarray(b)).max())
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=max(2e-6, 1e-5 * scale))
    assert sum(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(g4[1])) > 0  # critic learns


def test_value_loss_falls_and_reference_stays_frozen(model):
    graphdef, params = model
    step = make_train_step(graphdef, _cfg(kl_coef=0.05, kl_estimator="k3", kl_placement="loss",
                                          critic_lr=3e-2))
    state = step.init(params)
    assert isinstance(state, PPOState) and state.ref_params is not None
    groups = make_groups(4, seed=4)
    mbs, stats = build_microbatches(groups, T, 4, PAD, step.cfg.grpo)
    history = []
    for _ in range(15):
        state, m = step.update(state, mbs, stats["num_tokens"])
        history.append(m)
    assert history[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at first
    assert history[-1]["kl_ref"] > 0  # the policy moved away from the frozen reference
    assert history[-1]["value_loss"] < 0.5 * history[0]["value_loss"]
    for a, b in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(state.params) == jax.tree.structure(params)  # publishable as is
    for key in ("ess", "clip_frac", "mismatch_kl", "entropy_sampled", "grad_norm", "critic_grad_norm",
                "explained_variance"):
        assert np.isfinite(history[-1][key]), key


def test_no_recompilation_across_batch_sizes_and_hyperparameters(model):
    graphdef, params = model
    step = make_train_step(graphdef, _cfg())
    state = step.init(params)
    for k, n_groups in enumerate((4, 2, 6)):
        mbs, stats = build_microbatches(make_groups(n_groups, seed=k), T, 4, PAD, step.cfg.grpo)
        state = step.set_hyperparams(state, lr=1e-3 * (k + 1))
        state, m = step.update(state, mbs, stats["num_tokens"])
        assert m["learning_rate"] == pytest.approx(1e-3 * (k + 1))
    assert step.cache_sizes() == {"zeros": 1, "prepare": 1, "accumulate": 1, "apply": 1}


def test_a_batch_size_rule_change_moves_the_critic_with_the_actor(model):
    graphdef, params = model
    step = make_train_step(graphdef, _cfg(critic_lr=3e-2))  # actor lr 1e-2: ratio 3
    state = step.init(params)
    state = step.set_hyperparams(state, lr=2e-2, b1=0.81, b2=0.998, eps=5e-9)
    want = {"learning_rate": 2e-2, "b1": 0.81, "b2": 0.998, "eps": 5e-9}
    actor, critic = step.get_hyperparams(state), step.get_critic_hyperparams(state)
    assert {k: actor[k] for k in want} == pytest.approx(want)
    assert {k: critic[k] for k in want} == pytest.approx({**want, "learning_rate": 6e-2})
    # and the update uses them: one step from zero moments moves the critic head by about lr
    mbs, stats = build_microbatches(make_groups(4, seed=7), T, 4, PAD, step.cfg.grpo)
    new, _ = step.update(state, mbs, stats["num_tokens"])
    moved = np.abs(np.asarray(new.critic_params["head"]["b"]) - np.asarray(state.critic_params["head"]["b"]))
    assert float(moved) == pytest.approx(6e-2, rel=0.05)


def test_ppo_config_validation_names_the_key():
    with pytest.raises(ValueError, match=r"^ppo\.gae_lambda"):
        dataclasses.replace(LearnerConfig(), ppo=PPOConfig(gae_lambda=1.5)).validate()
    with pytest.raises(ValueError, match=r"^ppo\.kl_estimator"):
        dataclasses.replace(LearnerConfig(), ppo=PPOConfig(kl_estimator="k2")).validate()
    with pytest.raises(ValueError, match=r"^algorithm"):
        dataclasses.replace(LearnerConfig(), algorithm="a2c").validate()


@pytest.mark.slow
def test_ppo_learns_sort6_in_a_short_seeded_run(tmp_path):
    from cadence.launch.config import load_config
    from cadence.launch.metrics import read_metrics
    from cadence.launch.run.train import train

    cfg = load_config(overrides=["learner.algorithm=ppo", "run.steps=60", "run.eval_every=30",
                                 "learner.sft.steps=30", "task.heldout_size=64", "run.progress=false"])
    train(cfg, str(tmp_path / "run"))
    rows = [m for m in read_metrics(str(tmp_path / "run")) if m["step"] > 0]
    first = np.mean([m["reward/mean"] for m in rows[:10]])
    last = np.mean([m["reward/mean"] for m in rows[-10:]])
    assert last > first + 0.1, (first, last)
    assert all(np.isfinite(m["value_loss"]) for m in rows)

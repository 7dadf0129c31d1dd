"""learner.skip_zero_advantage: groups whose rewards are all equal (zero advantage) go into
microbatches of their own, and the train step skips those microbatches' gradient pass. The update
must be the one the step makes computing everything (params, loss, grad norms, unit norms), and
the descriptive metrics the means over the tokens that were computed."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from cadence.learner.config import GRPOConfig, LearnerConfig, OptimizerConfig
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig
from cadence.learner.packing import layout_microbatches
from cadence.learner.steps.grpo_step import GRPOTrainStep, has_signal, whole_batch
from cadence.protocols.testing import rollout_group

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
T, PAD, G = 24, 0, 4


@functools.lru_cache(maxsize=1)
def _model():
    return llama.init_params(MODEL, 0)


def _groups(flat, seed):
    """One group per entry: True = all rewards equal (alternately all 0 and all 1), else mixed."""
    rng = np.random.default_rng(seed)
    out = []
    for i, is_flat in enumerate(flat):
        prompt = [1] + [int(x) for x in rng.integers(3, MODEL.vocab_size, rng.integers(2, 6))]
        comps = [[int(x) for x in rng.integers(3, MODEL.vocab_size, rng.integers(1, 12))] for _ in range(G)]
        behav = [[float(-rng.exponential()) for _ in c] for c in comps]
        rewards = [float(i % 2)] * G if is_flat else [float(x) for x in rng.integers(0, 2, G)]
        if not is_flat and len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        out.append(rollout_group(f"g{i}", "t", prompt, comps, behav, rewards, 0))
    return out


FLAT = [False, True, True, False, True, True, True, False]  # 5 of 8 groups without a signal


def _cfg(skip, microbatch_tokens=2 * T, **grpo):
    return LearnerConfig(batch_size=32, microbatch_size=4, group_size=G, microbatch_tokens=microbatch_tokens,
                         skip_zero_advantage=skip, optimizer=OptimizerConfig(lr=1e-2),
                         grpo=dataclasses.replace(GRPOConfig(), **grpo))


def _step(cfg):
    graphdef, _ = _model()
    return GRPOTrainStep(functools.partial(llama.forward, graphdef), cfg)


@pytest.mark.parametrize("microbatch_tokens", [2 * T, 0])
def test_flat_groups_fill_microbatches_of_their_own_within_each_unit(microbatch_tokens):
    groups = _groups(FLAT, seed=1)
    cfg = GRPOConfig()
    plain, plain_stats = layout_microbatches(groups, T, 4, microbatch_tokens, PAD, cfg, units=2)
    mbs, stats = layout_microbatches(groups, T, 4, microbatch_tokens, PAD, cfg, units=2, separate_flat=True)
    assert stats["flat_groups"] == 5
    # the units keep their groups: the noise scale's small batches are the same samples
    assert stats["unit_samples"] == plain_stats["unit_samples"]
    assert sum(stats["unit_microbatches"]) == len(mbs)
    signal = [has_signal(mb) for mb in mbs]
    flat_tokens = sum(float(np.asarray(mb.loss_mask).sum()) for mb, s in zip(mbs, signal) if not s)
    # every token of a flat group sits in a microbatch without a signal (groups of 4 fill padded
    # microbatches of 4 exactly; packed, each part fills microbatches of its own)
    want = sum(len(c) for g, f in zip(groups, FLAT) if f for c in g.completion_tokens)
    assert flat_tokens == want
    assert stats["num_tokens"] == plain_stats["num_tokens"]
    assert sum(np.asarray(mb.loss_mask).sum() for mb in mbs) == sum(np.asarray(mb.loss_mask).sum() for mb in plain)


@pytest.mark.parametrize("microbatch_tokens", [2 * T, 0])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_skipping_flat_microbatches_gives_the_same_update(microbatch_tokens, aggregation):
    _, params = _model()
    groups = _groups(FLAT, seed=2)
    full, skip = (_step(_cfg(s, microbatch_tokens, aggregation=aggregation)) for s in (False, True))
    mbs, stats = layout_microbatches(groups, T, 4, microbatch_tokens, PAD, full.cfg.grpo, units=2,
                                     separate_flat=True)
    units, n = stats["unit_microbatches"], stats["num_tokens"]
    sa, ma = full.update(full.init(params), mbs, n, units=units)
    sb, mb_ = skip.update(skip.init(params), mbs, n, units=units)
    skipped = [i for i, mb in enumerate(mbs) if not has_signal(mb)]
    assert mb_["skipped_microbatches"] == len(skipped) >= 2
    for x, y in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6)
    for key in ("loss", "pg_loss", "grad_norm_sq"):
        assert mb_[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-8), key
    np.testing.assert_allclose(mb_["unit_grad_norm_sq"], ma["unit_grad_norm_sq"], rtol=1e-5, atol=1e-10)
    assert all(mb_["microbatch_grad_norm_sq"][i] == 0 for i in skipped)
    assert all(ma["microbatch_grad_norm_sq"][i] < 1e-12 for i in skipped)  # computed: zero anyway
    # the descriptive metrics are means over the computed tokens: the full step on those alone
    kept = [mb for i, mb in enumerate(mbs) if i not in skipped]
    tokens = int(sum(np.asarray(mb.loss_mask).sum() for mb in kept))
    _, mc = full.update(full.init(params), kept, tokens)
    for key in ("clip_frac", "ratio_mean", "entropy", "entropy_sampled", "mismatch_kl", "ess"):
        assert mb_[key] == pytest.approx(mc[key], rel=1e-5), key


def test_a_batch_without_any_signal_still_steps_adam_on_a_zero_gradient():
    _, params = _model()
    full, skip = _step(_cfg(False, 4 * T)), _step(_cfg(True, 4 * T))
    first, s1 = layout_microbatches(_groups([False] * 4, seed=3), T, 4, 4 * T, PAD, full.cfg.grpo)
    flat, s2 = layout_microbatches(_groups([True], seed=4), T, 4, 4 * T, PAD, full.cfg.grpo, separate_flat=True)
    assert len(flat) == 1 and not has_signal(flat[0])  # the fused one-microbatch path
    states = []
    for step in (full, skip):  # a signal update (Adam's moments nonzero), then one without signal
        state, _ = step.update(step.init(params), first, s1["num_tokens"])
        before = [np.asarray(x).copy() for x in jax.tree.leaves(state.params)]
        state, m = step.update(state, flat, s2["num_tokens"])
        states.append(state)
        assert m["grad_norm"] == 0.0
        # the moments still move the params: an update is not a no-op
        assert any(not np.array_equal(b, np.asarray(a)) for b, a in zip(before, jax.tree.leaves(state.params)))
    assert m["skipped_microbatches"] == 1
    for x, y in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-7)


def test_a_learner_over_several_processes_skips_by_the_whole_microbatch():
    """Given only its rows (WholeBatch), a process skips what the whole microbatch says: a rank
    whose rows of a microbatch are all flat still computes it when another rank's are not."""
    mbs, _ = layout_microbatches(_groups(FLAT, seed=5), T, 4, 2 * T, PAD, GRPOConfig(), separate_flat=True)
    whole = whole_batch(mbs)
    assert whole.signal == tuple(has_signal(mb) for mb in mbs)
    step = _step(_cfg(True))
    rows_of_one = [mb._replace(advantages=np.zeros_like(mb.advantages)) for mb in mbs]  # this rank's rows: flat
    assert step._skipped(rows_of_one, whole) == frozenset(i for i, s in enumerate(whole.signal) if not s)
    assert whole.part([0, 1]).signal == whole.signal[:2]


def test_config_names_what_skipping_cannot_keep_exact():
    with pytest.raises(ValueError, match="skip_zero_advantage.*entropy_scope"):
        _cfg(True, entropy_scope="all").validate()
    _cfg(True, entropy_scope="all", entropy_coef=0.0).validate()  # no bonus: exact again
    with pytest.raises(ValueError, match="skip_zero_advantage.*ppo"):
        dataclasses.replace(_cfg(True, microbatch_tokens=0), algorithm="ppo").validate()

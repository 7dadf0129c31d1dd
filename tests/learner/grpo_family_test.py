"""The GRPO family as configuration: aggregations, sequence-level ratios (GSPO), batch std, and the
ESS / mismatch-KL closed forms under a synthetic behavior policy; all against NumPy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.learner.algorithms import grpo
from cadence.learner.batching import build_microbatches
from cadence.learner.config import GRPOConfig, LearnerConfig, OptimizerConfig
from cadence.learner.steps.grpo_step import GRPOTrainStep

rng = np.random.default_rng(3)
B, T = 4, 6
MASK = np.array([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]],
                np.float32)
LP = np.log(rng.uniform(0.05, 0.95, (B, T)))
BLP = LP - rng.normal(0, 0.3, (B, T))  # ratios around 1, several beyond +-0.2
ADV = np.array([1.0, -1.0, 0.5, -2.0])


def _cfg(**kw):
    return dataclasses.replace(GRPOConfig(), **kw)


def np_token_values(lp, blp, adv, lo, hi):
    r = np.exp(lp - blp)
    a = adv[:, None]
    return np.minimum(r * a, np.clip(r, 1 - lo, 1 + hi) * a)


def np_aggregate(v, mask, mode, constant):
    lengths = mask.sum(1)
    rows = lengths > 0
    if mode == "token_mean":
        return np.sum(v * mask) / mask.sum()
    if mode == "seq_mean_token_mean":
        return np.sum(np.sum(v * mask, 1)[rows] / lengths[rows]) / rows.sum()
    return np.sum(v * mask) / (rows.sum() * constant)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
@pytest.mark.parametrize("constant", [0, 10])
def test_every_aggregation_matches_numpy_and_adds_up_over_microbatches(mode, constant):
    cfg = _cfg(correction="coupled", aggregation=mode, aggregation_constant=constant, clip_high=0.28)
    budget = 5  # the completion budget: the longest row has 5 completion tokens
    loss, _ = grpo.grpo_token_loss(jnp.asarray(LP, jnp.float32), jnp.asarray(BLP, jnp.float32),
                                   jnp.asarray(ADV, jnp.float32), jnp.asarray(MASK), MASK.sum(), cfg,
                                   completion_budget=budget)
    v = np_token_values(LP, BLP, ADV, 0.2, 0.28)
    want = -np_aggregate(v, MASK, mode, constant or budget)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    # Two microbatches with the GLOBAL token and sequence counts add up to the full batch.
    parts = [grpo.grpo_token_loss(jnp.asarray(LP[s], jnp.float32), jnp.asarray(BLP[s], jnp.float32),
                                  jnp.asarray(ADV[s], jnp.float32), jnp.asarray(MASK[s]), MASK.sum(), cfg,
                                  num_sequences=4.0, completion_budget=budget)[0]
             for s in (slice(0, 1), slice(1, 4))]
    np.testing.assert_allclose(float(sum(parts)), want, rtol=1e-5)


def test_seq_sum_norm_divides_by_the_completion_budget_not_the_row():
    # Dr.GRPO through the train step: rows of [prompt (3 tokens) | completion | padding], T = 16,
    # engine.max_new_tokens = 8. Each sequence's token sum / 8, mean over sequences: the prompt
    # and padding columns must not enter the divisor (T = 16 would halve the loss).
    p = np.array([0.1, 0.2, 0.3, 0.4])
    cfg = LearnerConfig(batch_size=4, microbatch_size=4, group_size=2, optimizer=OptimizerConfig(lr=1e-3),
                        grpo=_cfg(scale_by_std=False, aggregation="seq_sum_norm", correction="none"))
    completions = [[0, 1, 2], [3], [1, 1, 1, 1, 1, 1, 1, 1], [2, 3]]
    groups = [_Group(0, completions[:2], [[-1.0] * len(c) for c in completions[:2]]),
              _Group(1, completions[2:], [[-1.0] * len(c) for c in completions[2:]])]
    for g in groups:
        g.prompt_tokens = [0, 1, 2]
        g.rewards = [1.0, 0.0]
    mbs, stats = build_microbatches(groups, 16, 4, 0, cfg.grpo)
    step = GRPOTrainStep(_bias_logits, cfg, completion_budget=8)
    _, metrics = step.update(step.init({"b": jnp.asarray(np.log(p), jnp.float32)}), mbs, stats["num_tokens"])
    adv = np.array([0.5, -0.5, 0.5, -0.5])  # r - mean, not scaled; ratio 1 ("none")
    want = -np.sum(adv * np.array([len(c) for c in completions])) / (4 * 8)
    np.testing.assert_allclose(metrics["pg_loss"], want, rtol=1e-6)
    with pytest.raises(ValueError, match="aggregation_constant"):  # no budget and no constant
        GRPOTrainStep(_bias_logits, cfg).update(
            step.init({"b": jnp.asarray(np.log(p), jnp.float32)}), mbs, stats["num_tokens"])


def test_aggregations_differ_as_documented():
    # seq_mean_token_mean weighs a 1-token sequence like a 5-token one; token_mean does not.
    v = np.ones((B, T)) * np.arange(1, B + 1)[:, None]
    got = {m: np_aggregate(v, MASK, m, T) for m in ("token_mean", "seq_mean_token_mean", "seq_sum_norm")}
    assert got["seq_mean_token_mean"] == pytest.approx(2.5)
    assert got["token_mean"] == pytest.approx((1 * 5 + 2 * 2 + 3 * 3 + 4 * 1) / 11)
    assert got["seq_sum_norm"] == pytest.approx((1 * 5 + 2 * 2 + 3 * 3 + 4 * 1) / (4 * T))


def np_gspo_loss_and_grad(lp, blp, adv, mask, lo, hi):
    """GSPO: s_b = exp(mean_t(lp - blp)), loss = -mean_b min(s A, clip(s) A); d/dlp analytic."""
    lengths = mask.sum(1)
    s = np.exp(np.sum((lp - blp) * mask, 1) / lengths)  # [B]
    unclipped, clipped = s * adv, np.clip(s, 1 - lo, 1 + hi) * adv
    binding = clipped < unclipped
    obj = np.where(binding, clipped, unclipped)
    loss = -np.mean(obj)
    dobj_ds = np.where(binding, 0.0, adv)
    grad = -(dobj_ds * s / lengths)[:, None] * mask / B
    return loss, grad, binding


def test_gspo_sequence_ratio_loss_and_gradient_match_numpy():
    lo, hi = 0.05, 0.08
    cfg = _cfg(correction="coupled", importance_level="sequence", aggregation="seq_mean_token_mean",
               clip_low=lo, clip_high=hi)

    def loss_fn(lp):
        return grpo.grpo_token_loss(lp, jnp.asarray(BLP, jnp.float32), jnp.asarray(ADV, jnp.float32),
                                    jnp.asarray(MASK), MASK.sum(), cfg)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(LP, jnp.float32))
    want_loss, want_grad, binding = np_gspo_loss_and_grad(LP, BLP, ADV, MASK, lo, hi)
    assert 0 < binding.sum() < B  # the case exercises both branches
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    want_clip = np.sum(binding * MASK.sum(1)) / MASK.sum()  # every token of a clipped sequence
    np.testing.assert_allclose(float(metrics["clip_frac"]), want_clip, rtol=1e-6)


def test_sequence_level_decoupled_weight_is_the_truncated_geometric_mean():
    prox = LP + rng.normal(0, 0.5, (B, T))
    ratio, weight = grpo.importance_ratio_and_weight(
        jnp.asarray(LP), jnp.asarray(BLP), jnp.asarray(prox), jnp.asarray(MASK), "decoupled", 1.3, "sequence")
    lengths = MASK.sum(1)
    want_w = np.minimum(np.exp(np.sum((prox - BLP) * MASK, 1) / lengths), 1.3)
    want_r = np.exp(np.sum((LP - prox) * MASK, 1) / lengths)
    np.testing.assert_allclose(np.asarray(weight)[:, 0], want_w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ratio)[:, 3], want_r, rtol=1e-5)


def test_batch_std_divides_by_one_std_for_the_whole_batch():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.5, 0.9, 0.1], [0.3, 0.3, 0.3, 0.3], [4.0, 0.0]]
    got = grpo.batch_std_advantages(rewards, 1e-6)
    centered = [np.asarray(r) - np.mean(r) for r in rewards]
    std = np.sqrt(np.mean(np.concatenate(centered) ** 2))
    for g, c in zip(got, centered):
        np.testing.assert_allclose(g, c / (std + 1e-6), rtol=1e-5)
    assert np.all(got[2] == 0)


# ---- ESS and mismatch KL against closed forms with a synthetic behavior policy ----------------

VOCAB = 4


def _bias_logits(params, tokens, positions, mask):
    """A learner whose next-token distribution is softmax(b) everywhere."""
    del positions, mask
    return jnp.broadcast_to(params["b"], tokens.shape + (VOCAB,))


class _Group:
    def __init__(self, i, completions, behavior):
        self.prompt_id, self.prompt_tokens, self.policy_version = f"g{i}", [0], 0
        self.completion_tokens, self.behavior_logprobs = completions, behavior
        self.rewards = [float(j % 2) for j in range(len(completions))]


def test_ess_and_mismatch_kl_equal_their_closed_forms():
    p = np.array([0.1, 0.2, 0.3, 0.4])  # learner
    q = np.array([0.25, 0.25, 0.125, 0.375])  # behavior (the sampler), known to differ
    # 8 tokens in exact proportion to q (2, 2, 1, 3): sample averages under q are expectations.
    tokens = [0, 0, 1, 1, 2, 3, 3, 3]
    completions = [tokens[i:i + 2] for i in range(0, 8, 2)]
    behavior = [[float(np.log(q[t])) for t in c] for c in completions]
    groups = [_Group(0, completions[:2], behavior[:2]), _Group(1, completions[2:], behavior[2:])]
    cfg = LearnerConfig(batch_size=4, microbatch_size=2, group_size=2, optimizer=OptimizerConfig(lr=1e-3))
    step = GRPOTrainStep(_bias_logits, cfg)
    mbs, stats = build_microbatches(groups, 3, 2, 0, cfg.grpo)
    _, metrics = step.update(step.init({"b": jnp.asarray(np.log(p), jnp.float32)}), mbs, stats["num_tokens"])
    rho_sq = np.sum(p**2 / q)  # E_q[rho^2], rho = p / q; E_q[rho] = 1
    np.testing.assert_allclose(metrics["ess"], 1.0 / rho_sq, rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch_kl"], np.sum(q * np.log(q / p)), rtol=1e-5)  # KL(q||p)
    assert metrics["ess"] < 1 and metrics["mismatch_kl"] > 0

"""GRPO pieces vs plain NumPy references: advantages, clipped surrogate, corrections, metrics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.learner.algorithms import grpo
from cadence.learner.algorithms.logprobs import token_logprobs_and_entropy
from cadence.learner.config import GRPOConfig

# ---------------------------------------------------------------- NumPy references


def np_group_advantages(rewards, scale_by_std, eps):
    rewards = np.asarray(rewards, np.float64)
    out = []
    for row in rewards:
        if row.max() == row.min():
            out.append(np.zeros_like(row))
            continue
        c = row - row.mean()
        out.append(c / (row.std() + eps) if scale_by_std else c)
    return np.stack(out)


def np_ratio_weight(lp, blp, prox, cfg):
    if cfg.correction == "decoupled":
        r = np.exp(lp - prox)
        w = np.exp(prox - blp)
        if cfg.is_cap > 0:
            w = np.minimum(w, cfg.is_cap)
    elif cfg.correction == "coupled":
        r, w = np.exp(lp - blp), np.ones_like(lp)
    else:
        r, w = np.ones_like(lp), np.ones_like(lp)
    return r, w


def np_loss_and_grad(lp, blp, adv, mask, n, cfg, prox=None, entropy=None):
    """Loss and d loss / d logprobs written out by hand."""
    lp, blp = np.where(mask > 0, lp, 0.0), np.where(mask > 0, blp, 0.0)
    prox = lp if prox is None else np.where(mask > 0, prox, 0.0)
    r, w = np_ratio_weight(lp, blp, prox, cfg)
    a = np.asarray(adv)[:, None]
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    surr = np.minimum(r * a, np.clip(r, lo, hi) * a)
    # Dual clip: a negative advantage's objective is floored at c * A (no gradient there).
    dual = (a < 0) & (cfg.dual_clip * a > surr) if cfg.dual_clip > 0 else np.zeros_like(surr, bool)
    surr = np.where(dual, cfg.dual_clip * a, surr)
    loss = -np.sum(w * surr * mask) / n
    # The unclipped branch is active unless the clipped objective is strictly smaller; its
    # derivative wrt log pi is A * r (r = exp(lp - const)); "none" has r == 1.
    binding = (np.clip(r, lo, hi) * a < r * a) | dual
    dsurr = np.where(binding, 0.0, a * r)
    grad = -w * dsurr * mask / n
    if entropy is not None:
        on = mask * (a != 0) if cfg.entropy_scope == "signal" else mask
        loss -= cfg.entropy_coef * np.sum(entropy * on) / n
    return loss, grad, binding


def _cfg(**kw):
    return dataclasses.replace(GRPOConfig(), **kw)


# ---------------------------------------------------------------- group advantages


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_advantages_match_numpy(scale_by_std):
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.2, 0.5, 0.9, 0.1], [0.3, 0.3, 0.3, 0.3]])
    got = np.asarray(grpo.group_advantages(jnp.asarray(rewards), scale_by_std, 1e-6))
    np.testing.assert_allclose(got, np_group_advantages(rewards, scale_by_std, 1e-6), rtol=1e-5, atol=1e-6)
    host = grpo.group_advantages(rewards, scale_by_std, 1e-6)  # NumPy in, NumPy out (host batching)
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    np.testing.assert_allclose(host, got, rtol=1e-6, atol=1e-7)
    traced = jax.jit(lambda r: grpo.group_advantages(r, scale_by_std, 1e-6))(jnp.asarray(rewards))
    np.testing.assert_allclose(np.asarray(traced), got, rtol=1e-6, atol=1e-7)
    # Hand value: [1, 0, 0, 1] has mean 0.5, std 0.5.
    expected_first = [1.0, -1.0, -1.0, 1.0] if scale_by_std else [0.5, -0.5, -0.5, 0.5]
    np.testing.assert_allclose(got[0], expected_first, rtol=1e-5)


def test_zero_variance_group_gets_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the mean alone would leave a residue.
    rewards = np.array([[0.1, 0.1, 0.1], [7.3, 7.3, 7.3], [1.0, 2.0, 4.0]])
    for scale in (True, False):
        for got in (grpo.group_advantages(rewards, scale, 1e-6),
                    np.asarray(grpo.group_advantages(jnp.asarray(rewards), scale, 1e-6))):
            assert np.all(got[:2] == 0.0)
            assert np.all(got[2] != 0.0)


# ---------------------------------------------------------------- the loss

# Four samples, 4 tokens each: col 0 is the prompt, the last row has one padding token.
LP = np.log(np.array([
    [0.5, 0.60, 0.30, 0.20],
    [0.5, 0.45, 0.10, 0.70],
    [0.5, 0.20, 0.50, 0.90],
    [0.5, 0.35, 0.25, 0.05],
]))
# Behavior log-probs: ratios pi/pi_behav of 1.5 (above 1 + clip_high), 0.5 (below 1 - clip_low), 1.1,
# and 4.0 with a negative advantage (above the dual clip 3).
BLP = LP - np.log(np.array([
    [1.0, 1.5, 0.5, 1.1],
    [1.0, 0.5, 1.5, 1.1],
    [1.0, 1.5, 0.5, 4.0],
    [1.0, 0.5, 1.1, 9.0],
]))
ADV = np.array([1.0, -1.0, -0.5, 2.0])  # both signs meet both clip sides
MASK = np.array([[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 0]], np.float32)
N = float(MASK.sum())


def _jax_loss(cfg, lp=LP, blp=BLP, adv=ADV, mask=MASK, n=N, **kw):
    return grpo.grpo_token_loss(
        jnp.asarray(lp, jnp.float32), jnp.asarray(blp, jnp.float32), jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask), n, cfg, **kw,
    )


@pytest.mark.parametrize("correction", ["decoupled", "coupled", "none"])
@pytest.mark.parametrize("is_cap", [2.0, 0.0])
def test_loss_and_grad_match_numpy_per_correction(correction, is_cap):
    cfg = _cfg(correction=correction, is_cap=is_cap, clip_low=0.2, clip_high=0.28)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: _jax_loss(cfg, lp=lp), has_aux=True)(jnp.asarray(LP, jnp.float32))
    ref_loss, ref_grad, binding = np_loss_and_grad(LP, BLP, ADV, MASK, N, cfg)
    np.testing.assert_allclose(float(loss), ref_loss, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_frac"]), np.sum(binding * MASK) / N, atol=1e-7)
    assert np.all(np.asarray(grad)[MASK == 0] == 0.0)  # prompt and padding get no gradient


def test_coupled_clips_both_sides_and_leaves_the_other_sides():
    cfg = _cfg(correction="coupled", clip_low=0.2, clip_high=0.28)
    grad = np.asarray(jax.grad(lambda lp: _jax_loss(cfg, lp=lp)[0])(jnp.asarray(LP, jnp.float32)))
    # ratio 1.5 > 1.28 with A > 0 (row 0 col 1): clipped, zero gradient;
    # ratio 0.5 < 0.8 with A < 0 (row 1 col 1): clipped, zero gradient.
    assert grad[0, 1] == 0.0 and grad[1, 1] == 0.0
    # ratio 0.5 with A > 0 (row 0 col 2) and ratio 1.5 with A < 0 (row 1 col 2): not clipped,
    # d(-r A / N)/d log pi = -r A / N.
    np.testing.assert_allclose(grad[0, 2], -0.5 * 1.0 / N, rtol=1e-5)
    np.testing.assert_allclose(grad[1, 2], -1.5 * -1.0 / N, rtol=1e-5)
    # Loss value on the clipped token uses the clipped ratio: row 0 col 1 contributes -1.28 * 1.
    only = np.zeros_like(MASK)
    only[0, 1] = 1.0
    loss, _ = _jax_loss(cfg, mask=only, n=1.0)
    np.testing.assert_allclose(float(loss), -1.28, rtol=1e-6)


@pytest.mark.parametrize("dual_clip", [3.0, 0.0])
def test_dual_clip_bounds_negative_advantages_against_numpy(dual_clip):
    # Stale tokens the learner now likes far more than the sampler did: ratios e^5 and e^15 (and
    # 2.5, inside the dual clip) with negative advantages, one ratio e^5 with a positive one.
    lp = np.log(np.full((3, 4), 0.5))
    blp = lp - np.array([[0.0, 5.0, 15.0, np.log(2.5)],
                         [0.0, 5.0, 0.1, 0.0],
                         [0.0, 5.0, 15.0, 0.0]])
    adv = np.array([-1.0, 2.0, -0.5])
    mask = np.array([[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 0]], np.float32)
    n = float(mask.sum())
    cfg = _cfg(correction="coupled", dual_clip=dual_clip)
    (loss, metrics), grad = jax.value_and_grad(
        lambda x: _jax_loss(cfg, lp=x, blp=blp, adv=adv, mask=mask, n=n), has_aux=True)(
        jnp.asarray(lp, jnp.float32))
    ref_loss, ref_grad, binding = np_loss_and_grad(lp, blp, adv, mask, n, cfg)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_frac"]), np.sum(binding * mask) / n, atol=1e-7)
    grad = np.asarray(grad)
    if dual_clip:
        # Hand values: each silenced token contributes -c * A / n to the loss and no gradient;
        # r = 2.5 < c keeps its gradient -r A / n; the positive advantage is clipped at 1.2 as before.
        assert grad[0, 1] == 0.0 and grad[0, 2] == 0.0 and grad[2, 1] == 0.0 and grad[2, 2] == 0.0
        np.testing.assert_allclose(grad[0, 3], -2.5 * -1.0 / n, rtol=1e-5)
        want = -(3 * -1.0 * 2 + 2.5 * -1.0 + 1.2 * 2.0 + np.exp(0.1) * 2.0 + 2.0 + 3 * -0.5 * 2) / n
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
        np.testing.assert_allclose(float(metrics["dual_clip_frac"]), 4 / n, rtol=1e-6)
    else:  # without it the e^15 token alone outweighs the whole batch
        assert abs(grad[0, 2]) > 1e6 * abs(grad[0, 3])
        assert float(metrics["dual_clip_frac"]) == 0.0


@pytest.mark.parametrize("correction", ["coupled", "decoupled"])
def test_unclipped_objective_is_the_importance_weighted_policy_gradient(correction):
    # clip=False (the controller's noise units on stale batches): every token keeps d(-w r A / N),
    # the clipped ones (ratios 1.5, 0.5 on the wrong side, 4.0 and 9.0 past the dual clip) included.
    cfg = _cfg(correction=correction, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: _jax_loss(cfg, lp=lp, clip=False), has_aux=True)(jnp.asarray(LP, jnp.float32))
    r, w = np_ratio_weight(LP, BLP, LP, cfg)
    a = ADV[:, None]
    np.testing.assert_allclose(float(loss), -np.sum(w * r * a * MASK) / N, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), -w * r * a * MASK / N, rtol=1e-5, atol=1e-7)
    _, _, binding = np_loss_and_grad(LP, BLP, ADV, MASK, N, cfg)
    # the metrics still say where the clip would bind (coupled: it does; decoupled: ratio 1)
    np.testing.assert_allclose(float(metrics["clip_frac"]), np.sum(binding * MASK) / N, atol=1e-7)
    clipped = np.asarray(jax.grad(lambda lp: _jax_loss(cfg, lp=lp)[0])(jnp.asarray(LP, jnp.float32)))
    if correction == "coupled":
        assert np.sum(binding * MASK) >= 4 and not np.allclose(clipped, np.asarray(grad))
    else:
        np.testing.assert_allclose(clipped, np.asarray(grad), rtol=1e-6)


def test_dual_clip_must_sit_above_the_upper_clip():
    with pytest.raises(ValueError, match="dual_clip"):
        _cfg(dual_clip=1.1, clip_high=0.28).validate()
    _cfg(dual_clip=0.0).validate()
    _cfg(dual_clip=3.0, clip_high=0.28).validate()


def test_decoupled_ratio_is_one_and_weight_is_truncated():
    cfg = _cfg(correction="decoupled", is_cap=2.0)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: _jax_loss(cfg, lp=lp), has_aux=True)(jnp.asarray(LP, jnp.float32))
    # One step per batch: the proximal policy is the current one, so no token is clipped and the
    # gradient is -w A / N with w = min(pi / pi_behav, 2): row 2 col 3 has pi/pi_behav = 4 -> 2.
    assert float(metrics["clip_frac"]) == 0.0
    np.testing.assert_allclose(float(metrics["ratio_mean"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad)[2, 3], -2.0 * -0.5 / N, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[0, 1], -1.5 * 1.0 / N, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["is_truncated_frac"]), 1.0 / N, rtol=1e-6)  # row 3 col 3 is padding
    # Without the cap the weight 4 is used as is.
    grad_uncapped = jax.grad(lambda lp: _jax_loss(_cfg(correction="decoupled", is_cap=0.0), lp=lp)[0])(jnp.asarray(LP, jnp.float32))
    np.testing.assert_allclose(np.asarray(grad_uncapped)[2, 3], -4.0 * -0.5 / N, rtol=1e-5)


def test_decoupled_with_proximal_policy_clips_around_it():
    # A later multi-epoch objective passes the proximal log-probs: the clip acts on pi / pi_prox.
    cfg = _cfg(correction="decoupled", is_cap=0.0, clip_low=0.2, clip_high=0.28)
    prox = BLP + 0.05
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: _jax_loss(cfg, lp=lp, proximal_logprobs=jnp.asarray(prox, jnp.float32)),
        has_aux=True)(jnp.asarray(LP, jnp.float32))
    ref_loss, ref_grad, binding = np_loss_and_grad(LP, BLP, ADV, MASK, N, cfg, prox=prox)
    assert binding[MASK > 0].any() and not binding[MASK > 0].all()
    np.testing.assert_allclose(float(loss), ref_loss, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)


def test_none_is_plain_policy_gradient():
    cfg = _cfg(correction="none", clip_low=0.0, clip_high=0.0)  # even a zero-width clip is inert
    grad = np.asarray(jax.grad(lambda lp: _jax_loss(cfg, lp=lp)[0])(jnp.asarray(LP, jnp.float32)))
    np.testing.assert_allclose(grad, -ADV[:, None] * MASK / N, rtol=1e-6)


def test_padding_rows_and_masked_garbage_contribute_nothing():
    cfg = _cfg(correction="coupled")
    loss, metrics = _jax_loss(cfg)
    # Append a padding row whose log-probs would overflow exp() if they were used.
    lp = np.concatenate([LP, [[0.0, 0.0, 0.0, 0.0]]])
    blp = np.concatenate([BLP, [[-1e4, -1e4, -1e4, -1e4]]])
    mask = np.concatenate([MASK, np.zeros((1, 4), np.float32)])
    (loss2, metrics2), grad = jax.value_and_grad(
        lambda x: _jax_loss(cfg, lp=x, blp=blp, adv=np.append(ADV, 5.0), mask=mask),
        has_aux=True)(jnp.asarray(lp, jnp.float32))
    np.testing.assert_allclose(float(loss2), float(loss), atol=1e-7)
    for k in metrics:
        np.testing.assert_allclose(float(metrics2[k]), float(metrics[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[-1] == 0.0)


def test_microbatch_sums_equal_full_batch():
    cfg = _cfg(correction="coupled", entropy_coef=0.01)
    ent = np.random.default_rng(0).random(LP.shape)
    full, m_full = _jax_loss(cfg, entropy=jnp.asarray(ent, jnp.float32))
    parts = [
        _jax_loss(cfg, lp=LP[s], blp=BLP[s], adv=ADV[s], mask=MASK[s], entropy=jnp.asarray(ent[s], jnp.float32))
        for s in (slice(0, 1), slice(1, 4))
    ]
    np.testing.assert_allclose(float(parts[0][0] + parts[1][0]), float(full), atol=1e-7)
    summed = {k: float(parts[0][1][k] + parts[1][1][k]) for k in m_full}
    for k in m_full:
        np.testing.assert_allclose(summed[k], float(m_full[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(grpo.finalize_metrics(summed)["ess"],
                               float(grpo.finalize_metrics(m_full)["ess"]), rtol=1e-5)


def test_entropy_bonus_and_metric():
    cfg = _cfg(entropy_coef=0.1)
    ent = np.random.default_rng(1).random(LP.shape).astype(np.float32)
    (loss, metrics), d_ent = jax.value_and_grad(
        lambda e: _jax_loss(cfg, entropy=e), has_aux=True)(jnp.asarray(ent))
    ref_loss, _, _ = np_loss_and_grad(LP, BLP, ADV, MASK, N, cfg, entropy=ent)
    np.testing.assert_allclose(float(loss), ref_loss, atol=1e-6)
    np.testing.assert_allclose(float(metrics["entropy"]), np.sum(ent * MASK) / N, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(d_ent), -0.1 * MASK / N, rtol=1e-6)
    loss0, _ = _jax_loss(_cfg(entropy_coef=0.0), entropy=jnp.asarray(ent))
    np.testing.assert_allclose(float(loss0), float(metrics["pg_loss"]), atol=1e-7)


@pytest.mark.parametrize("scope", ["signal", "all"])
def test_entropy_bonus_acts_only_where_the_advantage_does(scope):
    # sample 1's group had equal rewards (advantage exactly 0): under "signal" the bonus skips its
    # tokens, so they get no gradient at all; the metric still averages every token
    adv = ADV.copy()
    adv[1] = 0.0
    cfg = _cfg(entropy_coef=0.1, entropy_scope=scope)
    ent = np.random.default_rng(2).random(LP.shape).astype(np.float32)
    (loss, metrics), d_ent = jax.value_and_grad(
        lambda e: _jax_loss(cfg, adv=adv, entropy=e), has_aux=True)(jnp.asarray(ent))
    ref_loss, _, _ = np_loss_and_grad(LP, BLP, adv, MASK, N, cfg, entropy=ent)
    np.testing.assert_allclose(float(loss), ref_loss, atol=1e-6)
    on = MASK.copy()
    if scope == "signal":
        on[1] = 0.0
    np.testing.assert_allclose(np.asarray(d_ent), -0.1 * on / N, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["entropy"]), np.sum(ent * MASK) / N, rtol=1e-6)


def test_mismatch_metrics_match_numpy():
    _, metrics = _jax_loss(_cfg())
    m = MASK > 0
    log_rho = (LP - BLP)[m]
    rho = np.exp(log_rho)
    np.testing.assert_allclose(float(metrics["logprob_diff_abs"]), np.mean(np.abs(log_rho)), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["mismatch_kl"]), np.mean(rho - 1 - log_rho), rtol=1e-5)
    ess = grpo.finalize_metrics({k: float(v) for k, v in metrics.items()})["ess"]
    np.testing.assert_allclose(ess, rho.sum() ** 2 / (rho.size * np.sum(rho**2)), rtol=1e-5)
    assert 0 < ess < 1
    # Sampler == learner: no mismatch, ESS 1.
    _, same = _jax_loss(_cfg(), blp=LP)
    assert abs(float(same["mismatch_kl"])) < 1e-7 and abs(float(same["logprob_diff_abs"])) < 1e-7
    np.testing.assert_allclose(grpo.finalize_metrics(same)["ess"], 1.0, rtol=1e-6)


def test_extreme_behavior_logprobs_stay_finite():
    blp = BLP.copy()
    blp[0, 1] = -500.0  # the sampler claims a vanishing probability
    for correction in ("decoupled", "coupled", "none"):
        (loss, metrics), grad = jax.value_and_grad(
            lambda lp: _jax_loss(_cfg(correction=correction, is_cap=0.0), lp=lp, blp=blp),
            has_aux=True)(jnp.asarray(LP, jnp.float32))
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad))), correction
        assert all(np.isfinite(float(v)) for v in metrics.values()), correction


# ---------------------------------------------------------------- log-probs from logits


def test_token_logprobs_and_entropy_match_numpy():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    tokens = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    for temp in (1.0, 0.7):
        lp, ent = token_logprobs_and_entropy(jnp.asarray(logits), jnp.asarray(tokens), temp)
        z = logits.astype(np.float64) / temp
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        ref_lp = np.zeros((2, 5))
        ref_ent = np.zeros((2, 5))
        for b in range(2):
            for t in range(1, 5):
                ref_lp[b, t] = logp[b, t - 1, tokens[b, t]]
                ref_ent[b, t] = -np.sum(np.exp(logp[b, t - 1]) * logp[b, t - 1])
        np.testing.assert_allclose(np.asarray(lp), ref_lp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-5, atol=1e-5)

"""PPO pieces against plain NumPy references: token rewards, GAE, clipped value loss, KL estimators."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.learner.algorithms import ppo

# Three rows of T = 6: prompt tokens (mask 0), completions of 4, 2 and 0 tokens, padding after.
MASK = np.array([
    [0, 1, 1, 1, 1, 0],
    [0, 0, 0, 1, 1, 0],
    [0, 0, 0, 0, 0, 0],
], np.float32)
REWARDS = np.array([1.0, -0.5, 3.0], np.float32)
VALUES = np.array([
    [9.0, 0.2, 0.4, -0.1, 0.7, 9.0],  # off-mask entries (9.0) must be ignored
    [9.0, 9.0, 9.0, 0.3, -0.2, 9.0],
    [9.0, 9.0, 9.0, 9.0, 9.0, 9.0],
], np.float32)


def np_gae(rewards_t, values, mask, gamma, lam):
    """Textbook GAE, one row at a time over its completion tokens (a Python loop)."""
    adv = np.zeros_like(values, np.float64)
    for b in range(values.shape[0]):
        idx = np.nonzero(mask[b])[0]
        last = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            next_v = values[b, idx[j + 1]] if j + 1 < len(idx) else 0.0
            delta = rewards_t[b, t] + gamma * next_v - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    returns = (adv + values) * mask
    return adv, returns


def test_token_rewards_put_the_reward_on_the_last_token():
    got = np.asarray(ppo.token_rewards(jnp.asarray(REWARDS), jnp.asarray(MASK)))
    want = np.zeros_like(MASK)
    want[0, 4], want[1, 4] = 1.0, -0.5  # row 2 has no completion token: no reward anywhere
    np.testing.assert_array_equal(got, want)
    kl = np.arange(18, dtype=np.float32).reshape(3, 6) / 10
    shaped = np.asarray(ppo.token_rewards(jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(kl), 0.5))
    np.testing.assert_allclose(shaped, want - 0.5 * kl * MASK, rtol=1e-6)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0)])
def test_gae_matches_numpy(gamma, lam):
    rng = np.random.default_rng(0)
    r_t = (rng.normal(size=MASK.shape) * MASK).astype(np.float32)
    adv, ret = jax.jit(lambda r, v, m: ppo.gae(r, v, m, gamma, lam))(r_t, VALUES, MASK)
    want_adv, want_ret = np_gae(r_t, VALUES * MASK, MASK, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(adv)[MASK == 0] == 0)


def test_gae_hand_values():
    # Row 1: tokens at 3, 4 with V = 0.3, -0.2, reward -0.5 on token 4, gamma = lam = 1:
    # A_4 = -0.5 - (-0.2) = -0.3; A_3 = (0 + V_4 - V_3) + A_4 = -0.5 - 0.3 = -0.8 (Monte Carlo).
    r_t = np.asarray(ppo.token_rewards(jnp.asarray(REWARDS), jnp.asarray(MASK)))
    adv, ret = ppo.gae(jnp.asarray(r_t), jnp.asarray(VALUES), jnp.asarray(MASK), 1.0, 1.0)
    np.testing.assert_allclose(np.asarray(adv)[1, 3:5], [-0.8, -0.3], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ret)[1, 3:5], [-0.5, -0.5], rtol=1e-6)  # returns = R


@pytest.mark.parametrize("clip", [0.2, 0.0])
def test_value_loss_matches_numpy(clip):
    v = np.array([0.0, 0.5, 1.0, -1.0, 0.25], np.float32)
    old = np.array([0.1, 0.1, 0.1, 0.1, 0.1], np.float32)
    ret = np.array([1.0, 0.0, 0.2, -0.5, 0.3], np.float32)
    got = np.asarray(ppo.value_loss(jnp.asarray(v), jnp.asarray(old), jnp.asarray(ret), clip))
    if clip > 0:
        vc = old + np.clip(v - old, -clip, clip)
        want = 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2)
    else:
        want = 0.5 * (v - ret) ** 2
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Hand value: v=0.5, old=0.1, ret=0: clipped value 0.3 -> max(0.25, 0.09) / 2 = 0.125.
    assert got[1] == pytest.approx(0.125)
    if clip > 0:  # v=1.0, ret=0.2: the clipped value 0.3 is closer, the max keeps the unclipped
        assert got[2] == pytest.approx(0.5 * max(0.8**2, 0.1**2))


def test_value_loss_gradient_is_zero_where_the_clipped_branch_binds():
    # v = 1.0, old = 0.1, ret = 2.0: moving from 0.1 towards ret beyond clip: unclipped is 1.0,
    # clipped branch (0.3 - 2)^2 = 2.89 is larger -> loss constant in v (gradient 0).
    g = jax.grad(lambda v: ppo.value_loss(v, jnp.float32(0.1), jnp.float32(2.0), 0.2))(jnp.float32(1.0))
    assert float(g) == 0.0
    g = jax.grad(lambda v: ppo.value_loss(v, jnp.float32(0.1), jnp.float32(2.0), 0.2))(jnp.float32(0.2))
    assert float(g) == pytest.approx(0.2 - 2.0)


def test_kl_estimators_match_numpy_and_their_expectation():
    lp = np.log(np.array([0.5, 0.3, 0.2]))
    ref = np.log(np.array([0.2, 0.3, 0.5]))
    k1 = np.asarray(ppo.kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k1"))
    k3 = np.asarray(ppo.kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k3"))
    np.testing.assert_allclose(k1, lp - ref, rtol=1e-6)
    np.testing.assert_allclose(k3, np.exp(ref - lp) - 1 - (ref - lp), rtol=1e-5)
    # Under samples from pi (weights p), both are unbiased for KL(pi || ref).
    p = np.exp(lp)
    kl = float(np.sum(p * (lp - ref)))
    assert float(np.sum(p * k1)) == pytest.approx(kl, rel=1e-5)
    assert float(np.sum(p * k3)) == pytest.approx(kl, rel=1e-5)
    assert np.all(k3 >= 0)
    with pytest.raises(ValueError, match="k2"):
        ppo.kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k2")


def test_whiten_uses_the_given_statistics_on_the_mask_only():
    adv = np.array([[0.0, 1.0, 3.0], [5.0, 2.0, 0.0]], np.float32)
    mask = np.array([[0, 1, 1], [1, 1, 0]], np.float32)
    got = np.asarray(ppo.whiten(jnp.asarray(adv), jnp.asarray(mask), 2.0, 2.0, eps=0.0))
    np.testing.assert_allclose(got, (adv - 2.0) / 2.0 * mask)

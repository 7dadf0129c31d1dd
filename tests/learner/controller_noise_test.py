"""Noise-scale estimator: two-batch estimates on synthetic gradients with known mean and covariance,
unequal small batches, and GRPO groups (whole-group units against groups split over small batches)."""
import numpy as np
import pytest

from cadence.learner.controller import GradientNorms
from cadence.learner.controller.noise import NoiseScaleEstimator, small_batches, two_batch_estimate


def synthetic_step(rng, mean, scale, sizes):
    """Per-sample gradients ~ N(mean, diag(scale^2)) in small batches of `sizes`;
    (small-batch mean |g|^2 list, batch mean |g|^2)."""
    g = mean + rng.normal(size=(sum(sizes), mean.size)) * scale  # [B, D]
    parts = np.split(g, np.cumsum(sizes)[:-1])
    return [float(np.sum(p.mean(axis=0) ** 2)) for p in parts], float(np.sum(g.mean(axis=0) ** 2))


def problem(rng, true_noise, d=50):
    mean = rng.normal(size=d)
    mean /= np.linalg.norm(mean)  # |G|^2 = 1
    scale = rng.uniform(0.5, 1.5, size=d)
    scale *= np.sqrt(true_noise / np.sum(scale**2))  # tr(Sigma) = true_noise
    return mean, scale


@pytest.mark.parametrize("true_noise, batch, num_mb", [(64.0, 128, 4), (300.0, 256, 8), (20.0, 64, 2)])
def test_estimate_within_20_percent_of_the_truth(true_noise, batch, num_mb):
    rng = np.random.default_rng(0)
    mean, scale = problem(rng, true_noise)
    est = NoiseScaleEstimator(decay=0.98)
    for _ in range(300):
        small, big = synthetic_step(rng, mean, scale, [batch // num_mb] * num_mb)
        assert est.update(small, big, batch / num_mb, batch)
    assert est.noise_scale == pytest.approx(true_noise, rel=0.2)
    assert est.trace_sigma == pytest.approx(true_noise, rel=0.2)
    assert est.grad_sq == pytest.approx(1.0, rel=0.2)


def test_hand_made_unequal_sizes_match_the_two_equation_solve():
    """E |G_i|^2 = |G|^2 + tr / n_i and E |G_B|^2 = |G|^2 + tr / B, averaged over i: NumPy solves it."""
    small, sizes, big, b = [3.0, 5.0, 2.5], [2.0, 6.0, 4.0], 1.0, 12.0
    a = np.array([[1.0, np.mean(1.0 / np.array(sizes))], [1.0, 1.0 / b]])
    g2, trace = np.linalg.solve(a, [np.mean(small), big])
    assert two_batch_estimate(small, sizes, big, b) == pytest.approx((g2, trace), rel=1e-12)
    # equal sizes: McCandlish's two-batch formulas
    g2, trace = two_batch_estimate([2.0, 4.0], [8, 8], 1.5, 16)
    assert g2 == pytest.approx((16 * 1.5 - 8 * 3.0) / 8) and trace == pytest.approx((3.0 - 1.5) / (1 / 8 - 1 / 16))


def test_unequal_small_batches_are_weighed_by_their_own_sizes():
    # Packed microbatches (and units) differ in size: 4 and 28 samples of 32. Taking every small
    # batch as B / 2 = 16 samples (the equal-size formula) mistakes the small one's extra variance
    # for less signal.
    rng = np.random.default_rng(1)
    mean, scale = problem(rng, 40.0)
    est, naive = NoiseScaleEstimator(decay=0.99), NoiseScaleEstimator(decay=0.99)
    for _ in range(600):
        small, big = synthetic_step(rng, mean, scale, [4, 28])
        assert est.update(small, big, [4, 28], 32)
        naive.update(small, big, 16, 32)
    assert est.noise_scale == pytest.approx(40.0, rel=0.2)
    assert naive.noise_scale is None or abs(naive.noise_scale / 40.0 - 1) > 0.5


def grpo_batch(rng, groups, group_size, d, shared=3.0):
    """Per-sample policy gradients of GRPO groups: A_j (c_p + e_j), where c_p is what a prompt's
    completions share (large), e_j ~ N(0, I) their own part, reward 1 where e_j leans along a fixed
    direction, and A_j the group-normalized advantage (sums to zero in the group). [B, D]."""
    direction = np.zeros(d)
    direction[0] = 1.0
    out = []
    for _ in range(groups):
        c = shared * rng.normal(size=d)
        e = rng.normal(size=(group_size, d))
        r = (e @ direction + 0.5 * rng.normal(size=group_size) > 0).astype(float)
        a = (r - r.mean()) / (r.std() + 1e-6)
        out.append(a[:, None] * (c + e))
    return np.concatenate(out)


def test_grpo_groups_need_whole_group_units():
    """What a group's completions share cancels only in the whole group: small batches holding
    parts of groups overstate the variance and leave |G|^2 <= 0 (as SmolLM2's packed microbatches
    did); units of whole groups recover the noise scale of groups as the samples."""
    rng = np.random.default_rng(2)
    g, d, groups = 8, 16, 4
    # the truth, in samples: groups are the independent draws, each worth g samples
    draws = np.stack([grpo_batch(rng, 1, g, d).mean(axis=0) for _ in range(20_000)])
    truth = g * np.trace(np.cov(draws.T)) / np.sum(draws.mean(axis=0) ** 2)
    units, split = NoiseScaleEstimator(decay=0.995), NoiseScaleEstimator(decay=0.995)
    for _ in range(2000):
        x = grpo_batch(rng, groups, g, d)
        big = float(np.sum(x.mean(axis=0) ** 2))
        whole = [float(np.sum(p.mean(axis=0) ** 2)) for p in np.split(x, groups)]  # one group each
        # the same batch cut across groups: each small batch holds half of two groups
        halves = np.split(x, 2 * groups)
        mixed = [np.concatenate([halves[i], halves[(i + 3) % len(halves)]]) for i in range(0, 2 * groups, 2)]
        across = [float(np.sum(p.mean(axis=0) ** 2)) for p in mixed]
        units.update(whole, big, g, groups * g)
        split.update(across, big, g, groups * g)
    assert units.noise_scale == pytest.approx(truth, rel=0.25)
    assert split.grad_sq < 0 and split.noise_scale is None


def feed(est, g2, trace):
    """One update whose two-batch estimates are exactly (g2, trace): small batches of 8, big 16."""
    big = g2 + trace / 16
    assert est.update([big + trace / 16] * 2, big, 8, 16)


def ema_reference(d, values):
    """The bias-corrected EMA of `values` (oldest first) and its weights, as NumPy computes them."""
    w = (1 - d) * d ** np.arange(len(values))[::-1]
    return np.sum(w * values) / w.sum(), w


def test_unresolved_grad_sq_gives_a_range_unbounded_above():
    """Per-update |G|^2 estimates scattered around zero (GRPO's sparse rewards): the point estimate
    means nothing; the range is tr / (|G|^2 + 2 SE) up to infinity, SE from the EMA's spread and
    effective count: checked against a NumPy reference of the weighted mean and variance."""
    d, g2s, traces = 0.8, [0.3, -0.5, 0.1, 0.4, -0.2, 0.05], [20.0, 30.0, 25.0, 10.0, 40.0, 22.0]
    est = NoiseScaleEstimator(decay=d)
    for i, (g, t) in enumerate(zip(g2s, traces)):
        feed(est, g, t)
        if i < 3:  # no spread from fewer than 4: the point, while it is positive
            assert est.noise_scale_interval == (None if est.noise_scale is None else (est.noise_scale,) * 2)
    mean, w = ema_reference(d, np.array(g2s))
    trace, _ = ema_reference(d, np.array(traces))
    var = np.sum(w * np.square(g2s)) / w.sum() - mean**2
    se = np.sqrt(var * np.sum(w**2)) / w.sum()
    assert est.grad_sq == pytest.approx(mean) and est.grad_sq_stderr == pytest.approx(se)
    assert 0 < mean < 2 * se  # unresolved
    low, high = est.noise_scale_interval
    assert low == pytest.approx(trace / (mean + 2 * se)) and high == np.inf
    assert est.noise_scale == pytest.approx(trace / mean)  # the point: inside, and meaningless
    # resolved: |G|^2 ~ 1 +- 0.1 every update: a range around the estimate
    sure = NoiseScaleEstimator(decay=d)
    values = [1.0 + 0.1 * (-1) ** k for k in range(8)]
    for v in values:
        feed(sure, v, 50.0)
    mean, w = ema_reference(d, np.array(values))
    se = np.sqrt((np.sum(w * np.square(values)) / w.sum() - mean**2) * np.sum(w**2)) / w.sum()
    low, high = sure.noise_scale_interval
    assert low == pytest.approx(50.0 / (mean + 2 * se)) and high == pytest.approx(50.0 / (mean - 2 * se))
    assert low < sure.noise_scale < high < 1.5 * low


def test_sparse_grpo_rewards_leave_grad_sq_unresolved_and_the_range_holds_the_truth():
    """Few groups carry a reward difference (most gradients are zero): at 2 groups per update
    the |G|^2 average stays within noise of zero: the range's high end is unbounded nearly always,
    and it holds the true noise scale in 3 updates of 4 (its low end, which a grow must pay at,
    above the truth in the rest)."""
    rng = np.random.default_rng(3)
    g, d = 8, 16

    def sparse(groups):
        x = grpo_batch(rng, groups, g, d)
        keep = rng.random(groups) < 0.25  # a quarter of the groups have unequal rewards
        return (x.reshape(groups, g, d) * keep[:, None, None]).reshape(-1, d)

    draws = np.stack([sparse(1).mean(axis=0) for _ in range(40_000)])
    truth = g * np.trace(np.cov(draws.T)) / np.sum(draws.mean(axis=0) ** 2)
    est, inside, unbounded, n = NoiseScaleEstimator(decay=0.9), 0, 0, 0
    for k in range(400):
        x = sparse(2)
        est.update([float(np.sum(p.mean(axis=0) ** 2)) for p in np.split(x, 2)], float(np.sum(x.mean(axis=0) ** 2)),
                   g, 2 * g)
        if k >= 20:  # (before, every update so far may have been zero: nothing known)
            low, high = est.noise_scale_interval
            inside += low <= truth <= high
            unbounded += high == np.inf
            n += 1
    assert inside >= 0.7 * n and unbounded >= 0.9 * n, (inside, unbounded, n)  # 75% and 99% (seed 3)


def test_negative_gradient_estimate_gives_no_noise_scale_and_recovers():
    est = NoiseScaleEstimator(decay=0.5)
    # |G_big|^2 much smaller than |G_small|^2 / k: the |G|^2 estimate is negative
    assert est.update([10.0, 10.0], 0.1, 16, 32)
    assert est.grad_sq < 0
    assert est.noise_scale is None  # not usable, instead of a negative or huge B_noise
    for _ in range(10):
        est.update([2.0, 2.0], 1.5, 16, 32)  # |G|^2 = 1, tr = 16
    assert est.noise_scale == pytest.approx(16.0, rel=0.05)


def test_unusable_inputs_are_refused():
    est = NoiseScaleEstimator()
    assert not est.update([], 1.0, 8, 16)
    assert not est.update([1.0], float("nan"), 8, 16)
    assert not est.update([1.0], 1.0, 16, 16)  # one microbatch: small == big
    one_unit = GradientNorms(1.0, (0.3, 0.2), (10.0, 10.0), unit_grad_norm_sq=(1.0,), unit_share=(1.0,),
                             unit_samples=(8,))
    assert not est.update_from_gradients(one_unit, 8)  # one group: never its split microbatches
    assert est.noise_scale is None and est.count == 0


def test_train_step_norms_become_small_batch_mean_gradients():
    # contributions are normalized by the whole batch: a part with share s has mean gradient c / s
    grads = GradientNorms(0.5, (0.25, 0.09), (50.0, 25.0))
    small, sizes = small_batches(grads, 48)
    assert small == pytest.approx([0.25 / (2 / 3) ** 2, 0.09 / (1 / 3) ** 2]) and sizes == pytest.approx([32, 16])
    units = GradientNorms(0.5, (0.25, 0.09, 0.1), (50.0, 25.0, 25.0), unit_grad_norm_sq=(0.3, 0.2),
                          unit_share=(0.5, 0.5), unit_samples=(24, 24))
    small, sizes = small_batches(units, 48)  # units win over microbatches
    assert small == pytest.approx([1.2, 0.8]) and sizes == [24, 24]
    est = NoiseScaleEstimator(decay=0.0)
    assert est.update_from_gradients(units, 48)
    assert est.grad_sq == pytest.approx((48 * 0.5 - 24 * 1.0) / 24)


def test_state_dict_round_trip():
    a = NoiseScaleEstimator(0.7)
    a.update([2.0, 3.0], 1.0, 8, 16)
    b = NoiseScaleEstimator()
    b.load_state_dict(a.state_dict())
    assert b.noise_scale == a.noise_scale and b.decay == 0.7
    for _ in range(4):
        a.update([1.0, 2.0], 0.9, 8, 16)
        b.update([1.0, 2.0], 0.9, 8, 16)
    assert b.grad_sq == a.grad_sq and b.grad_sq_stderr == a.grad_sq_stderr is not None

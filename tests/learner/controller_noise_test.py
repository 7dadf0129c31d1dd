"""Noise-scale estimator: two-batch estimates on synthetic gradients with known mean and covariance."""
import numpy as np
import pytest

from cadence.learner.controller.noise import NoiseScaleEstimator, microbatch_mean_grad_sq


def synthetic_step(rng, mean, scale, batch_size, num_microbatches):
    """Per-sample gradients ~ N(mean, diag(scale^2)); (microbatch mean |g|^2 list, batch mean |g|^2)."""
    g = mean + rng.normal(size=(batch_size, mean.size)) * scale  # [B, D]
    mbs = g.reshape(num_microbatches, -1, mean.size).mean(axis=1)  # [num_mb, D]
    return [float(np.sum(m * m)) for m in mbs], float(np.sum(g.mean(axis=0) ** 2))


@pytest.mark.parametrize("true_noise, batch, num_mb", [(64.0, 128, 4), (300.0, 256, 8), (20.0, 64, 2)])
def test_estimate_within_20_percent_of_the_truth(true_noise, batch, num_mb):
    rng = np.random.default_rng(0)
    d = 50
    mean = rng.normal(size=d)
    mean /= np.linalg.norm(mean)  # |G|^2 = 1
    scale = rng.uniform(0.5, 1.5, size=d)
    scale *= np.sqrt(true_noise / np.sum(scale**2))  # tr(Sigma) = true_noise
    est = NoiseScaleEstimator(decay=0.98)
    for _ in range(300):
        small, big = synthetic_step(rng, mean, scale, batch, num_mb)
        assert est.update(small, big, batch / num_mb, batch)
    assert est.noise_scale == pytest.approx(true_noise, rel=0.2)
    assert est.trace_sigma == pytest.approx(true_noise, rel=0.2)
    assert est.grad_sq == pytest.approx(1.0, rel=0.2)


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
    assert est.noise_scale is None and est.count == 0


def test_train_step_metrics_are_converted_to_microbatch_mean_gradients():
    # the train step reports contributions normalized by the batch's 100 tokens
    assert microbatch_mean_grad_sq([0.25, 0.09], [50.0, 25.0], 100) == pytest.approx([0.25 * 4, 0.09 * 16])
    est = NoiseScaleEstimator(decay=0.0)
    assert est.update_from_gradients([0.25, 0.09], [50.0, 25.0], 100, 0.5, batch_size=64)
    s = np.mean([1.0, 1.44])
    assert est.grad_sq == pytest.approx((64 * 0.5 - 32 * s) / 32)


def test_state_dict_round_trip():
    a = NoiseScaleEstimator(0.7)
    a.update([2.0, 3.0], 1.0, 8, 16)
    b = NoiseScaleEstimator()
    b.load_state_dict(a.state_dict())
    assert b.noise_scale == a.noise_scale and b.decay == 0.7
    a.update([1.0, 2.0], 0.9, 8, 16)
    b.update([1.0, 2.0], 0.9, 8, 16)
    assert b.grad_sq == a.grad_sq

"""The gradient noise scale B_noise = tr(Sigma) / |G|^2 (McCandlish et al. 2018), estimated online.

Two-batch estimator from one update: the microbatch gradients are the small batches (B_small
samples each), the accumulated gradient is the big one (B_big = B samples):

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Each term is unbiased but noisy (the |G|^2 one can be negative), so each gets its own
exponential moving average and only the averages are divided. Units are samples.
"""
from __future__ import annotations

import math

import numpy as np


def microbatch_mean_grad_sq(microbatch_grad_norm_sq, microbatch_tokens, tokens: float) -> list[float]:
    """|grad|^2 of each microbatch's own mean gradient, from a train step's update metrics.

    The train step reports each microbatch's contribution to the batch gradient (normalized by
    the batch's token count N = `tokens`); a microbatch with n_i tokens has mean gradient
    contribution * N / n_i.
    """
    n = float(tokens)
    return [float(s) * (n / t) ** 2 for s, t in zip(microbatch_grad_norm_sq, microbatch_tokens) if t > 0]


class NoiseScaleEstimator:
    """EMAs of the two-batch |G|^2 and tr(Sigma) estimates; `noise_scale` divides them.

    Args:
      decay: EMA decay per update in [0, 1) (0: the latest update only).
    """

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.g2 = 0.0  # bias-corrected by `weight` when read
        self.trace = 0.0
        self.weight = 0.0  # sum of EMA weights so far (bias correction, as in Adam)
        self.count = 0

    def update(self, small_sq: list[float], big_sq: float, b_small: float, b_big: float) -> bool:
        """Add one update's measurements; False (and nothing changes) if they cannot be used.

        Args:
          small_sq: |G_small|^2 of each small batch (microbatch mean gradients).
          big_sq: |G_big|^2 of the whole-batch mean gradient.
          b_small, b_big: their sizes in samples (b_big > b_small).
        """
        small = [s for s in small_sq if math.isfinite(s)]
        if not small or not math.isfinite(big_sq) or not b_big > b_small > 0:
            return False
        s = float(np.mean(small))
        g2 = (b_big * big_sq - b_small * s) / (b_big - b_small)
        trace = (s - big_sq) / (1.0 / b_small - 1.0 / b_big)
        d = self.decay
        self.g2 = d * self.g2 + (1 - d) * g2
        self.trace = d * self.trace + (1 - d) * trace
        self.weight = d * self.weight + (1 - d)
        self.count += 1
        return True

    def update_from_gradients(self, microbatch_grad_norm_sq, microbatch_tokens, tokens: float, grad_norm_sq: float,
                              batch_size: int) -> bool:
        """`update` from a train step's gradient norms (learner/controller/interface.py, GradientNorms)
        of a batch of `batch_size` samples and `tokens` loss tokens."""
        small = microbatch_mean_grad_sq(microbatch_grad_norm_sq, microbatch_tokens, tokens)
        if len(small) < 2:
            return False  # one microbatch: small == big, nothing to compare
        return self.update(small, float(grad_norm_sq), batch_size / len(small), float(batch_size))

    @property
    def grad_sq(self) -> float | None:
        """Estimated |G|^2 (None before any update)."""
        return self.g2 / self.weight if self.weight > 0 else None

    @property
    def trace_sigma(self) -> float | None:
        """Estimated tr(Sigma), the per-sample gradient variance (None before any update)."""
        return self.trace / self.weight if self.weight > 0 else None

    @property
    def noise_scale(self) -> float | None:
        """B_noise in samples, or None while either average is not yet positive (not usable)."""
        g2, tr = self.grad_sq, self.trace_sigma
        if g2 is None or not g2 > 0 or not tr > 0:
            return None
        return tr / g2

    def state_dict(self) -> dict:
        return {"decay": self.decay, "g2": self.g2, "trace": self.trace, "weight": self.weight,
                "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self.g2, self.trace, self.weight = float(state["g2"]), float(state["trace"]), float(state["weight"])
        self.count = int(state["count"])

"""The gradient noise scale B_noise = tr(Sigma) / |G|^2 (McCandlish et al. 2018), estimated online.

Two-batch estimator from one update: small batches i of n_i samples each (their mean gradients
G_i) and the whole batch of B samples (G_B). For independent samples
    E |G_i|^2 = |G|^2 + tr(Sigma) / n_i,     E |G_B|^2 = |G|^2 + tr(Sigma) / B,
so with S = mean_i |G_i|^2 and h = mean_i 1 / n_i (sizes may differ: packed microbatches do)
    tr(Sigma) ~ (S - |G_B|^2) / (h - 1 / B),     |G|^2 ~ |G_B|^2 - tr(Sigma) / B,
which for equal n_i = b is McCandlish's (B |G_B|^2 - b |G_b|^2) / (B - b) and (|G_b|^2 - |G_B|^2) / (1/b - 1/B).

The samples must be independent across small batches. GRPO's are not: a group's advantages are
normalized within the group (they sum to zero), so a gradient component the group's completions
share cancels in the whole group and in nothing smaller. A small batch holding part of a group
carries it, the small batches' norms grow, and |G|^2 comes out <= 0 (SmolLM2: 66-88% of updates,
docs/controller.md). The small batches are therefore whole-group units (GradientNorms.unit_*), the
microbatches only where the train step reported no units.

On a batch sampled by an older policy (asynchronous runs) the trained objective's clip drops the
tokens the last update moved most: a systematic part of the clipped gradient, present in every
unit, that the estimate reads as |G|^2 (sort-6: B_noise 250-300 where on-policy batches read
600-1,200). The units are then taken from the objective without its clip
(ControllerConfig.noise_objective) and |G_B|^2 is that objective's (GradientNorms.unit_batch_grad_norm_sq).

Each term is unbiased but noisy (the |G|^2 one can be negative), so each gets its own
exponential moving average and only the averages are divided. Units are samples.

|G|^2 is often not resolved: where a GRPO group's completions all get the same reward its
gradient is zero, and the groups that carry signal have nearly orthogonal gradients (SmolLM2 at
B = 16: one update in ~8 had two nonzero units; their sum's norm was the sum of theirs). The
average then sits within noise of zero, its sign says nothing, and a ratio taken from it (or a
None that holds B wherever it is) misleads. `noise_scale_interval` is what the decision rule reads:
B_noise over |G|^2 +- z SE(|G|^2), SE from the per-update estimates' spread and the EMA's effective
count, i.e. (tr / (|G|^2 + z SE), tr / (|G|^2 - z SE)), the upper end unbounded (inf) while
|G|^2 is within z SE of zero. The rule moves B only where the move pays at the end of that range
least in its favour (learner/controller/decision.py).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def small_batches(grads, batch_size: int) -> tuple[list[float], list[float]]:
    """(|G_i|^2 of each small batch's own mean gradient, its size n_i in samples) from a train step's
    GradientNorms (learner/controller/interface.py) of a batch of `batch_size` samples: its whole-group
    units when it has them, else its microbatches (sizes estimated as batch_size x token share).

    The train step reports each part's contribution to the batch gradient, normalized by the batch's
    loss normalizer; a part holding a share s of it has mean gradient contribution / s."""
    if grads.unit_grad_norm_sq:
        shares, sizes, sq = grads.unit_share, grads.unit_samples, grads.unit_grad_norm_sq
    else:
        total = float(sum(grads.microbatch_tokens))
        shares = [t / total if total > 0 else 0.0 for t in grads.microbatch_tokens]
        sizes, sq = [s * batch_size for s in shares], grads.microbatch_grad_norm_sq
    kept = [(float(q) / s ** 2, float(n)) for q, s, n in zip(sq, shares, sizes) if s > 0 and n > 0]
    return [q for q, _ in kept], [n for _, n in kept]


def two_batch_estimate(small_sq: Sequence[float], small_sizes: Sequence[float], big_sq: float,
                       big_size: float) -> tuple[float, float] | None:
    """(|G|^2, tr(Sigma)) from one update (module docstring), or None when they cannot be separated
    (no finite small batch, or none smaller than the whole)."""
    pairs = [(float(q), float(n)) for q, n in zip(small_sq, small_sizes) if math.isfinite(q) and n > 0]
    if not pairs or not math.isfinite(big_sq) or not big_size > 0:
        return None
    s = float(np.mean([q for q, _ in pairs]))
    h = float(np.mean([1.0 / n for _, n in pairs]))
    gap = h - 1.0 / big_size
    if not gap > 1e-12 * h:
        return None
    trace = (s - big_sq) / gap
    return big_sq - trace / big_size, trace


RESOLVED_Z = 2.0  # |G|^2 counts as resolved this many standard errors above zero
MIN_UPDATES_FOR_BOUND = 4  # the spread of fewer estimates says too little for a bound


class NoiseScaleEstimator:
    """EMAs of the two-batch |G|^2 and tr(Sigma) estimates; `noise_scale` divides them.

    Args:
      decay: EMA decay per update in [0, 1) (0: the latest update only).
    """

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.g2 = 0.0  # bias-corrected by `weight` when read
        self.g2_sq = 0.0  # EMA of the per-update |G|^2 estimates squared (their spread)
        self.trace = 0.0
        self.weight = 0.0  # sum of EMA weights so far (bias correction, as in Adam)
        self.weight_sq = 0.0  # sum of squared EMA weights (the average's effective sample count)
        self.count = 0

    def update(self, small_sq: Sequence[float], big_sq: float, small_sizes, big_size: float) -> bool:
        """Add one update's measurements; False (and nothing changes) if they cannot be used.

        Args:
          small_sq: |G_i|^2 of each small batch's mean gradient.
          big_sq: |G_B|^2 of the whole-batch mean gradient.
          small_sizes: n_i in samples, one per small batch, or one number for all.
          big_size: B in samples.
        """
        if not isinstance(small_sizes, (list, tuple, np.ndarray)):
            small_sizes = [small_sizes] * len(small_sq)
        est = two_batch_estimate(small_sq, small_sizes, big_sq, big_size)
        if est is None:
            return False
        g2, trace = est
        d = self.decay
        self.g2 = d * self.g2 + (1 - d) * g2
        self.g2_sq = d * self.g2_sq + (1 - d) * g2 * g2
        self.trace = d * self.trace + (1 - d) * trace
        self.weight = d * self.weight + (1 - d)
        self.weight_sq = d * d * self.weight_sq + (1 - d) ** 2
        self.count += 1
        return True

    def update_from_gradients(self, grads, batch_size: int) -> bool:
        """`update` from a train step's GradientNorms of a batch of `batch_size` samples."""
        small, sizes = small_batches(grads, batch_size)
        if len(small) < 2:
            return False  # one part: small == big, nothing to compare
        big = grads.grad_norm_sq if grads.unit_batch_grad_norm_sq is None else grads.unit_batch_grad_norm_sq
        return self.update(small, float(big), sizes, float(batch_size))

    @property
    def grad_sq(self) -> float | None:
        """Estimated |G|^2 (None before any update)."""
        return self.g2 / self.weight if self.weight > 0 else None

    @property
    def trace_sigma(self) -> float | None:
        """Estimated tr(Sigma), the per-sample gradient variance (None before any update)."""
        return self.trace / self.weight if self.weight > 0 else None

    @property
    def grad_sq_stderr(self) -> float | None:
        """Standard error of the averaged |G|^2: the per-update estimates' spread over the EMA's
        effective number of them (None before MIN_UPDATES_FOR_BOUND updates)."""
        if self.count < MIN_UPDATES_FOR_BOUND or not self.weight > 0:
            return None
        mean = self.g2 / self.weight
        var = max(self.g2_sq / self.weight - mean * mean, 0.0)
        return math.sqrt(var * self.weight_sq) / self.weight  # var / n_eff, n_eff = weight^2 / weight_sq

    @property
    def noise_scale(self) -> float | None:
        """B_noise in samples, or None while either average is not yet positive (not usable)."""
        g2, tr = self.grad_sq, self.trace_sigma
        if g2 is None or not g2 > 0 or not tr > 0:
            return None
        return tr / g2

    @property
    def noise_scale_interval(self) -> tuple[float, float] | None:
        """(low, high) B_noise over |G|^2 +- RESOLVED_Z SE (module docstring): high = inf while |G|^2
        is within that of zero; (point, point) while too few updates give no spread; None while
        tr(Sigma) <= 0 or nothing says |G|^2 > 0."""
        g2, tr, se = self.grad_sq, self.trace_sigma, self.grad_sq_stderr
        if g2 is None or not tr > 0:
            return None
        if se is None:
            return (tr / g2, tr / g2) if g2 > 0 else None
        top, bottom = max(g2, 0.0) + RESOLVED_Z * se, g2 - RESOLVED_Z * se
        if not top > 0:
            return None
        return tr / top, (tr / bottom if bottom > 0 else math.inf)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "g2": self.g2, "g2_sq": self.g2_sq, "trace": self.trace,
                "weight": self.weight, "weight_sq": self.weight_sq, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self.g2, self.trace, self.weight = float(state["g2"]), float(state["trace"]), float(state["weight"])
        # checkpoints before the spread was kept: it starts over (the bound waits for new updates)
        self.g2_sq, self.weight_sq = float(state.get("g2_sq", 0.0)), float(state.get("weight_sq", 0.0))
        self.count = int(state["count"]) if "g2_sq" in state else 0

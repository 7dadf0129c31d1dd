"""The decision rule: predicted time-to-target T(B) proportional to (1 + B / B_noise) / X(B).

E(B) = 1 + B / B_noise is the samples-to-target penalty (McCandlish et al. 2018) and X(B) the
pipeline's samples per second, so T(B) = E(B) / X(B) up to a constant. B -> B' pays only if
X(B') / X(B) > E(B') / E(B); a hysteresis margin keeps noise in the estimates from flapping B, and a
B_noise known only within a range is read at the end least in the move's favour.

Past the scaling rule's ceiling (controller.max_scaled_batch_size) a batch trains at less lr than
the rule asks, by a factor s (scaling.lr_shortfall), and E(B) is taken s times larger: in the
regime the square-root rule rests on (gradient noise fills Adam's second moment) the update's
drift per sample shrinks as the lr does, while its noise shrinks faster, so the drift is what is
lost. (Sort-6, 512 on 256's values: s = 1.41 predicts 1.66-1.79x 256's samples, measured 1.41x.)
"""
from __future__ import annotations

from typing import Callable, Iterable


def time_to_target_score(batch_size: float, noise_scale: float, throughput: float,
                         lr_shortfall: float = 1.0) -> float:
    """(1 + B / B_noise) s / X(B): proportional to the predicted wall time to the target (s: the
    scaling rule's lr at B over the lr the ceiling allows, 1 without one)."""
    return (1.0 + batch_size / noise_scale) * lr_shortfall / throughput


def candidate_batch_sizes(batch_size: int, min_batch_size: int, max_batch_size: int,
                          multiple: int) -> list[int]:
    """B/2, B, 2B inside [B_min, B_max] that are multiples of `multiple` (B itself always)."""
    out = []
    for b in (batch_size // 2, batch_size, batch_size * 2):
        ok = b == batch_size or (min_batch_size <= b <= max_batch_size and b % multiple == 0 and b > 0)
        if ok and b not in out:
            out.append(b)
    return out


def choose_batch_size(batch_size: int, candidates: Iterable[int], noise_scale: float | tuple[float, float],
                      throughput: Callable[[int], float], hysteresis: float,
                      lr_shortfall: Callable[[int], float] = lambda b: 1.0) -> tuple[int, dict[int, float]]:
    """The batch size to use next and every candidate's predicted time to target relative to B's.

    Args:
      batch_size: the current B (kept unless another candidate wins by the margin).
      candidates: batch sizes to compare (should include batch_size).
      noise_scale: B_noise in samples (> 0), or its (low, high) range (high may be inf): a larger
        candidate is then judged at low, a smaller one at high, the end least in its favour, so
        B moves only where the data say the move pays whatever B_noise is within the range.
      throughput: B -> predicted pipeline samples/s.
      hysteresis: a candidate must score below (1 - hysteresis) times B's to be chosen.
      lr_shortfall: B -> the scaling rule's lr there over the lr the ceiling allows (>= 1).

    Returns:
      (chosen B, {candidate: T(candidate) / T(B)}, B's own 1.0); lower is faster.
    """
    low, high = noise_scale if isinstance(noise_scale, tuple) else (noise_scale, noise_scale)
    x_b = throughput(batch_size)
    scores = {}
    for b in {int(c) for c in candidates} | {batch_size}:
        bn = low if b > batch_size else high
        scores[b] = (time_to_target_score(b, bn, throughput(b), lr_shortfall(b))
                     / time_to_target_score(batch_size, bn, x_b, lr_shortfall(batch_size)))
    best = min(scores, key=scores.get)
    if best != batch_size and scores[best] < 1.0 - hysteresis:
        return best, dict(sorted(scores.items()))
    return batch_size, dict(sorted(scores.items()))

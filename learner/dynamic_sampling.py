"""Dynamic sampling (DAPO): drop groups whose advantages are all zero, keep drawing until full.

A group whose G rewards are all equal has zero advantage for every completion under any group
normalization, so it adds tokens but no gradient. The learner loop's `group_filter` seam drops such
groups (their admission slots are freed, so actors draw replacements) and the loop keeps collecting
until the batch holds B samples: never under-full. The drop is counted in loop.dropped[reason].

Guard: a policy that solves (or fails) every prompt would otherwise drop forever; after
`max_consecutive_drops` drops in a row the next group is kept anyway and counted in `guard_kept`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

ZERO_VARIANCE = "zero_advantage_variance"  # the loop.dropped key


def has_zero_advantage_variance(rewards) -> bool:
    """True when all rewards of the group are equal (the exact test group_advantages applies)."""
    r = np.asarray(rewards, np.float64)
    return r.size == 0 or bool(r.max() == r.min())


class DynamicSamplingFilter:
    """group -> drop reason or None; install as `LearnerLoop.group_filter`.

    Args:
      max_consecutive_drops: drops in a row after which the next group is kept anyway.
    """

    def __init__(self, max_consecutive_drops: int = 1024):
        if max_consecutive_drops < 1:
            raise ValueError(f"max_consecutive_drops: must be >= 1, got {max_consecutive_drops}")
        self.max_consecutive_drops = max_consecutive_drops
        self.consecutive_drops = 0
        self.dropped = 0  # groups dropped so far
        self.guard_kept = 0  # zero-variance groups kept because the guard tripped

    def __call__(self, group: Any) -> str | None:
        if not has_zero_advantage_variance(group.rewards):
            self.consecutive_drops = 0
            return None
        if self.consecutive_drops >= self.max_consecutive_drops:
            self.consecutive_drops = 0
            self.guard_kept += 1
            return None
        self.consecutive_drops += 1
        self.dropped += 1
        return ZERO_VARIANCE


def make_group_filter(learner_cfg) -> Callable[[Any], str | None] | None:
    """The group filter the config asks for (a DynamicSamplingFilter), or None.

    Args:
      learner_cfg: LearnerConfig (grpo.dynamic_sampling and grpo.max_consecutive_drops are read).
    """
    grpo = learner_cfg.grpo
    if not grpo.dynamic_sampling:
        return None
    return DynamicSamplingFilter(grpo.max_consecutive_drops)

"""Configuration of the built-in tasks."""

from __future__ import annotations

import dataclasses
from typing import Literal

TASK_NAMES = ("sort", "add_reversed")
REWARD_KINDS = ("partial", "exact")


def prompt_space_size(name: str, num_digits: int) -> int:
    """Number of distinct prompts a task can produce (sort: 10^n digit strings; addition: 10^2n)."""
    if name == "sort":
        return 10**num_digits
    if name == "add_reversed":
        return 10 ** (2 * num_digits)
    raise ValueError(f"name: unknown task {name!r}; expected one of {TASK_NAMES}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Which built-in task to train on and how its prompts and rewards are made."""

    name: Literal["sort", "add_reversed"] = "sort"  # sort digits, or add with digits reversed
    num_digits: int = 6  # sort: digits to sort; add_reversed: digits per operand (use 3)
    seed: int = 0  # seed of the training prompt stream
    heldout_size: int = 256  # number of prompts in the fixed held-out set
    heldout_seed: int = 1234  # seed of the held-out set (independent of `seed`)
    reward: Literal["partial", "exact"] = "partial"  # per-slot partial credit, or 1/0 exact match

    def validate(self) -> None:
        """Checks ranges; raises ValueError("<field>: <problem>")."""
        if self.name not in TASK_NAMES:
            raise ValueError(f"name: unknown task {self.name!r}; expected one of {TASK_NAMES}")
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"reward: must be one of {REWARD_KINDS}, got {self.reward!r}")
        if not 1 <= self.num_digits <= 12:
            raise ValueError(f"num_digits: must be in 1..12, got {self.num_digits}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        if self.heldout_seed < 0:
            raise ValueError(f"heldout_seed: must be >= 0, got {self.heldout_seed}")
        if self.heldout_size < 1:
            raise ValueError(f"heldout_size: must be >= 1, got {self.heldout_size}")
        # Keep at least half the prompt space for training so held-out redraws stay cheap.
        limit = prompt_space_size(self.name, self.num_digits) // 2
        if self.heldout_size > limit:
            raise ValueError(
                f"heldout_size: {self.heldout_size} exceeds half of the {2 * limit} distinct "
                f"{self.name} prompts with num_digits={self.num_digits} (max {limit})"
            )

"""Configuration of the built-in tasks."""

from __future__ import annotations

import dataclasses
from typing import Literal

TASK_NAMES = ("sort", "add_reversed", "jsonl")
DIGIT_TASKS = ("sort", "add_reversed")
REWARD_KINDS = ("partial", "exact")
PROMPT_FORMATS = ("plain", "chat")


def prompt_space_size(name: str, num_digits: int) -> int:
    """Number of distinct prompts a digit task can produce (sort: 10^n digit strings; addition: 10^2n)."""
    if name == "sort":
        return 10**num_digits
    if name == "add_reversed":
        return 10 ** (2 * num_digits)
    raise ValueError(f"name: unknown digit task {name!r}; expected one of {DIGIT_TASKS}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Which task to train on and how its prompts and rewards are made."""

    name: Literal["sort", "add_reversed", "jsonl"] = "sort"  # sort digits, add with digits reversed, or a JSONL file of math problems
    num_digits: int = 6  # sort: digits to sort; add_reversed: digits per operand (use 3)
    seed: int = 0  # seed of the training prompt stream
    heldout_size: int = 256  # number of prompts in the fixed held-out set
    heldout_seed: int = 1234  # seed of the held-out set (independent of `seed`)
    reward: Literal["partial", "exact"] = "partial"  # digit tasks: per-slot partial credit, or 1/0 exact match
    path: str = ""  # jsonl: the JSONL file, one problem per line
    prompt_field: str = "question"  # jsonl: key of the problem text in each record
    answer_field: str = "answer"  # jsonl: key of the reference answer (GSM8K "... #### 72" and \boxed{} both work)
    prompt_template: str = "{prompt}"  # jsonl: text around the problem; "{prompt}" is replaced by it
    format: Literal["plain", "chat"] = "plain"  # jsonl: raw text, or the checkpoint's chat template
    system_prompt: str = ""  # jsonl, chat format: optional system message ("" = none)

    def validate(self) -> None:
        """Checks ranges; raises ValueError("<field>: <problem>")."""
        if self.name not in TASK_NAMES:
            raise ValueError(f"name: unknown task {self.name!r}; expected one of {TASK_NAMES}")
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"reward: must be one of {REWARD_KINDS}, got {self.reward!r}")
        if self.format not in PROMPT_FORMATS:
            raise ValueError(f"format: must be one of {PROMPT_FORMATS}, got {self.format!r}")
        if self.name == "jsonl":
            if not self.path:
                raise ValueError("path: the jsonl task needs a JSONL file (task.path=FILE)")
            if not self.prompt_field or not self.answer_field:
                raise ValueError("prompt_field: prompt_field and answer_field must be non-empty")
            if "{prompt}" not in self.prompt_template:
                raise ValueError(f"prompt_template: must contain '{{prompt}}', got {self.prompt_template!r}")
        if not 1 <= self.num_digits <= 12:
            raise ValueError(f"num_digits: must be in 1..12, got {self.num_digits}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        if self.heldout_seed < 0:
            raise ValueError(f"heldout_seed: must be >= 0, got {self.heldout_seed}")
        if self.heldout_size < 1:
            raise ValueError(f"heldout_size: must be >= 1, got {self.heldout_size}")
        if self.name == "jsonl":
            return  # the record count bounds heldout_size; the task checks it when it reads the file
        # Keep at least half the prompt space for training so held-out redraws stay cheap.
        limit = prompt_space_size(self.name, self.num_digits) // 2
        if self.heldout_size > limit:
            raise ValueError(
                f"heldout_size: {self.heldout_size} exceeds half of the {2 * limit} distinct "
                f"{self.name} prompts with num_digits={self.num_digits} (max {limit})"
            )

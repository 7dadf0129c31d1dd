"""Configuration of a task: which one (a built-in or a plug-in), its arguments, and how rewards run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

BUILTIN_TASKS = ("sort", "add_reversed", "jsonl", "word_problems")
TEXT_TASKS = ("jsonl", "word_problems")  # need a checkpoint tokenizer (prompts are words)
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

    name: str = "sort"  # sort | add_reversed | jsonl (math JSONL) | word_problems (generated arithmetic) | package.module:factory | file.py:factory | a cadence.tasks entry point
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # plug-in tasks: arguments their factory reads (task.args.KEY=VALUE)
    num_digits: int = 6  # sort: digits to sort; add_reversed: digits per operand (use 3)
    seed: int = 0  # seed of the training prompt stream
    heldout_size: int = 256  # number of prompts in the fixed held-out set
    heldout_seed: int = 1234  # seed of the held-out set (independent of `seed`)
    reward: Literal["partial", "exact"] = "partial"  # digit tasks: per-slot partial credit, or 1/0 exact match
    path: str = ""  # jsonl: the JSONL file, one problem per line
    prompt_field: str = "question"  # jsonl: key of the problem text in each record
    answer_field: str = "answer"  # jsonl: key of the reference answer (GSM8K "... #### 72" and \boxed{} both work)
    prompt_template: str = ""  # jsonl, word_problems: text around the problem ("{prompt}" marks where); "" = the task's own: the problem alone (jsonl), the problem and an instruction to answer in \boxed{} (word_problems)
    format: Literal["plain", "chat"] = "plain"  # jsonl, word_problems: raw text, or the checkpoint's chat template
    system_prompt: str = ""  # jsonl, word_problems, chat format: optional system message ("" = none)
    max_ops: int = 3  # word_problems: operations per problem (+ - * exact /), drawn uniformly from 1..max_ops (at most 3)
    reward_workers: int = 2  # reward worker processes (spawned; time and memory limits); 0 = score inline in the actor, unguarded
    reward_timeout_s: float = 30.0  # per completion: a reward that runs longer scores 0 (counted) and its worker is replaced
    reward_group_timeout_s: float = 300.0  # per group (worker pool): completions unscored when their group has scored this long score 0 ("group_timeout")
    reward_memory_mb: int = 2048  # address-space limit of each reward worker (RLIMIT_AS; 0 = none)
    reward_url: str = ""  # score on an HTTP reward server instead (POST one group per request; see docs/tasks.md)
    reward_concurrency: int = 8  # reward_url: requests in flight
    reward_retries: int = 2  # reward_url: re-sends after a timeout, connection error, HTTP error or malformed answer
    env_timeout_s: float = 30.0  # multi-turn: per environment call (start, step); one that runs longer ends its episode with reward 0 (counted as env_timeout)
    env_threads: int = 16  # multi-turn: environment calls running at once per actor process (rows step concurrently)

    def validate(self) -> None:
        """Checks ranges; raises ValueError("<field>: <problem>")."""
        if self.name not in BUILTIN_TASKS and ":" not in self.name:
            import importlib.metadata
            installed = sorted(p.name for p in importlib.metadata.entry_points(group="cadence.tasks"))
            if self.name not in installed:
                raise ValueError(f"name: unknown task {self.name!r}; expected one of {BUILTIN_TASKS}, "
                                 f"package.module:factory, file.py:factory, or an installed 'cadence.tasks' "
                                 f"entry point {installed}")
        if not isinstance(self.args, Mapping) or not all(isinstance(k, str) for k in self.args):
            raise ValueError(f"args: must be a mapping with string keys, got {self.args!r}")
        if self.args and self.name in BUILTIN_TASKS:
            raise ValueError(f"args: the built-in task {self.name!r} takes its settings as task.* keys, "
                             f"not task.args (got {sorted(self.args)})")
        if self.reward_workers < 0:
            raise ValueError(f"reward_workers: must be >= 0 (0 = inline), got {self.reward_workers}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"reward_timeout_s: must be > 0, got {self.reward_timeout_s}")
        if not self.reward_group_timeout_s > 0:
            raise ValueError(f"reward_group_timeout_s: must be > 0, got {self.reward_group_timeout_s}")
        if self.reward_memory_mb < 0:
            raise ValueError(f"reward_memory_mb: must be >= 0 (0 = no limit), got {self.reward_memory_mb}")
        if self.reward_memory_mb and self.reward_memory_mb < 256:
            raise ValueError(f"reward_memory_mb: {self.reward_memory_mb} is below what a Python worker needs "
                             "to start (use >= 256, or 0 for no limit)")
        if self.reward_url and not self.reward_url.startswith(("http://", "https://")):
            raise ValueError(f"reward_url: must start with http:// or https://, got {self.reward_url!r}")
        if self.reward_concurrency < 1:
            raise ValueError(f"reward_concurrency: must be >= 1, got {self.reward_concurrency}")
        if self.reward_retries < 0:
            raise ValueError(f"reward_retries: must be >= 0, got {self.reward_retries}")
        if not self.env_timeout_s > 0:
            raise ValueError(f"env_timeout_s: must be > 0, got {self.env_timeout_s}")
        if self.env_threads < 1:
            raise ValueError(f"env_threads: must be >= 1, got {self.env_threads}")
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"reward: must be one of {REWARD_KINDS}, got {self.reward!r}")
        if self.format not in PROMPT_FORMATS:
            raise ValueError(f"format: must be one of {PROMPT_FORMATS}, got {self.format!r}")
        if self.name == "jsonl":
            if not self.path:
                raise ValueError("path: the jsonl task needs a JSONL file (task.path=FILE)")
            if not self.prompt_field or not self.answer_field:
                raise ValueError("prompt_field: prompt_field and answer_field must be non-empty")
        if self.prompt_template and "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template: must contain '{{prompt}}', got {self.prompt_template!r}")
        if not 1 <= self.max_ops <= 3:
            raise ValueError(f"max_ops: must be in 1..3, got {self.max_ops}")
        if not 1 <= self.num_digits <= 12:
            raise ValueError(f"num_digits: must be in 1..12, got {self.num_digits}")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        if self.heldout_seed < 0:
            raise ValueError(f"heldout_seed: must be >= 0, got {self.heldout_seed}")
        if self.heldout_size < 1:
            raise ValueError(f"heldout_size: must be >= 1, got {self.heldout_size}")
        if self.name not in ("sort", "add_reversed"):
            return  # the record count bounds heldout_size; the task checks it when it reads the file
        # Keep at least half the prompt space for training so held-out redraws stay cheap.
        limit = prompt_space_size(self.name, self.num_digits) // 2
        if self.heldout_size > limit:
            raise ValueError(
                f"heldout_size: {self.heldout_size} exceeds half of the {2 * limit} distinct "
                f"{self.name} prompts with num_digits={self.num_digits} (max {limit})"
            )

"""The task interface: a prompt source plus a verifiable reward."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from actors.tasks.config import TaskConfig


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a task's training stream or held-out set."""

    prompt_id: str  # stable, unique: f"{task}/{split}/{index}", e.g. "sort6/train/1234"
    index: int  # position in its stream (training index, or position in the held-out list)
    tokens: tuple[int, ...]  # model input: BOS + encoded prompt text
    answer: tuple[int, ...]  # target completion ids INCLUDING the final EOS


class Task(Protocol):
    """A prompt source plus a verifiable reward.

    Attributes:
      name: short task name used in prompt ids, e.g. "sort6".
      max_prompt_len: max len(tokens) over the whole stream.
      max_completion_len: len(answer); the engine's max_new_tokens.
    """

    name: str
    max_prompt_len: int
    max_completion_len: int

    def prompt(self, index: int) -> Prompt:
        """Training prompt `index`: a pure function of (task seed, index)."""
        ...

    def heldout(self) -> list[Prompt]:
        """The fixed held-out set; independent of the training seed, never in the training stream."""
        ...

    def reward(self, prompt: Prompt, completion: Sequence[int]) -> float:
        """Reward of generated ids (may lack EOS, may contain junk ids)."""
        ...

    def exact_match(self, prompt: Prompt, completion: Sequence[int]) -> bool:
        """True iff the completion equals the answer up to and including EOS."""
        ...


def make_task(cfg: TaskConfig, tokenizer=None) -> Task:
    """Builds the task named by cfg (validating cfg first).

    Args:
      cfg: the task sub-config.
      tokenizer: the policy's tokenizer (launch.policy.Policy.tokenizer). None means the built-in
        CharTokenizer, which the digit tasks default to; the jsonl task requires a checkpoint's.

    Returns:
      A SortTask, AddReversedTask or JsonlMathTask.
    """
    # Imported here (the task modules import this one for Prompt), and only the one asked for:
    # the jsonl task's verifier (math-verify, SymPy) costs ~1-2 s to import.
    cfg.validate()
    if cfg.name == "sort":
        from actors.tasks.sort import SortTask
        return SortTask(cfg, tokenizer)
    if cfg.name == "add_reversed":
        from actors.tasks.add_reversed import AddReversedTask
        return AddReversedTask(cfg, tokenizer)
    if cfg.name == "jsonl":
        from actors.tasks.jsonl_task import JsonlMathTask
        return JsonlMathTask(cfg, tokenizer)
    raise ValueError(f"name: unknown task {cfg.name!r}")

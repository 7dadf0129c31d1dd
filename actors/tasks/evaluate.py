"""Pure evaluation helpers; the caller generates the completions (e.g. greedily with its engine)."""

from __future__ import annotations

from collections.abc import Sequence

from cadence.actors.tasks.base import Prompt, Task


def _check(prompts: Sequence[Prompt], completions: Sequence[Sequence[int]]) -> None:
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise ValueError("cannot evaluate an empty set of prompts")


def exact_match_rate(
    task: Task, prompts: Sequence[Prompt], completions: Sequence[Sequence[int]]
) -> float:
    """Fraction of prompts whose completion exactly matches the answer.

    Args:
      task: the task that made the prompts.
      prompts: the prompts, e.g. task.heldout().
      completions: one generated id sequence per prompt, in the same order.

    Returns:
      A float in [0, 1].

    Raises:
      ValueError: on a length mismatch or no prompts.
    """
    _check(prompts, completions)
    hits = sum(task.exact_match(p, c) for p, c in zip(prompts, completions))
    return hits / len(prompts)


def mean_reward(
    task: Task, prompts: Sequence[Prompt], completions: Sequence[Sequence[int]]
) -> float:
    """Mean of task.reward over (prompt, completion) pairs; arguments as in exact_match_rate."""
    _check(prompts, completions)
    return sum(task.reward(p, c) for p, c in zip(prompts, completions)) / len(prompts)

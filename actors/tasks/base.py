"""The task interface: a prompt source plus a reward, and optionally a multi-turn environment.

    task = make_task(cfg.task, tokenizer)          # actors.tasks.registry
    prompt = task.prompt(index)                    # Prompt: tokens, optional answer, metadata
    score = task.score(prompt, Completion(ids, text))   # a float, or Score(reward, exact_match, metrics)

A task with answers (the built-ins) fills ``Prompt.answer`` (used by the supervised warm-up) and
``Score.exact_match`` (held-out exact match, ``run.stop_at_exact_match``); a task without them
leaves both empty and is judged by its reward and its own metrics. A multi-turn task also has
``environment(prompt) -> Environment`` (see actors/episodes.py for how episodes run).

This module defines types only; the registry that builds tasks by name is actors/tasks/registry.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a task's training stream or held-out set."""

    prompt_id: str  # stable, unique: f"{task}/{split}/{index}", e.g. "sort6/train/1234"
    index: int  # position in its stream (training index, or position in the held-out list)
    tokens: tuple[int, ...]  # model input: BOS + encoded prompt text
    answer: tuple[int, ...] = ()  # reference completion ids INCLUDING the final EOS; () = no reference
    text: str = ""  # the prompt as text (optional; what a reward or a reward server may want to read)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the record's other fields
    # which answer ids the supervised warm-up trains on: () = all of them; a multi-turn transcript
    # marks the environment's observations False (in the context, out of the loss). Last, so
    # positional construction keeps its meaning.
    answer_mask: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        # Prompts travel to reward workers and servers: keep them plain and read-only in spirit.
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "answer", tuple(int(t) for t in self.answer))
        object.__setattr__(self, "answer_mask", tuple(bool(m) for m in self.answer_mask))
        if self.answer_mask and len(self.answer_mask) != len(self.answer):
            raise ValueError(f"{self.prompt_id}: answer_mask has {len(self.answer_mask)} entries for "
                             f"{len(self.answer)} answer ids")


@dataclasses.dataclass(frozen=True)
class Completion:
    """What the model generated for a prompt, as the reward sees it."""

    ids: tuple[int, ...]  # generated ids (may lack EOS, may contain junk ids)
    text: str  # the ids up to the first EOS, decoded without special tokens


@dataclasses.dataclass(frozen=True)
class Score:
    """A reward with what else the task knows about one completion."""

    reward: float
    exact_match: bool | None = None  # None: the task has no reference answer
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)  # averaged as task/<name>, eval/<name>
    error: str = ""  # "" or why scoring failed (then reward is 0): timeout, error, crashed, memory, ...


@runtime_checkable
class Task(Protocol):
    """A prompt source plus a reward.

    Attributes:
      name: short task name used in prompt ids, e.g. "sort6" (no "/").
      tokenizer: the policy's tokenizer the task encodes with (encode, decode, eos_id, ...).
      max_prompt_len: max len(tokens) over the whole stream.
      max_completion_len: tokens a completion needs: single-turn, the engine's max_new_tokens must
        cover it; multi-turn, the whole episode after the prompt (model and tool tokens).
      stop (optional): strings that end a completion (multi-turn: a turn) as EOS does, the string
        kept, e.g. ("</tool_call>",); see actors/episodes.py.
    """

    name: str
    tokenizer: Any
    max_prompt_len: int
    max_completion_len: int

    def prompt(self, index: int) -> Prompt:
        """Training prompt `index`: a pure function of (task seed, index)."""
        ...

    def heldout(self) -> list[Prompt]:
        """The fixed held-out set; independent of the training seed, never in the training stream."""
        ...

    def score(self, prompt: Prompt, completion: Completion) -> float | Score:
        """Reward of one completion (runs in a reward worker process unless task.reward_workers=0).

        Must be a plain function of its arguments: workers build their own copy of the task,
        unless the task has ``scoring()`` (below).
        """
        ...

    # Optional: ``scoring(self) -> Callable[[Prompt, Completion], float | Score] | None``: a
    # picklable function that scores like ``score`` from the prompt alone (its record is in
    # Prompt.metadata). Reward workers then run it and never build the task, so a large dataset
    # is read once, by the actor, not once per worker (the built-ins and RecordsTask have it).


@dataclasses.dataclass(frozen=True)
class Step:
    """What an environment answers after one model turn."""

    # tokens appended to the context (out of the loss; a warm-up transcript marks them in Prompt.answer_mask)
    observation: Sequence[int] = ()
    reward: float = 0.0  # added to the episode's reward
    done: bool = False  # the episode ends here (the observation is then dropped)
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)  # summed over the episode


class Environment(Protocol):
    """One episode of a multi-turn task, started from a prompt (see actors/episodes.py).

        env = task.environment(prompt)
        for turn in range(task.max_turns):
            step = env.step(Completion(model_turn_ids, text))  # tool output, reward, done

    Both calls run on the actor's environment threads, rows at once, each within
    task.env_timeout_s (actors/env_runner.py); an instance serves one episode, so it needs no lock.
    """

    def step(self, turn: Completion) -> Step:
        """React to the model's latest turn (ids as generated, EOS included when it stopped)."""
        ...


def is_multi_turn(task: Any) -> bool:
    """True when the task runs episodes (it has an ``environment(prompt)`` method)."""
    return callable(getattr(task, "environment", None))


def as_score(value: Any) -> Score:
    """A task's score() result as a Score (a bare number is the reward)."""
    if isinstance(value, Score):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"score() must return a number or a Score, got {type(value).__name__}")
    return Score(float(value))


def completion_text(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The ids up to (not including) the first EOS, decoded without special tokens (with them:
    what stop strings are matched against, since a stop string may be one)."""
    eos = tokenizer.eos_id
    kept = []
    for t in ids:
        if int(t) == eos:
            break
        kept.append(int(t))
    try:
        return tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)
    except TypeError:  # CharTokenizer renders specials visibly and takes no such flag
        return tokenizer.decode(kept)

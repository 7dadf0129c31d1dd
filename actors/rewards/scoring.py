"""Scoring completions: the Scorer interface, the inline scorer, and the one call the actor makes.

    scorer = make_scorer(task_cfg, task, tokenizer)        # actors/rewards/__init__.py
    scores = score_groups(scorer, task, prompts, rows)     # [n_prompts][G] Score, one call per engine result

A Scorer turns (prompt, completion) items into Scores. Where it runs is its business: inline in the
actor thread (InlineScorer), in worker processes with time and memory limits (pool.RewardPool), or
on an HTTP reward server (remote.RemoteScorer). Whatever goes wrong with one completion's reward (it
raises, returns a non-number or NaN, hangs, exhausts memory, kills its process, the server fails)
gives that completion reward 0 and a reason in Score.error; it never stops the run.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Protocol

from cadence.actors.tasks.base import Completion, Prompt, Score, as_score, completion_text

Item = tuple[Prompt, Completion]
# progress(done, total): completions scored so far in this call. The actor turns it into liveness
# (a scorer that moves on is working, however long the whole call takes).
Progress = Callable[[int, int], None]
PROGRESS_EVERY_S = 0.5

# Reasons in Score.error / RolloutGroup.reward_errors (metrics: reward/errors/<reason>).
ERROR = "error"  # the reward raised
INVALID = "invalid"  # it returned something other than a finite number or a Score
TIMEOUT = "timeout"  # it ran past task.reward_timeout_s (its worker was replaced)
GROUP_TIMEOUT = "group_timeout"  # its group had run task.reward_group_timeout_s before it was scored
CRASHED = "crashed"  # its worker process died (os._exit, a signal, the kernel's OOM killer)
MEMORY = "memory"  # it hit the worker's memory limit (MemoryError)
ENV_ERROR = "env_error"  # a multi-turn environment raised (the episode ends there)


class Scorer(Protocol):
    def score_groups(self, groups: Sequence[Sequence[Item]], progress: Progress | None = None) -> list[list[Score]]:
        """Scores of each group's items (same nesting); never raises for a reward's failure.
        progress, if given, is called in the caller's thread as completions get scored."""
        ...

    def close(self) -> None: ...


def failed(reason: str) -> Score:
    return Score(0.0, None, {}, reason)


def failures_as_misses(scores: Sequence[Score], has_reference: bool = False) -> list[Score]:
    """The scores with each failed one (its error set) counted as not matching, when the task has
    reference answers (has_reference, or another score carries an exact_match): a failure must
    not make exact match unknown for the whole set. A task without answers keeps None."""
    scores = list(scores)
    if not any(s.error for s in scores):
        return scores
    if not (has_reference or any(s.exact_match is not None for s in scores if not s.error)):
        return scores
    return [dataclasses.replace(s, exact_match=False) if s.error and s.exact_match is None else s
            for s in scores]


def safe_score(task, prompt: Prompt, completion: Completion) -> Score:
    """task.score with every failure of the reward itself turned into a 0 with its reason."""
    try:
        value = task.score(prompt, completion)
    except MemoryError:
        return failed(MEMORY)
    except Exception:  # noqa: BLE001 - any error of user code is the reward's failure, not ours
        return failed(ERROR)
    try:
        score = as_score(value)
        reward = float(score.reward)
        metrics = {str(k): float(v) for k, v in dict(score.metrics).items()}
    except (TypeError, ValueError):
        return failed(INVALID)
    if not math.isfinite(reward) or not all(math.isfinite(v) for v in metrics.values()):
        return failed(INVALID)
    exact = None if score.exact_match is None else bool(score.exact_match)
    return Score(reward, exact, metrics, "")


class InlineScorer:
    """Calls task.score in the caller's thread: no process boundary, so no time or memory limit
    (task.reward_workers=0; for rewards you trust to be fast)."""

    def __init__(self, task):
        self.task = task

    def score_groups(self, groups: Sequence[Sequence[Item]], progress: Progress | None = None) -> list[list[Score]]:
        total, done, out = sum(len(g) for g in groups), 0, []
        for group in groups:
            out.append([safe_score(self.task, p, c) for p, c in group])
            done += len(group)
            if progress is not None:
                progress(done, total)
        return out

    def close(self) -> None:
        pass


def wait_reporting(future: concurrent.futures.Future, done: Callable[[], int], total: int,
                   progress: Progress | None):
    """future.result(), calling progress(done(), total) every PROGRESS_EVERY_S while it runs and
    whenever done() moved (in the caller's thread)."""
    last = -1
    while True:
        try:
            result = future.result(timeout=PROGRESS_EVERY_S if progress is not None else None)
        except concurrent.futures.TimeoutError:
            now = done()
            if now != last:
                progress(now, total)
                last = now
            continue
        if progress is not None:
            progress(total, total)
        return result


def make_completion(tokenizer, ids: Sequence[int]) -> Completion:
    ids = tuple(int(t) for t in ids)
    return Completion(ids, completion_text(tokenizer, ids))


def score_groups(scorer: Scorer, task, prompts: Sequence[Prompt],
                 completions: Sequence[Sequence[Sequence[int]]], progress: Progress | None = None) -> list[list[Score]]:
    """Scores one engine result: completions[i] holds prompt i's G generated id lists.

    Text is decoded here, once, with the task's tokenizer (up to the first EOS, specials skipped).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"score_groups: {len(prompts)} prompts but {len(completions)} groups")
    groups = [[(p, make_completion(task.tokenizer, ids)) for ids in rows]
              for p, rows in zip(prompts, completions)]
    scores = scorer.score_groups(groups, progress) if progress is not None else scorer.score_groups(groups)
    has_reference = any(p.answer for p in prompts) or any(
        s.exact_match is not None for g in scores for s in g if not s.error)
    return [failures_as_misses(g, has_reference) for g in scores]


def score_rollouts(scorer: Scorer, task, prompts: Sequence[Prompt], rollouts,
                   progress: Progress | None = None) -> list[list[Score]]:
    """[n_prompts][G] Scores of an actor step's rollouts (actors/episodes.py): the environment's
    when the episodes brought them, else the task's reward through the scorer."""
    G = len(rollouts.tokens) // len(prompts)
    if rollouts.scores is not None:
        return [list(rollouts.scores[i * G:(i + 1) * G]) for i in range(len(prompts))]
    return score_groups(scorer, task, prompts, [rollouts.tokens[i * G:(i + 1) * G] for i in range(len(prompts))],
                        progress)

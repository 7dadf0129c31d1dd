"""Held-out evaluation: greedy rollouts of the held-out prompts, scored like training samples.

    metrics = evaluate_heldout(engine, task, params, scorer=scorer)

Reports the task's own numbers: eval/reward (mean), eval/exact_match when the task has reference
answers (every Score carries exact_match; a completion whose scoring failed counts as not
matching, so one failure never erases the metric run.stop_at_exact_match reads), eval/<name> for
each metric the task's scores (or its environment's steps) report, and eval/reward_errors (how many
held-out rewards failed; 0 when none did).

The same numbers when the actors evaluate (a sharded learner hands the held-out prompts out as
work, launch/run/pipeline.py): each actor runs `heldout_scores` on its chunk, and the learner
aggregates all of them with `heldout_metrics`, as `evaluate_heldout` does here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from cadence.actors.episodes import Rollouts, generate_rollouts
from cadence.actors.rewards.scoring import InlineScorer, Scorer, failures_as_misses, score_rollouts
from cadence.actors.tasks.base import Completion, Prompt, Score, completion_text


@dataclasses.dataclass(frozen=True)
class Heldout:
    """Each held-out prompt with its greedy completion and score, and the metrics of them all."""

    task: str  # the task's name
    metrics: dict  # eval/reward, eval/exact_match, eval/<task metric>, eval/reward_errors
    prompts: list[Prompt]
    completions: list[Completion]  # ids (multi-turn: turns and observations) and decoded text
    scores: list[Score]


def evaluate_heldout(engine, task, params, prompts: Sequence[Prompt] | None = None,
                     scorer: Scorer | None = None, envs=None) -> dict:
    """Greedy decoding (multi-turn tasks: greedy episodes) of the held-out set, then scoring.
    envs: the EnvRunner of multi-turn tasks (task.env_threads, task.env_timeout_s)."""
    return heldout_results(engine, task, params, prompts, scorer, envs).metrics


def heldout_results(engine, task, params, prompts: Sequence[Prompt] | None = None,
                    scorer: Scorer | None = None, envs=None) -> Heldout:
    """evaluate_heldout, keeping each completion and score (to read, or to break down by kind)."""
    prompts = list(task.heldout() if prompts is None else prompts)
    scores, out = heldout_scores(engine, task, params, prompts, scorer, envs)
    scores = failures_as_misses(scores, has_reference=any(p.answer for p in prompts))
    completions = [Completion(tuple(ids), completion_text(task.tokenizer, ids)) for ids in out.tokens]
    return Heldout(task.name, _metrics(scores), prompts, completions, scores)


def heldout_scores(engine, task, params, prompts: Sequence[Prompt], scorer: Scorer | None = None,
                   envs=None) -> tuple[list[Score], Rollouts]:
    """Greedy completions of `prompts` (the same key for every caller) and each one's Score as the
    reward gave it; with the rollouts (token counts)."""
    out = generate_rollouts(engine, params, task, prompts, jax.random.key(0), greedy=True, envs=envs)
    return [s for group in score_rollouts(scorer or InlineScorer(task), task, prompts, out) for s in group], out


def heldout_metrics(scores: Sequence[Score], prompts: Sequence[Prompt]) -> dict:
    """The eval/* metrics of the held-out set's scores (in any order), failures counted as misses."""
    return _metrics(failures_as_misses(scores, has_reference=any(p.answer for p in prompts)))


def _metrics(scores: Sequence[Score]) -> dict:
    metrics = {"eval/reward": float(np.mean([s.reward for s in scores]))}
    exact = [s.exact_match for s in scores]
    if all(e is not None for e in exact):
        metrics["eval/exact_match"] = float(np.mean(exact))
    names = sorted({k for s in scores for k in s.metrics})
    for name in names:
        if name not in ("reward", "exact_match"):
            metrics[f"eval/{name}"] = float(np.mean([s.metrics.get(name, 0.0) for s in scores]))
    metrics["eval/reward_errors"] = sum(1 for s in scores if s.error)
    return metrics

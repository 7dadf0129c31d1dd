"""Held-out evaluation: greedy rollouts of the held-out prompts, scored like training samples.

    metrics = evaluate_heldout(engine, task, params, scorer=scorer)

Reports the task's own numbers: eval/reward (mean), eval/exact_match when the task has reference
answers (every Score carries exact_match), eval/<name> for each metric the task's scores (or its
environment's steps) report, and eval/reward_errors when some rewards failed.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from actors.episodes import generate_rollouts
from actors.rewards.scoring import InlineScorer, Scorer, score_rollouts
from actors.tasks.base import Prompt


def evaluate_heldout(engine, task, params, prompts: Sequence[Prompt] | None = None,
                     scorer: Scorer | None = None) -> dict:
    """Greedy decoding (multi-turn tasks: greedy episodes) of the held-out set, then scoring."""
    prompts = list(task.heldout() if prompts is None else prompts)
    out = generate_rollouts(engine, params, task, prompts, jax.random.key(0), greedy=True)
    scores = [s for group in score_rollouts(scorer or InlineScorer(task), task, prompts, out) for s in group]
    metrics = {"eval/reward": float(np.mean([s.reward for s in scores]))}
    exact = [s.exact_match for s in scores]
    if all(e is not None for e in exact):
        metrics["eval/exact_match"] = float(np.mean(exact))
    names = sorted({k for s in scores for k in s.metrics})
    for name in names:
        if name not in ("reward", "exact_match"):
            metrics[f"eval/{name}"] = float(np.mean([s.metrics.get(name, 0.0) for s in scores]))
    errors = sum(1 for s in scores if s.error)
    if errors:
        metrics["eval/reward_errors"] = errors
    return metrics

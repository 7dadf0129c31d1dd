"""Where rewards run: inline, in a pool of worker processes, or on an HTTP reward server.

    scorer = make_scorer(cfg.task, task, tokenizer)
    scores = score_groups(scorer, task, prompts, completions)   # per engine result
    scorer.close()
"""
from __future__ import annotations

from cadence.actors.tasks.base import is_multi_turn
from cadence.actors.rewards.scoring import InlineScorer, Scorer, safe_score, score_groups, score_rollouts


def make_scorer(task_cfg, task, tokenizer=None) -> Scorer:
    """The scorer task_cfg asks for: reward_url > reward_workers > 0 (pool) > inline. Multi-turn
    tasks are scored by their environments (in the actor), so they get the inline scorer.

    tokenizer: what the task was built with (the pool's workers build their own copy from it).
    Raises RewardWorkerError when the task does not build in a worker.
    """
    if task_cfg.reward_url:
        from cadence.actors.rewards.remote import RemoteScorer
        return RemoteScorer(task_cfg.reward_url, task.name, task_cfg.reward_concurrency,
                            task_cfg.reward_timeout_s, task_cfg.reward_retries)
    if task_cfg.reward_workers > 0 and hasattr(task, "score") and not is_multi_turn(task):
        from cadence.actors.rewards.pool import RewardPool
        return RewardPool(worker_source(task_cfg, task, tokenizer), task_cfg.reward_workers,
                          task_cfg.reward_timeout_s, task_cfg.reward_memory_mb,
                          group_timeout_s=task_cfg.reward_group_timeout_s)
    return InlineScorer(task)


class ScoringOnly:
    """What a reward worker scores with when the task offers a scoring function: that function
    alone, so the worker never builds the task (reads or tokenizes its dataset)."""

    def __init__(self, score):
        self.score = score


def worker_source(task_cfg, task, tokenizer=None):
    """A picklable zero-argument callable that builds, in a worker, something with .score: the
    task's scoring function (Task.scoring, when it has one that pickles), else the whole task."""
    import functools
    import pickle

    scoring = getattr(task, "scoring", None)
    fn = scoring() if callable(scoring) else None
    if fn is not None:
        try:
            pickle.dumps(fn)
            return functools.partial(ScoringOnly, fn)
        except (pickle.PicklingError, TypeError, AttributeError):
            pass  # e.g. a closure: the worker builds the task instead
    from cadence.actors.tasks.registry import task_factory
    return task_factory(task_cfg, tokenizer)


__all__ = ["InlineScorer", "Scorer", "ScoringOnly", "make_scorer", "safe_score", "score_groups", "score_rollouts",
           "worker_source"]

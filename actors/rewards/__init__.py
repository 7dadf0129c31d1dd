"""Where rewards run: inline, in a pool of worker processes, or on an HTTP reward server.

    scorer = make_scorer(cfg.task, task, tokenizer)
    scores = score_groups(scorer, task, prompts, completions)   # per engine result
    scorer.close()
"""
from __future__ import annotations

from actors.tasks.base import is_multi_turn
from actors.rewards.scoring import InlineScorer, Scorer, safe_score, score_groups, score_rollouts


def make_scorer(task_cfg, task, tokenizer=None) -> Scorer:
    """The scorer task_cfg asks for: reward_url > reward_workers > 0 (pool) > inline. Multi-turn
    tasks are scored by their environments (in the actor), so they get the inline scorer.

    tokenizer: what the task was built with (the pool's workers build their own copy from it).
    Raises RewardWorkerError when the task does not build in a worker.
    """
    if task_cfg.reward_url:
        from actors.rewards.remote import RemoteScorer
        return RemoteScorer(task_cfg.reward_url, task.name, task_cfg.reward_concurrency,
                            task_cfg.reward_timeout_s, task_cfg.reward_retries)
    if task_cfg.reward_workers > 0 and hasattr(task, "score") and not is_multi_turn(task):
        from actors.rewards.pool import RewardPool
        from actors.tasks.registry import task_factory
        return RewardPool(task_factory(task_cfg, tokenizer), task_cfg.reward_workers,
                          task_cfg.reward_timeout_s, task_cfg.reward_memory_mb)
    return InlineScorer(task)


__all__ = ["InlineScorer", "Scorer", "make_scorer", "safe_score", "score_groups", "score_rollouts"]

"""Reward throughput: groups/s scored by the worker pool vs calling the same reward inline.

The reward is the default task's (sort-6 partial credit: microseconds per completion), so this
measures what the pool adds per group: a pickle to the worker, one JSON answer per completion,
the dispatch threads. Both sides score the same groups (G=8 completions each) in batches of one
engine call (16 groups), as the actor does. Prints one JSON line.

    python benchmarks/reward_pool_bench.py [--groups 2048] [--workers 2]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cadence.actors.rewards.pool import RewardPool
from cadence.actors.rewards.scoring import InlineScorer, make_completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task, task_factory


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=2048)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-call", type=int, default=16, help="groups per score_groups call (one engine call)")
    a = p.parse_args()
    cfg = TaskConfig()
    task = make_task(cfg)
    rng = np.random.default_rng(0)
    calls = []
    for c in range(a.groups // a.per_call):
        groups = []
        for i in range(a.per_call):
            prompt = task.prompt(c * a.per_call + i)
            groups.append([(prompt, make_completion(task.tokenizer, rng.integers(2, 14, 7).tolist()))
                           for _ in range(8)])
        calls.append(groups)

    def run(scorer) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = [scorer.score_groups(g) for g in calls]
        return time.perf_counter() - t0, out

    inline_s, inline_scores = run(InlineScorer(task))
    pool = RewardPool(task_factory(cfg, None), workers=a.workers)
    try:
        pool.wait_ready()
        pool.score_groups(calls[0])  # every worker up and warm
        pool_s, pool_scores = run(pool)
    finally:
        pool.close()
    same = all(x.reward == y.reward for c1, c2 in zip(inline_scores, pool_scores)
               for g1, g2 in zip(c1, c2) for x, y in zip(g1, g2))
    n = len(calls) * a.per_call
    print(json.dumps({"bench": "reward_pool", "groups": n, "group_size": 8, "workers": a.workers,
                      "pool_groups_per_second": n / pool_s, "inline_groups_per_second": n / inline_s,
                      "pool_ms_per_group": 1e3 * pool_s / n, "inline_ms_per_group": 1e3 * inline_s / n,
                      "ratio": inline_s / pool_s, "same_rewards": same}))


if __name__ == "__main__":
    main()

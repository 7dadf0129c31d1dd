"""Helpers for tests and benchmarks: real RolloutGroup messages without an engine behind them."""
from __future__ import annotations

from cadence.protocols.messages import EngineTimings, RolloutGroup

_NO_TIMINGS = EngineTimings(queued_at=0.0, started_at=0.0, finished_at=0.0, generate_seconds=0.0,
                            num_tokens=0, engine="test")


def rollout_group(prompt_id: str, task: str, prompt_tokens: list[int], completion_tokens: list[list[int]],
                  behavior_logprobs: list[list[float]], rewards: list[float], policy_version: int = 0,
                  actor_id: str = "a") -> RolloutGroup:
    """A validated RolloutGroup with placeholder timings (positional order as in the message)."""
    return RolloutGroup(prompt_id=prompt_id, task=task, prompt_tokens=list(prompt_tokens),
                        completion_tokens=completion_tokens, behavior_logprobs=behavior_logprobs,
                        rewards=[float(r) for r in rewards], policy_version=policy_version,
                        actor_id=actor_id, timings=_NO_TIMINGS)


def random_groups(num_groups: int, seed: int, vocab_size: int, group_size: int, max_completion: int = 12,
                  prompt_len: tuple[int, int] = (2, 6)) -> list[RolloutGroup]:
    """Groups of random tokens (ids >= 3; each prompt starts with 1), prompts of 1 + [prompt_len)
    tokens, completions of 1..max_completion, behavior log-probs < 0 and rewards in [0, 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_groups):
        prompt = [1] + [int(x) for x in rng.integers(3, vocab_size, rng.integers(*prompt_len))]
        comps = [[int(x) for x in rng.integers(3, vocab_size, rng.integers(1, max_completion + 1))]
                 for _ in range(group_size)]
        behav = [[float(-rng.exponential()) for _ in c] for c in comps]
        out.append(rollout_group(f"g{i}", "t", prompt, comps, behav, [float(x) for x in rng.random(group_size)], 0))
    return out

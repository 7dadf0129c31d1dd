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

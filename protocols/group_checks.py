"""Is a group what its grant asked for, and something the learner can train on?

    limits = GroupLimits(group_size=8, max_completion_tokens=512, vocab_size=32000)
    granted = GrantedPrompts.of(prompts, min_version=3)    # when the dispatcher grants them
    bad = check_group(group, granted, limits, newest_version=5)
    if bad is not None:
        reason, detail = bad                               # e.g. "group_size", "has 5 completions, not 2"

The codec has already checked that a group is consistent with itself (per-completion fields agree
in length, ids >= 0, values finite). That does not make it safe to train on: an actor (or anyone who
can reach the dispatcher) could answer a grant with another prompt, more completions than the run's
G, a prompt that leaves no room in the learner's rows, or rewards and log-probs that overflow the
loss. The dispatcher runs this on every group before it reaches the ledger or the learner; a group
that fails is rejected, counted as `actors/bad_groups/REASON`, and its sender disconnected.

Reasons: prompt_tokens (not the granted prompt's tokens), group_size (not G), completion_length
(a completion longer than the run's completion budget), token_id (an id outside the vocabulary),
reward_range (|reward| above max_abs_reward), logprob_range and kept_logmass_range (above 0 or
below LOGPROB_FLOOR), future_version (newer than any published), stale_version (older than the
grant's min_version, which the learner would drop).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cadence.protocols.messages import RolloutGroup

# A log-probability (or kept log-mass) above this is not a log of a probability: 0 plus float slack.
LOGPROB_CEILING = 1e-3
# Below this no sampler draws a token: float32 holds no probability under e^-104. A value like -1e30
# would make the learner's importance ratio exp(new - behavior) overflow.
LOGPROB_FLOOR = -1e3


@dataclasses.dataclass(frozen=True)
class GroupLimits:
    group_size: int  # G: completions per prompt
    max_completion_tokens: int = 0  # the run's completion budget (engine.max_new_tokens, or a multi-turn episode); 0 = unchecked
    vocab_size: int = 0  # completion ids must be < this; 0 = unchecked
    # |reward| above this is refused: float32 group statistics overflow near 1e19, and no task means 1e30
    max_abs_reward: float = 1e6


@dataclasses.dataclass
class GrantedPrompts:
    """The prompts of one grant still waiting for their groups: prompt id -> the prompt's token ids
    as little-endian int32 bytes (compared with a group's packed prompt_tokens as they are)."""

    tokens: dict[str, bytes]
    min_version: int = 0  # the oldest policy version the grant allows (Grant.min_version)

    @classmethod
    def of(cls, prompts, min_version: int = 0) -> "GrantedPrompts":
        return cls({p.prompt_id: np.asarray(p.tokens, "<i4").tobytes() for p in prompts}, min_version)

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self):
        return iter(self.tokens)

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self.tokens


def check_group(group: RolloutGroup, granted: GrantedPrompts, limits: GroupLimits,
                newest_version: int) -> tuple[str, str] | None:
    """None for a group that answers its grant within the limits; else (reason, detail).
    The caller has checked that group.prompt_id is in `granted`."""
    if group.prompt_tokens.data != granted.tokens[group.prompt_id]:
        return "prompt_tokens", (f"prompt_tokens ({len(group.prompt_tokens)} ids) are not the tokens of "
                                 f"the granted prompt {group.prompt_id!r}")
    G = group.group_size
    if G != limits.group_size:
        return "group_size", f"has {G} completions, the run's group size is {limits.group_size}"
    tokens = group.completion_tokens
    if limits.max_completion_tokens and G:
        longest = int(tokens.lengths.max())
        if longest > limits.max_completion_tokens:
            return "completion_length", (f"a completion of {longest} tokens exceeds the run's budget of "
                                         f"{limits.max_completion_tokens}")
    if limits.vocab_size and len(tokens.data):
        top = int(tokens.values.max())
        if top >= limits.vocab_size:
            return "token_id", f"completion token id {top} is outside the vocabulary ({limits.vocab_size})"
    worst = max(map(abs, group.rewards), default=0.0)
    if worst > limits.max_abs_reward:
        return "reward_range", f"a reward of magnitude {worst:g} exceeds {limits.max_abs_reward:g}"
    for field in ("behavior_logprobs", "kept_logmass"):
        value = getattr(group, field)
        if value is None or not len(value.data):
            continue
        values = value.values
        low, high = float(values.min()), float(values.max())
        if high > LOGPROB_CEILING or low < LOGPROB_FLOOR:
            reason = "logprob_range" if field == "behavior_logprobs" else "kept_logmass_range"
            return reason, f"{field} span [{low:g}, {high:g}], outside [{LOGPROB_FLOOR:g}, 0]"
    if group.policy_version > newest_version:
        return "future_version", (f"policy_version {group.policy_version} is newer than the newest published "
                                  f"({newest_version})")
    if group.policy_version < granted.min_version:
        return "stale_version", (f"policy_version {group.policy_version} is older than its grant allows "
                                 f"({granted.min_version})")
    return None

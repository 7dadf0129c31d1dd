"""Typed messages that actors and the learner exchange.

Messages are frozen msgspec Structs in one tagged union (`Message`); the tag travels in the field
`type`. Fields are plain Python lists and scalars (no NumPy) so that a message is cheap to encode
and means the same thing on every host.

Each message checks its own consistency in `validate()`, which also runs on construction and on
decode (msgspec calls `__post_init__` in both cases), so an inconsistent message is rejected at the
sender as well as at the receiver. A failure is an `InvalidMessage` naming the field and, for
per-completion fields, the index.
"""

from __future__ import annotations

import math

import msgspec

from protocols.errors import InvalidMessage


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of all top-level messages: frozen, keyword-only, tagged by the field `type`."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises InvalidMessage if the fields are inconsistent."""


class EngineTimings(msgspec.Struct, frozen=True, kw_only=True):
    """When and how fast an engine produced one group (nested in RolloutGroup)."""

    queued_at: float  # time.time() when the prompt was handed to the engine
    started_at: float  # time.time() when generation began
    finished_at: float  # time.time() when the last completion finished
    generate_seconds: float  # time spent generating this group
    num_tokens: int  # completion tokens generated for this group
    engine: str  # which engine produced it, e.g. "jax" or "sglang"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises InvalidMessage if a count or duration is negative or not finite."""
        if self.num_tokens < 0:
            raise InvalidMessage(f"EngineTimings.num_tokens: must be >= 0, got {self.num_tokens}")
        if not (math.isfinite(self.generate_seconds) and self.generate_seconds >= 0):
            raise InvalidMessage(
                f"EngineTimings.generate_seconds: must be finite and >= 0, got {self.generate_seconds}"
            )


class RolloutGroup(_Message, kw_only=True, tag="rollout_group"):
    """One prompt's G sampled completions with their behavior logprobs and rewards."""

    prompt_id: str  # stable id of the prompt (used to track prompts in flight)
    task: str  # name of the task that supplied the prompt and scored the completions
    prompt_tokens: list[int]  # [P] prompt token ids
    completion_tokens: list[list[int]]  # [G][T_g] each completion's ids, up to and including EOS
    behavior_logprobs: list[list[float]]  # [G][T_g] logprob of each sampled id under the engine
    rewards: list[float]  # [G] one scalar reward per completion
    policy_version: int  # weights version that produced the completions
    actor_id: str  # which actor sent the group
    timings: EngineTimings
    exact_match: list[bool] | None = None  # [G] optional: did the answer match exactly
    # [G][T_g] optional: log of the probability mass the sampler's top-p nucleus kept at each
    # token (<= 0): the token was drawn with probability exp(behavior_logprob - kept_logmass), and
    # -kept_logmass is KL(truncated || full) of that step. None: no truncation, or not reported.
    kept_logmass: list[list[float]] | None = None

    @property
    def group_size(self) -> int:
        """Number of completions G in the group."""
        return len(self.completion_tokens)

    def validate(self) -> None:
        """Raises InvalidMessage unless the per-completion fields agree in length and are sane.

        Checks: G >= 1; behavior_logprobs, rewards (and exact_match, kept_logmass if given) have G
        entries; each completion has as many logprobs (and kept log-masses) as ids; ids are >= 0;
        logprobs, kept log-masses and rewards are finite; policy_version >= 0; prompt_id is
        non-empty.
        """
        name = "RolloutGroup"
        if not self.prompt_id:
            raise InvalidMessage(f"{name}.prompt_id: must be non-empty")
        if self.policy_version < 0:
            raise InvalidMessage(f"{name}.policy_version: must be >= 0, got {self.policy_version}")
        if self.prompt_tokens and min(self.prompt_tokens) < 0:
            raise InvalidMessage(f"{name}.prompt_tokens: token ids must be >= 0")
        group_size = len(self.completion_tokens)
        if group_size < 1:
            raise InvalidMessage(f"{name}.completion_tokens: a group needs at least 1 completion")
        per_completion = {"behavior_logprobs": self.behavior_logprobs, "rewards": self.rewards}
        if self.exact_match is not None:
            per_completion["exact_match"] = self.exact_match
        if self.kept_logmass is not None:
            per_completion["kept_logmass"] = self.kept_logmass
        for field, values in per_completion.items():
            if len(values) != group_size:
                raise InvalidMessage(
                    f"{name}.{field}: has {len(values)} entries for {group_size} completions "
                    f"in completion_tokens"
                )
        for i, (tokens, logprobs) in enumerate(zip(self.completion_tokens, self.behavior_logprobs)):
            if len(tokens) != len(logprobs):
                raise InvalidMessage(
                    f"{name}.behavior_logprobs[{i}]: has {len(logprobs)} logprobs for "
                    f"{len(tokens)} tokens in completion_tokens[{i}]"
                )
            if tokens and min(tokens) < 0:
                raise InvalidMessage(f"{name}.completion_tokens[{i}]: token ids must be >= 0")
            # One C-level sum per completion: NaN or inf anywhere makes it non-finite.
            if not math.isfinite(sum(logprobs)):
                j = next((j for j, lp in enumerate(logprobs) if not math.isfinite(lp)), None)
                if j is not None:  # else a finite overflow of the sum, which is fine
                    raise InvalidMessage(
                        f"{name}.behavior_logprobs[{i}][{j}]: must be finite, got {logprobs[j]}"
                    )
        for i, (tokens, kept) in enumerate(zip(self.completion_tokens, self.kept_logmass or ())):
            if len(kept) != len(tokens):
                raise InvalidMessage(f"{name}.kept_logmass[{i}]: has {len(kept)} values for "
                                     f"{len(tokens)} tokens in completion_tokens[{i}]")
            if not math.isfinite(sum(kept)):
                raise InvalidMessage(f"{name}.kept_logmass[{i}]: must be finite")
        for i, reward in enumerate(self.rewards):
            if not math.isfinite(reward):
                raise InvalidMessage(f"{name}.rewards[{i}]: must be finite, got {reward}")


class WeightsPublished(_Message, kw_only=True, tag="weights_published"):
    """The learner announces a new weights version that actors should sample from."""

    version: int  # policy version of the new weights
    step: int  # learner optimizer step that produced them
    location: str  # where to find them: "inproc" or a checkpoint path
    published_at: float  # time.time() at publication

    def validate(self) -> None:
        """Raises InvalidMessage if version or step is negative or location is empty."""
        for field in ("version", "step"):
            value = getattr(self, field)
            if value < 0:
                raise InvalidMessage(f"WeightsPublished.{field}: must be >= 0, got {value}")
        if not self.location:
            raise InvalidMessage("WeightsPublished.location: must be non-empty")


class Control(_Message, kw_only=True, tag="control"):
    """The learner or controller tells actors to change settings or stop; None means unchanged."""

    batch_size: int | None = None  # new learner batch size B in samples
    concurrency: int | None = None  # new number of prompts an actor keeps in flight
    max_staleness: int | None = None  # new bound on policy versions between sampling and use
    stop: bool = False  # finish in-flight work and exit

    def validate(self) -> None:
        """Raises InvalidMessage if a given setting is out of range."""
        for field, lowest in (("batch_size", 1), ("concurrency", 1), ("max_staleness", 0)):
            value = getattr(self, field)
            if value is not None and value < lowest:
                raise InvalidMessage(f"Control.{field}: must be >= {lowest}, got {value}")


Message = RolloutGroup | WeightsPublished | Control
MESSAGE_TYPES: tuple[type, ...] = (RolloutGroup, WeightsPublished, Control)

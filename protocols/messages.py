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
    grant_id: str = ""  # the dispatcher's grant this group answers ("" outside the dispatcher protocol)
    # [G][T_g] optional: True where the policy sampled the token (trained on), False for tokens an
    # environment put in the context (tool output: masked out of the loss). None: all True.
    policy_mask: list[list[bool]] | None = None
    reward_errors: list[str] | None = None  # [G] optional: "" or why scoring failed (the reward is then 0)
    task_metrics: dict[str, list[float]] | None = None  # optional: the task's own per-completion metrics, [G] each
    # [G][T_g] optional: log of the probability mass the sampler's top-p nucleus kept at each
    # token (<= 0; 0 on tokens the policy did not sample): the token was drawn with probability
    # exp(behavior_logprob - kept_logmass), and -kept_logmass is KL(truncated || full) of that
    # step. None: no truncation, or not reported.
    kept_logmass: list[list[float]] | None = None

    @property
    def group_size(self) -> int:
        """Number of completions G in the group."""
        return len(self.completion_tokens)

    def validate(self) -> None:
        """Raises InvalidMessage unless the per-completion fields agree in length and are sane.

        Checks: G >= 1; behavior_logprobs, rewards (and exact_match, policy_mask, reward_errors,
        kept_logmass, each task_metrics list if given) have G entries; each completion has as many
        logprobs (and policy_mask entries, kept log-masses) as ids; ids are >= 0; logprobs, kept
        log-masses, rewards and task metrics are finite; policy_version >= 0; prompt_id is
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
        for field in ("exact_match", "policy_mask", "reward_errors", "kept_logmass"):
            if getattr(self, field) is not None:
                per_completion[field] = getattr(self, field)
        for key, values in (self.task_metrics or {}).items():
            per_completion[f"task_metrics[{key!r}]"] = values
            if not math.isfinite(sum(values)):
                raise InvalidMessage(f"{name}.task_metrics[{key!r}]: values must be finite")
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
        if self.policy_mask is not None:
            for i, (tokens, mask) in enumerate(zip(self.completion_tokens, self.policy_mask)):
                if len(mask) != len(tokens):
                    raise InvalidMessage(f"{name}.policy_mask[{i}]: has {len(mask)} entries for "
                                         f"{len(tokens)} tokens in completion_tokens[{i}]")
        for i, reward in enumerate(self.rewards):
            if not math.isfinite(reward):
                raise InvalidMessage(f"{name}.rewards[{i}]: must be finite, got {reward}")


class WeightsPublished(_Message, kw_only=True, tag="weights_published"):
    """The learner announces a new weights version that actors should sample from."""

    version: int  # policy version of the new weights
    step: int  # learner optimizer step that produced them
    location: str  # where to find them: "inproc", a checkpoint path or a weights endpoint
    published_at: float  # time.time() at publication
    tensors: list[TensorSpec] | None = None  # a weights transfer: the arrays whose frames follow

    def validate(self) -> None:
        """Raises InvalidMessage if version or step is negative or location is empty."""
        for field in ("version", "step"):
            value = getattr(self, field)
            if value < 0:
                raise InvalidMessage(f"WeightsPublished.{field}: must be >= 0, got {value}")
        if not self.location:
            raise InvalidMessage("WeightsPublished.location: must be non-empty")


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One array of a weights transfer: its tree path, dtype and shape, sent as `frames` raw frames."""

    path: str
    dtype: str  # numpy dtype name, e.g. "float32", "bfloat16"
    shape: list[int]
    frames: int  # raw frames that follow for it (big arrays are chunked)


class WeightsRequest(_Message, kw_only=True, tag="weights_request"):
    """An actor asks for the newest weights; the answer is a WeightsPublished header with `tensors`
    set, followed by the raw frames, or the header alone when `have_version` is already the newest."""

    have_version: int = -1  # the version the actor holds (-1: none)


class Control(_Message, kw_only=True, tag="control"):
    """The learner or controller tells actors to change settings or stop; None means unchanged."""

    batch_size: int | None = None  # new learner batch size B in samples
    concurrency: int | None = None  # new number of prompts an actor keeps in flight
    max_staleness: int | None = None  # new bound on policy versions between sampling and use
    stop: bool = False  # finish in-flight work and exit
    reason: str = ""  # why (with stop: "finished", "hung: ..."), for the actor's log

    def validate(self) -> None:
        """Raises InvalidMessage if a given setting is out of range."""
        for field, lowest in (("batch_size", 1), ("concurrency", 1), ("max_staleness", 0)):
            value = getattr(self, field)
            if value is not None and value < lowest:
                raise InvalidMessage(f"Control.{field}: must be >= {lowest}, got {value}")


# -- the dispatcher protocol (protocols/dispatch.py): actors ask for work, the learner grants it ----
def _check_nonempty(name: str, **fields: str) -> None:
    for field, value in fields.items():
        if not value:
            raise InvalidMessage(f"{name}.{field}: must be non-empty")


def _check_at_least(name: str, lowest: int, **fields: int) -> None:
    for field, value in fields.items():
        if value < lowest:
            raise InvalidMessage(f"{name}.{field}: must be >= {lowest}, got {value}")


class Hello(_Message, kw_only=True, tag="hello"):
    """An actor joins (or rejoins) the dispatcher; the answer is a Welcome."""

    actor_id: str  # stable name, unique among live actors (a restarted process reuses its own)
    capacity: int  # prompts the actor generates in one engine call
    host: str = ""
    pid: int = 0

    def validate(self) -> None:
        _check_nonempty("Hello", actor_id=self.actor_id)
        _check_at_least("Hello", 1, capacity=self.capacity)


class Welcome(_Message, kw_only=True, tag="welcome"):
    """The dispatcher accepts an actor: what it needs to build its task, model and engine."""

    session: str  # this learner incarnation; a new one after every learner (re)start
    config: dict  # the run's resolved config tree (launch.config_loader.to_dict)
    weights_endpoint: str  # where to fetch weights ("" = in the learner's process)
    version: int  # newest policy version now
    heartbeat_seconds: float  # how often each side sends a Heartbeat
    concurrency: int  # prompts per engine call the controller wants now

    def validate(self) -> None:
        _check_nonempty("Welcome", session=self.session)
        _check_at_least("Welcome", 0, version=self.version)
        _check_at_least("Welcome", 1, concurrency=self.concurrency)


class WorkRequest(_Message, kw_only=True, tag="work_request"):
    """An actor has room for `capacity` more prompts."""

    actor_id: str
    capacity: int

    def validate(self) -> None:
        _check_at_least("WorkRequest", 1, capacity=self.capacity)


class Grant(_Message, kw_only=True, tag="grant"):
    """Prompts the dispatcher admitted for one actor: generate with weights of at least `version`."""

    grant_id: str  # the groups that answer it carry this id
    prompt_indices: list[int]  # stream indices (the task builds prompt i from its own seed and i)
    prompt_ids: list[str]  # the matching prompt ids, checked by the actor against its task
    version: int  # newest policy version at admission: generate with this one or newer
    min_version: int  # oldest version the learner will still accept for these samples

    def validate(self) -> None:
        _check_nonempty("Grant", grant_id=self.grant_id, prompt_indices=self.prompt_indices)
        if len(self.prompt_indices) != len(self.prompt_ids):
            raise InvalidMessage(f"Grant.prompt_ids: has {len(self.prompt_ids)} ids for "
                                 f"{len(self.prompt_indices)} prompt_indices")
        _check_at_least("Grant", 0, version=self.version)


class Heartbeat(_Message, kw_only=True, tag="heartbeat"):
    """Either side is alive. An actor also says what it is doing (for liveness and metrics)."""

    sender: str  # actor_id, or "learner"
    session: str = ""  # the learner's session as the sender knows it ("" before a Welcome)
    version: int = 0  # learner: newest version; actor: the version of the weights it holds
    phase: str = ""  # actor: idle | weights | generating | scoring | sending
    phase_seconds: float = 0.0  # actor: how long it has been in that phase
    generate_seconds: float = 0.0  # actor: cumulative time inside engine calls
    engine_stats: dict[str, float] = {}  # actor: its engine's cumulative counters, e.g. {"sglang/syncs": 3.0}

    def validate(self) -> None:
        for name, v in self.engine_stats.items():
            if not math.isfinite(v):
                raise InvalidMessage(f"Heartbeat.engine_stats[{name!r}]: must be finite, got {v}")


class Goodbye(_Message, kw_only=True, tag="goodbye"):
    """An actor leaves: its prompts still in flight go back to the stream."""

    actor_id: str
    reason: str = ""
    error: bool = False  # it is leaving because it failed (reason holds the exception)


class Reset(_Message, kw_only=True, tag="reset"):
    """The dispatcher does not know the sender (e.g. the learner restarted): drop any work from an
    older session and say Hello again."""

    session: str
    reason: str = ""


Message = RolloutGroup | WeightsPublished | WeightsRequest | Control | Hello | Welcome | WorkRequest \
    | Grant | Heartbeat | Goodbye | Reset
MESSAGE_TYPES: tuple[type, ...] = (RolloutGroup, WeightsPublished, WeightsRequest, Control, Hello, Welcome,
                                   WorkRequest, Grant, Heartbeat, Goodbye, Reset)

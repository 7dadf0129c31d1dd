"""Typed messages that actors and the learner exchange.

Messages are frozen msgspec Structs in one tagged union (`Message`); the tag travels in the field
`type`. Fields are plain Python lists and scalars, except the per-token fields of a RolloutGroup,
which are packed little-endian arrays (`Ragged`): a 16x1024-token group decodes to four buffers,
not 50k Python numbers. Either way a message means the same thing on every host.

Each message checks its own consistency in `validate()`, which also runs on construction and on
decode (msgspec calls `__post_init__` in both cases), so an inconsistent message is rejected at the
sender as well as at the receiver. A failure is an `InvalidMessage` naming the field and, for
per-completion fields, the index.
"""

from __future__ import annotations

import math
import struct
from typing import NoReturn

import msgspec
import numpy as np
from msgspec.structs import force_setattr

from cadence.protocols.bytechecks import all_finite_float32, all_nonnegative_int32, all_zero_or_one
from cadence.protocols.errors import InvalidMessage
from cadence.protocols.ragged import DTYPES, Packed, Ragged


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


# The per-token fields of a RolloutGroup and the element type each travels as.
RAGGED_FIELDS = {"completion_tokens": "int32", "behavior_logprobs": "float32", "policy_mask": "bool",
                 "kept_logmass": "float32"}


_RAGGED_NAMES = tuple(RAGGED_FIELDS)  # completion_tokens first
_PER_COMPLETION = ("behavior_logprobs", "rewards", "exact_match", "policy_mask", "reward_errors", "kept_logmass")
_WHAT = {"behavior_logprobs": "logprobs", "policy_mask": "entries", "kept_logmass": "values"}  # per token


class RolloutGroup(_Message, kw_only=True, tag="rollout_group"):
    """One prompt's G sampled completions with their behavior logprobs and rewards.

    The per-token fields are `Ragged` (protocols/ragged.py) and the prompt ids `Packed`: one
    little-endian buffer each, read as NumPy views (`.values`, `.lengths`, `[i]`). The constructor
    also takes lists (or arrays) and packs them: prompt_tokens=[1, 2], completion_tokens=[[5, 6], [7]].
    """

    prompt_id: str  # stable id of the prompt (used to track prompts in flight)
    task: str  # name of the task that supplied the prompt and scored the completions
    prompt_tokens: Packed  # [P] int32 prompt token ids
    completion_tokens: Ragged  # [G][T_g] int32 each completion's ids, up to and including EOS
    behavior_logprobs: Ragged  # [G][T_g] float32 logprob of each sampled id under the engine
    rewards: list[float]  # [G] one scalar reward per completion
    policy_version: int  # weights version that produced the completions
    actor_id: str  # which actor sent the group
    timings: EngineTimings
    exact_match: list[bool] | None = None  # [G] optional: did the answer match exactly
    grant_id: str = ""  # the dispatcher's grant this group answers ("" outside the dispatcher protocol)
    # [G][T_g] bool optional: True where the policy sampled the token (trained on), False for tokens
    # an environment put in the context (tool output: masked out of the loss). None: all True.
    policy_mask: Ragged | None = None
    reward_errors: list[str] | None = None  # [G] optional: "" or why scoring failed (the reward is then 0)
    task_metrics: dict[str, list[float]] | None = None  # optional: the task's own per-completion metrics, [G] each
    # [G][T_g] float32 optional: log of the probability mass the sampler's top-p nucleus kept at
    # each token (<= 0; 0 on tokens the policy did not sample): the token was drawn with probability
    # exp(behavior_logprob - kept_logmass), and -kept_logmass is KL(truncated || full) of that
    # step. None: no truncation, or not reported.
    kept_logmass: Ragged | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_tokens, Packed):  # a list or array of ids: pack it
            try:
                force_setattr(self, "prompt_tokens", Packed.pack(self.prompt_tokens, "int32"))
            except (ValueError, TypeError) as e:
                raise InvalidMessage(f"RolloutGroup.prompt_tokens: {e}") from None
        for field, dtype in RAGGED_FIELDS.items():
            value = getattr(self, field)
            if value is not None and not isinstance(value, Ragged):  # lists of rows: pack them
                try:
                    force_setattr(self, field, Ragged.pack(value, dtype))
                except (ValueError, TypeError) as e:
                    raise InvalidMessage(f"RolloutGroup.{field}: {e}") from None
        self.validate()

    @property
    def group_size(self) -> int:
        """Number of completions G in the group."""
        return len(self.completion_tokens)

    def validate(self) -> None:
        """Raises InvalidMessage unless the per-completion fields agree in length and are sane.

        Checks: G >= 1; behavior_logprobs, rewards (and exact_match, policy_mask, reward_errors,
        kept_logmass, each task_metrics list if given) have G entries; each completion has as many
        logprobs (and policy_mask entries, kept log-masses) as ids; each per-token field has its
        dtype and row lengths that fit its data; ids are >= 0; logprobs, kept log-masses, rewards
        and task metrics are finite; policy_mask holds only True/False; policy_version >= 0;
        prompt_id is non-empty.

        This runs on every group the learner receives, where it was most of the receiving cost, so
        a valid group passes one quick screen (`_passes`, ~2 us at 8x8) and only a group that fails
        it gets the full check that names the problem (`_check`); the screen never passes a group
        the full check rejects.
        """
        if not self._passes():
            self._check()

    def _passes(self) -> bool:
        """True only for a valid group (see validate); False means: run the full check."""
        prompt, tokens, logprobs = self.prompt_tokens, self.completion_tokens, self.behavior_logprobs
        lengths, data = tokens.row_lengths, tokens.data
        group_size = len(lengths) >> 2
        if not (self.prompt_id and self.policy_version >= 0
                and prompt.dtype == "int32" and not len(prompt.data) & 3 and all_nonnegative_int32(prompt.data)
                and tokens.dtype == "int32" and group_size and not len(lengths) & 3
                and all_nonnegative_int32(lengths) and len(data) == 4 * _sum_int32(lengths)
                and all_nonnegative_int32(data)
                and logprobs.dtype == "float32" and logprobs.row_lengths == lengths
                and len(logprobs.data) == len(data) and all_finite_float32(logprobs.data)
                and len(self.rewards) == group_size and math.isfinite(sum(self.rewards))):
            return False  # a finite sum means every term is finite (NaN or inf would carry through)
        if self.exact_match is not None and len(self.exact_match) != group_size:
            return False
        if self.reward_errors is not None and len(self.reward_errors) != group_size:
            return False
        if (mask := self.policy_mask) is not None and not (
                mask.dtype == "bool" and mask.row_lengths == lengths and 4 * len(mask.data) == len(data)
                and all_zero_or_one(mask.data)):
            return False
        if (kept := self.kept_logmass) is not None and not (
                kept.dtype == "float32" and kept.row_lengths == lengths and len(kept.data) == len(data)
                and all_finite_float32(kept.data)):
            return False
        for values in (self.task_metrics or {}).values():
            if len(values) != group_size or not math.isfinite(sum(values)):
                return False
        return True

    def _check(self) -> None:
        """The full check, one condition at a time: raises InvalidMessage naming the field."""
        name = "RolloutGroup"
        if not self.prompt_id:
            raise InvalidMessage(f"{name}.prompt_id: must be non-empty")
        if self.policy_version < 0:
            raise InvalidMessage(f"{name}.policy_version: must be >= 0, got {self.policy_version}")
        prompt = self.prompt_tokens
        if prompt.dtype != "int32" or len(prompt.data) % 4:
            raise InvalidMessage(f"{name}.prompt_tokens: must be int32 ({len(prompt.data)} bytes of "
                                 f"{prompt.dtype!r} given)")
        if not all_nonnegative_int32(prompt.data):
            raise InvalidMessage(f"{name}.prompt_tokens: token ids must be >= 0")
        tokens = self.completion_tokens
        ragged = [(f, v) for f in _RAGGED_NAMES if (v := getattr(self, f)) is not None]
        for field, value in ragged:
            if value.dtype != RAGGED_FIELDS[field]:
                raise InvalidMessage(f"{name}.{field}: dtype must be {RAGGED_FIELDS[field]}, got {value.dtype!r}")
            if len(value.row_lengths) % 4:
                raise InvalidMessage(f"{name}.{field}: row_lengths holds {len(value.row_lengths)} bytes, "
                                     f"not a whole number of int32")
        total = _check_row_lengths(name, "completion_tokens", tokens)
        group_size = len(tokens)
        if group_size < 1:
            raise InvalidMessage(f"{name}.completion_tokens: a group needs at least 1 completion")
        for field in _PER_COMPLETION:
            values = getattr(self, field)
            if values is not None and len(values) != group_size:
                _wrong_count(name, field, values, group_size)
        for key, values in (self.task_metrics or {}).items():
            if len(values) != group_size:
                _wrong_count(name, f"task_metrics[{key!r}]", values, group_size)
            if not all(map(math.isfinite, values)):
                raise InvalidMessage(f"{name}.task_metrics[{key!r}]: values must be finite")
        for field, value in ragged[1:]:  # the fields after completion_tokens
            if value.row_lengths != tokens.row_lengths:  # a bytes compare: the same lengths, same total
                _check_row_lengths(name, field, value)
                have, want = value.lengths, tokens.lengths
                i = int(np.flatnonzero(have != want)[0])
                raise InvalidMessage(f"{name}.{field}[{i}]: has {have[i]} {_WHAT[field]} for "
                                     f"{want[i]} tokens in completion_tokens[{i}]")
            if total * DTYPES[value.dtype].itemsize != len(value.data):
                _wrong_size(name, field, value, total)
        if not all_nonnegative_int32(tokens.data):
            i, _ = _row_of(tokens, int(np.argmax(tokens.values < 0)))
            raise InvalidMessage(f"{name}.completion_tokens[{i}]: token ids must be >= 0")
        if not all_finite_float32(self.behavior_logprobs.data):
            _not_finite(name, "behavior_logprobs", self.behavior_logprobs, at_token=True)
        if self.kept_logmass is not None and not all_finite_float32(self.kept_logmass.data):
            _not_finite(name, "kept_logmass", self.kept_logmass, at_token=False)
        if self.policy_mask is not None and not all_zero_or_one(self.policy_mask.data):
            mask = self.policy_mask.values.view(np.uint8)
            i, j = _row_of(self.policy_mask, int(np.argmax(mask > 1)))
            raise InvalidMessage(f"{name}.policy_mask[{i}][{j}]: must be True or False, got byte {mask.max()}")
        i = next((i for i, r in enumerate(self.rewards) if not math.isfinite(r)), None)
        if i is not None:
            raise InvalidMessage(f"{name}.rewards[{i}]: must be finite, got {self.rewards[i]}")


def _sum_int32(data: bytes) -> int:
    """The sum of little-endian int32s: a group's G row lengths. Python ints for the usual handful
    (cheaper than a NumPy call), NumPy for many; the unpackers kept are bounded, as a peer picks G."""
    n = len(data) >> 2
    if n > _UNPACK_MAX:
        return int(np.frombuffer(data, "<i4").sum(dtype=np.int64))
    unpack = _UNPACK_INT32S.get(n)
    if unpack is None:
        unpack = _UNPACK_INT32S[n] = struct.Struct(f"<{n}i").unpack  # group sizes repeat: keep them
    return sum(unpack(data))


_UNPACK_MAX = 256
_UNPACK_INT32S: dict[int, object] = {}


def _wrong_count(name: str, field: str, values, group_size: int) -> NoReturn:
    raise InvalidMessage(f"{name}.{field}: has {len(values)} entries for {group_size} completions "
                         f"in completion_tokens")


def _check_row_lengths(name: str, field: str, value: Ragged) -> int:
    """Row lengths >= 0 that fill the field's data; returns their sum."""
    lengths = value.row_lengths
    if not all_nonnegative_int32(lengths):
        i = int(np.argmax(value.lengths < 0))
        raise InvalidMessage(f"{name}.{field}[{i}]: negative row length")
    total = _sum_int32(lengths)
    if total * DTYPES[value.dtype].itemsize != len(value.data):
        _wrong_size(name, field, value, total)
    return total


def _wrong_size(name: str, field: str, value: Ragged, total: int) -> NoReturn:
    itemsize = DTYPES[value.dtype].itemsize
    raise InvalidMessage(f"{name}.{field}: row lengths sum to {total} values but data holds "
                         f"{len(value.data) / itemsize:g}")


def _not_finite(name: str, field: str, value: Ragged, at_token: bool) -> None:
    values = value.values
    i, j = _row_of(value, int(np.argmax(~np.isfinite(values))))
    where = f"[{i}][{j}]" if at_token else f"[{i}]"
    got = f", got {float(values[value.offsets[i] + j])}" if at_token else ""
    raise InvalidMessage(f"{name}.{field}{where}: must be finite{got}")


def _row_of(value: Ragged, flat: int) -> tuple[int, int]:
    """(row, column) of flat index `flat` into value.values."""
    offsets = value.offsets
    i = int(np.searchsorted(offsets, flat, side="right")) - 1
    return i, flat - int(offsets[i])


class WeightsPublished(_Message, kw_only=True, tag="weights_published"):
    """The learner announces a new weights version that actors should sample from."""

    version: int  # policy version of the new weights
    step: int  # learner optimizer step that produced them
    location: str  # where to find them: "inproc", a checkpoint path or a weights endpoint
    published_at: float  # time.time() at publication
    tensors: list[TensorSpec] | None = None  # a weights transfer: the arrays whose frames follow
    # a transfer in buckets (a sharded learner streams its shards): this is bucket `bucket` of
    # `buckets`; the actor asks for the next one (WeightsRequest.bucket) until it has them all
    bucket: int = 0
    buckets: int = 1

    def validate(self) -> None:
        """Raises InvalidMessage if version or step is negative or location is empty."""
        for field in ("version", "step"):
            value = getattr(self, field)
            if value < 0:
                raise InvalidMessage(f"WeightsPublished.{field}: must be >= 0, got {value}")
        if not self.location:
            raise InvalidMessage("WeightsPublished.location: must be non-empty")
        if not 0 <= self.bucket < max(self.buckets, 1):
            raise InvalidMessage(f"WeightsPublished.bucket: {self.bucket} is not in [0, {self.buckets})")


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One array of a weights transfer: its tree path, dtype and shape, sent as `frames` raw frames.

    A piece of a larger array (a learner's shard, streamed without assembling the whole) also
    names where it sits: `offset` (its first index on each axis) in an array of shape `whole`."""

    path: str
    dtype: str  # numpy dtype name, e.g. "float32", "bfloat16"
    shape: list[int]
    frames: int  # raw frames that follow for it (big arrays are chunked)
    offset: list[int] | None = None  # None: the whole array
    whole: list[int] | None = None


class WeightsRequest(_Message, kw_only=True, tag="weights_request"):
    """An actor asks for the newest weights; the answer is a WeightsPublished header with `tensors`
    set, followed by the raw frames, or the header alone when `have_version` is already the newest."""

    have_version: int = -1  # the version the actor holds (-1: none)
    # the next bucket of a transfer in progress: of `version` (bucket 0 starts one, of the newest)
    version: int = -1
    bucket: int = 0


class Control(_Message, kw_only=True, tag="control"):
    """The learner tells actors to change their concurrency or to stop; None means unchanged.

    Earlier versions also carried `batch_size` and `max_staleness`, never sent or read (actors do
    not need B: admission is the dispatcher's). Both were optional with a None default, so the
    schema version stays: an older peer's Control still decodes here (unknown fields are ignored)
    and ours decodes there (the missing fields take their default).
    """

    concurrency: int | None = None  # new number of prompts an actor keeps in flight
    stop: bool = False  # finish in-flight work and exit
    reason: str = ""  # why (with stop: "finished", "hung: ..."), for the actor's log

    def validate(self) -> None:
        """Raises InvalidMessage if a given setting is out of range."""
        if self.concurrency is not None and self.concurrency < 1:
            raise InvalidMessage(f"Control.concurrency: must be >= 1, got {self.concurrency}")


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
    # silence after which each side counts the other gone (0: an older dispatcher did not say)
    heartbeat_timeout_seconds: float = 0.0
    # the other learner processes' weight servers, each serving the pieces its devices hold: a
    # version is whole with weights_endpoint's pieces and theirs (protocols/weights_wire.fetch_all)
    weights_shards: list[str] = []

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
    # The learner session that granted it: work of an older session is void. A dispatcher before
    # this field sent ids "<session>-<n>": decoding such a Grant fills the field from its id.
    session: str = ""

    def __post_init__(self) -> None:
        if not self.session and "-" in self.grant_id:
            force_setattr(self, "session", self.grant_id.rsplit("-", 1)[0])
        self.validate()

    def validate(self) -> None:
        _check_nonempty("Grant", grant_id=self.grant_id, prompt_indices=self.prompt_indices)
        if len(self.prompt_indices) != len(self.prompt_ids):
            raise InvalidMessage(f"Grant.prompt_ids: has {len(self.prompt_ids)} ids for "
                                 f"{len(self.prompt_indices)} prompt_indices")
        _check_at_least("Grant", 0, version=self.version)


class EvalGrant(_Message, kw_only=True, tag="eval_grant"):
    """Held-out evaluation as work: greedy completions of these held-out prompts (the actor builds
    task.heldout() itself; index i is its i-th prompt) with exactly weights `version`, scored
    by the task's reward and answered with one EvalResult."""

    eval_id: str  # the EvalResult that answers it carries this id
    prompt_indices: list[int]  # positions in the task's held-out set
    prompt_ids: list[str]  # the matching prompt ids, checked by the actor against its task
    version: int  # the weights version to evaluate (the learner's newest while it waits)
    session: str  # the learner session that issued it: work of an older session is void

    def validate(self) -> None:
        _check_nonempty("EvalGrant", eval_id=self.eval_id, prompt_indices=self.prompt_indices,
                        session=self.session)
        if len(self.prompt_indices) != len(self.prompt_ids):
            raise InvalidMessage(f"EvalGrant.prompt_ids: has {len(self.prompt_ids)} ids for "
                                 f"{len(self.prompt_indices)} prompt_indices")
        if min(self.prompt_indices) < 0:
            raise InvalidMessage(f"EvalGrant.prompt_indices: must be >= 0, got {min(self.prompt_indices)}")
        _check_at_least("EvalGrant", 0, version=self.version)


class EvalResult(_Message, kw_only=True, tag="eval_result"):
    """One EvalGrant's scores, per prompt in the grant's order: the reward, exact match (None: the
    task has no reference answer), the task's own metrics and why scoring failed ("" if it did
    not), as the task's Score had them before the learner's aggregation (actors/evaluation.py)."""

    eval_id: str
    actor_id: str
    version: int  # the weights version the completions came from
    prompt_indices: list[int]  # the grant's, in its order
    rewards: list[float]
    exact_match: list[bool | None]
    reward_errors: list[str]
    task_metrics: dict[str, list[float]] = {}  # a metric some prompts lack is 0.0 there (as the mean reads it)
    generate_seconds: float = 0.0  # engine time of the grant
    num_tokens: int = 0  # completion tokens generated

    def validate(self) -> None:
        _check_nonempty("EvalResult", eval_id=self.eval_id, prompt_indices=self.prompt_indices)
        _check_at_least("EvalResult", 0, version=self.version, num_tokens=self.num_tokens)
        n = len(self.prompt_indices)
        for field in ("rewards", "exact_match", "reward_errors"):
            if len(getattr(self, field)) != n:
                raise InvalidMessage(f"EvalResult.{field}: has {len(getattr(self, field))} entries for "
                                     f"{n} prompt_indices")
        i = next((i for i, r in enumerate(self.rewards) if not math.isfinite(r)), None)
        if i is not None:
            raise InvalidMessage(f"EvalResult.rewards[{i}]: must be finite, got {self.rewards[i]}")
        for key, values in self.task_metrics.items():
            if len(values) != n:
                raise InvalidMessage(f"EvalResult.task_metrics[{key!r}]: has {len(values)} entries for "
                                     f"{n} prompt_indices")
            if not all(map(math.isfinite, values)):
                raise InvalidMessage(f"EvalResult.task_metrics[{key!r}]: values must be finite")
        if not (math.isfinite(self.generate_seconds) and self.generate_seconds >= 0):
            raise InvalidMessage(f"EvalResult.generate_seconds: must be finite and >= 0, got {self.generate_seconds}")


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
    | Grant | Heartbeat | Goodbye | Reset | EvalGrant | EvalResult
MESSAGE_TYPES: tuple[type, ...] = (RolloutGroup, WeightsPublished, WeightsRequest, Control, Hello, Welcome,
                                   WorkRequest, Grant, Heartbeat, Goodbye, Reset, EvalGrant, EvalResult)

"""Tests for protocols.codec: round trips and every way bytes can be wrong."""

import json
import pickle
import random

import msgspec
import numpy as np
import pytest

from cadence.protocols.codec import DEFAULT_MAX_BYTES, MAGIC, SCHEMA_VERSION, Codec, decode, encode
from cadence.protocols.errors import (
    ForeignMessage,
    InvalidMessage,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaVersionMismatch,
)
from cadence.protocols.messages import Control, EngineTimings, Grant, RolloutGroup, WeightsPublished, Welcome
from cadence.protocols.ragged import Ragged


def make_group(**overrides) -> RolloutGroup:
    timings = EngineTimings(
        queued_at=100.0, started_at=100.5, finished_at=102.0, generate_seconds=1.5,
        num_tokens=5, engine="sglang",
    )
    fields = dict(
        prompt_id="gsm8k-17", task="gsm8k", prompt_tokens=[5, 6, 7],
        completion_tokens=[[1, 2], [3, 4, 2]],
        behavior_logprobs=[[-0.5, -0.25], [-1.0, -0.125, -2.0]],
        rewards=[1.0, 0.0], policy_version=3, actor_id="actor-0", timings=timings,
    )
    fields.update(overrides)
    return RolloutGroup(**fields)


EXAMPLES = [
    make_group(),
    make_group(exact_match=[True, False]),
    WeightsPublished(version=4, step=40, location="/ckpt/step_40", published_at=1.7e9),
    Control(),
    Control(concurrency=32, stop=True, reason="finished"),
]


def envelope(body, magic=MAGIC, version=SCHEMA_VERSION) -> bytes:
    """Hand-built wire bytes around a plain (dict) body."""
    return msgspec.msgpack.encode([magic, version, body])


def wire(rows, dtype: str) -> list:
    """A per-token field as it travels: [dtype, row_lengths bytes, data bytes]."""
    return msgspec.to_builtins(Ragged.pack(rows, dtype), builtin_types=(bytes,))


def group_body(**changes) -> dict:
    body = msgspec.to_builtins(make_group(), builtin_types=(bytes,))
    body.update(changes)
    return body


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_of_every_message_type(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg


def test_float32_logprobs_survive_exactly():
    logprobs = [[-0.1, -1e-12], [-123.456789012345, -2.0**-40, -7.0]]
    sent = make_group(behavior_logprobs=logprobs)
    back = decode(encode(sent))
    assert back.behavior_logprobs == sent.behavior_logprobs
    assert back.behavior_logprobs.tolist() == [[float(np.float32(x)) for x in row] for row in logprobs]


def test_per_token_fields_travel_as_little_endian_bin():
    raw = msgspec.msgpack.decode(encode(make_group()))
    dtype, lengths, data = raw[2]["completion_tokens"]
    assert dtype == "int32" and isinstance(lengths, bytes) and isinstance(data, bytes)
    assert np.frombuffer(lengths, "<i4").tolist() == [2, 3]
    assert np.frombuffer(data, "<i4").tolist() == [1, 2, 3, 4, 2]
    assert raw[2]["behavior_logprobs"][0] == "float32"


def test_wire_format_is_the_versioned_envelope():
    raw = msgspec.msgpack.decode(encode(Control(stop=True)))
    assert raw[:2] == ["cadence", 2]
    assert raw[2]["type"] == "control" and raw[2]["stop"] is True


def test_decode_accepts_bytearray_and_memoryview():
    data = encode(EXAMPLES[0])
    assert decode(bytearray(data)) == EXAMPLES[0]
    assert decode(memoryview(data)) == EXAMPLES[0]


def test_decode_rejects_str_and_encode_rejects_non_messages():
    with pytest.raises(TypeError, match="decode expects bytes, got str"):
        decode(encode(Control()).decode("latin-1"))
    with pytest.raises(TypeError, match="cannot encode dict: not a Cadence message"):
        encode({"type": "control"})


def test_a_group_mutated_into_inconsistency_is_rejected_by_the_receiver():
    group = make_group()
    group.rewards.append(0.5)
    data = encode(group)  # construction validated it; encode does not pay for that twice
    with pytest.raises(InvalidMessage, match="rewards: has 3 entries for 2 completions"):
        decode(data)


def test_every_truncation_is_rejected_as_truncated():
    data = encode(make_group(exact_match=[True, False]))
    for cut in range(len(data)):
        with pytest.raises(MalformedMessage) as info:
            decode(data[:cut])
        assert str(info.value).startswith("truncated message:"), (cut, str(info.value))
        assert f"{cut} bytes" in str(info.value)


def test_trailing_garbage_is_malformed():
    with pytest.raises(MalformedMessage, match="malformed message:.*trailing"):
        decode(encode(Control()) + b"\x00")


def test_oversized_message_is_rejected_naming_both_sizes():
    data = encode(make_group())
    small = Codec(max_bytes=len(data) - 1)
    with pytest.raises(MessageTooLarge) as info:
        small.decode(data)
    assert str(info.value) == f"message too large: {len(data)} bytes, over max_bytes {len(data) - 1}"
    with pytest.raises(MessageTooLarge, match=f"rollout_group is {len(data)} bytes, over max_bytes"):
        small.encode(make_group())
    assert Codec(max_bytes=len(data)).decode(data) == make_group()  # the limit is inclusive
    assert DEFAULT_MAX_BYTES >= 1 << 20


def test_codec_rejects_nonpositive_max_bytes():
    with pytest.raises(ValueError, match="max_bytes: must be >= 1, got 0"):
        Codec(max_bytes=0)


@pytest.mark.parametrize("version", [0, 1, 99])
def test_wrong_schema_version_is_rejected_naming_both_versions(version):
    with pytest.raises(SchemaVersionMismatch) as info:
        decode(envelope(group_body(), version=version))
    assert str(info.value) == (
        f"schema version mismatch: message has version {version}, this codec speaks version 2"
    )


def test_wrong_version_is_reported_even_if_the_body_changed_shape():
    old = msgspec.to_builtins(make_group())  # schema 1: per-token fields were lists of lists
    old["completion_tokens"], old["behavior_logprobs"] = [[1, 2], [3, 4, 2]], [[-0.5, -0.25], [-1.0, -0.125, -2.0]]
    with pytest.raises(SchemaVersionMismatch, match="has version 1, this codec speaks version 2"):
        decode(envelope(old, version=1))
    with pytest.raises(SchemaVersionMismatch, match="has version 3"):
        decode(envelope({"type": "rollout_group_v3", "tokens": "packed"}, version=3))


def test_wrong_magic_is_foreign():
    with pytest.raises(ForeignMessage, match="foreign message: magic 'other' is not 'cadence'"):
        decode(envelope(group_body(), magic="other"))


@pytest.mark.parametrize("seed", range(20))
def test_random_bytes_are_rejected(seed):
    data = random.Random(seed).randbytes(64)
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert isinstance(info.value, (MalformedMessage, ForeignMessage))
    text = str(info.value)
    assert text.startswith(("truncated message:", "malformed message:", "foreign message:")), text


@pytest.mark.parametrize(
    "value",
    [
        {"prompt_id": "p", "tokens": [1, 2]},  # a map, not our envelope
        [1, 2, 3],  # an array of the wrong types
        ["cadence", 1],  # too short
        "cadence",
        42,
    ],
    ids=["map", "int-array", "short-envelope", "str", "int"],
)
def test_valid_msgpack_of_another_shape_is_foreign(value):
    with pytest.raises(ForeignMessage, match="foreign message: not a Cadence envelope"):
        decode(msgspec.msgpack.encode(value))


@pytest.mark.parametrize("text", [json.dumps(msgspec.to_builtins(make_group())), "[1, 2]"])
def test_json_is_rejected_with_a_hint(text):
    with pytest.raises(ProtocolError, match="looks like JSON"):
        decode(text.encode())


def test_pickle_is_rejected():
    with pytest.raises(ProtocolError):
        decode(pickle.dumps(make_group()))


def test_unknown_message_type_is_foreign_and_lists_known_ones():
    with pytest.raises(ForeignMessage) as info:
        decode(envelope({"type": "gradient", "values": [1.0]}))
    assert str(info.value) == (
        "foreign message: unknown message type 'gradient' "
        "(known: rollout_group, weights_published, weights_request, control, hello, welcome, "
        "work_request, grant, heartbeat, goodbye, reset, eval_grant, eval_result)"
    )


@pytest.mark.parametrize(
    "body, expected",
    [({"prompt_id": "p"}, "body has no 'type' field"), ([1, 2], "body is not a map")],
)
def test_body_without_a_tag_is_foreign(body, expected):
    with pytest.raises(ForeignMessage, match=expected):
        decode(envelope(body))


def test_logprob_token_length_mismatch_is_rejected_at_decode():
    body = group_body(behavior_logprobs=wire([[-0.5, -0.25], [-1.0, -0.125, -2.0, -0.5]], "float32"))
    with pytest.raises(InvalidMessage) as info:
        decode(envelope(body))
    assert str(info.value) == (
        "invalid message: RolloutGroup.behavior_logprobs[1]: "
        "has 4 logprobs for 3 tokens in completion_tokens[1]"
    )


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"policy_version": "3"}, r"Expected `int`, got `str` - at `\$.policy_version`"),
        ({"completion_tokens": [[1, 2], [3, 4, 2]]},  # lists of lists: the old shape
         r"Expected `array` of at least length 3, got 2 - at `\$.completion_tokens`"),
        ({"timings": {"engine": "jax"}}, r"missing required field `queued_at` - at `\$.timings`"),
    ],
)
def test_mistyped_field_is_rejected_naming_the_field(changes, expected):
    with pytest.raises(InvalidMessage, match=r"invalid rollout_group message: .*" + expected):
        decode(envelope(group_body(**changes)))


def test_missing_field_is_rejected_naming_it():
    body = group_body()
    del body["rewards"]
    with pytest.raises(InvalidMessage, match="invalid rollout_group message: .*`rewards`"):
        decode(envelope(body))


def test_nested_validation_error_keeps_its_path():
    body = group_body()
    body["timings"]["num_tokens"] = -1
    with pytest.raises(InvalidMessage) as info:
        decode(envelope(body))
    assert "EngineTimings.num_tokens: must be >= 0, got -1" in str(info.value)
    assert "`$.timings`" in str(info.value)


def test_unknown_extra_fields_are_ignored():
    body = group_body(added_in_a_minor_change=[1, 2, 3])
    assert decode(envelope(body)) == make_group()


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("completion_tokens", ["float32", np.array([2, 3], "<i4").tobytes(), bytes(20)],
         "RolloutGroup.completion_tokens: dtype must be int32, got 'float32'"),
        ("completion_tokens", ["int32", np.array([2, 3], "<i4").tobytes(), bytes(16)],
         "RolloutGroup.completion_tokens: row lengths sum to 5 values but data holds 4"),
        ("completion_tokens", ["int32", np.array([2, -3], "<i4").tobytes(), bytes(0)],
         "RolloutGroup.completion_tokens[1]: negative row length"),
        ("behavior_logprobs", ["float32", b"\x02\x00\x00", bytes(20)],
         "RolloutGroup.behavior_logprobs: row_lengths holds 3 bytes, not a whole number of int32"),
        ("completion_tokens", wire([[1, 2], [3, -4, 2]], "int32"),
         "RolloutGroup.completion_tokens[1]: token ids must be >= 0"),
        ("behavior_logprobs", wire([[-0.5, -0.25], [-1.0, float("nan"), -2.0]], "float32"),
         "RolloutGroup.behavior_logprobs[1][1]: must be finite, got nan"),
    ],
    ids=["dtype", "short-data", "negative-length", "ragged-lengths-bytes", "negative-id", "nan"],
)
def test_inconsistent_packed_field_is_rejected_at_decode(field, value, expected):
    with pytest.raises(InvalidMessage) as info:
        decode(envelope(group_body(**{field: value})))
    assert expected in str(info.value)


class _ControlBefore(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="control"):
    """Control as peers before this version had it (batch_size and max_staleness, never used)."""

    batch_size: int | None = None
    concurrency: int | None = None
    max_staleness: int | None = None
    stop: bool = False
    reason: str = ""


class _GrantBefore(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="grant"):
    grant_id: str
    prompt_indices: list[int]
    prompt_ids: list[str]
    version: int
    min_version: int


class _WelcomeBefore(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="welcome"):
    session: str
    config: dict
    weights_endpoint: str
    version: int
    heartbeat_seconds: float
    concurrency: int


def test_messages_of_the_previous_shape_still_decode_both_ways():
    # Control lost two optional fields and Grant gained one, without a schema bump: an older
    # peer's messages decode here, and ours decode there.
    old = _ControlBefore(batch_size=256, concurrency=32, max_staleness=2, stop=True, reason="finished")
    assert decode(envelope(msgspec.to_builtins(old))) == Control(concurrency=32, stop=True, reason="finished")
    ours = msgspec.msgpack.decode(encode(Control(concurrency=8)))
    assert msgspec.convert(ours[2], _ControlBefore) == _ControlBefore(concurrency=8)
    old_grant = _GrantBefore(grant_id="5e55i0n-4", prompt_indices=[1], prompt_ids=["t/train/1"], version=3,
                             min_version=2)
    assert decode(envelope(msgspec.to_builtins(old_grant))).session == "5e55i0n"
    ours = msgspec.msgpack.decode(encode(Grant(grant_id="s-1", prompt_indices=[1], prompt_ids=["t/train/1"],
                                               version=3, min_version=2, session="s")))
    assert msgspec.convert(ours[2], _GrantBefore).grant_id == "s-1"
    # Welcome gained the learner's heartbeat timeout: 0 from an older dispatcher (the actor keeps its own)
    old_welcome = _WelcomeBefore(session="s", config={}, weights_endpoint="", version=0, heartbeat_seconds=1.0,
                                 concurrency=4)
    assert decode(envelope(msgspec.to_builtins(old_welcome))).heartbeat_timeout_seconds == 0.0
    ours = msgspec.msgpack.decode(encode(Welcome(session="s", config={}, weights_endpoint="", version=0,
                                                 heartbeat_seconds=1.0, concurrency=4, heartbeat_timeout_seconds=9.0)))
    assert msgspec.convert(ours[2], _WelcomeBefore).concurrency == 4

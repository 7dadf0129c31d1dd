"""Tests for protocols.messages: construction-time validation of every message type."""

import math

import msgspec
import numpy as np
import pytest

from cadence.protocols.errors import InvalidMessage, ProtocolError
from cadence.protocols.codec import MAGIC, SCHEMA_VERSION, decode, encode
from cadence.protocols.ragged import Ragged
from cadence.protocols.messages import (
    MESSAGE_TYPES,
    Control,
    EngineTimings,
    EvalGrant,
    EvalResult,
    Goodbye,
    Grant,
    Heartbeat,
    Hello,
    Reset,
    RolloutGroup,
    WeightsPublished,
    WeightsRequest,
    Welcome,
    WorkRequest,
)


def make_timings(**overrides) -> EngineTimings:
    fields = dict(
        queued_at=100.0, started_at=100.5, finished_at=102.0, generate_seconds=1.5,
        num_tokens=5, engine="jax",
    )
    fields.update(overrides)
    return EngineTimings(**fields)


def make_group(**overrides) -> RolloutGroup:
    fields = dict(
        prompt_id="gsm8k-17", task="gsm8k", prompt_tokens=[5, 6, 7],
        completion_tokens=[[1, 2], [3, 4, 2]],
        behavior_logprobs=[[-0.5, -0.25], [-1.0, -0.125, -2.0]],
        rewards=[1.0, 0.0], policy_version=3, actor_id="actor-0", timings=make_timings(),
    )
    fields.update(overrides)
    return RolloutGroup(**fields)


def test_valid_group_keeps_its_fields():
    group = make_group(exact_match=[True, False], kept_logmass=[[-0.1, 0.0], [0.0, -0.2, -0.05]])
    assert group.kept_logmass[1].tolist() == pytest.approx([0.0, -0.2, -0.05]) and make_group().kept_logmass is None
    assert group.group_size == 2
    assert group.completion_tokens[1].tolist() == [3, 4, 2]
    assert group.completion_tokens.values.dtype == np.int32 and group.behavior_logprobs.values.dtype == np.float32
    assert group.completion_tokens.lengths.tolist() == [2, 3]
    assert group.exact_match == [True, False]
    assert make_group().exact_match is None


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # SGLang was seen returning more logprobs than tokens.
        ({"behavior_logprobs": [[-0.5, -0.25], [-1.0, -0.125, -2.0, -3.0]]},
         "behavior_logprobs[1]: has 4 logprobs for 3 tokens in completion_tokens[1]"),
        ({"behavior_logprobs": [[-0.5], [-1.0, -0.125, -2.0]]},
         "behavior_logprobs[0]: has 1 logprobs for 2 tokens in completion_tokens[0]"),
        ({"behavior_logprobs": [[-0.5, -0.25]]},
         "behavior_logprobs: has 1 entries for 2 completions in completion_tokens"),
        ({"rewards": [1.0, 0.0, 1.0]}, "rewards: has 3 entries for 2 completions in completion_tokens"),
        ({"exact_match": [True]}, "exact_match: has 1 entries for 2 completions in completion_tokens"),
        ({"completion_tokens": [], "behavior_logprobs": [], "rewards": []},
         "completion_tokens: a group needs at least 1 completion"),
        ({"completion_tokens": [[1, 2], [3, -4, 2]]}, "completion_tokens[1]: token ids must be >= 0"),
        ({"prompt_tokens": [5, -1]}, "prompt_tokens: token ids must be >= 0"),
        ({"behavior_logprobs": [[-0.5, math.nan], [-1.0, -0.125, -2.0]]},
         "behavior_logprobs[0][1]: must be finite, got nan"),
        ({"behavior_logprobs": [[-0.5, -0.25], [-1.0, -math.inf, -2.0]]},
         "behavior_logprobs[1][1]: must be finite, got -inf"),
        ({"rewards": [1.0, math.inf]}, "rewards[1]: must be finite, got inf"),
        ({"policy_version": -1}, "policy_version: must be >= 0, got -1"),
        ({"prompt_id": ""}, "prompt_id: must be non-empty"),
        ({"kept_logmass": [[-0.1, 0.0]]}, "kept_logmass: has 1 entries for 2 completions in completion_tokens"),
        ({"kept_logmass": [[-0.1, 0.0], [0.0, -0.2]]},
         "kept_logmass[1]: has 2 values for 3 tokens in completion_tokens[1]"),
        ({"kept_logmass": [[-0.1, math.nan], [0.0, -0.2, 0.0]]}, "kept_logmass[0]: must be finite"),
    ],
)
def test_inconsistent_group_is_rejected_naming_field_and_index(overrides, expected):
    with pytest.raises(InvalidMessage) as info:
        make_group(**overrides)
    assert str(info.value) == f"RolloutGroup.{expected}"


def test_invalid_message_is_a_protocol_error_and_a_value_error():
    with pytest.raises(ProtocolError):
        make_group(rewards=[1.0])
    with pytest.raises(ValueError):
        make_group(rewards=[1.0])


def test_empty_completion_is_allowed():
    group = make_group(completion_tokens=[[], [1]], behavior_logprobs=[[], [-0.5]])
    assert group.group_size == 2


def test_validate_catches_lists_mutated_after_construction():
    group = make_group()
    group.rewards.append(1.0)
    with pytest.raises(InvalidMessage, match=r"rewards: has 3 entries for 2"):
        group.validate()


def test_packed_fields_are_read_only():
    group = make_group()
    with pytest.raises(ValueError, match="read-only"):
        group.behavior_logprobs[0][0] = 1.0


def test_packed_and_list_construction_agree():
    from cadence.protocols.ragged import Ragged
    packed = make_group(completion_tokens=Ragged.pack([np.array([1, 2]), np.array([3, 4, 2])], "int32"),
                        behavior_logprobs=Ragged.pack([[-0.5, -0.25], [-1.0, -0.125, -2.0]], "float32"))
    assert packed == make_group()


def test_unpackable_value_names_the_field():
    with pytest.raises(InvalidMessage, match=r"RolloutGroup.completion_tokens: cannot pack rows as int32"):
        make_group(completion_tokens=[[1, 2**40], [3, 4, 2]])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"num_tokens": -1}, "EngineTimings.num_tokens: must be >= 0, got -1"),
        ({"generate_seconds": -0.5}, "EngineTimings.generate_seconds: must be finite and >= 0"),
        ({"generate_seconds": math.nan}, "EngineTimings.generate_seconds: must be finite and >= 0"),
    ],
)
def test_bad_timings_are_rejected(overrides, expected):
    with pytest.raises(InvalidMessage, match=expected):
        make_timings(**overrides)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"version": -1}, "WeightsPublished.version: must be >= 0, got -1"),
        ({"step": -2}, "WeightsPublished.step: must be >= 0, got -2"),
        ({"location": ""}, "WeightsPublished.location: must be non-empty"),
    ],
)
def test_bad_weights_published_is_rejected(overrides, expected):
    fields = dict(version=4, step=40, location="inproc", published_at=123.0)
    fields.update(overrides)
    with pytest.raises(InvalidMessage) as info:
        WeightsPublished(**fields)
    assert str(info.value) == expected


def test_control_defaults_mean_unchanged():
    control = Control()
    assert (control.concurrency, control.stop, control.reason) == (None, False, "")


def test_bad_control_is_rejected():
    with pytest.raises(InvalidMessage) as info:
        Control(concurrency=0)
    assert str(info.value) == "Control.concurrency: must be >= 1, got 0"


def test_grant_carries_its_session():
    g = Grant(grant_id="s1-3", prompt_indices=[4], prompt_ids=["t/train/4"], version=0, min_version=0, session="s1")
    assert g.session == "s1" and decode(encode(g)).session == "s1"
    # a Grant from a dispatcher before the field: its id "<session>-<n>" gives the session
    old = Grant(grant_id="0a1b2c-17", prompt_indices=[4], prompt_ids=["t/train/4"], version=0, min_version=0)
    assert old.session == "0a1b2c"


def test_messages_are_frozen_and_keyword_only():
    group = make_group()
    with pytest.raises(AttributeError):
        group.policy_version = 4
    with pytest.raises(TypeError):
        WeightsPublished(4, 40, "inproc", 123.0)


def test_message_types_have_distinct_tags_in_the_type_field():
    examples = [make_group(), WeightsPublished(version=1, step=2, location="inproc", published_at=0.0),
                WeightsRequest(have_version=3), Control(stop=True), Hello(actor_id="a", capacity=2),
                Welcome(session="s", config={}, weights_endpoint="", version=0, heartbeat_seconds=1.0,
                        concurrency=1),
                WorkRequest(actor_id="a", capacity=1),
                Grant(grant_id="g", prompt_indices=[4], prompt_ids=["t/train/4"], version=0, min_version=0),
                Heartbeat(sender="a", engine_stats={"sglang/syncs": 2.0}), Goodbye(actor_id="a"), Reset(session="s"),
                EvalGrant(eval_id="e", prompt_indices=[0, 3], prompt_ids=["t/heldout/0", "t/heldout/3"], version=2,
                          session="s"),
                EvalResult(eval_id="e", actor_id="a", version=2, prompt_indices=[0, 3], rewards=[1.0, 0.0],
                           exact_match=[True, None], reward_errors=["", "timeout"], task_metrics={"len": [6.0, 2.0]},
                           generate_seconds=0.5, num_tokens=12)]
    assert [type(m) for m in examples] == list(MESSAGE_TYPES)
    tags = [msgspec.to_builtins(m)["type"] for m in examples]
    assert tags == ["rollout_group", "weights_published", "weights_request", "control", "hello", "welcome",
                    "work_request", "grant", "heartbeat", "goodbye", "reset", "eval_grant", "eval_result"]
    for m in examples:  # every kind survives the wire
        assert decode(encode(m)) == m


@pytest.mark.parametrize("make, field", [
    (lambda: Hello(actor_id="", capacity=1), "Hello.actor_id"),
    (lambda: Hello(actor_id="a", capacity=0), "Hello.capacity"),
    (lambda: Grant(grant_id="g", prompt_indices=[], prompt_ids=[], version=0, min_version=0), "Grant.prompt_indices"),
    (lambda: Grant(grant_id="g", prompt_indices=[1, 2], prompt_ids=["x"], version=0, min_version=0),
     "Grant.prompt_ids"),
    (lambda: WorkRequest(actor_id="a", capacity=0), "WorkRequest.capacity"),
    (lambda: Heartbeat(sender="a", engine_stats={"sglang/syncs": float("nan")}), "Heartbeat.engine_stats"),
    (lambda: EvalGrant(eval_id="", prompt_indices=[0], prompt_ids=["x"], version=0, session="s"), "EvalGrant.eval_id"),
    (lambda: EvalGrant(eval_id="e", prompt_indices=[], prompt_ids=[], version=0, session="s"),
     "EvalGrant.prompt_indices"),
    (lambda: EvalGrant(eval_id="e", prompt_indices=[-1], prompt_ids=["x"], version=0, session="s"),
     "EvalGrant.prompt_indices"),
    (lambda: EvalGrant(eval_id="e", prompt_indices=[0, 1], prompt_ids=["x"], version=0, session="s"),
     "EvalGrant.prompt_ids"),
    (lambda: EvalGrant(eval_id="e", prompt_indices=[0], prompt_ids=["x"], version=-1, session="s"), "EvalGrant.version"),
    (lambda: _eval_result(rewards=[1.0]), "EvalResult.rewards"),
    (lambda: _eval_result(rewards=[1.0, float("inf")]), r"EvalResult.rewards\[1\]"),
    (lambda: _eval_result(exact_match=[True]), "EvalResult.exact_match"),
    (lambda: _eval_result(reward_errors=[""]), "EvalResult.reward_errors"),
    (lambda: _eval_result(task_metrics={"len": [1.0]}), r"EvalResult.task_metrics\['len'\]"),
    (lambda: _eval_result(task_metrics={"len": [1.0, float("nan")]}), r"EvalResult.task_metrics\['len'\]"),
    (lambda: _eval_result(generate_seconds=-1.0), "EvalResult.generate_seconds"),
    (lambda: _eval_result(version=-1), "EvalResult.version"),
])
def test_dispatcher_messages_name_the_bad_field(make, field):
    with pytest.raises(InvalidMessage, match=field):
        make()


def _eval_result(**overrides):
    fields = dict(eval_id="e", actor_id="a", version=1, prompt_indices=[0, 1], rewards=[1.0, 0.0],
                  exact_match=[True, False], reward_errors=["", ""])
    return EvalResult(**{**fields, **overrides})


def test_a_bad_eval_result_is_rejected_at_the_receiver_too():
    assert decode(encode(_eval_result())) == _eval_result()
    raw = msgspec.msgpack.encode([MAGIC, SCHEMA_VERSION, {"type": "eval_result", "eval_id": "e", "actor_id": "a",
                                  "version": 1, "prompt_indices": [0, 1], "rewards": [1.0],
                                  "exact_match": [True, False], "reward_errors": ["", ""]}])
    with pytest.raises(InvalidMessage, match="EvalResult.rewards"):
        decode(raw)


def test_optional_task_fields_round_trip_and_are_checked():
    from cadence.protocols.codec import MAGIC, SCHEMA_VERSION, decode, encode

    group = make_group(policy_mask=[[True, True], [True, False, True]], reward_errors=["", "timeout"],
                       task_metrics={"tool_use": [1.0, 0.0]})
    back = decode(encode(group))
    assert back.policy_mask.tolist() == [[True, True], [True, False, True]]
    assert back.reward_errors == ["", "timeout"] and back.task_metrics == {"tool_use": [1.0, 0.0]}
    for overrides, expected in [
        ({"policy_mask": [[True, True], [True]]}, r"policy_mask\[1\]: has 1 entries for 3 tokens"),
        ({"policy_mask": [[True, True]]}, r"policy_mask: has 1 entries for 2 completions"),
        ({"reward_errors": [""]}, r"reward_errors: has 1 entries"),
        ({"task_metrics": {"x": [1.0]}}, r"task_metrics\['x'\]: has 1 entries"),
        ({"task_metrics": {"x": [1.0, math.nan]}}, r"task_metrics\['x'\]: values must be finite"),
    ]:
        with pytest.raises(InvalidMessage, match=expected):
            make_group(**overrides)


def test_a_receiver_without_the_optional_fields_still_decodes_the_group():
    """Optional fields need no schema bump: an older decoder ignores them."""
    class OldGroup(msgspec.Struct, kw_only=True, tag="rollout_group", tag_field="type"):
        prompt_id: str
        rewards: list[float]

    new = make_group(policy_mask=[[True, True], [True, False, True]], reward_errors=["", "error"])
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldGroup)
    assert old.rewards == [1.0, 0.0]


def _fuzzed_groups(seed: int, n: int):
    """Valid groups with every optional field, each with one field replaced by random bytes or values."""
    from msgspec.structs import force_setattr
    from cadence.protocols.ragged import Packed

    rng = np.random.default_rng(seed)
    base = make_group(exact_match=[True, False], policy_mask=[[True, True], [True, False, True]],
                      reward_errors=["", "x"], task_metrics={"m": [1.0, 0.5]},
                      kept_logmass=[[-0.1, 0.0], [0.0, -0.2, -0.05]])
    specials = [0.0, -1.5, math.nan, math.inf, -math.inf, 1e308]

    def raw(size):
        return rng.integers(0, 256, size, dtype=np.uint8).tobytes()

    def row_lengths():
        return rng.choice([np.array(v, "<i4").tobytes() for v in ([2, 3], [3, 2], [2], [2, 3, 0], [-1, 6], [5, 0])]
                          + [b"\x02\x00\x00", b""])

    for _ in range(n):
        field = rng.choice(["prompt_tokens", "completion_tokens", "behavior_logprobs", "policy_mask",
                            "kept_logmass", "rewards", "exact_match", "reward_errors", "task_metrics"])
        group = msgspec.structs.replace(base)
        dtype = str(rng.choice(["int32", "float32", "bool", "int64"]))
        if field == "prompt_tokens":
            value = Packed(dtype, raw(int(rng.choice([0, 3, 12, 13]))))
        elif field in ("completion_tokens", "behavior_logprobs", "policy_mask", "kept_logmass"):
            size = int(rng.choice([5, 19, 20, 21, 4000]))
            value = Ragged(dtype if rng.random() < 0.5 else {"completion_tokens": "int32", "policy_mask": "bool"}
                           .get(field, "float32"), row_lengths(), raw(size))
        elif field == "rewards":
            value = [float(rng.choice(specials)) for _ in range(int(rng.integers(0, 4)))]
        elif field == "task_metrics":
            value = {"m": [float(rng.choice(specials)) for _ in range(int(rng.integers(1, 4)))]}
        else:
            value = [getattr(base, field)[0]] * int(rng.integers(0, 4))
        force_setattr(group, field, value)
        yield group


@pytest.mark.parametrize("seed", range(4))
def test_the_quick_screen_never_passes_a_group_the_full_check_rejects(seed):
    """validate() trusts RolloutGroup._passes for the common case: it must be sound, and it must
    pass valid groups (or every group would pay for the full check)."""
    verdicts = {"both reject": 0, "both pass": 0, "full check only": 0}
    for group in _fuzzed_groups(seed, 500):
        try:
            group._check()
            valid = True
        except InvalidMessage:
            valid = False
        passes = group._passes()
        assert not passes or valid, f"screen passed an invalid group: {group!r}"
        verdicts["both pass" if passes else "both reject" if not valid else "full check only"] += 1
    assert verdicts["both reject"] > 100 and verdicts["both pass"] > 10, verdicts
    assert verdicts["full check only"] <= verdicts["both pass"] // 4, verdicts  # finite overflowing sums only


def test_many_completions_are_checked_like_few():
    lengths = [3] * 299 + [2]
    group = make_group(completion_tokens=[[1] * n for n in lengths], behavior_logprobs=[[-0.5] * n for n in lengths],
                       rewards=[0.0] * 300)
    assert group._passes() and group.completion_tokens.lengths.sum() == 899
    with pytest.raises(InvalidMessage, match=r"completion_tokens: row lengths sum to 899 values but data holds 900"):
        make_group(completion_tokens=Ragged("int32", group.completion_tokens.row_lengths, bytes(3600)),
                   behavior_logprobs=group.behavior_logprobs, rewards=[0.0] * 300)


def test_valid_groups_pass_the_quick_screen():
    rng = np.random.default_rng(0)
    for g in (1, 4, 16, 300):  # 300: beyond the cached row-length unpackers
        lengths = rng.integers(0, 600 if g < 100 else 20, g)
        group = make_group(completion_tokens=[rng.integers(0, 50000, n).tolist() for n in lengths],
                           behavior_logprobs=[(-rng.exponential(size=n)).tolist() for n in lengths],
                           policy_mask=[rng.random(n) < 0.8 for n in lengths], rewards=[0.5] * g,
                           kept_logmass=[np.zeros(n) for n in lengths], exact_match=[False] * g)
        assert group._passes()

"""SampleLedger: each stream index in exactly one state; impossible transitions raise."""
import dataclasses

import pytest

from cadence.protocols.ledger import LedgerError, SampleLedger
from cadence.protocols.messages import EngineTimings, RolloutGroup


@dataclasses.dataclass(frozen=True)
class P:
    prompt_id: str
    index: int


def group(i):
    t = EngineTimings(queued_at=0.0, started_at=0.0, finished_at=1.0, generate_seconds=1.0, num_tokens=2,
                      engine="jax")
    return RolloutGroup(prompt_id=f"t/train/{i}", task="t", prompt_tokens=[1, 5], completion_tokens=[[4, 2]] * 2,
                        behavior_logprobs=[[-0.5, -0.1]] * 2, rewards=[1.0, 0.0], policy_version=3,
                        actor_id="a", timings=t)


def prompts(lo, hi):
    return [P(f"t/train/{i}", i) for i in range(lo, hi)]


def test_lifecycle_and_verify():
    led = SampleLedger()
    led.warmup(2)
    led.issue(prompts(2, 8))
    for i in range(2, 7):
        led.queue(group(i))
    led.consume(group(2), 1)
    led.consume(group(3), 1)
    led.drop(group(4), "stale")
    counts = led.verify(8)
    assert counts == {"warmup": 2, "in_flight": 1, "queued": 2, "consumed": 2, "dropped": 1,
                      "dropped_by_reason": {"stale": 1}}
    with pytest.raises(LedgerError, match="unaccounted"):
        led.verify(9)  # index 8 was handed out by the stream but never issued


def test_impossible_transitions_raise():
    led = SampleLedger()
    led.issue(prompts(0, 2))
    led.queue(group(0))
    led.consume(group(0), 1)
    with pytest.raises(LedgerError, match="consumed twice"):
        led.consume(group(0), 2)
    with pytest.raises(LedgerError, match="not in flight"):
        led.queue(group(5))
    with pytest.raises(LedgerError, match="issued twice"):
        led.issue(prompts(1, 2))
    with pytest.raises(LedgerError, match="not queued"):
        led.drop(group(1), "stale")


def test_state_dict_round_trip_keeps_queued_groups_and_is_a_copy():
    led = SampleLedger()
    led.issue(prompts(0, 4))
    led.queue(group(0))
    led.queue(group(1))
    led.consume(group(0), 1)
    d = led.state_dict()
    led.queue(group(2))  # later mutations do not leak into the saved copy
    back = SampleLedger.from_state_dict(d)
    assert list(back.queued) == ["t/train/1"] and back.queued["t/train/1"] == group(1)
    assert back.in_flight == {"t/train/2": 2, "t/train/3": 3}
    assert back.consumed == {"t/train/0": 1}
    # a resume re-issues the in-flight ones: verify accounts for them as pending
    pending = sorted(back.in_flight.values())
    back.in_flight.clear()
    assert back.verify(4, pending)["queued"] == 1



def test_a_checkpoint_with_queued_groups_of_an_older_schema_fails_naming_it():
    import base64

    import msgspec

    led = SampleLedger()
    led.issue(prompts(0, 2))
    led.queue(group(0))
    d = led.state_dict()
    old_body = msgspec.to_builtins(group(0))  # schema 1 sent the per-token fields as lists of lists
    old_body["completion_tokens"], old_body["behavior_logprobs"] = [[4, 2]] * 2, [[-0.5, -0.1]] * 2
    d["queued"] = [base64.b64encode(msgspec.msgpack.encode(["cadence", 1, old_body])).decode("ascii")]
    with pytest.raises(LedgerError, match=r"checkpoint ledger: queued group 0 was saved in another wire schema "
                                          r"\(schema version mismatch: message has version 1, this codec speaks "
                                          r"version 2\)"):
        SampleLedger.from_state_dict(d)

def test_settled_prompts_compact_into_a_watermark_and_counts_stay_exact():
    led = SampleLedger(recent=8)
    led.warmup(3)
    n = 1000
    led.issue(prompts(3, n))
    for i in range(3, n - 2):  # the last two stay in flight
        led.queue(group(i))
        if i % 10 == 0:
            led.drop(group(i), "stale")
        elif i < n - 5:  # three stay queued
            led.consume(group(i), i)
    counts = led.verify(n)
    assert counts["consumed"] == sum(1 for i in range(3, n - 5) if i % 10) and counts["queued"] == 3
    assert counts["dropped_by_reason"] == {"stale": sum(1 for i in range(3, n - 2) if i % 10 == 0)}
    assert counts["in_flight"] == 2
    state = led.state_dict()
    # bounded: the recent settled prompts plus the queued and in-flight ones, not every prompt ever
    assert len(state["index_of"]) <= 8 + 3 + 2 and state["watermark"] > n - 20
    back = SampleLedger.from_state_dict(state, recent=8)
    assert back.verify(n) == counts
    with pytest.raises(LedgerError, match="issued twice"):
        back.issue(prompts(5, 6))  # below the watermark: settled long ago


def test_a_checkpoint_that_listed_every_settled_prompt_compacts_on_load():
    led = SampleLedger(recent=10_000)
    led.issue(prompts(0, 300))
    for i in range(300):
        led.queue(group(i))
        led.consume(group(i), 1)
    old = led.state_dict()
    del old["watermark"], old["settled_consumed"], old["settled_dropped"]  # the format before compaction
    back = SampleLedger.from_state_dict(old, recent=16)
    assert back.watermark == 300 - 16 and back.verify(300)["consumed"] == 300


def test_release_returns_an_actors_prompts_for_reissue():
    led = SampleLedger()
    led.issue(prompts(0, 4))
    assert led.release(["t/train/1", "t/train/3"]) == [1, 3]
    assert led.verify(4, pending_reissue=[1, 3])["in_flight"] == 2
    with pytest.raises(LedgerError, match="unaccounted"):
        led.verify(4)  # released without being re-issued: lost
    with pytest.raises(LedgerError, match="released but was not in flight"):
        led.release(["t/train/1"])
    led.issue(prompts(1, 2))  # handed out again
    assert led.verify(4, pending_reissue=[3])["in_flight"] == 3

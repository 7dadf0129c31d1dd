"""SampleLedger: each stream index in exactly one state; impossible transitions raise."""
import dataclasses

import pytest

from protocols.ledger import LedgerError, SampleLedger
from protocols.messages import EngineTimings, RolloutGroup


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

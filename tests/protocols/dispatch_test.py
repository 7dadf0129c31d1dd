"""Dispatcher bookkeeping (no sockets): grants within the staleness bound, groups accepted only for a
live grant, gone and hung actors' prompts re-issued, the ledger accounting for every prompt."""
import pytest

from cadence.actors.prompt_stream import PromptStream
from cadence.actors.tasks.registry import make_task
from cadence.actors.tasks.config import TaskConfig
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.messages import (
    Control,
    EngineTimings,
    Goodbye,
    Grant,
    Heartbeat,
    Hello,
    Reset,
    RolloutGroup,
    Welcome,
    WorkRequest,
)

G = 2
A, B = (0, b"a"), (1, b"b")


class Rig:
    def __init__(self, batch_size=4, max_staleness=0, **settings):
        self.task = make_task(TaskConfig(name="sort", num_digits=3, heldout_size=4))
        self.stream, self.ledger = PromptStream(self.task), SampleLedger()
        self.gate = AdmissionGate(batch_size, max_staleness)
        self.version = 0
        self.delivered, self.gone, self.hung = [], [], []
        self.core = Dispatcher(self.stream, self.ledger, self.gate,
                               DispatchSettings(group_size=G, config={"x": 1}, **settings),
                               deliver=self.delivered.append, version_fn=lambda: self.version,
                               on_actor_gone=lambda *a: self.gone.append(a), on_hung=lambda *a: self.hung.append(a))

    def hello(self, peer, actor_id, now=0.0):
        (out,) = self.core.handle(peer, Hello(actor_id=actor_id, capacity=4), now)
        return out[1]

    def request(self, peer, actor_id, n, now=0.0):
        return self.core.handle(peer, WorkRequest(actor_id=actor_id, capacity=n), now)

    def group(self, grant, i, version=None):
        t = EngineTimings(queued_at=0, started_at=0, finished_at=0, generate_seconds=0, num_tokens=4, engine="jax")
        tokens = list(self.task.prompt(grant.prompt_indices[i]).tokens)  # the granted prompt's
        return RolloutGroup(prompt_id=grant.prompt_ids[i], task="t", prompt_tokens=tokens, completion_tokens=[[3, 2]] * G,
                            behavior_logprobs=[[-1.0, -1.0]] * G, rewards=[1.0] * G, actor_id="x", timings=t,
                            policy_version=grant.version if version is None else version, grant_id=grant.grant_id)


def test_hello_is_welcomed_with_the_config_and_grants_respect_the_staleness_bound():
    r = Rig(batch_size=4, max_staleness=0)  # synchronous: only the next batch (2 groups) may be generated
    w = r.hello(A, "a")
    assert isinstance(w, Welcome) and w.config == {"x": 1} and w.session == r.core.session
    (peer, grant), = r.request(A, "a", 8)
    assert peer == A and isinstance(grant, Grant) and len(grant.prompt_indices) == 2 and grant.version == 0
    assert grant.prompt_ids == [r.task.prompt(i).prompt_id for i in grant.prompt_indices]
    assert r.request(A, "a", 8) == []  # the bound is reached: the request waits
    for i in range(2):
        assert r.core.handle(A, r.group(grant, i), 1.0) == []
    assert [g.prompt_id for g in r.delivered] == grant.prompt_ids and r.ledger.counts()["queued"] == 2
    r.gate.take_batch(4)
    assert r.core.regrant() == []  # version 0 is still the newest: the next batch needs version 1
    r.version = 1
    (_, grant2), = r.core.regrant()  # the waiting request is served once the version moves
    assert grant2.version == 1 and grant2.prompt_indices == [2, 3]


def test_a_group_for_no_live_grant_is_dropped_and_counted():
    r = Rig(max_staleness=4)
    r.hello(A, "a")
    (_, grant), = r.request(A, "a", 2)
    g = r.group(grant, 0)
    r.core.handle(A, g, 0)
    r.core.handle(A, g, 0)  # the same answer twice
    forged = RolloutGroup(**{**{f: getattr(g, f) for f in g.__struct_fields__}, "grant_id": "other-1"})
    r.core.handle(A, forged, 0)
    assert len(r.delivered) == 1 and r.core.counts["late_groups"] == 2
    # from a peer the dispatcher does not know: told to start over
    (peer, reset), = r.core.handle(B, r.group(grant, 1), 0)
    assert peer == B and isinstance(reset, Reset) and r.core.counts["late_groups"] == 3


def test_a_silent_actor_is_gone_and_its_prompts_are_reissued_first():
    r = Rig(max_staleness=4, heartbeat_timeout_seconds=5.0)
    r.hello(A, "a")
    r.hello(B, "b")
    (_, ga), = r.request(A, "a", 3)
    r.core.handle(A, r.group(ga, 0), 1.0)  # one of three answered
    issued = r.gate.issued
    r.core.handle(B, Heartbeat(sender="b"), 4.0)
    r.core.tick(6.5)  # a: silent for 5.5 s; b: 2.5 s
    assert [g[0] for g in r.gone] == ["a"] and "no heartbeat" in r.gone[0][1]
    assert r.gate.issued == issued - 2 * G and r.core.counts["reissued"] == 2
    assert r.stream.pending_reissue == ga.prompt_indices[1:]
    r.ledger.verify(r.stream.position, r.stream.pending_reissue)
    (_, gb), = r.request(B, "b", 3, now=6.0)
    assert gb.prompt_indices[:2] == ga.prompt_indices[1:]  # handed out again before anything fresh
    r.core.handle(A, r.group(ga, 1), 6.5)  # the gone actor's late answer: dropped, not consumed twice
    assert r.core.counts["late_groups"] == 1 and len(r.delivered) == 1


def test_goodbye_and_a_rejoin_return_the_prompts_in_flight():
    r = Rig(max_staleness=4)
    r.hello(A, "a")
    (_, g1), = r.request(A, "a", 2)
    r.hello(B, "a")  # the same actor restarted (new connection): its old work is void
    assert r.gone[-1][:2] == ("a", "rejoined") and r.stream.pending_reissue == g1.prompt_indices
    (_, g2), = r.request(B, "a", 2)
    assert g2.prompt_indices == g1.prompt_indices
    r.core.handle(B, Goodbye(actor_id="a", reason="SIGTERM"), 1.0)
    assert r.gone[-1][:2] == ("a", "left: SIGTERM") and "a" not in r.core.actors
    r.ledger.verify(r.stream.position, r.stream.pending_reissue)
    assert r.hello(A, "a") and r.hello(A, "a")  # a repeated Hello is answered, not a rejoin
    assert r.core.counts["joined"] == 3


def test_an_actor_stuck_in_one_phase_with_prompts_is_hung():
    r = Rig(max_staleness=4, liveness_timeout_seconds=30.0)
    r.hello(A, "a")
    (_, grant), = r.request(A, "a", 2)
    r.core.handle(A, Heartbeat(sender="a", phase="scoring", phase_seconds=0.0), 1.0)
    for t in (10.0, 20.0, 30.0):  # heartbeats keep coming: alive, but no progress
        r.core.handle(A, Heartbeat(sender="a", phase="scoring", phase_seconds=t - 1.0), t)
        assert not r.hung and not [m for _, m in r.core.tick(t) if isinstance(m, Control)]
    r.core.handle(A, Heartbeat(sender="a", phase="scoring", phase_seconds=39.5), 40.5)
    out = r.core.tick(40.5)
    (actor_id, detail), = r.hung
    assert actor_id == "a" and "no progress for 40 s while scoring" in detail and grant.prompt_ids[0] in detail
    assert "actors.liveness_timeout_seconds=30" in detail
    assert any(isinstance(m, Control) and m.stop for _, m in out)
    assert r.core.counts["reissued"] == 2


def test_queue_size_holds_back_grants_until_the_learner_takes_groups():
    r = Rig(batch_size=4, max_staleness=8, queue_size=2)
    r.hello(A, "a")
    (_, grant), = r.request(A, "a", 2)
    for i in range(2):
        r.core.handle(A, r.group(grant, i), 0)
    assert r.request(A, "a", 2) == []  # 2 groups wait for the learner: no more work
    for g in r.delivered:
        r.ledger.consume(g, 1)
    assert len(r.core.regrant()) == 1


def test_a_group_newer_than_the_learner_is_released_for_reissue():
    r = Rig(max_staleness=4)
    r.hello(A, "a")
    (_, grant), = r.request(A, "a", 1)
    out = r.core.handle(A, r.group(grant, 0, version=7), 0)  # weights from a timeline a resume rolled back
    assert not r.delivered and r.core.counts["bad_groups/future_version"] == 1
    assert [type(m) for _, m in out] == [Control] and out[0][1].stop  # cut off: it rejoins as a new connection
    assert r.stream.pending_reissue == grant.prompt_indices
    r.ledger.verify(r.stream.position, r.stream.pending_reissue)


def test_metrics_per_actor():
    r = Rig(max_staleness=4)
    r.hello(A, "a", now=0.0)
    (_, grant), = r.request(A, "a", 2)
    r.core.handle(A, r.group(grant, 0), 1.0)
    r.core.handle(A, Heartbeat(sender="a", version=0, phase="generating", engine_stats={"sglang/syncs": 2.0}), 1.5)
    r.version = 3
    m = r.core.metrics(2.0)
    assert m["actors/alive"] == 1 and m["actor/a/in_flight"] == 1 and m["actor/a/version_lag"] == 3
    assert m["actor/a/samples_per_second"] == pytest.approx(G / 2.0) and m["actor/a/heartbeat_age"] == 0.5
    # an actor process's engine counters (its heartbeats) and the engine that made each group
    assert m["actor/a/sglang/syncs"] == 2.0 and m["actors/groups/jax"] == 1 and "actors/groups/sglang" not in m

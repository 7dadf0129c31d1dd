"""Held-out evaluation as work for the actors: the dispatcher splits the held-out set into chunks,
hands them out before training prompts, re-issues the chunk of an actor that leaves, goes silent or
hangs, drops late answers, cuts off an actor whose answer is not what was granted, and tells the
waiter once every prompt has its score. Bookkeeping without sockets, then the same over real ZeroMQ
sockets with real clients."""
import functools
import threading

import pytest

from cadence.actors.prompt_stream import PromptStream
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.dispatch_client import DispatcherClient
from cadence.protocols.dispatch_server import DispatchServer
from cadence.protocols.eval_work import EvalWork
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.messages import Control, EvalGrant, EvalResult, Goodbye, Grant, Heartbeat, Hello, WorkRequest
from tests import waiting

G = 2
A, B = (0, b"a"), (1, b"b")
HELDOUT = 10


class Rig:
    def __init__(self, **settings):
        self.task = make_task(TaskConfig(name="sort", num_digits=3, heldout_size=HELDOUT))
        self.stream, self.ledger = PromptStream(self.task), SampleLedger()
        self.gate = AdmissionGate(8, 2)
        self.done = []
        self.bad = []
        self.core = Dispatcher(self.stream, self.ledger, self.gate, DispatchSettings(group_size=G, **settings),
                               deliver=lambda g: None, version_fn=lambda: 3,
                               on_bad_group=lambda *a: self.bad.append(a))
        self.ids = [p.prompt_id for p in self.task.heldout()]

    def hello(self, peer, actor_id, now=0.0):
        self.core.handle(peer, Hello(actor_id=actor_id, capacity=4), now)

    def start(self, parts=1, version=3):
        return self.core.start_eval(version, list(range(HELDOUT)), self.ids, parts, self.done.append)

    def ask(self, peer, actor_id, now=0.0):
        return self.core.handle(peer, WorkRequest(actor_id=actor_id, capacity=4), now)


def result(grant: EvalGrant, actor_id="a", version=None, reward=None, **kw) -> EvalResult:
    n = len(grant.prompt_indices)
    fields = dict(eval_id=grant.eval_id, actor_id=actor_id, version=grant.version if version is None else version,
                  prompt_indices=list(grant.prompt_indices),
                  rewards=[float(i) if reward is None else reward for i in grant.prompt_indices],
                  exact_match=[i % 2 == 0 for i in grant.prompt_indices], reward_errors=[""] * n,
                  task_metrics={"len": [1.0] * n})
    fields.update(kw)
    return EvalResult(**fields)


def test_chunks_go_first_one_per_actor_and_the_scores_come_back_in_held_out_order():
    r = Rig()
    r.hello(A, "a")
    r.hello(B, "b")
    assert r.start() == []  # nobody asked yet: nothing sent
    (peer, ga), = r.ask(A, "a")  # before any training prompt
    (_, gb), = r.ask(B, "b")
    assert peer == A and isinstance(ga, EvalGrant) and isinstance(gb, EvalGrant)
    assert ga.version == 3 and ga.session == r.core.session
    # split over the 2 live actors (more than the 1 part asked for), disjoint, covering the set
    assert sorted(ga.prompt_indices + gb.prompt_indices) == list(range(HELDOUT))
    assert len(ga.prompt_indices) == len(gb.prompt_indices) == 5
    assert ga.prompt_ids == [r.ids[i] for i in ga.prompt_indices]
    assert r.ledger.counts()["in_flight"] == 0  # the training stream was not touched
    # an actor holding a chunk gets training work next, not a second chunk
    (_, training), = r.ask(A, "a")
    assert isinstance(training, Grant)
    r.core.handle(B, result(gb, "b"), 0.0)
    assert not r.done
    r.core.handle(A, result(ga), 0.0)
    (job,) = r.done
    assert [s.reward for s in job.ordered()] == [float(i) for i in range(HELDOUT)]
    assert [s.exact_match for s in job.ordered()] == [i % 2 == 0 for i in range(HELDOUT)]
    assert all(s.metrics == {"len": 1.0} and s.error == "" for s in job.ordered())


def test_parts_split_the_set_even_before_the_actors_joined():
    work = EvalWork("s")
    job = work.start(0, list(range(10)), [f"p{i}" for i in range(10)], parts=3, on_done=lambda j: None)
    assert [len(c) for c in job.pending] == [4, 4, 2]


@pytest.mark.parametrize("leave", ["goodbye", "silent", "hung"])
def test_the_chunk_of_an_actor_that_leaves_goes_silent_or_hangs_is_reissued(leave):
    r = Rig(heartbeat_timeout_seconds=5.0, liveness_timeout_seconds=20.0)
    r.hello(A, "a")
    r.start()
    (_, first), = r.ask(A, "a")
    assert first.prompt_indices == list(range(HELDOUT))
    r.hello(B, "b", now=1.0)
    if leave == "goodbye":
        r.core.handle(A, Goodbye(actor_id="a", reason="killed"), 1.0)
    elif leave == "silent":
        r.core.handle(B, Heartbeat(sender="b"), 6.0)
        r.core.tick(6.0)
    else:  # heartbeats keep coming, but it stays in one phase while holding the chunk
        for t in (5.0, 10.0, 15.0, 20.0, 26.0):
            r.core.handle(A, Heartbeat(sender="a", phase="evaluating"), t)
            r.core.handle(B, Heartbeat(sender="b"), t)
        out = r.core.tick(26.0)
        (stop,) = [m for _, m in out if isinstance(m, Control) and m.stop]
        assert "while evaluating (a chunk of the held-out evaluation;" in stop.reason
    assert "a" not in r.core.actors and r.core.counts["eval_reissued"] == 1
    (_, again), = r.ask(B, "b", now=26.0)
    assert isinstance(again, EvalGrant) and again.prompt_indices == first.prompt_indices
    assert again.eval_id != first.eval_id  # a chunk id per hand-out: the old one's answer is late
    r.core.handle(B, result(again, "b"), 26.0)
    assert len(r.done) == 1 and r.core.metrics(26.0)["actors/eval_reissued"] == 1


def test_a_late_answer_is_dropped_and_a_wrong_one_cuts_the_actor_off():
    r = Rig()
    r.hello(A, "a")
    r.hello(B, "b")
    r.start()
    (_, ga), = r.ask(A, "a")
    (_, gb), = r.ask(B, "b")
    r.core.handle(A, result(gb, "a"), 0.0)  # not its chunk: late (e.g. from before a rejoin)
    assert r.core.evals.late == 1 and "a" in r.core.actors and not r.done
    out = r.core.handle(A, result(ga, "a", version=2), 0.0)  # another version than granted
    assert [type(m) for _, m in out] == [Control] and "evaluated version 2" in out[0][1].reason
    assert "a" not in r.core.actors and r.bad and r.core.counts["bad_eval_results"] == 1
    r.hello((0, b"c"), "c")
    (_, gc), = r.ask((0, b"c"), "c")
    assert gc.prompt_indices == ga.prompt_indices  # the cut-off actor's chunk, handed out again
    r.core.handle((0, b"c"), result(gc, "c"), 0.0)
    r.core.handle(B, result(gb, "b"), 0.0)
    assert len(r.done) == 1


def test_a_cancelled_evaluation_hands_out_nothing_more_and_its_answers_are_late():
    r = Rig()
    r.hello(A, "a")
    r.hello(B, "b")
    r.start()
    (_, ga), = r.ask(A, "a")
    r.core.evals.cancel()
    (_, gb), = r.ask(B, "b")
    assert isinstance(gb, Grant)
    r.core.handle(A, result(ga), 0.0)
    assert not r.done and r.core.evals.late == 1


# -- the same over real sockets -----------------------------------------------------------------
wait_for = functools.partial(waiting.wait_for, timeout=10.0, interval=0.02)


def test_over_zeromq_a_closed_client_s_chunk_is_finished_by_the_other(ctx):
    r = Rig(heartbeat_seconds=0.1, heartbeat_timeout_seconds=1.0)
    server = DispatchServer(r.core, ctx=ctx, external="tcp://127.0.0.1:0").start()
    stop = threading.Event()
    clients = [DispatcherClient(server.endpoint, name, 4, ctx=ctx, heartbeat_seconds=0.1,
                                learner_timeout_seconds=1.0).start() for name in ("p0", "p1")]
    try:
        assert all(c.wait_welcome(5) for c in clients)
        done = threading.Event()
        server.call(lambda core: core.start_eval(3, list(range(HELDOUT)), r.ids, 2, lambda job: done.set()))
        # call() runs on the server's thread: a request answered before it would get training work
        wait_for(lambda: r.core.evals.job is not None, what="the evaluation to start")
        g0 = clients[0].request(4, stop, timeout=5)
        assert isinstance(g0, EvalGrant) and len(g0.prompt_indices) == 5
        clients[0].close("killed")  # leaves with its chunk unanswered
        got = []
        while len(got) < 2:  # the other client answers its chunk and then the re-issued one
            g = clients[1].request(4, stop, timeout=5)
            if isinstance(g, EvalGrant):
                got.append(g.prompt_indices)
                assert clients[1].send_eval(result(g, "p1"), g)
        assert g0.prompt_indices in got
        wait_for(done.is_set, what="the evaluation to finish")
        with server.lock:
            job = r.core.evals.job
            assert [s.reward for s in job.ordered()] == [float(i) for i in range(HELDOUT)] and job.reissued == 1
    finally:
        stop.set()
        for c in clients:
            c.close()
        server.stop()


def test_an_evaluation_that_fails_on_every_actor_ends_naming_the_last_error():
    r = Rig()
    r.start()
    for n in range(3):
        peer = (0, f"p{n}".encode())
        r.hello(peer, f"p{n}")
        (_, g), = r.ask(peer, f"p{n}")
        assert isinstance(g, EvalGrant) and not r.done
        r.core.handle(peer, Goodbye(actor_id=f"p{n}", reason=f"ValueError: broken reward {n}", error=True), 0.0)
    (job,) = r.done
    assert job.failed.startswith("3 actors failed evaluating version 3") and "broken reward 2" in job.failed
    r.hello(A, "a")
    (_, g), = r.ask(A, "a")
    assert isinstance(g, Grant)  # training goes on being handed out (the learner decides to stop)

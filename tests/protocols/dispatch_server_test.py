"""The dispatcher over real ZeroMQ sockets (inproc and tcp on 127.0.0.1): clients join, get grants,
send groups; bad bytes are counted and dropped; Curve keeps strangers out; a restarted learner is
rejoined with no work carried across."""
import contextlib
import functools
import os
import threading
import time

import msgspec
import zmq

from cadence.actors.prompt_stream import PromptStream
from cadence.actors.tasks.registry import make_task
from cadence.actors.tasks.config import TaskConfig
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.codec import MAGIC, SCHEMA_VERSION, encode
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.dispatch_server import DispatchServer
from cadence.protocols.dispatch_client import DispatcherClient
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.messages import EngineTimings, RolloutGroup
from cadence.protocols.transport import InProcessTransport
from cadence.protocols.zmq_transport import write_keys
from tests import waiting

G = 2


wait_for = functools.partial(waiting.wait_for, timeout=10.0, interval=0.02)


class Learner:
    """A dispatcher with its real ledger, gate and stream, delivering into a queue."""

    def __init__(self, ctx, external="tcp://127.0.0.1:0", keys=None, max_bytes=1 << 20, heartbeat_seconds=0.1,
                 **settings):
        self.task = make_task(TaskConfig(name="sort", num_digits=3, heldout_size=4))
        self.stream, self.ledger = PromptStream(self.task), SampleLedger()
        self.gate = AdmissionGate(64, 8)
        self.queue = InProcessTransport()
        settings.setdefault("heartbeat_timeout_seconds", 1.0)
        s = DispatchSettings(group_size=G, heartbeat_seconds=heartbeat_seconds, **settings)
        self.core = Dispatcher(self.stream, self.ledger, self.gate, s, deliver=self.queue.put, version_fn=lambda: 0)
        self.server = DispatchServer(self.core, ctx=ctx, external=external, keys=keys, max_bytes=max_bytes).start()
        self.gate.on_change = self.server.wake


TASK = make_task(TaskConfig(name="sort", num_digits=3, heldout_size=4))


def answer(grant, i):
    t = EngineTimings(queued_at=0, started_at=0, finished_at=0, generate_seconds=0, num_tokens=2, engine="jax")
    tokens = list(TASK.prompt(grant.prompt_indices[i]).tokens)  # the granted prompt's
    return RolloutGroup(prompt_id=grant.prompt_ids[i], task="t", prompt_tokens=tokens, completion_tokens=[[3]] * G,
                        behavior_logprobs=[[-1.0]] * G, rewards=[0.5] * G, policy_version=0, actor_id="c",
                        timings=t, grant_id=grant.grant_id)


def client(ctx, endpoint, name, **kw):
    return DispatcherClient(endpoint, name, 4, ctx=ctx, heartbeat_seconds=0.1, learner_timeout_seconds=1.0, **kw).start()


def test_an_actor_takes_the_run_s_heartbeat_settings_from_its_welcome(ctx):
    # An actor process knows no config before it joins: the learner's Welcome carries them.
    learner = Learner(ctx, heartbeat_seconds=0.05, heartbeat_timeout_seconds=2.5)
    c = DispatcherClient(learner.server.endpoint, "late", 4, ctx=ctx).start()  # defaults: 1 s and 10 s
    try:
        assert c.wait_welcome(5) is not None
        assert (c.heartbeat_seconds, c.learner_timeout_seconds) == (0.05, 2.5)
    finally:
        c.close()
        learner.server.stop()


def test_threads_and_processes_speak_the_same_protocol(ctx):
    learner = Learner(ctx)
    stop = threading.Event()
    clients = [client(ctx, learner.server.inproc, "thread"), client(ctx, learner.server.endpoint, "remote")]
    for c in clients:
        assert c.wait_welcome(5).session == learner.core.session
        grant = c.request(3, stop, timeout=5)
        assert grant is not None and len(grant.prompt_indices) == 3
        assert c.send_groups([answer(grant, i) for i in range(3)], grant)
    got = [learner.queue.get(timeout=5) for _ in range(6)]
    assert None not in got and learner.ledger.counts()["queued"] == 6
    assert wait_for(lambda: learner.server.metrics()["actors/alive"] == 2)
    grant = clients[1].request(2, stop, timeout=5)
    clients[1].close("bye")  # leaves with 2 prompts in flight
    assert wait_for(lambda: learner.core.counts["reissued"] == 2)
    assert learner.stream.pending_reissue == grant.prompt_indices
    learner.ledger.verify(learner.stream.position, learner.stream.pending_reissue)
    clients[0].close()
    learner.server.stop()


def test_big_and_small_groups_alternate_intact_over_tcp(ctx):
    # Big messages are read in place (ZeroMQ's frame), small ones copied: the switch must not
    # mix up or lose any group.
    learner = Learner(ctx)
    stop = threading.Event()
    c = client(ctx, learner.server.endpoint, "remote")
    assert c.wait_welcome(5) is not None
    grant = c.request(4, stop, timeout=5)
    assert grant is not None and len(grant.prompt_ids) == 4
    sent = []
    for i, n in enumerate((20_000, 1, 20_000, 20_000)):  # 20k tokens: ~160 KB, over the 64 KiB switch
        g = answer(grant, i)
        sent.append(msgspec.structs.replace(g, completion_tokens=[[3] * n] * G, behavior_logprobs=[[-1.0] * n] * G))
    assert c.send_groups(sent, grant)
    got = [learner.queue.get(timeout=5) for _ in sent]
    assert got == sent
    c.close()
    learner.server.stop()


@contextlib.contextmanager
def burst_the_learner_does_not_read(ctx, monkeypatch):
    """Inside: the learner reads nothing while its actor has queued 4000 groups of ~38 KB, more
    than ZeroMQ's high-water marks (the actor's lowered to 10 messages, the learner's 1000) and the
    kernel's buffers hold (tcp_rmem can grow to 32 MB here: ~900 groups), with room to spare (with
    1000 a side the kernel's buffers took nearly all of it, and 2500 once all drained on a loaded
    machine): messages wait in the client. Yields (learner, client, grant)."""
    import cadence.protocols.dispatch_client as dispatch_client
    monkeypatch.setattr(dispatch_client, "client_socket",
                        functools.partial(dispatch_client.client_socket, hwm=10))
    learner = Learner(ctx, heartbeat_seconds=30.0, heartbeat_timeout_seconds=120.0)
    learner.gate.set_batch_size(10_000)  # room to admit the whole burst
    c = DispatcherClient(learner.server.endpoint, "burst", 4000, ctx=ctx, heartbeat_seconds=30.0,
                         learner_timeout_seconds=120.0).start()
    assert c.wait_welcome(5) is not None
    grant = c.request(4000, threading.Event(), timeout=10)
    assert grant is not None and len(grant.prompt_ids) == 4000
    groups = [msgspec.structs.replace(answer(grant, i), completion_tokens=[[3] * 600] * G,
                                      behavior_logprobs=[[-1.0] * 600] * G) for i in range(len(grant.prompt_ids))]
    with learner.server.lock:  # the dispatcher thread cannot read while we hold its lock
        assert c.send_groups(groups, grant)
        assert wait_for(lambda: len(c._out) > 0 and c._out[0] is not None, timeout=2)
        time.sleep(0.5)  # let the I/O thread hit the high-water mark
        assert len(c._out) > 0  # it did: messages wait in the client
        yield learner, c, grant


def test_a_burst_over_the_high_water_mark_is_sent_without_waiting_for_a_heartbeat(ctx, monkeypatch):
    # Once the learner reads again, the actor's I/O thread must resume sending when the socket has
    # room, not at its next heartbeat or the learner's (30 s each here; it did wait for one).
    with burst_the_learner_does_not_read(ctx, monkeypatch) as (learner, c, grant):
        pass
    got = [learner.queue.get(timeout=15) for _ in range(len(grant.prompt_ids))]
    assert None not in got and [g.prompt_id for g in got] == grant.prompt_ids
    c.close()
    learner.server.stop()


def test_close_while_the_learner_takes_nothing_ends_the_io_thread_in_time(ctx, monkeypatch):
    # A stopping learner no longer reads; groups above the high-water mark cannot leave. close()
    # must still end the I/O thread within its timeout (it looped on, and the caller's context
    # teardown then closed the socket under its poll: "Socket operation on non-socket").
    with burst_the_learner_does_not_read(ctx, monkeypatch) as (learner, c, _):
        c.close(timeout=1.0)
        assert not c._thread.is_alive()
    learner.server.stop()


def test_bad_bytes_are_counted_and_dropped_and_the_server_keeps_serving(ctx):
    learner = Learner(ctx, max_bytes=4096)
    raw = ctx.socket(zmq.DEALER)
    raw.connect(learner.server.endpoint)
    raw.send(b"\xc1 not msgpack")  # malformed
    raw.send(b'{"type": "hello"}')  # JSON: foreign
    raw.send(msgspec.msgpack.encode([MAGIC, SCHEMA_VERSION + 1, {"type": "hello"}]))  # another schema version
    raw.send(msgspec.msgpack.encode([MAGIC, SCHEMA_VERSION, {"type": "hello", "pad": "x" * 5000}]))  # too large
    raw.send_multipart([b"a", b"b"])  # an unexpected frame count
    assert wait_for(lambda: sum(learner.server.bad_messages.values()) == 5)
    assert set(learner.server.bad_messages) == {"MalformedMessage", "ForeignMessage", "SchemaVersionMismatch",
                                                "MessageTooLarge", "frames"}
    good = client(ctx, learner.server.endpoint, "good")
    assert good.wait_welcome(5) is not None and good.request(1, threading.Event(), timeout=5) is not None
    good.close()
    raw.close(0)
    learner.server.stop()


def test_with_curve_a_stranger_gets_nothing_through_and_the_run_is_unaffected(ctx, tmp_path):
    from cadence.protocols.zmq_transport import CurveKeys

    keys = write_keys(str(tmp_path / "keys"))
    learner = Learner(ctx, keys=keys)
    stranger_ctx = zmq.Context()
    public, secret = zmq.curve_keypair()
    stranger = stranger_ctx.socket(zmq.DEALER)
    stranger.curve_serverkey, stranger.curve_publickey, stranger.curve_secretkey = keys.server_public, public, secret
    stranger.connect(learner.server.endpoint)
    from cadence.protocols.messages import Hello
    stranger.send(encode(Hello(actor_id="evil", capacity=100)))
    friend_keys = CurveKeys(keys.directory, keys.server_public, None, keys.client_public, keys.client_secret)
    friend = client(ctx, learner.server.endpoint, "friend", keys=friend_keys)
    assert friend.wait_welcome(5) is not None
    assert friend.request(2, threading.Event(), timeout=5) is not None
    time.sleep(0.5)
    assert set(learner.core.actors) == {"friend"} and stranger.poll(200) == 0
    assert learner.core.counts["joined"] == 1 and not learner.server.bad_messages
    friend.close()
    stranger.close(0)
    stranger_ctx.destroy(linger=0)
    learner.server.stop()


def test_a_restarted_learner_is_rejoined_and_old_grants_are_void(ctx):
    first = Learner(ctx)
    endpoint = first.server.endpoint
    c = client(ctx, endpoint, "survivor")
    stop = threading.Event()
    old_session = c.wait_welcome(5).session
    old_grant = c.request(2, stop, timeout=5)
    first.server.stop()  # the learner dies with the grant outstanding
    second = None
    for _ in range(50):  # ... and comes back on the same port (ZeroMQ frees it asynchronously)
        try:
            second = Learner(ctx, external=endpoint)
            break
        except OSError:
            time.sleep(0.1)
    assert wait_for(lambda: c.session == second.core.session, timeout=15)
    assert c.session != old_session
    assert not c.send_groups([answer(old_grant, 0)], old_grant)  # work of the old session is not sent
    new_grant = c.request(2, stop, timeout=5)
    assert new_grant.grant_id.startswith(second.core.session)
    c.send_groups([answer(new_grant, 0)], new_grant)
    assert second.queue.get(timeout=5).prompt_id == new_grant.prompt_ids[0]
    c.close()
    second.server.stop()


def test_a_context_torn_down_under_the_io_thread_closes_the_client_quietly(ctx):
    # Pipeline.stop destroys the context after close() waited its time; a thread starved past
    # that (a loaded machine) met a closed socket in its poll and died with a traceback.
    own = zmq.Context()
    learner = Learner(ctx)
    c = client(own, learner.server.endpoint, "torn")
    assert c.wait_welcome(5) is not None
    errors = []
    old_hook, threading.excepthook = threading.excepthook, errors.append
    try:
        own.destroy(linger=0)
        c._thread.join(5)
    finally:
        threading.excepthook = old_hook
    assert not c._thread.is_alive() and errors == []
    assert "context was closed" in c.stop_reason
    assert c.request(1, threading.Event(), timeout=1) is None
    c.close()  # idempotent after the fact
    learner.server.stop()


def test_a_wake_between_the_io_threads_read_and_its_flag_is_not_lost(ctx, monkeypatch):
    # The I/O thread cleared its "wake pending" flag before reading the wake pipe; a wake landing
    # in between wrote a byte that the read then swallowed, leaving the flag set and the pipe
    # empty: no wake was ever written again and every send waited for a heartbeat (a default
    # run took 116 s instead of 25). Replay that interleaving once, then ask for work again.
    import cadence.protocols.dispatch_client as dispatch_client
    learner = Learner(ctx, heartbeat_seconds=30.0, heartbeat_timeout_seconds=120.0)
    c = DispatcherClient(learner.server.endpoint, "wake", 4, ctx=ctx, heartbeat_seconds=30.0,
                         learner_timeout_seconds=120.0)
    real_read, replayed = os.read, []

    def read(fd, n):
        if fd == c._wake_r and not replayed:
            replayed.append(1)
            c._wake()  # the worker's wake, racing the I/O thread
        return real_read(fd, n)

    monkeypatch.setattr(dispatch_client.os, "read", read)
    c.start()
    assert c.wait_welcome(5) is not None
    stop = threading.Event()
    assert c.request(1, stop, timeout=5) is not None and replayed
    assert c.request(1, stop, timeout=5) is not None  # no heartbeat for 30 s: only a wake sends it
    c.close()
    learner.server.stop()

"""The actor's side of the dispatcher protocol (protocols/dispatch.py).

    client = DispatcherClient(endpoint, "actor-0", capacity=16, ctx=ctx).start()
    welcome = client.wait_welcome(timeout=60)
    while not stop.is_set():
        grant = client.request(actor.prompts_per_call, stop)      # None: stopped or session reset
        ...generate and score...
        client.send_groups(groups, grant)                          # dropped if the session changed

The answer to a request may also be an EvalGrant (held-out prompts to evaluate greedily with one
weights version, protocols/eval_work.py): the worker answers it with `send_eval(result, grant)`.

One I/O thread owns the DEALER socket: it sends what the worker queued, answers with Hello until
welcomed, sends a Heartbeat every heartbeat_seconds whatever the worker is doing (with the phase it
reported via `phase()`), and watches the learner: silence for learner_timeout_seconds or a Reset
means the learner restarted or forgot us, so the client says Hello again, and work granted under
the old session is abandoned (the new learner re-issues those prompts itself from its checkpoint).
A Control(stop) from the learner sets `stop_reason` (the actor then exits).
"""
from __future__ import annotations

import collections
import os
import queue
import socket
import threading
import time

import zmq

from cadence.protocols.codec import Codec
from cadence.protocols.errors import ProtocolError
from cadence.protocols.messages import (
    Control,
    EvalGrant,
    EvalResult,
    Goodbye,
    Grant,
    Heartbeat,
    Hello,
    Reset,
    RolloutGroup,
    Welcome,
    WorkRequest,
)
from cadence.protocols.zmq_transport import CurveKeys, client_socket


class DispatcherClient:
    def __init__(self, endpoint: str, actor_id: str, capacity: int, *, ctx: zmq.Context,
                 keys: CurveKeys | None = None, max_bytes: int = 64 << 20, heartbeat_seconds: float = 1.0,
                 learner_timeout_seconds: float = 10.0):
        self.endpoint, self.actor_id, self.capacity = endpoint, actor_id, capacity
        self.codec = Codec(max_bytes)
        self._sock = client_socket(ctx, zmq.DEALER, endpoint, keys=keys, max_bytes=max_bytes + (1 << 20))
        self.heartbeat_seconds = heartbeat_seconds
        self.learner_timeout_seconds = learner_timeout_seconds
        self.welcome: Welcome | None = None
        self.session = ""  # "" while not welcomed
        self.learner_version = 0
        self.concurrency: int | None = None  # the controller's latest word, if any
        self.stop_reason = ""  # set by a Control(stop) from the learner
        # reported in heartbeats; the actor sets them through report()
        self.generate_seconds = 0.0  # cumulative engine time
        self.version = -1  # weights version this actor holds
        self.engine_stats: dict[str, float] = {}  # its engine's counters
        self.resets = 0
        self.bad_messages = 0
        self._phase, self._phase_since = "idle", time.monotonic()
        self._out: collections.deque = collections.deque()
        self._grants: queue.SimpleQueue = queue.SimpleQueue()
        self._welcomed = threading.Event()
        self._closing = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False  # a byte is in the wake pipe: one write per I/O-thread round
        self._thread = threading.Thread(target=self._run, name=f"{actor_id}-io", daemon=True)
        self._last_heard = 0.0
        self._linger_ms = 0
        self._close_by = float("inf")  # close(): the I/O thread gives up sending what is left by then
        self._host, self._pid = socket.gethostname(), os.getpid()

    # -- the worker's side ----------------------------------------------------------------------
    def start(self) -> "DispatcherClient":
        self._thread.start()
        return self

    def wait_welcome(self, timeout: float | None = None) -> Welcome | None:
        return self.welcome if self._welcomed.wait(timeout) else None

    @property
    def connected(self) -> bool:
        return self._welcomed.is_set()

    def phase(self, name: str) -> None:
        """What the worker is doing now (idle, weights, generating, scoring, sending): the dispatcher
        declares an actor hung when one phase lasts too long while it holds prompts."""
        if name != self._phase:
            self._phase, self._phase_since = name, time.monotonic()

    def report(self, *, version: int | None = None, generate_seconds: float | None = None,
               engine_stats: dict[str, float] | None = None) -> None:
        """What the next heartbeats tell the learner (None: unchanged): the weights version this
        actor generates with (the learner's version-lag metric), its cumulative engine time, and
        its engine's counters."""
        if version is not None:
            self.version = version
        if generate_seconds is not None:
            self.generate_seconds = generate_seconds
        if engine_stats is not None:
            self.engine_stats = dict(engine_stats)

    def request(self, n: int, stop: threading.Event, timeout: float | None = None) -> Grant | EvalGrant | None:
        """Ask for up to n prompt groups and wait for the grant (or an evaluation's chunk, which the
        dispatcher hands out first). None if `stop` is set, the learner
        told us to stop, the session changed while waiting, or after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.phase("idle")
        while not (stop.is_set() or self.stop_reason):
            if not self._welcomed.wait(0.05):
                continue
            session = self.session
            self._drain_grants()  # grants of an older session are void
            self._queue(WorkRequest(actor_id=self.actor_id, capacity=max(1, n)))
            while not (stop.is_set() or self.stop_reason) and self.session == session:
                if deadline is not None and time.monotonic() > deadline:
                    return None
                try:
                    grant = self._grants.get(timeout=0.05)
                except queue.Empty:
                    continue
                if grant.session == session:
                    return grant
            if deadline is not None and time.monotonic() > deadline:
                return None
        return None

    def send_eval(self, result: EvalResult, grant: EvalGrant) -> bool:
        """Queue an evaluation's scores; False (nothing sent) if the grant's session is over."""
        if not self.current(grant):
            return False
        self._queue(result)
        return True

    def current(self, grant: Grant | EvalGrant) -> bool:
        """Is the grant still the learner's (no restart or reset since)?"""
        return bool(self.session) and grant.session == self.session

    def send_groups(self, groups: list[RolloutGroup], grant: Grant) -> bool:
        """Queue the groups for the learner; False (nothing sent) if the grant's session is over."""
        if not self.current(grant):
            return False
        for g in groups:
            self._queue(g)
        return True

    def close(self, reason: str = "", error: bool = False, timeout: float = 2.0) -> None:
        """Say Goodbye (prompts in flight go back to the stream) and stop the I/O thread. Idempotent."""
        if self._closing.is_set():
            return
        self._linger_ms = int(timeout * 1000)
        # The I/O thread gives up a little before the join below does, so it is gone when close() returns.
        self._close_by = time.monotonic() + max(timeout - 0.2, timeout / 2)
        if self._thread.is_alive():  # the I/O thread owns the socket: it sends the Goodbye and closes
            if self.session:
                self._queue(Goodbye(actor_id=self.actor_id, reason=reason, error=error))
            self._closing.set()
            self._wake()
            self._thread.join(timeout)
        else:
            self._closing.set()
            self._shut(0)

    def _shut(self, linger_ms: int) -> None:
        self._sock.close(linger_ms)
        w, self._wake_w = self._wake_w, -1
        os.close(self._wake_r)
        os.close(w)

    # -- the I/O thread -------------------------------------------------------------------------
    def _queue(self, msg) -> None:
        self._out.append(self.codec.encode(msg))
        self._wake()

    def _wake(self) -> None:
        if self._wake_w < 0 or self._wake_pending:  # the I/O thread has not read the last one yet
            return
        self._wake_pending = True
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def _drain_grants(self) -> None:
        while True:
            try:
                self._grants.get_nowait()
            except queue.Empty:
                return

    def _hello(self) -> bytes:
        return self.codec.encode(Hello(actor_id=self.actor_id, capacity=self.capacity, host=self._host,
                                       pid=self._pid))

    def _heartbeat(self, now: float) -> bytes:
        return self.codec.encode(Heartbeat(sender=self.actor_id, session=self.session, version=max(self.version, 0),
                                           phase=self._phase, phase_seconds=now - self._phase_since,
                                           generate_seconds=self.generate_seconds,
                                           engine_stats=self.engine_stats))

    def _send(self, data: bytes) -> bool:
        try:
            self._sock.send(data, zmq.NOBLOCK)  # copied at every size: see ZmqTransport.put_bytes
            return True
        except zmq.Again:  # the learner is away and the queue is full: heartbeats resume when it is back
            return False

    def _run(self) -> None:
        try:
            self._loop()
        except zmq.ZMQError as e:
            if e.errno not in (zmq.ENOTSOCK, zmq.ETERM):
                raise
            # The owner tore the context down under us (close() gave up on a starved thread, or
            # was never called): the client is closed; a waiting worker hears why and stops.
            self.stop_reason = self.stop_reason or "the actor's ZeroMQ context was closed"
            self._closing.set()
        finally:  # the Goodbye (if any) gets the linger time to leave
            self._shut(self._linger_ms if self.session else 0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        watching = zmq.POLLIN  # what the poller waits for on the socket
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:  # Hello until welcomed, then heartbeats
                self._send(self._heartbeat(now) if self.session else self._hello())
                next_beat = now + self.heartbeat_seconds
            if self.session and now - self._last_heard > self.learner_timeout_seconds:
                self._lose_session()  # the learner went quiet: restarted or gone; hello again
                next_beat = now
            while self._out:  # after a Goodbye nothing else is queued
                if not self._send(self._out[0]):
                    break
                self._out.popleft()
            # Closing: done once all is sent, or when the learner has stopped taking messages for
            # the whole grace (the caller stops waiting then and may tear the context down).
            if self._closing.is_set() and (not self._out or now >= self._close_by):
                return
            # Messages left over: the high-water mark was reached. Wake as soon as the socket takes
            # more, not at the next heartbeat (a burst of groups stalled for heartbeat_seconds).
            want = zmq.POLLIN | zmq.POLLOUT if self._out else zmq.POLLIN
            if want != watching:
                poller.modify(self._sock, want)
                watching = want
            wake_at = min(next_beat, self._close_by)
            events = dict(poller.poll(timeout=max(1, int((wake_at - time.monotonic()) * 1000))))
            if events.get(self._wake_r):
                os.read(self._wake_r, 4096)
                # After reading, not before: cleared first, a wake landing between the two had its
                # byte read here and left the flag set with the pipe empty, and from then on no
                # wake wrote again (every send waited for the next heartbeat, a run 4x slower).
                # A wake between the read and this line finds its message sent by the next round.
                self._wake_pending = False
            if events.get(self._sock, 0) & zmq.POLLIN:
                self._receive()

    def _receive(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.codec.decode(data.buffer)
            except ProtocolError:
                self.bad_messages += 1
                continue
            self._last_heard = time.monotonic()
            if isinstance(msg, Welcome):
                self.welcome, self.session = msg, msg.session
                self.learner_version = msg.version
                self.concurrency = msg.concurrency
                # the run's heartbeat settings, from its learner (an actor process knows no config before)
                self.heartbeat_seconds = msg.heartbeat_seconds
                self.learner_timeout_seconds = msg.heartbeat_timeout_seconds or self.learner_timeout_seconds
                self._welcomed.set()
            elif isinstance(msg, (Grant, EvalGrant)):
                self.learner_version = max(self.learner_version, msg.version)
                self._grants.put(msg)
            elif isinstance(msg, Heartbeat):
                if self.session and msg.session != self.session:
                    self._lose_session()
                else:
                    self.learner_version = max(self.learner_version, msg.version)
            elif isinstance(msg, Reset):
                self.resets += 1
                self._lose_session()
            elif isinstance(msg, Control):
                if msg.concurrency is not None:
                    self.concurrency = msg.concurrency
                if msg.stop:
                    self.stop_reason = msg.reason or "stopped by the learner"

    def _lose_session(self) -> None:
        self.session = ""
        self._welcomed.clear()
        self._out.clear()  # groups and requests of the old session mean nothing to a new learner
        self._send(self._hello())

"""The dispatcher's thread: ROUTER sockets in front of a Dispatcher (protocols/dispatch.py).

    server = DispatchServer(core, ctx=ctx, external="tcp://127.0.0.1:0").start()   # plus inproc
    server.call(lambda core: core.control_all(msg))    # run on the server thread
    server.wake()                                       # re-check waiting requests now
    server.stop()

Actor threads in this process connect to `server.inproc`, actor processes to `server.endpoint`
(tcp/ipc, Curve-authenticated when keys are given); both speak the same protocol.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter
from typing import Callable

import zmq

from cadence.protocols.codec import Codec
from cadence.protocols.dispatch import Dispatcher
from cadence.protocols.errors import ProtocolError
from cadence.protocols.zmq_transport import ZERO_COPY_BYTES, CurveKeys, RefusalCounter, bound_endpoint, server_socket


class DispatchServer:
    """Runs a Dispatcher on a thread: an inproc ROUTER for actor threads, and optionally an external
    one (tcp/ipc) for actor processes. Other threads reach the core through `call(fn)` (run on the
    server thread) and `wake()` (re-check waiting requests now).

    Bad bytes from a peer (malformed, foreign, another schema version, too large) are counted by
    kind in `bad_messages` and dropped; the server keeps running. Handshakes the external socket
    refused (an unknown key, another user) are counted in `refused.refused`.
    """

    def __init__(self, core: Dispatcher, *, ctx: zmq.Context, external: str = "", keys: CurveKeys | None = None,
                 max_bytes: int = 64 << 20, key_name: str = "actors.keys_dir"):
        self.core = core
        self.ctx = ctx
        self.codec = Codec(max_bytes)
        self.inproc = f"inproc://cadence-dispatch-{core.session}"
        self.lock = threading.RLock()  # the core is touched by the server thread and metrics readers
        slack = max_bytes + (1 << 20)  # ZeroMQ cuts only the grossly oversized; the codec counts the rest
        self._sockets = [server_socket(ctx, zmq.ROUTER, self.inproc, keys=None, max_bytes=slack)]
        self.endpoint = ""
        if external:
            self._sockets.append(server_socket(ctx, zmq.ROUTER, external, keys=keys, max_bytes=slack,
                                               key_name=key_name))
            self.endpoint = bound_endpoint(self._sockets[1])
        self.refused = RefusalCounter(self._sockets[1]) if external else None
        self.bad_messages: Counter = Counter()
        self._zero_copy = [False] * len(self._sockets)  # per socket: receive the next message uncopied
        self.last_error = ""
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dispatcher", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "DispatchServer":
        self._thread.start()
        return self

    def wake(self) -> None:
        """Thread-safe and cheap: the server re-checks waiting requests at once."""
        if self._stop.is_set():
            return
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def call(self, fn: Callable[[Dispatcher], list]) -> None:
        """Run fn(core) on the server thread; the messages it returns are sent."""
        self._calls.put(fn)
        self.wake()

    def metrics(self) -> dict:
        with self.lock:
            out = self.core.metrics(time.monotonic())
        out["actors/bad_messages"] = sum(self.bad_messages.values())
        out["actors/refused_connections"] = self.refused.refused if self.refused else 0
        return out

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for s in self._sockets:
            s.close(0)
        if self.refused is not None:
            self.refused.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self._sockets:
            poller.register(s, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self.refused is not None:
            poller.register(self.refused.socket, zmq.POLLIN)
        tick_every = min(0.05, self.core.settings.heartbeat_seconds / 2)
        next_tick = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=max(1, int((next_tick - time.monotonic()) * 1000))))
                out: list = []
                with self.lock:
                    for i, s in enumerate(self._sockets):
                        if events.get(s):
                            out += self._receive(i, s)
                    if self.refused is not None and events.get(self.refused.socket):
                        self.refused.poll()
                    if events.get(self._wake_r):
                        os.read(self._wake_r, 4096)
                        while not self._calls.empty():
                            out += self._calls.get()(self.core) or []
                        out += self.core.regrant()
                    now = time.monotonic()
                    if now >= next_tick:
                        out += self.core.tick(now)
                        next_tick = now + tick_every
                self._send(out)
        except BaseException as e:  # surfaced by the wiring's health check
            self.error = e
            raise

    def _receive(self, index: int, sock: zmq.Socket) -> list:
        out = []
        while True:
            # Frame objects cost more than copying a small message; a big one is read in place.
            # The size is known only after receiving, so the previous message's size decides.
            zero_copy = self._zero_copy[index]
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=not zero_copy)
            except zmq.Again:
                return out
            if len(frames) != 2:
                self.bad_messages["frames"] += 1
                continue
            routing_id, data = (frames[0].bytes, frames[1].buffer) if zero_copy else frames
            self._zero_copy[index] = len(data) >= ZERO_COPY_BYTES
            peer = (index, routing_id)
            try:
                msg = self.codec.decode(data)
            except ProtocolError as e:
                self.bad_messages[type(e).__name__] += 1
                self.last_error = str(e)
                continue
            out += self.core.handle(peer, msg, time.monotonic())

    def _send(self, out: list) -> None:
        for (index, routing_id), msg in out:
            try:
                self._sockets[index].send_multipart([routing_id, self.codec.encode(msg)], zmq.NOBLOCK)
            except zmq.Again:  # that peer is not reading (gone, or far behind): heartbeats will tell
                self.core.counts["send_dropped"] += 1

"""Receive loop for consumers: decode bytes into messages, survive bad input, count it.

One bad message from a misconfigured or foreign peer must not take the learner down, nor vanish
without trace: `Receiver` logs each `ProtocolError`, counts it (in total and by kind), keeps the
last error's text, and moves on to the next message.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from cadence.protocols.codec import Codec
from cadence.protocols.errors import ProtocolError
from cadence.protocols.messages import Message
from cadence.protocols.transport import BytesTransport

_log = logging.getLogger(__name__)


class Receiver:
    """Pulls bytes from a transport and turns them into messages.

    Use `receive()` to pull one message from your own loop, or `start()` / `stop()` (or `run()`)
    to deliver every message to `on_message` from a background thread.

    Args:
      transport: where the bytes come from (e.g. an InProcessTransport or a ZeroMQ transport).
      codec: how to decode them; a default Codec if None.
      on_message: called with each decoded message by run(); required for run() and start().
      poll_seconds: how often run() checks its stop event while the transport is idle.
    """

    def __init__(
        self,
        transport: BytesTransport,
        codec: Codec | None = None,
        on_message: Callable[[Message], None] | None = None,
        poll_seconds: float = 0.05,
    ):
        if poll_seconds <= 0:
            raise ValueError(f"poll_seconds: must be > 0, got {poll_seconds}")
        self.transport = transport
        self.codec = codec if codec is not None else Codec()
        self.on_message = on_message
        self.poll_seconds = poll_seconds
        self.received_count = 0  # messages decoded successfully
        self.error_count = 0  # ProtocolErrors seen (bad messages skipped)
        self.errors_by_kind: collections.Counter[str] = collections.Counter()  # by error class
        self.last_error: str | None = None  # text of the most recent ProtocolError
        self.failure: BaseException | None = None  # what ended the background thread, if not stop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def receive(self, timeout: float | None = None) -> Message | None:
        """Returns the next valid message, skipping (and counting) bad ones.

        Args:
          timeout: seconds to wait in total, across skipped messages; None waits forever.

        Returns:
          The message, or None on timeout or once the transport is closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            data = self.transport.get_bytes(remaining)
            if data is None:
                return None
            try:
                msg = self.codec.decode(data)
            except ProtocolError as e:
                self._record_error(e)
                continue
            self.received_count += 1
            return msg

    def run(self, stop: threading.Event | None = None) -> None:
        """Delivers messages to on_message until `stop` is set or the transport closes.

        An exception from on_message propagates: a consumer's bug should not be hidden.
        """
        if self.on_message is None:
            raise ValueError("on_message: required to run a Receiver")
        stop = stop if stop is not None else self._stop
        while not stop.is_set() and not self.transport.closed:
            msg = self.receive(timeout=self.poll_seconds)
            if msg is not None:
                self.on_message(msg)

    def start(self) -> None:
        """Runs run() in a daemon thread until stop()."""
        if self._thread is not None:
            raise RuntimeError("Receiver already started")
        if self.on_message is None:
            raise ValueError("on_message: required to start a Receiver")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_thread, name="cadence-receiver", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stops the background thread and waits for it; re-raises what ended it, if anything."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure

    def _run_thread(self) -> None:
        try:
            self.run(self._stop)
        except BaseException as e:  # kept for stop() to re-raise in the owner's thread
            self.failure = e
            _log.exception("receiver thread failed")

    def _record_error(self, error: ProtocolError) -> None:
        self.error_count += 1
        self.errors_by_kind[type(error).__name__] += 1
        self.last_error = str(error)
        _log.warning("skipped a bad message (%d so far): %s", self.error_count, error)

"""Transports: how messages travel from actors to the learner (and back).

A `Transport` moves items one way: `put(item, timeout)`, `get(timeout)` (None on timeout or once
closed) and `close()`. A `BytesTransport` moves encoded bytes: `put_bytes` / `get_bytes`. Code
that may later talk across processes should speak bytes plus a `Codec` (see `Receiver`), so that a
ZeroMQ transport drops in unchanged.

`InProcessTransport` is a thread-safe queue implementing both views. Without a codec it passes
objects through untouched (the fast path inside one process); with a codec, `put` encodes and `get`
decodes, so the queue holds exactly the bytes a socket would carry (the wire path, in-process).
`maxsize > 0` bounds the queue: `put` then blocks (backpressure) or raises `TransportFull` after its
timeout.

Planned ZeroMQ transport (a later issue): a PUSH socket on the sending side and a PULL socket on
the receiving side, over `ipc://` or `tcp://` bound to loopback by default, implementing
`put_bytes` / `get_bytes` / `close` / `closed` with the same timeout and close semantics as here
(`put` / `get` then wrap a `Codec`). Backpressure maps onto the socket's high-water mark.

Close semantics (every implementation): after `close()`, `put` raises `TransportClosed`, `get`
returns None promptly, and callers blocked in either wake up. Items still queued are dropped.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Protocol, runtime_checkable

from cadence.protocols.codec import Codec


class TransportClosed(RuntimeError):
    """Raised by `put` on a transport that has been closed."""


class TransportFull(TimeoutError):
    """Raised by `put` when a bounded transport stayed full for the whole timeout."""


@runtime_checkable
class Transport(Protocol):
    """Moves items one way between threads, processes, or hosts."""

    def put(self, item: Any, timeout: float | None = None) -> None:
        """Sends item; blocks at most timeout seconds (None: forever) if the transport is full."""

    def get(self, timeout: float | None = None) -> Any | None:
        """Returns the next item, or None after timeout seconds (None: wait forever) or once closed."""

    def close(self) -> None:
        """Closes the transport; idempotent."""

    @property
    def closed(self) -> bool:
        """Whether close() has been called."""


@runtime_checkable
class BytesTransport(Protocol):
    """The bytes-level view a socket transport implements; see the module docstring."""

    def put_bytes(self, data: bytes, timeout: float | None = None) -> None:
        """Sends encoded bytes; same blocking and close semantics as Transport.put."""

    def get_bytes(self, timeout: float | None = None) -> bytes | memoryview | None:
        """Returns the next encoded bytes (or a read-only memoryview of the transport's own buffer,
        for big messages), or None on timeout or once closed."""

    def close(self) -> None:
        """Closes the transport; idempotent."""

    @property
    def closed(self) -> bool:
        """Whether close() has been called."""


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout: must be >= 0 or None, got {timeout}")
    return time.monotonic() + timeout


class InProcessTransport:
    """A thread-safe FIFO queue implementing Transport and BytesTransport.

    Args:
      maxsize: most items queued at once; 0 means unbounded. When full, put blocks.
      codec: if given, put encodes and get decodes (the wire path); put_bytes and get_bytes always
        pass bytes through untouched.
    """

    def __init__(self, maxsize: int = 0, codec: Codec | None = None):
        if maxsize < 0:
            raise ValueError(f"maxsize: must be >= 0, got {maxsize}")
        self.maxsize = maxsize
        self.codec = codec
        self._items: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether close() has been called."""
        return self._closed

    def qsize(self) -> int:
        """Number of items queued now (a snapshot; for metrics, not for control flow)."""
        return len(self._items)

    def put(self, item: Any, timeout: float | None = None) -> None:
        """Enqueues item (encoded first if a codec is set).

        Raises:
          ValueError: item is None.
          TransportClosed: the transport is closed, or was closed while waiting.
          TransportFull: maxsize > 0 and the queue stayed full for timeout seconds.
          ProtocolError, TypeError: the codec could not encode item.
        """
        if item is None:
            raise ValueError("item: cannot put None, which get uses to mean timeout or closed")
        if self.codec is not None:
            item = self.codec.encode(item)  # outside the lock: encoding a big group takes time
        self._put(item, timeout)

    def get(self, timeout: float | None = None) -> Any | None:
        """Returns the next item (decoded if a codec is set), or None on timeout or once closed.

        Raises:
          ProtocolError: a codec is set and the queued bytes are not a valid message; that item is
            consumed, so the next get continues with the item after it.
        """
        item = self._get(timeout)
        if item is None or self.codec is None:
            return item
        return self.codec.decode(item)

    def put_bytes(self, data: bytes, timeout: float | None = None) -> None:
        """Enqueues already-encoded bytes; same semantics as put."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"put_bytes expects bytes, got {type(data).__name__}")
        self._put(bytes(data), timeout)

    def get_bytes(self, timeout: float | None = None) -> bytes | None:
        """Returns the next queued bytes undecoded, or None on timeout or once closed."""
        item = self._get(timeout)
        if item is not None and not isinstance(item, bytes):
            raise TypeError(
                f"get_bytes found a {type(item).__name__}: put it with a codec or via put_bytes"
            )
        return item

    def close(self) -> None:
        """Closes the transport, drops queued items, and wakes every blocked put and get."""
        with self._lock:
            self._closed = True
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def _put(self, item: Any, timeout: float | None) -> None:
        deadline = _deadline(timeout)
        with self._not_full:
            while True:
                if self._closed:
                    raise TransportClosed("put on a closed transport")
                if self.maxsize <= 0 or len(self._items) < self.maxsize:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TransportFull(
                        f"put timed out after {timeout} s: transport full "
                        f"(maxsize={self.maxsize}); the consumer is not keeping up"
                    )
                self._not_full.wait(remaining)
            self._items.append(item)
            self._not_empty.notify()

    def _get(self, timeout: float | None) -> Any | None:
        deadline = _deadline(timeout)
        with self._not_empty:
            while True:
                if self._closed:
                    return None
                if self._items:
                    item = self._items.popleft()
                    self._not_full.notify()
                    return item
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._not_empty.wait(remaining)

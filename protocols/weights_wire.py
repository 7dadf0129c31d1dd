"""Policy weights to actor processes: the newest version only, as raw array bytes (never pickle).

    server = WeightServer("tcp://127.0.0.1:0", ctx=ctx).start()    # learner side, its own thread
    server.publish(version, arrays_fn)     # arrays_fn() -> [(path, np.ndarray)], called lazily
    client = WeightClient(server.endpoint, ctx=ctx)                 # actor side, one thread
    got = client.fetch(have_version=3)     # (version, [(path, array)]) or None if 3 is the newest

A request names the version the actor holds; the answer is a WeightsPublished header (version,
and each array's path, dtype, shape and frame count) followed by the arrays' bytes as raw ZeroMQ
frames, big arrays chunked into frames of at most `chunk_bytes`, sent without copies. Whatever was
published in between is never sent: an actor that falls behind skips straight to the newest
(conflation). Arrays for a version are materialised once, on the first request, and shared by
every actor that asks for it. The receiving side checks every frame against the header.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable

import numpy as np
import zmq

from cadence.protocols.codec import Codec
from cadence.protocols.errors import ProtocolError
from cadence.protocols.messages import TensorSpec, WeightsPublished, WeightsRequest
from cadence.protocols.zmq_transport import CurveKeys, RefusalCounter, bound_endpoint, client_socket, server_socket

NamedArrays = list[tuple[str, np.ndarray]]


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends live in ml_dtypes (a JAX dependency)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def to_frames(arrays: NamedArrays, chunk_bytes: int) -> tuple[list[TensorSpec], list[memoryview]]:
    """Header specs and zero-copy frames of contiguous arrays."""
    specs, frames = [], []
    for path, a in arrays:
        a = np.ascontiguousarray(a)
        raw = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        n = max(1, math.ceil(len(raw) / chunk_bytes))
        specs.append(TensorSpec(path=path, dtype=a.dtype.name, shape=list(a.shape), frames=n))
        frames += [raw[i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(n)]
    return specs, frames


def from_frames(specs: list[TensorSpec], frames: list) -> NamedArrays:
    """Arrays from received frames; raises ProtocolError if the frames do not match the header."""
    if sum(s.frames for s in specs) != len(frames):
        raise ProtocolError(f"weights: header lists {sum(s.frames for s in specs)} frames, got {len(frames)}")
    out, i = [], 0
    for s in specs:
        dtype = _dtype(s.dtype)
        want = int(np.prod(s.shape, dtype=np.int64)) * dtype.itemsize
        parts = [frames[j].buffer if hasattr(frames[j], "buffer") else frames[j] for j in range(i, i + s.frames)]
        i += s.frames
        got = sum(len(p) for p in parts)
        if got != want:
            raise ProtocolError(f"weights: {s.path} should have {want} bytes ({s.dtype} {s.shape}), got {got}")
        buf = parts[0] if len(parts) == 1 else b"".join(bytes(p) for p in parts)
        out.append((s.path, np.frombuffer(buf, dtype=dtype).reshape(s.shape)))
    return out


class WeightServer:
    """Serves the newest published weights to any number of actors (see the module docstring)."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context, keys: CurveKeys | None = None,
                 chunk_bytes: int = 16 << 20, key_name: str = "actors.keys_dir"):
        self.codec = Codec(1 << 20)
        self.chunk_bytes = chunk_bytes
        self._sock = server_socket(ctx, zmq.ROUTER, endpoint, keys=keys, max_bytes=1 << 20, hwm=100,
                                   key_name=key_name)
        self.endpoint = bound_endpoint(self._sock)
        self.refused = RefusalCounter(self._sock)  # handshakes refused (read on the server thread)
        self._lock = threading.Lock()
        self._version = -1
        self._arrays_fn: Callable[[], NamedArrays] | None = None
        self._cache: tuple[int, list[TensorSpec], list[memoryview], list] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self.sent = 0  # transfers sent
        self.sent_bytes = 0
        self.bad_messages = 0

    def start(self) -> "WeightServer":
        self._thread.start()
        return self

    def publish(self, version: int, arrays_fn: Callable[[], NamedArrays]) -> None:
        """Make `version` the newest; arrays_fn runs on the server thread when first asked for."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"weights version went backwards: {version} < {self._version}")
            self._version, self._arrays_fn = version, arrays_fn

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close(0)
        self.refused.close()

    def _newest(self):
        with self._lock:
            version, fn = self._version, self._arrays_fn
        if self._cache is None or self._cache[0] != version:
            arrays = fn()
            specs, frames = to_frames(arrays, self.chunk_bytes)
            self._cache = (version, specs, frames, arrays)  # arrays kept alive while frames are in use
        return self._cache

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refused.poll()
            if not self._sock.poll(50, zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                self.bad_messages += 1
                continue
            peer = frames[0].bytes
            try:
                req = self.codec.decode(frames[1].buffer)
            except ProtocolError:
                self.bad_messages += 1
                continue
            if not isinstance(req, WeightsRequest):
                self.bad_messages += 1
                continue
            if self._arrays_fn is None or req.have_version >= self._version:
                header = WeightsPublished(version=max(self._version, 0), step=max(self._version, 0),
                                          location=self.endpoint, published_at=time.time())
                self._sock.send_multipart([peer, self.codec.encode(header)])
                continue
            version, specs, data, _ = self._newest()
            header = WeightsPublished(version=version, step=version, location=self.endpoint,
                                      published_at=time.time(), tensors=specs)
            self._sock.send_multipart([peer, self.codec.encode(header), *data], copy=False)
            self.sent += 1
            self.sent_bytes += sum(len(d) for d in data)


class WeightClient:
    """Fetches the newest weights from a WeightServer. One thread only, like a socket."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context, keys: CurveKeys | None = None,
                 chunk_bytes: int = 16 << 20):
        self.codec = Codec(1 << 20)
        self.endpoint = endpoint
        self._ctx, self._keys, self._chunk = ctx, keys, chunk_bytes
        self._sock = self._connect()
        self.fetched = 0
        self.fetched_bytes = 0

    def _connect(self) -> zmq.Socket:
        return client_socket(self._ctx, zmq.DEALER, self.endpoint, keys=self._keys,
                             max_bytes=max(self._chunk, 1 << 20) + (1 << 20), hwm=100)

    def fetch(self, have_version: int = -1, timeout: float = 60.0) -> tuple[int, NamedArrays] | None:
        """The newest weights if newer than have_version, else None. Raises TimeoutError."""
        self._sock.send(self.codec.encode(WeightsRequest(have_version=have_version)))
        if not self._sock.poll(int(timeout * 1000), zmq.POLLIN):
            # the reply may still come later: a fresh socket keeps it from answering the next request
            self._sock.close(0)
            self._sock = self._connect()
            raise TimeoutError(f"weights: no answer from {self.endpoint} within {timeout:g} s")
        frames = self._sock.recv_multipart(copy=False)
        header = self.codec.decode(frames[0].buffer)
        if not isinstance(header, WeightsPublished):
            raise ProtocolError(f"weights: expected a weights header, got {type(header).__name__}")
        if header.tensors is None:
            return None
        arrays = from_frames(header.tensors, frames[1:])
        self.fetched += 1
        self.fetched_bytes += sum(a.nbytes for _, a in arrays)
        return header.version, arrays

    def close(self) -> None:
        self._sock.close(0)

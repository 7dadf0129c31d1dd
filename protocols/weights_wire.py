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

A sharded learner publishes a `WeightSource` instead (server.publish_source): its pieces (each
device's shard, named by path, offset and whole shape) in buckets the actor asks for one at a
time, so the learner's host never holds more than one bucket beyond its shards, and no device
ever holds the whole model (learner/weight_stream.py). The version a transfer started with stays
served until that transfer ends, whatever is published meanwhile; the client assembles the pieces
into whole arrays and checks they tile each array exactly.
"""
from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from typing import Callable, Protocol, Sequence

import numpy as np
import zmq

from cadence.protocols.codec import Codec
from cadence.protocols.errors import ProtocolError
from cadence.protocols.messages import TensorSpec, WeightsPublished, WeightsRequest
from cadence.protocols.zmq_transport import CurveKeys, RefusalCounter, bound_endpoint, client_socket, server_socket

NamedArrays = list[tuple[str, np.ndarray]]
# one array of a bucket: (path, data, offset, whole shape); offset/whole None = a whole array
Piece = tuple[str, np.ndarray, Sequence[int] | None, Sequence[int] | None]
LATER, GONE = "later", "gone"  # an exact version asked of a server: not published there yet / dropped
STREAM_TIMEOUT_S = 120.0  # a transfer not continued for this long is dropped (its version released)
RELEASE_WAIT_S = 60.0  # the longest a new bucket waits for ZeroMQ to release the previous one


class WeightSource(Protocol):
    """One weights version, served in buckets (a sharded learner's shards; see module docstring)."""

    buckets: int

    def bucket(self, k: int) -> list[Piece]:
        """The pieces of bucket k, as host arrays (built when asked, dropped after sending)."""
        ...


class _WholeArrays:
    """A version given as whole arrays: one bucket, built once on the first request."""

    buckets = 1

    def __init__(self, arrays_fn: Callable[[], NamedArrays]):
        self._fn = arrays_fn

    def bucket(self, k: int) -> list[Piece]:
        return [(path, a, None, None) for path, a in self._fn()]


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends live in ml_dtypes (a JAX dependency)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def to_frames(arrays: NamedArrays | list[Piece], chunk_bytes: int) -> tuple[list[TensorSpec], list[memoryview]]:
    """Header specs and zero-copy frames of contiguous arrays (or pieces of arrays)."""
    specs, frames = [], []
    for path, a, *where in arrays:
        offset, whole = where if where else (None, None)
        a = np.ascontiguousarray(a)
        raw = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        n = max(1, math.ceil(len(raw) / chunk_bytes))
        specs.append(TensorSpec(path=path, dtype=a.dtype.name, shape=list(a.shape), frames=n,
                                offset=None if offset is None else [int(o) for o in offset],
                                whole=None if whole is None else [int(w) for w in whole]))
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
                 chunk_bytes: int = 16 << 20, key_name: str = "actors.keys_dir", retain: int = 1,
                 on_error: Callable[[BaseException], None] | None = None):
        self.codec = Codec(1 << 20)
        self.chunk_bytes = chunk_bytes
        # versions served when asked for by number (a learner of several processes: the actor takes
        # process 0's newest, then that version's pieces from the others, which may have moved on)
        self.retain = max(1, retain)
        self._recent: dict[int, WeightSource] = {}
        self._sock = server_socket(ctx, zmq.ROUTER, endpoint, keys=keys, max_bytes=1 << 20, hwm=100,
                                   key_name=key_name)
        self.endpoint = bound_endpoint(self._sock)
        self.refused = RefusalCounter(self._sock)  # handshakes refused (read on the server thread)
        self._lock = threading.Lock()
        self._version = -1
        self._source: WeightSource | None = None
        # peer -> transfer in progress: (version, source, last request's time, bytes sent so far)
        self._streams: dict[bytes, tuple[int, WeightSource, float, int]] = {}
        # the bucket built last: (version, k, specs, frames, trackers); its arrays live in the frames
        self._cache: tuple[int, int, list[TensorSpec], list, list] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self.sent = 0  # transfers sent (whole versions)
        self.sent_bytes = 0  # of whole transfers (a transfer's bytes count when its last bucket goes)
        self.buckets_built = 0  # buckets materialised on the host (once per bucket while actors keep step)
        self.bad_messages = 0
        self.error: BaseException | None = None  # what stopped the server thread (the run fails on it)
        self._on_error = on_error  # called on the server thread with it (where no loop reads .error)

    def start(self) -> "WeightServer":
        self._thread.start()
        return self

    def publish(self, version: int, arrays_fn: Callable[[], NamedArrays]) -> None:
        """Make `version` the newest; arrays_fn runs on the server thread when first asked for."""
        self.publish_source(version, _WholeArrays(arrays_fn))

    def publish_source(self, version: int, source: WeightSource) -> None:
        """Make `version` the newest, served in source.buckets buckets (built on the server thread)."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"weights version went backwards: {version} < {self._version}")
            self._version, self._source = version, source
            self._recent[version] = source
            while len(self._recent) > self.retain:
                del self._recent[min(self._recent)]

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close(0)
        self.refused.close()

    def _bucket(self, version: int, source: WeightSource, k: int):
        """Bucket k of `version`, built now unless it was the last one built. The previous bucket
        is released first (after ZeroMQ is done sending it): one bucket on the host at a time."""
        if self._cache is not None and self._cache[:2] == (version, k):
            return self._cache
        if self._cache is not None:
            for tracker in self._cache[4]:
                try:
                    tracker.wait(RELEASE_WAIT_S)
                except zmq.NotDone:  # a peer that does not read: go on, it holds its own copy
                    pass
            self._cache = None
        specs, frames = to_frames(source.bucket(k), self.chunk_bytes)
        self._cache = (version, k, specs, frames, [])  # trackers: one per send of its frames
        self.buckets_built += 1
        return self._cache

    def _reply_empty(self, peer: bytes, version: int) -> None:
        header = WeightsPublished(version=max(version, 0), step=max(version, 0),
                                  location=self.endpoint, published_at=time.time())
        self._sock.send_multipart([peer, self.codec.encode(header)])

    def _serve(self, peer: bytes, req: WeightsRequest) -> None:
        now = time.monotonic()
        for p in [p for p, (_, _, t, _) in self._streams.items() if now - t > STREAM_TIMEOUT_S]:
            del self._streams[p]  # a transfer abandoned midway (the actor died): its version goes
        with self._lock:
            newest, source = self._version, self._source
            exact = self._recent.get(req.version)
        sent_before = 0  # this transfer's earlier buckets
        if req.bucket == 0 and req.version >= 0:  # exactly this version (its pieces held here)
            if exact is None:  # the header's version says which: not published here yet, or gone
                return self._reply_empty(peer, newest)
            version, source = req.version, exact
        elif req.bucket == 0:
            if source is None or req.have_version >= newest:
                return self._reply_empty(peer, newest)
            version = newest
        else:  # the next bucket of a transfer: of the version it started with
            version, source, _, sent_before = self._streams.get(peer, (-1, None, 0.0, 0))
            if source is None or version != req.version or req.bucket >= source.buckets:
                self._streams.pop(peer, None)
                return self._reply_empty(peer, req.version)  # no tensors: start again
        k, n = req.bucket, source.buckets
        _, _, specs, frames, trackers = self._bucket(version, source, k)
        sent = sent_before + sum(len(f) for f in frames)
        if k + 1 < n:
            self._streams[peer] = (version, source, now, sent)
        else:
            self._streams.pop(peer, None)
        header = WeightsPublished(version=version, step=version, location=self.endpoint,
                                  published_at=time.time(), tensors=specs, bucket=k, buckets=n)
        # zero-copy: ZeroMQ reads the arrays' own memory; the trackers say when it is done with it
        data = [zmq.Frame(f, track=True) for f in frames]
        self._sock.send_multipart([peer, self.codec.encode(header), *data], copy=False)
        trackers += [f.tracker for f in data]
        del data
        if k + 1 == n:  # counted whole, so sent_bytes / sent is a transfer's size whenever read
            self.sent += 1
            self.sent_bytes += sent

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
            if not isinstance(req, WeightsRequest) or req.bucket < 0:
                self.bad_messages += 1
                continue
            try:
                self._serve(peer, req)
            except Exception as e:  # e.g. a bucket that cannot be built: fail the run, not hang its actors
                self.error = e
                # said here too: a learner process that is not process 0 has no loop that reads .error
                print(f"weight server {self.endpoint} stopped: {e!r}", file=sys.stderr, flush=True)
                traceback.print_exc(file=sys.stderr)
                if self._on_error is not None:
                    self._on_error(e)
                return


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
        self.restarts = 0  # transfers begun again because their version was dropped midway

    def _connect(self) -> zmq.Socket:
        return client_socket(self._ctx, zmq.DEALER, self.endpoint, keys=self._keys,
                             max_bytes=max(self._chunk, 1 << 20) + (1 << 20), hwm=100)

    def _send(self, have_version: int, version: int, bucket: int) -> None:
        self._sock.send(self.codec.encode(WeightsRequest(have_version=have_version, version=version, bucket=bucket)))

    def _recv(self, timeout: float):
        if not self._sock.poll(int(max(timeout, 0.001) * 1000), zmq.POLLIN):
            raise TimeoutError(f"weights: no answer from {self.endpoint} within {timeout:g} s")
        frames = self._sock.recv_multipart(copy=False)
        header = self.codec.decode(frames[0].buffer)
        if not isinstance(header, WeightsPublished):
            raise ProtocolError(f"weights: expected a weights header, got {type(header).__name__}")
        return header, frames[1:]

    def fetch(self, have_version: int = -1, timeout: float = 60.0) -> tuple[int, NamedArrays] | None:
        """The newest weights if newer than have_version, else None. Raises TimeoutError (the
        whole transfer, every bucket, within `timeout`), ProtocolError (frames that do not match
        their header, pieces that do not tile their arrays)."""
        whole = _Assembly()
        version = self.fetch_into(whole, have_version, time.monotonic() + timeout)
        if version is None:
            return None
        arrays = whole.arrays()
        self.fetched += 1
        self.fetched_bytes += sum(a.nbytes for _, a in arrays)
        return version, arrays

    def fetch_into(self, whole: "_Assembly", have_version: int, deadline: float, exact: int = -1):
        """This server's arrays (or pieces) of its newest version newer than have_version, or of
        exactly version `exact`, added to `whole`. Returns the version; None: nothing newer;
        LATER / GONE (exact only): not published here yet / no longer served."""
        try:
            return self._fetch(whole, have_version, deadline, exact)
        except BaseException:
            # a reply may still come: a fresh socket keeps it from answering the next request
            self._sock.close(0)
            self._sock = self._connect()
            raise

    def _fetch(self, whole: "_Assembly", have_version: int, deadline: float, exact: int):
        version, k, n, begun = exact, 0, 1, len(whole)
        self._send(have_version, exact, k)
        while k < n:
            left = deadline - time.monotonic()
            if k and left <= 0:
                raise TimeoutError(f"weights: version {version} not complete from {self.endpoint} "
                                   f"({k} of {n} buckets)")
            header, frames = self._recv(left)
            if header.tensors is None:
                if exact >= 0:
                    return LATER if k == 0 and header.version < exact else GONE
                if k == 0:
                    return None  # have_version is the newest
                self.restarts += 1  # the server dropped the version midway: the newest, from the start
                version, k, n = -1, 0, 1
                whole.truncate(begun)
                self._send(have_version, version, k)
                continue
            if k and (header.version != version or header.bucket != k or header.buckets != n):
                raise ProtocolError(f"weights: asked for bucket {k} of version {version}, got bucket "
                                    f"{header.bucket} of {header.buckets} of version {header.version}")
            version, n = header.version, header.buckets
            if k + 1 < n:  # ask for the next bucket now: it is built and sent while this one is assembled
                self._send(have_version, version, k + 1)
            for spec, (_, a) in zip(header.tensors, from_frames(header.tensors, frames)):
                whole.add(spec, a)
            k += 1
        return version

    def close(self) -> None:
        self._sock.close(0)


def fetch_all(clients: list["WeightClient"], have_version: int = -1, timeout: float = 60.0,
              poll_s: float = 0.01) -> tuple[int, NamedArrays] | None:
    """The newest weights from a learner whose processes each serve their own pieces: clients[0]
    (process 0's server) names the version, the others send their pieces of exactly that version
    (waiting for one that has not published it yet; starting over if one no longer serves it)."""
    if len(clients) == 1:
        return clients[0].fetch(have_version, timeout)
    deadline = time.monotonic() + timeout
    while True:
        whole = _Assembly()
        version = clients[0].fetch_into(whole, have_version, deadline)
        if version is None:
            return None
        for c in clients[1:]:
            got = c.fetch_into(whole, -1, deadline, exact=version)
            while got is LATER:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weights: {c.endpoint} has not published version {version}")
                time.sleep(poll_s)
                got = c.fetch_into(whole, -1, deadline, exact=version)
            if got is GONE:
                break
        else:
            arrays = whole.arrays()
            clients[0].fetched += 1
            clients[0].fetched_bytes += sum(a.nbytes for _, a in arrays)
            return version, arrays


class _Assembly:
    """Whole arrays from whole ones and pieces; checks the pieces tile each array exactly."""

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}
        self._boxes: dict[str, list[tuple[tuple[int, int], ...]]] = {}
        self._added: list[str] = []  # paths in the order their arrays or pieces came

    def __len__(self) -> int:
        return len(self._added)

    def truncate(self, n: int) -> None:
        """Forget what came after the first n additions (a transfer begun again)."""
        for path in self._added[n:]:
            self._arrays.pop(path, None)
            self._boxes.pop(path, None)
        del self._added[n:]

    def add(self, spec: TensorSpec, a: np.ndarray) -> None:
        if spec.path in self._arrays and spec.path not in self._boxes:
            raise ProtocolError(f"weights: {spec.path} sent twice")
        self._added.append(spec.path)
        if spec.offset is None:
            self._arrays[spec.path] = a
            return
        whole = tuple(spec.whole or ())
        if len(spec.offset) != a.ndim or len(whole) != a.ndim or \
                any(o < 0 or o + s > w for o, s, w in zip(spec.offset, a.shape, whole)):
            raise ProtocolError(f"weights: a piece of {spec.path} {list(a.shape)} at {spec.offset} "
                                f"does not fit its array {list(whole)}")
        out = self._arrays.get(spec.path)
        if out is None:
            out = self._arrays[spec.path] = np.empty(whole, a.dtype)
            self._boxes[spec.path] = []
        elif out.shape != whole or out.dtype != a.dtype:
            raise ProtocolError(f"weights: pieces of {spec.path} disagree on its shape or dtype")
        box = tuple((o, o + s) for o, s in zip(spec.offset, a.shape))
        if any(all(lo < b_hi and b_lo < hi for (lo, hi), (b_lo, b_hi) in zip(box, other))
               for other in self._boxes[spec.path] if a.size):
            raise ProtocolError(f"weights: pieces of {spec.path} overlap at {spec.offset}")
        self._boxes[spec.path].append(box)
        out[tuple(slice(lo, hi) for lo, hi in box)] = a

    def arrays(self) -> NamedArrays:
        for path, boxes in self._boxes.items():
            covered = sum(math.prod(hi - lo for lo, hi in box) for box in boxes)
            if covered != self._arrays[path].size:
                raise ProtocolError(f"weights: pieces of {path} cover {covered} of its "
                                    f"{self._arrays[path].size} elements")
        return list(self._arrays.items())

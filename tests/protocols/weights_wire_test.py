"""Weights over ZeroMQ: raw frames round-trip exactly (chunked, bf16, empty), a bad transfer is
refused, actors get only the newest version, and each version is materialised once."""
import contextlib

import ml_dtypes
import numpy as np
import pytest
import zmq

from cadence.protocols.errors import ProtocolError
from cadence.protocols.messages import TensorSpec
from cadence.protocols.weights_wire import WeightClient, WeightServer, fetch_all, from_frames, to_frames
from tests import waiting


@contextlib.contextmanager
def served(client: dict | None = None, **server_kwargs):
    """A started WeightServer on loopback and one WeightClient of it, closed afterwards."""
    ctx = zmq.Context()
    server = WeightServer("tcp://127.0.0.1:0", ctx=ctx, **server_kwargs).start()
    c = WeightClient(server.endpoint, ctx=ctx, **(client or {}))
    try:
        yield server, c, ctx
    finally:
        c.close()
        server.stop()
        ctx.destroy(linger=0)


@contextlib.contextmanager
def two_learner_processes():
    """Two started WeightServers (two learner processes' pieces, each keeping 2 versions) and a
    client of each, closed afterwards."""
    ctx = zmq.Context()
    servers = [WeightServer("tcp://127.0.0.1:0", ctx=ctx, retain=2).start() for _ in range(2)]
    clients = [WeightClient(s.endpoint, ctx=ctx) for s in servers]
    try:
        yield servers, clients
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop()
        ctx.destroy(linger=0)


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return [("['a'].value", rng.standard_normal((33, 7)).astype(np.float32)),
            ("['b'].value", rng.standard_normal(1000).astype(ml_dtypes.bfloat16)),
            ("['c']", np.arange(6, dtype=np.int32).reshape(2, 3)),
            ("['empty']", np.zeros((0, 4), np.float32)),
            ("['strided']", rng.standard_normal((10, 10)).astype(np.float32)[:, ::2])]


def test_frames_round_trip_exactly_with_chunking():
    specs, frames = to_frames(arrays(), chunk_bytes=100)
    assert sum(s.frames for s in specs) == len(frames) and max(len(f) for f in frames) <= 100
    back = from_frames(specs, [bytes(f) for f in frames])
    for (p, a), (q, b) in zip(arrays(), back):
        assert p == q and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


def test_a_transfer_that_does_not_match_its_header_is_refused():
    specs, frames = to_frames(arrays()[:1], chunk_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="header lists 1 frames, got 2"):
        from_frames(specs, [bytes(frames[0]), b"x"])
    with pytest.raises(ProtocolError, match=r"\['a'\].value should have 924 bytes"):
        from_frames(specs, [bytes(frames[0])[:-4]])
    with pytest.raises(ProtocolError):
        from_frames([TensorSpec(path="x", dtype="float32", shape=[2], frames=1)], [b"123"])


def test_actors_get_the_newest_version_and_each_version_is_built_once():
    ctx = zmq.Context()
    server = WeightServer("tcp://127.0.0.1:0", ctx=ctx, chunk_bytes=256).start()
    built = []

    def version(v):
        def fn():
            built.append(v)
            return arrays(seed=v)
        return fn

    clients = [WeightClient(server.endpoint, ctx=ctx, chunk_bytes=256) for _ in range(2)]
    assert clients[0].fetch(-1, timeout=5) is None  # nothing published yet
    for v in range(1, 4):
        server.publish(v, version(v))  # 1 and 2 are never asked for: never built, never sent
    for c in clients:
        v, got = c.fetch(-1, timeout=5)
        assert v == 3
        np.testing.assert_array_equal(got[0][1], arrays(seed=3)[0][1])
        assert c.fetch(3, timeout=5) is None  # already the newest
    assert built == [3] and server.sent == 2
    with pytest.raises(ValueError, match="backwards"):
        server.publish(2, version(2))
    for c in clients:
        c.close()
    server.stop()
    ctx.destroy(linger=0)


class Pieces:
    """A WeightSource as a sharded learner's is: each array cut into row blocks, in buckets."""

    def __init__(self, named, rows, per_bucket):
        self.named = named
        pieces = [(p, a[lo:lo + rows], [lo] + [0] * (a.ndim - 1), a.shape)
                  for p, a in named for lo in range(0, len(a), rows)]
        self._buckets = [pieces[i:i + per_bucket] for i in range(0, len(pieces), per_bucket)]
        self.buckets = len(self._buckets)
        self.built = []

    def bucket(self, k):
        self.built.append(k)
        return [(p, a.copy(), o, w) for p, a, o, w in self._buckets[k]]


def grid(seed):
    rng = np.random.default_rng(seed)
    return [("['w']", rng.standard_normal((10, 3)).astype(np.float32)),
            ("['b']", rng.standard_normal(7).astype(ml_dtypes.bfloat16))]


def test_a_version_streamed_in_buckets_is_assembled_exactly_and_built_one_bucket_at_a_time():
    ctx = zmq.Context()
    server = WeightServer("tcp://127.0.0.1:0", ctx=ctx, chunk_bytes=16).start()
    try:
        source = Pieces(grid(1), rows=3, per_bucket=2)
        assert source.buckets == 4
        server.publish_source(1, source)
        clients = [WeightClient(server.endpoint, ctx=ctx, chunk_bytes=16) for _ in range(2)]
        for c in clients:
            v, got = c.fetch(-1, timeout=5)
            assert v == 1 and [p for p, _ in got] == ["['w']", "['b']"]
            for (p, a), (q, b) in zip(grid(1), got):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
            assert c.fetch(1, timeout=5) is None
        # each bucket built when asked for, one at a time (clients in turn: each built again)
        assert source.built == [0, 1, 2, 3] * 2 and server.sent == 2
    finally:
        for c in clients:
            c.close()
        server.stop()
        ctx.destroy(linger=0)


def test_a_transfer_keeps_its_version_when_a_newer_one_is_published_midway():
    with served() as (server, client, ctx):
        first = Pieces(grid(1), rows=2, per_bucket=1)
        server.publish_source(1, first)
        real = first.bucket

        def then_publish(k):  # the learner moves on while bucket 1 of version 1 is being sent
            if k == 1:
                server.publish_source(2, Pieces(grid(2), rows=2, per_bucket=1))
            return real(k)

        first.bucket = then_publish
        v, got = client.fetch(-1, timeout=5)
        assert v == 1 and all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(grid(1), got))
        v, got = client.fetch(1, timeout=5)
        assert v == 2 and all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(grid(2), got))


def test_pieces_that_do_not_tile_their_array_are_refused():
    with served() as (server, client, ctx):
        a = np.arange(8, dtype=np.float32)
        for version, pieces, match in (
                (1, [("x", a[:4], [0], [8])], "cover 4 of its 8"),
                (2, [("x", a[:4], [0], [8]), ("x", a[2:6], [2], [8]), ("x", a[6:], [6], [8])], "overlap"),
                (3, [("x", a[:4], [6], [8])], "does not fit")):
            source = Pieces([], 1, 1)
            source.buckets, source.bucket = 1, lambda k, p=pieces: p
            server.publish_source(version, source)
            with pytest.raises(ProtocolError, match=match):
                client.fetch(-1, timeout=5)


def test_big_buckets_sent_zero_copy_are_released_so_the_next_bucket_is_not_held_up():
    # frames over ZeroMQ's copy threshold are sent from the arrays' own memory; the server drops a
    # bucket before it builds the next, once ZeroMQ is done with it (a bucket it kept a reference
    # to would never be done: each later bucket would wait RELEASE_WAIT_S)
    with served() as (server, client, ctx):
        big = [("['w']", np.random.default_rng(0).standard_normal((8, 65536)).astype(np.float32))]
        server.publish_source(1, Pieces(big, rows=2, per_bucket=1))  # 4 buckets of 512 KiB
        v, got = client.fetch(-1, timeout=20)
        assert v == 1 and got[0][1].tobytes() == big[0][1].tobytes()


class Half(Pieces):
    """One learner process's pieces: the rows of each array from `lo` on (or before)."""

    def __init__(self, named, upper):
        super().__init__(named, rows=5, per_bucket=1)
        self._buckets = [b for b in self._buckets if (b[0][2][0] >= 5) == upper]
        self.buckets = len(self._buckets)


def test_a_learner_of_two_processes_each_serving_its_pieces_is_fetched_whole_at_one_version():
    import threading

    named = lambda v: [("['w']", np.full((10, 3), v, np.float32))]  # noqa: E731
    with two_learner_processes() as (servers, clients):
        servers[0].publish_source(1, Half(named(1), upper=False))
        # the other process publishes version 1 a little later: the client waits for it
        late = threading.Timer(0.3, lambda: servers[1].publish_source(1, Half(named(1), upper=True)))
        late.start()
        v, got = fetch_all(clients, -1, timeout=10)
        assert v == 1 and got[0][1].tobytes() == named(1)[0][1].tobytes()
        # process 0 at 2 while the other has moved on to 3: it still serves 2 (retain=2)
        servers[0].publish_source(2, Half(named(2), upper=False))
        servers[1].publish_source(2, Half(named(2), upper=True))
        servers[1].publish_source(3, Half(named(3), upper=True))
        v, got = fetch_all(clients, 1, timeout=10)
        assert v == 2 and got[0][1].tobytes() == named(2)[0][1].tobytes()
        assert fetch_all(clients, 2, timeout=10) is None


def test_a_bucket_that_cannot_be_built_stops_the_server_with_its_error():
    with served() as (server, client, ctx):
        source = Pieces(grid(1), rows=3, per_bucket=2)

        def broken(k):
            raise RuntimeError("Array has been deleted")

        source.bucket = broken
        server.publish_source(1, source)
        with pytest.raises(TimeoutError):
            client.fetch(-1, timeout=1)
        assert isinstance(server.error, RuntimeError)  # Pipeline.health() fails the run with it


def test_a_learner_process_holding_no_piece_answers_with_an_empty_transfer():
    # e.g. a mesh of 3 that no array divides: every array is replicated and process 0 holds it
    from cadence.learner.weight_stream import ShardStream

    named = [("['w']", np.arange(12, dtype=np.float32).reshape(4, 3))]
    with two_learner_processes() as (servers, clients):
        nothing = ShardStream({}, [], dtype=None, bucket_bytes=1 << 20)
        assert nothing.buckets == 1 and nothing.bucket(0) == []
        servers[0].publish_source(1, Pieces(named, rows=4, per_bucket=1))
        servers[1].publish_source(1, nothing)
        v, got = fetch_all(clients, -1, timeout=10)
        assert v == 1 and got[0][1].tobytes() == named[0][1].tobytes()
        assert servers[1].error is None


def test_a_failed_server_calls_on_error_on_its_own_thread():
    # a learner process other than 0 has no loop that reads .error: on_error exits it (learner_group)
    import threading

    ctx = zmq.Context()
    seen = []
    called = threading.Event()
    server = WeightServer("tcp://127.0.0.1:0", ctx=ctx,
                          on_error=lambda e: (seen.append((e, threading.current_thread().name)), called.set())).start()
    client = WeightClient(server.endpoint, ctx=ctx)
    try:
        source = Pieces(grid(1), rows=3, per_bucket=2)
        source.bucket = lambda k: [][k]  # bucket 0 of none
        server.publish_source(1, source)
        with pytest.raises(TimeoutError):
            client.fetch(-1, timeout=1)
        assert called.wait(5) and isinstance(seen[0][0], IndexError) and seen[0][1] == "weight-server"
    finally:
        client.close()
        server.stop()
        ctx.destroy(linger=0)


def test_a_transfer_counts_bytes_and_all_when_its_last_bucket_goes():
    # metrics read mid-transfer must agree: sent_bytes / sent is always a whole transfer's size
    with served() as (server, client, ctx):
        named = grid(1)
        server.publish_source(1, Pieces(named, rows=3, per_bucket=2))  # 4 buckets
        client._send(-1, -1, 0)
        header, _ = client._recv(10)
        assert header.bucket == 0 and header.buckets == 4
        assert (server.sent, server.sent_bytes) == (0, 0)  # bucket 0 went; the transfer has not
        client._send(-1, 1, 1)
        client._recv(10)
        assert (server.sent, server.sent_bytes) == (0, 0)
        v, got = WeightClient(server.endpoint, ctx=ctx).fetch(-1, timeout=10)
        assert v == 1
        # the server counts right after its send returns: the client may have the bytes first
        whole = (1, sum(a.nbytes for _, a in named))
        waiting.wait_for(lambda: (server.sent, server.sent_bytes) == whole, 10, f"the transfer counted as {whole}")

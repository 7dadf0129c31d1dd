"""Weights over ZeroMQ: raw frames round-trip exactly (chunked, bf16, empty), a bad transfer is
refused, actors get only the newest version, and each version is materialised once."""
import ml_dtypes
import numpy as np
import pytest
import zmq

from cadence.protocols.errors import ProtocolError
from cadence.protocols.messages import TensorSpec
from cadence.protocols.weights_wire import WeightClient, WeightServer, from_frames, to_frames


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

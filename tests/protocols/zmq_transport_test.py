"""ZeroMQ sockets: the BytesTransport contract, loopback-only binds, Curve authentication, size limits.
Every socket here is on 127.0.0.1 or ipc://."""
import os
import time

import pytest
import zmq

from cadence.protocols.transport import TransportClosed, TransportFull
from cadence.protocols.zmq_transport import (
    CurveKeys,
    SecurityError,
    ZmqTransport,
    bound_endpoint,
    check_bind,
    client_socket,
    server_socket,
    write_keys,
)


@pytest.mark.parametrize("where", ["tcp", "ipc"])
def test_push_pull_round_trip_keeps_order_and_bytes(ctx, tmp_path, where):
    endpoint = "tcp://127.0.0.1:0" if where == "tcp" else f"ipc://{tmp_path}/t.sock"
    pull = ZmqTransport(endpoint, "pull", bind=True, ctx=ctx)
    push = ZmqTransport(pull.endpoint, "push", bind=False, ctx=ctx)
    payloads = [os.urandom(n) for n in (0, 1, 1000, 200_000)]
    for p in payloads:
        push.put_bytes(p, timeout=5)
    assert [pull.get_bytes(timeout=5) for _ in payloads] == payloads
    t0 = time.monotonic()
    assert pull.get_bytes(timeout=0.2) is None  # a timeout, not an error
    assert time.monotonic() - t0 >= 0.15
    push.close()
    pull.close()
    with pytest.raises(TransportClosed):
        push.put_bytes(b"x")
    assert pull.get_bytes(timeout=0.1) is None


def test_big_messages_arrive_uncopied_and_decode(ctx):
    from cadence.protocols.codec import decode, encode
    from cadence.protocols.testing import rollout_group

    pull = ZmqTransport("tcp://127.0.0.1:0", "pull", bind=True, ctx=ctx)
    push = ZmqTransport(pull.endpoint, "push", bind=False, ctx=ctx)
    big = rollout_group("p", "t", [1], [[5] * 20_000], [[-0.5] * 20_000], [1.0])
    small = rollout_group("q", "t", [1], [[5]], [[-0.5]], [0.0])
    sizes = []
    for msg in (big, big, small, big):
        push.put_bytes(encode(msg), timeout=5)
        data = pull.get_bytes(timeout=5)
        sizes.append(len(data))
        assert decode(data) == msg
    # after one big message the next one is taken as ZeroMQ's frame; a small one comes back as bytes
    assert sizes[0] > 64 * 1024 and sizes[2] < 1000
    kinds = []
    for msg in (big, small, big):  # the guess follows the previous message's size
        push.put_bytes(encode(msg), timeout=5)
        kinds.append(type(pull.get_bytes(timeout=5)))
    assert kinds == [memoryview, bytes, bytes]
    push.close()
    pull.close()


def test_put_without_a_taker_times_out_with_transport_full(ctx):
    push = ZmqTransport("tcp://127.0.0.1:0", "push", bind=True, ctx=ctx, maxsize=1)
    with pytest.raises(TransportFull, match="no peer is taking messages"):
        push.put_bytes(b"x", timeout=0.2)


def test_binding_beyond_loopback_needs_keys_and_names_the_key(tmp_path):
    for local in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:7", "ipc:///tmp/x", "inproc://a"):
        check_bind(local, authenticated=False)
    for wide in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:1", "tcp://myhost:9"):
        with pytest.raises(SecurityError, match="actors.keys_dir: binding .* beyond loopback"):
            check_bind(wide, authenticated=False)
        check_bind(wide, authenticated=True)


def test_keys_are_written_once_and_loaded(tmp_path):
    keys = write_keys(str(tmp_path / "k"))
    assert keys.server_secret and keys.client_secret and os.listdir(keys.authorized_dir) == ["client.key"]
    assert oct(os.stat(tmp_path / "k" / "server.key_secret").st_mode)[-3:] == "600"
    with pytest.raises(SecurityError, match="refusing to overwrite"):
        write_keys(str(tmp_path / "k"))
    with pytest.raises(SecurityError, match="does not exist"):
        CurveKeys.load(str(tmp_path / "nothing"))


def test_curve_lets_the_authorized_client_in_and_an_unknown_key_gets_nothing_through(ctx, tmp_path):
    keys = write_keys(str(tmp_path / "k"))
    server = server_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", keys=keys, max_bytes=1 << 20)
    endpoint = bound_endpoint(server)
    # an intruder: knows the server's public key but has its own, unauthorized pair
    public, secret = zmq.curve_keypair()
    intruder = ctx.socket(zmq.DEALER)
    intruder.curve_serverkey, intruder.curve_publickey, intruder.curve_secretkey = keys.server_public, public, secret
    intruder.connect(endpoint)
    plain = ctx.socket(zmq.DEALER)  # no Curve at all
    plain.connect(endpoint)
    for s in (intruder, plain):
        s.send(b"let me in", zmq.NOBLOCK)
    assert server.poll(1000) == 0  # nothing reached the application
    friend = client_socket(ctx, zmq.DEALER, endpoint, keys=keys, max_bytes=1 << 20)
    friend.send(b"hello")
    assert server.poll(5000)
    assert server.recv_multipart()[1] == b"hello"
    for s in (intruder, plain):
        s.close(0)


def test_a_peer_over_the_size_limit_is_cut_off(ctx):
    server = server_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", keys=None, max_bytes=1000)
    big = ctx.socket(zmq.PUSH)
    big.connect(bound_endpoint(server))
    big.send(b"x" * 5000)
    assert server.poll(500) == 0
    small = client_socket(ctx, zmq.PUSH, bound_endpoint(server), keys=None, max_bytes=1000)
    small.send(b"y" * 10)
    assert server.poll(5000) and server.recv() == b"y" * 10
    big.close(0)

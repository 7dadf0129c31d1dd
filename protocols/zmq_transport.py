"""ZeroMQ: sockets for other processes and hosts, with the in-process queue's semantics.

    keys = CurveKeys.load(dir) if dir else None           # `cadence keys DIR` writes them
    sock = server_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", keys=keys, max_bytes=64 << 20)
    endpoint = bound_endpoint(sock)                       # the port the OS picked
    peer = client_socket(ctx, zmq.DEALER, endpoint, keys=keys, max_bytes=64 << 20)

Security: a server binds loopback (`127.0.0.0/8`, `::1`, `localhost`), `ipc://` or `inproc://`
freely; binding any other address needs Curve keys, and `check_bind` refuses it otherwise, naming
the config key. With keys, the server authenticates every client against the public keys in
`authorized_clients/` (ZAP, run by pyzmq's authenticator thread): a client with an unknown key
completes no handshake, so none of its bytes reach the application. Every receiving socket has a
maximum message size (`MAXMSGSIZE`): a peer that sends more is disconnected by ZeroMQ itself.

`ZmqTransport` is the `BytesTransport` view (PUSH on one side, PULL on the other) with the
`InProcessTransport` contract: `put_bytes(data, timeout)` blocks while the high-water mark is
reached and raises `TransportFull` after its timeout, `get_bytes(timeout)` returns None on timeout
or once closed, and after `close()` puts raise `TransportClosed`. The dispatcher protocol
(protocols/dispatch.py) uses ROUTER/DEALER sockets made by the same two functions.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import threading
import time
import weakref
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocols.transport import TransportClosed, TransportFull, _deadline

SERVER_KEY = "server"
ZERO_COPY_BYTES = 64 * 1024  # messages this big are received uncopied (read in ZeroMQ's own frames)
CLIENT_KEY = "client"
AUTHORIZED = "authorized_clients"


class SecurityError(ValueError):
    """A socket would listen beyond loopback without authentication, or keys are missing."""


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """A CurveZMQ key set as `write_keys` lays it out in one directory.

    server_public is all a client needs of the server; a server also needs server_secret and the
    authorized client keys; a client needs its own pair."""

    directory: str
    server_public: bytes
    server_secret: bytes | None
    client_public: bytes | None
    client_secret: bytes | None

    @classmethod
    def load(cls, directory: str) -> "CurveKeys":
        directory = os.path.abspath(directory)
        path = os.path.join(directory, f"{SERVER_KEY}.key")
        if not os.path.isfile(path):
            raise SecurityError(f"keys: {path} does not exist (write a key set with `cadence keys {directory}`)")
        server_public, _ = zmq.auth.load_certificate(path)
        server_secret = client_public = client_secret = None
        secret = os.path.join(directory, f"{SERVER_KEY}.key_secret")
        if os.path.isfile(secret):
            _, server_secret = zmq.auth.load_certificate(secret)
        client = os.path.join(directory, f"{CLIENT_KEY}.key_secret")
        if os.path.isfile(client):
            client_public, client_secret = zmq.auth.load_certificate(client)
        return cls(directory, server_public, server_secret, client_public, client_secret)

    @property
    def authorized_dir(self) -> str:
        return os.path.join(self.directory, AUTHORIZED)


def write_keys(directory: str) -> CurveKeys:
    """Writes a server pair, one client pair, and authorizes that client. Returns the set.

    Hand `server.key` (public) plus `client.key` and `client.key_secret` to actor hosts; keep
    `server.key_secret` on the learner. More clients: put their public `.key` files into
    `authorized_clients/`."""
    if not zmq.has("curve"):
        raise SecurityError("keys: this libzmq has no CurveZMQ support")
    os.makedirs(directory, exist_ok=True)
    authorized = os.path.join(directory, AUTHORIZED)
    os.makedirs(authorized, exist_ok=True)
    for name in (SERVER_KEY, CLIENT_KEY):
        if os.path.exists(os.path.join(directory, f"{name}.key")):
            raise SecurityError(f"keys: {directory} already holds {name}.key; refusing to overwrite a key set")
    zmq.auth.create_certificates(directory, SERVER_KEY)
    public, _ = zmq.auth.create_certificates(directory, CLIENT_KEY)
    with open(public, "rb") as src, open(os.path.join(authorized, f"{CLIENT_KEY}.key"), "wb") as dst:
        dst.write(src.read())
    for name in (SERVER_KEY, CLIENT_KEY):
        os.chmod(os.path.join(directory, f"{name}.key_secret"), 0o600)
    return CurveKeys.load(directory)


def is_local_endpoint(endpoint: str) -> bool:
    """True for inproc://, ipc:// and tcp:// on a loopback address."""
    scheme = endpoint.split("://", 1)[0]
    if scheme in ("inproc", "ipc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*" or an interface / host name: not provably loopback
        return False


def check_bind(endpoint: str, authenticated: bool, key_name: str = "actors.keys_dir") -> None:
    """Refuse to listen beyond loopback without Curve keys (the error names `key_name`)."""
    if "://" not in endpoint:
        raise ValueError(f"endpoint: {endpoint!r} is not tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if not is_local_endpoint(endpoint) and not authenticated:
        raise SecurityError(f"{key_name}: binding {endpoint} reaches beyond loopback, and peers there must "
                            f"authenticate: write keys with `cadence keys DIR` and set {key_name}=DIR")


_auth_lock = threading.Lock()
_authenticators: "weakref.WeakKeyDictionary[zmq.Context, ThreadAuthenticator]" = weakref.WeakKeyDictionary()


def _authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """One ZAP authenticator per context, allowing exactly the keys in authorized_clients/.
    (Without one, a Curve server would accept any client key.)"""
    with _auth_lock:
        auth = _authenticators.get(ctx)
        if auth is not None:
            if auth._cadence_location != keys.authorized_dir:
                raise SecurityError("keys: one ZeroMQ context cannot serve two key sets")
            return
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=keys.authorized_dir)
        auth._cadence_location = keys.authorized_dir
        _authenticators[ctx] = auth


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the context's authenticator thread (before destroying the context)."""
    with _auth_lock:
        auth = _authenticators.pop(ctx, None)
    if auth is not None:
        auth.stop()


def _common(sock: zmq.Socket, max_bytes: int, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)


def server_socket(ctx: zmq.Context, kind: int, endpoint: str, *, keys: CurveKeys | None, max_bytes: int,
                  hwm: int = 1000, key_name: str = "actors.keys_dir") -> zmq.Socket:
    """A bound socket; tcp port 0 picks a free one (read it back with bound_endpoint)."""
    check_bind(endpoint, keys is not None, key_name)
    if keys is not None and keys.server_secret is None and not endpoint.startswith("inproc://"):
        raise SecurityError(f"{key_name}: {keys.directory} has no server.key_secret; a server needs it")
    sock = ctx.socket(kind)
    _common(sock, max_bytes, hwm)
    if keys is not None and not endpoint.startswith("inproc://"):
        _authenticator(ctx, keys)
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a message to a gone peer is dropped, not an error
    bind = endpoint[:-1] + "*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint
    try:
        sock.bind(bind)
    except zmq.ZMQError as e:
        sock.close(0)
        raise OSError(f"cannot listen on {endpoint}: {e}") from None
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def client_socket(ctx: zmq.Context, kind: int, endpoint: str, *, keys: CurveKeys | None, max_bytes: int,
                  hwm: int = 1000) -> zmq.Socket:
    """A connected socket; with keys it authenticates as keys' client pair."""
    sock = ctx.socket(kind)
    _common(sock, max_bytes, hwm)
    if keys is not None and not endpoint.startswith("inproc://"):
        if keys.client_secret is None:
            raise SecurityError(f"keys: {keys.directory} has no client.key_secret; a client needs its own pair")
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.connect(endpoint)
    return sock


class ZmqTransport:
    """One direction of a BytesTransport over ZeroMQ: mode "push" sends, "pull" receives.

    Exactly one side binds (bind=True). `maxsize` maps onto the high-water mark, so backpressure
    works as with a bounded InProcessTransport (per peer, plus ZeroMQ's kernel buffers).
    Not thread-safe: one thread per transport object, like a socket.
    """

    def __init__(self, endpoint: str, mode: str, *, bind: bool, ctx: zmq.Context | None = None,
                 keys: CurveKeys | None = None, max_bytes: int = 64 << 20, maxsize: int = 1000):
        if mode not in ("push", "pull"):
            raise ValueError(f"mode: must be 'push' or 'pull', got {mode!r}")
        self.mode = mode
        self._ctx = ctx or zmq.Context.instance()
        kind = zmq.PUSH if mode == "push" else zmq.PULL
        make = server_socket if bind else client_socket
        self._sock = make(self._ctx, kind, endpoint, keys=keys, max_bytes=max_bytes, hwm=max(maxsize, 1))
        self.endpoint = bound_endpoint(self._sock) if bind else endpoint
        self._closed = False
        self._zero_copy = False  # receive the next message without copying it (see _recv)

    @property
    def closed(self) -> bool:
        return self._closed

    def put_bytes(self, data: bytes, timeout: float | None = None) -> None:
        if self.mode != "push":
            raise TypeError("put_bytes on a pull transport")
        if self._closed:
            raise TransportClosed("put on a closed transport")
        deadline = _deadline(timeout)
        while True:
            try:
                # Copied into ZeroMQ at every size: an uncopied send of a freshly encoded group cost
                # more (its release runs on pyzmq's gc thread; benchmarks/zmq_bench.py: 0.67 vs
                # 0.76 of raw at 132 KB, 0.49 vs 0.62 at 2 MB).
                self._sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TransportFull(f"put timed out after {timeout} s: no peer is taking messages "
                                    f"(high-water mark reached or no peer connected)")
            wait_ms = 50 if remaining is None else max(1, min(50, int(remaining * 1000)))
            try:
                self._sock.poll(wait_ms, zmq.POLLOUT)
            except zmq.ZMQError:
                if not self._closed:
                    raise
            if self._closed:
                raise TransportClosed("transport closed while waiting to put")

    def get_bytes(self, timeout: float | None = None) -> bytes | memoryview | None:
        """The next message, or None on timeout or once closed.

        A message of ZERO_COPY_BYTES or more comes back as a read-only memoryview of ZeroMQ's own
        frame (no copy; Codec.decode takes it like bytes), a smaller one as bytes."""
        if self.mode != "pull":
            raise TypeError("get_bytes on a push transport")
        if self._closed:
            return None
        try:  # a message is usually waiting when the consumer is busy: no poll (~6 us a call)
            return self._recv()
        except zmq.Again:
            pass
        except zmq.ZMQError:
            if self._closed:
                return None
            raise
        deadline = _deadline(timeout)
        while not self._closed:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            wait_ms = 50 if remaining is None else max(0, min(50, int(remaining * 1000)))
            try:
                if self._sock.poll(wait_ms, zmq.POLLIN):
                    return self._recv()
            except zmq.Again:  # another reader of the same socket took it (not ours to prevent)
                continue
            except zmq.ZMQError:
                if self._closed:  # closed by another thread while we waited
                    return None
                raise
        return None

    def _recv(self) -> bytes | memoryview:
        # Copying a big frame into bytes costs more than the frame object; a small one the other
        # way round. The size is known only after receiving, so guess from the previous message.
        if not self._zero_copy:
            data = self._sock.recv(zmq.NOBLOCK)
            self._zero_copy = len(data) >= ZERO_COPY_BYTES
            return data
        frame = self._sock.recv(zmq.NOBLOCK, copy=False)
        self._zero_copy = len(frame) >= ZERO_COPY_BYTES
        return frame.buffer if self._zero_copy else frame.bytes

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(0)

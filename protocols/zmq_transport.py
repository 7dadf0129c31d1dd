"""ZeroMQ: sockets for other processes and hosts, with the in-process queue's semantics.

    keys = CurveKeys.load(dir) if dir else None           # `cadence keys DIR` writes them
    sock = server_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", keys=keys, max_bytes=64 << 20)
    endpoint = bound_endpoint(sock)                       # the port the OS picked
    peer = client_socket(ctx, zmq.DEALER, endpoint, keys=keys, max_bytes=64 << 20)

Security: a server binds loopback (`127.0.0.0/8`, `::1`, `localhost`), `ipc://` or `inproc://`
freely; binding any other address needs Curve keys, and `check_bind` refuses it otherwise, naming
the config key. With keys, the server authenticates every client against the public keys in
`authorized_clients/` (ZAP, run by pyzmq's authenticator thread): a client with an unknown key
completes no handshake, so none of its bytes reach the application. Without keys, an `ipc://`
server admits only processes of its own user: the kernel hands ZeroMQ the peer's uid and the same
ZAP thread refuses any other (the socket's directory, `private_dir`, mode 0700, already keeps other
users from connecting at all; the uid check holds where that does not, e.g. for root). A refused
handshake is counted (`RefusalCounter`). Every receiving socket has a maximum message size
(`MAXMSGSIZE`): a peer that sends more is disconnected by ZeroMQ itself.

    directory = private_dir(run_dir)                     # RUN_DIR/sockets, 0700 (or a short one)
    sock = server_socket(ctx, zmq.ROUTER, f"ipc://{directory}/dispatch", keys=None, max_bytes=...)
    refused = RefusalCounter(sock)                       # refused.poll() -> handshakes refused so far

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
import stat
import tempfile
import threading
import time
import uuid
import weakref
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from cadence.protocols.transport import TransportClosed, TransportFull, _deadline

SERVER_KEY = "server"
ZERO_COPY_BYTES = 64 * 1024  # messages this big are received uncopied (read in ZeroMQ's own frames)
CLIENT_KEY = "client"
AUTHORIZED = "authorized_clients"
IPC_DOMAIN = b"cadence-ipc"  # the ZAP domain of ipc:// servers without keys: their peers' uid is checked
SOCKETS_DIR = "sockets"  # private_dir's folder in a run directory
_IPC_PATH_MAX = 100  # bytes of a Unix socket path (sun_path holds 107 plus NUL; kept short of it)


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


def private_dir(run_dir: str, longest_name: str = "dispatch.weights") -> str:
    """A directory for a run's ipc:// sockets that only this user can enter: RUN_DIR/sockets, mode
    0700 (refused if it is a link or another user's). Unix socket paths are short (~107 bytes): when
    RUN_DIR/sockets/`longest_name` would be longer, a fresh 0700 directory under the temporary folder
    instead (the caller removes it; endpoint.json tells actors where)."""
    path = os.path.join(os.path.abspath(run_dir), SOCKETS_DIR)
    if len(os.path.join(path, longest_name).encode()) > _IPC_PATH_MAX:
        return tempfile.mkdtemp(prefix="cadence-")  # 0700 by definition
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise SecurityError(f"actors.listen: {path} must be a directory of this user (uid {os.getuid()}), "
                            f"not a link or another user's; remove it")
    os.chmod(path, 0o700)  # whatever the umask or an earlier run left
    return path


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, plus the rule for ipc:// servers without keys: a NULL handshake passes
    only from a peer process of this user (libzmq puts the peer's uid:gid:pid, from SO_PEERCRED,
    at the end of the address it gives ZAP)."""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 6 and msg[5] == b"NULL" and msg[2] == IPC_DOMAIN:
            parts = msg[3].decode("ascii", "replace").rsplit(":", 3)
            uid = parts[1] if len(parts) == 4 else ""
            if uid == str(os.getuid()):
                self._send_zap_reply(msg[1], b"200", b"OK", "local")
            else:
                self._send_zap_reply(msg[1], b"400", b"another user")
            return
        await super().handle_zap_message(msg)


_auth_lock = threading.Lock()
_authenticators: "weakref.WeakKeyDictionary[zmq.Context, _Authenticator]" = weakref.WeakKeyDictionary()


def _authenticator(ctx: zmq.Context, keys: CurveKeys | None) -> None:
    """One ZAP authenticator per context: with keys, it allows exactly the keys in
    authorized_clients/ (without one, a Curve server would accept any client key); it always
    applies the same-user rule to ipc:// servers without keys."""
    with _auth_lock:
        auth = _authenticators.get(ctx)
        if auth is None:
            auth = _Authenticator(ctx)
            auth.start()
            auth._cadence_location = None
            _authenticators[ctx] = auth
        if keys is None:
            return
        if auth._cadence_location is None:
            auth.configure_curve(domain="*", location=keys.authorized_dir)
            auth._cadence_location = keys.authorized_dir
        elif auth._cadence_location != keys.authorized_dir:
            raise SecurityError("keys: one ZeroMQ context cannot serve two key sets")


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the context's authenticator thread (before destroying the context)."""
    with _auth_lock:
        auth = _authenticators.pop(ctx, None)
    if auth is not None:
        auth.stop()


_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class RefusalCounter:
    """Counts the handshakes a server socket refused: an unknown Curve key, a client without keys
    at a Curve server, a process of another user at an ipc:// server (ZeroMQ's socket monitor).
    `poll()` reads the events waiting and returns the count so far; `socket` can join a poller.
    Not thread-safe: the thread that owns the server socket calls it."""

    def __init__(self, sock: zmq.Socket):
        # pyzmq names the monitor's inproc endpoint after the socket's fd: a server restarted in the
        # same context can get the old fd back before ZeroMQ has released that name ("Address
        # already in use", seen in dispatch_server_test's restart); a name of its own cannot clash.
        self.socket = sock.get_monitor_socket(_REFUSED, addr=f"inproc://cadence-refused-{uuid.uuid4().hex}")
        self.refused = 0
        self.last = ""  # the last refusal, for logs: "HANDSHAKE_FAILED_AUTH from ipc://..."

    def poll(self) -> int:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.refused
            except zmq.ZMQError:  # closed
                return self.refused
            event = parse_monitor_message(frames)
            self.refused += 1
            self.last = f"{zmq.Event(event['event']).name} on {event['endpoint'].decode(errors='replace')}"

    def close(self) -> None:
        self.socket.close(0)


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
    elif endpoint.startswith("ipc://"):
        _authenticator(ctx, None)
        sock.zap_domain = IPC_DOMAIN  # NULL handshakes go to ZAP: the peer's uid is checked
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

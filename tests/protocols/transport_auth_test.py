"""Who may connect to a run (issue 31, finding 1): the default ipc:// socket in a private directory
admits only this user's processes, a Curve server only its keys; every refused handshake is counted
(actors/refused_connections) and nothing of the stranger's reaches the dispatcher.

The tests that play another user run a child process as `nobody` (they need root to switch users)."""
import functools
import multiprocessing as mp
import os
import shutil
import stat
import tempfile

import pytest
import zmq

from cadence.actors.config import ActorsConfig
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.codec import encode
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.dispatch_client import DispatcherClient
from cadence.protocols.dispatch_server import DispatchServer
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.messages import Hello
from cadence.protocols.transport import InProcessTransport
from cadence.protocols.weights_wire import WeightClient, WeightServer
from cadence.protocols.zmq_transport import SecurityError, private_dir, write_keys
from tests import waiting

wait_for = functools.partial(waiting.wait_for, timeout=10.0, interval=0.02)
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (setuid)")


def dispatcher(ctx, external, keys=None):
    stream = PromptStream(make_task(TaskConfig(name="sort", num_digits=3, heldout_size=4)))
    core = Dispatcher(stream, SampleLedger(), AdmissionGate(64, 4), DispatchSettings(group_size=2, heartbeat_seconds=0.1),
                      deliver=InProcessTransport().put, version_fn=lambda: 0)
    return DispatchServer(core, ctx=ctx, external=external, keys=keys, max_bytes=1 << 20).start()


def _stranger(endpoint, report):
    """Another user's process: says Hello, and reports whether anything came back."""
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(encode(Hello(actor_id="stranger", capacity=1)), zmq.NOBLOCK)
    except zmq.Again:  # no connection was ever completed: nothing to send on
        pass
    report.put(bool(s.poll(1500)))
    s.close(0)
    ctx.term()


def stranger_gets_an_answer(endpoint) -> bool:
    report = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_stranger, args=(endpoint, report))
    p.start()
    answered = report.get(timeout=20)
    p.join(10)
    return answered


@pytest.fixture
def open_dir():
    """A run directory that any user may enter (pytest's tmp_path lies in a private folder: there the
    stranger would be stopped before our own directory had a say)."""
    path = tempfile.mkdtemp(prefix="cadence-auth-test-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_default_listener_is_an_ipc_socket_in_the_run_directory():
    assert ActorsConfig().listen == "ipc://"


def test_private_dir_is_0700_whatever_the_umask_and_refuses_a_link(tmp_path):
    os.makedirs(tmp_path / "run")
    old = os.umask(0)
    try:
        path = private_dir(str(tmp_path / "run"), "x")
    finally:
        os.umask(old)
    assert path == str(tmp_path / "run" / "sockets")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    os.chmod(path, 0o777)  # an earlier run, or someone, loosened it: tightened again
    assert stat.S_IMODE(os.stat(private_dir(str(tmp_path / "run"), "x")).st_mode) == 0o700
    os.makedirs(tmp_path / "other" / "target")
    os.symlink(tmp_path / "other" / "target", tmp_path / "other" / "sockets")
    with pytest.raises(SecurityError, match="not a link"):
        private_dir(str(tmp_path / "other"), "x")


def test_a_run_directory_too_deep_for_a_socket_path_gets_a_short_private_one(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    os.makedirs(deep)
    path = private_dir(str(deep))
    try:
        assert not path.startswith(str(deep)) and len(path) < 60
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    finally:
        os.rmdir(path)


def test_a_client_without_keys_or_with_an_unknown_key_is_refused_and_counted(ctx, tmp_path):
    keys = write_keys(str(tmp_path / "keys"))
    server = dispatcher(ctx, "tcp://127.0.0.1:0", keys=keys)
    bare = ctx.socket(zmq.DEALER)  # no Curve at all
    bare.setsockopt(zmq.LINGER, 0)
    bare.connect(server.endpoint)
    wrong = ctx.socket(zmq.DEALER)  # Curve, with a key nobody authorized
    wrong.setsockopt(zmq.LINGER, 0)
    wrong.curve_serverkey = keys.server_public
    wrong.curve_publickey, wrong.curve_secretkey = zmq.curve_keypair()
    wrong.connect(server.endpoint)
    for s in (bare, wrong):
        try:
            s.send(encode(Hello(actor_id="stranger", capacity=1)), zmq.NOBLOCK)
        except zmq.Again:
            pass
    assert wait_for(lambda: server.metrics()["actors/refused_connections"] >= 2)
    assert not bare.poll(200) and not wrong.poll(200)
    assert server.core.counts["joined"] == 0 and sum(server.bad_messages.values()) == 0
    # The key holder joins as ever.
    ok = DispatcherClient(server.endpoint, "ok", 1, ctx=ctx, keys=keys, heartbeat_seconds=0.1).start()
    assert ok.wait_welcome(5) is not None
    for s in (ok, bare, wrong):
        s.close()
    server.stop()


@as_root
def test_another_user_cannot_reach_a_run_s_ipc_socket(ctx, open_dir):
    server = dispatcher(ctx, f"ipc://{private_dir(open_dir)}/dispatch")
    assert not stranger_gets_an_answer(server.endpoint)  # the kernel refuses: the directory is 0700
    assert server.core.counts["joined"] == 0
    mine = DispatcherClient(server.endpoint, "mine", 1, ctx=ctx, heartbeat_seconds=0.1).start()
    assert mine.wait_welcome(5) is not None
    mine.close()
    server.stop()


@as_root
def test_past_loosened_permissions_another_user_is_still_refused_and_counted(ctx, open_dir):
    # The directory and the socket file made world-accessible (a umask, a chmod, a shared folder):
    # the kernel lets the stranger connect; the server's uid check refuses the handshake.
    directory = private_dir(open_dir)
    server = dispatcher(ctx, f"ipc://{directory}/dispatch")
    weights = WeightServer(f"ipc://{directory}/dispatch.weights", ctx=ctx).start()
    os.chmod(directory, 0o777)
    for name in ("dispatch", "dispatch.weights"):
        os.chmod(os.path.join(directory, name), 0o777)
    assert not stranger_gets_an_answer(server.endpoint)
    assert not stranger_gets_an_answer(weights.endpoint)
    assert wait_for(lambda: server.metrics()["actors/refused_connections"] >= 1)
    assert wait_for(lambda: weights.refused.refused >= 1)
    assert server.core.counts["joined"] == 0 and sum(server.bad_messages.values()) == 0
    assert weights.bad_messages == 0 and weights.sent == 0
    mine = DispatcherClient(server.endpoint, "mine", 1, ctx=ctx, heartbeat_seconds=0.1).start()
    assert mine.wait_welcome(5) is not None
    client = WeightClient(weights.endpoint, ctx=ctx)
    weights.publish(1, lambda: [])
    assert client.fetch(-1, timeout=5) is not None  # this user's process fetches as ever
    client.close()
    mine.close()
    weights.stop()
    server.stop()

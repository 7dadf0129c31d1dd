"""A launched server and every worker it started die with the process that launched it, even on
SIGKILL (no orphan holding a port and memory), and on stop(): ServerProcess runs its command under a
watcher (actors/sglang/server.py, die_with_parent). A stand-in server that starts a worker ignoring
SIGTERM (as multiprocessing's resource tracker does) is the server here; the real one is killed in
tests/e2e/sglang_processes_test.py."""
import os
import signal
import subprocess
import sys

import pytest

from cadence.actors.sglang.server import ServerProcess
from tests.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

FAKE_SERVER = """import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)"])
time.sleep(600)
"""
# The launching process: starts the stand-in through ServerProcess, prints its pid, waits.
LAUNCHER = """
import sys, time
import cadence.actors.sglang.server as server
if sys.argv[2] == "unguarded":  # the control: the same launch without the watcher
    server.die_with_parent = lambda command: list(command)
p = server.ServerProcess(sys.executable, "fake_server", (), log_dir=sys.argv[1], env=("PYTHONPATH=" + sys.argv[1],))
p.start(sys.argv[1])
print(p.proc.pid, flush=True)
time.sleep(600)
"""


def group(pgid: int) -> set[int]:
    """Living (not zombie) processes of the process group."""
    out = set()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            out.add(int(pid))
    return out


def fake_server(tmp_path):
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)


def launch_and_kill_the_launcher(tmp_path, mode: str, patience: float) -> int:
    fake_server(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), mode], stdout=subprocess.PIPE,
                                text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    pgid = int(launcher.stdout.readline())
    least = 3 if mode == "guarded" else 2  # (watcher,) server, worker
    wait_for(lambda: len(group(pgid)) >= least, 30, what=f"{least} processes in the launched group", interval=0.05)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    try:  # guarded, the group empties; unguarded (the control), it is still there after its patience
        wait_for(lambda: not group(pgid), patience, interval=0.05)
    except AssertionError:
        pass
    return pgid


def test_a_launched_server_and_its_workers_die_when_the_launcher_is_killed(tmp_path):
    pgid = launch_and_kill_the_launcher(tmp_path, "guarded", patience=10.0)
    assert not group(pgid), "the server or a worker outlived the process that launched it"


def test_without_the_watcher_the_same_server_is_orphaned(tmp_path):
    """The control: its own session keeps it alive after its launcher's SIGKILL."""
    pgid = launch_and_kill_the_launcher(tmp_path, "unguarded", patience=1.0)
    try:
        assert group(pgid)
    finally:
        os.killpg(pgid, signal.SIGKILL)


def test_stop_takes_workers_that_ignore_sigterm(tmp_path):
    fake_server(tmp_path)
    p = ServerProcess(sys.executable, "fake_server", (), log_dir=str(tmp_path), env=(f"PYTHONPATH={tmp_path}",))
    p.start(str(tmp_path))
    pgid = p.proc.pid
    wait_for(lambda: len(group(pgid)) >= 3, 30, what="the server, its watcher and its worker", interval=0.05)
    p.stop()
    wait_for(lambda: not group(pgid), 10, what="stop() to end the whole process group", interval=0.05)

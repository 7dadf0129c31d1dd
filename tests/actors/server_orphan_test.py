"""A launched server dies with the process that launched it, even on SIGKILL (no orphan holding a
port and memory): ServerProcess runs its command under die_with_parent (actors/sglang/server.py).
A plain `sleep`-like stand-in is the server here; the real one is killed in
tests/e2e/sglang_processes_test.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The launching process: starts a "server" (sleep) through ServerProcess, prints its pid, waits.
LAUNCHER = """
import sys, time
import actors.sglang.server as server
if sys.argv[2] == "unguarded":  # the control: the same launch without the guard
    server.die_with_parent = lambda command: list(command)
p = server.ServerProcess(sys.executable, "fake_server", (), log_dir=sys.argv[1], env=("PYTHONPATH=" + sys.argv[1],))
p.start(sys.argv[1])
print(p.proc.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds nothing
    except OSError:
        return False


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ")


def launch_and_kill_the_launcher(tmp_path, mode: str, patience: float) -> int:
    (tmp_path / "fake_server.py").write_text("import time\ntime.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), mode], stdout=subprocess.PIPE,
                                text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    pid = int(launcher.stdout.readline())
    deadline = time.time() + 30
    while "fake_server" not in cmdline(pid) or "-c" in cmdline(pid).split()[:2]:  # it became the server
        assert time.time() < deadline, cmdline(pid)
        time.sleep(0.05)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + patience
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launched_server_dies_when_its_launcher_is_killed(tmp_path):
    pid = launch_and_kill_the_launcher(tmp_path, "guarded", patience=10.0)
    assert not alive(pid), "the server outlived the process that launched it"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_without_the_guard_the_same_server_is_orphaned(tmp_path):
    """The control: its own session keeps it alive after its launcher's SIGKILL."""
    pid = launch_and_kill_the_launcher(tmp_path, "unguarded", patience=1.0)
    try:
        assert alive(pid)
    finally:
        os.killpg(pid, signal.SIGKILL)

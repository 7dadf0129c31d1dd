"""A Ray cluster of two nodes on this machine, on loopback inside a private network namespace.

For tests and benchmarks: Ray binds the machine's address and listens on all interfaces, so
nothing here may run in the machine's own network namespace: call `enter_private_network()`
(launch/cluster/private_network.py) first. A head node and a worker node then start on
127.0.0.1, each in its own process group and temp dir, the worker with the custom resource `worker_node` (tasks that ask for it land there).
`workers=N` starts N worker nodes (each with `worker_node`); kill_worker(i) / start_worker(i) name one.

    enter_private_network()                       # root (or CAP_SYS_ADMIN) needed
    with LocalCluster(cpus=2) as cluster:
        cluster.address                           # "127.0.0.1:PORT" for `cadence launch ray --address`
        cluster.kill_worker()                     # the worker node is lost (every process of it, SIGKILL)
        cluster.start_worker()                    # capacity returns

No Ray import: the nodes are `ray start --block` processes of this Python's environment.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from cadence._root import IMPORT_ROOT
from cadence.launch.cluster.private_network import enter_private_network, listening_sockets  # noqa: F401 (tests)

HEAD_RESOURCE, WORKER_RESOURCE = "head_node", "worker_node"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, cpus: int = 2, head_resources: dict | None = None, worker_resources: dict | None = None,
                 env: dict | None = None, timeout: float = 180.0, workers: int = 1):
        self.cpus, self.timeout = cpus, timeout
        self.head_resources = {HEAD_RESOURCE: 1, **(head_resources or {})}
        self.worker_resources = {WORKER_RESOURCE: 1, **(worker_resources or {})}
        self.dir = tempfile.mkdtemp(prefix="cr-", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "JAX_PLATFORMS": "cpu",
                    "PYTHONPATH": os.pathsep.join(p for p in (IMPORT_ROOT, os.environ.get("PYTHONPATH", "")) if p),
                    **(env or {})}
        self.head: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = [None] * workers
        self._starts = [0] * workers  # each worker's log gains one "started" mark per start

    @property
    def worker(self) -> subprocess.Popen | None:
        """The first worker node's process (the only one unless workers > 1)."""
        return self.workers[0]

    def _ray(self) -> str:
        beside = os.path.join(os.path.dirname(sys.executable), "ray")  # this environment's, even if not on PATH
        return beside if os.path.exists(beside) else (shutil.which("ray") or "ray")

    def _node(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        proc = subprocess.Popen([self._ray(), "start", "--block", "--node-ip-address", "127.0.0.1",
                                 "--num-cpus", str(self.cpus), "--temp-dir", os.path.join(self.dir, name),
                                 "--disable-usage-stats", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        log.close()
        return proc

    def _wait_started(self, name: str, proc: subprocess.Popen, mark_count: int = 1) -> None:
        path, deadline = os.path.join(self.dir, f"{name}.log"), time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            with open(path, errors="replace") as f:
                text = f.read()
            if text.count("Ray runtime started") >= mark_count:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"ray {name} node exited with {proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"ray {name} node did not start within {self.timeout:.0f} s")

    def start(self) -> "LocalCluster":
        self.head = self._node("head", ["--head", "--port", str(self.port), "--include-dashboard", "false",
                                        "--resources", json.dumps(self.head_resources)])
        self._wait_started("head", self.head)
        for i in range(len(self.workers)):
            self.start_worker(i)
        return self

    def start_worker(self, i: int = 0) -> None:
        name = "worker" if i == 0 else f"worker{i}"
        self._starts[i] += 1
        self.workers[i] = self._node(name, ["--address", self.address,
                                            "--resources", json.dumps(self.worker_resources)])
        self._wait_started(name, self.workers[i], self._starts[i])

    def kill_worker(self, i: int = 0) -> None:
        """Worker node i is lost: SIGKILL to its whole process group (raylet, workers, agents)."""
        _killpg(self.workers[i], signal.SIGKILL)

    def stop(self) -> None:
        for proc in (*self.workers, self.head):
            _killpg(proc, signal.SIGTERM)
        time.sleep(2.0)
        for proc in (*self.workers, self.head):
            _killpg(proc, signal.SIGKILL)
        # Ray's worker processes may have left the process groups: whatever still runs from our temp dir
        for pid in _pids_mentioning(self.dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _killpg(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    if sig == signal.SIGKILL:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            pass
    return pids

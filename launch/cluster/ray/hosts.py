"""One Cadence process inside a Ray actor: Ray places and restarts it, Cadence's ZeroMQ carries the data.

    host = ProcessHost.options(placement_group=..., max_restarts=-1).remote(
        "actor-0", argv, env, files={"keys/server.key": b"...", ...}, file_args=["--keys", "{dir}/keys"])
    ray.get(host.info.remote())          # pid, node, incarnation
    ray.get(host.read_log.remote(0))     # the process's output, gathered by the driver into RUN_DIR/logs

A host started with `argv` spawns its process at once, and when that process exits with a
non-zero status unasked, the host exits too, so Ray restarts the host (max_restarts) and with it
the process: that is how a dead actor process comes back (after the driver gathered the
failed process's output, or LAST_WORDS_S: its error would otherwise be lost with the host). A host started without `argv` waits
for `start(argv, env)` (the learner: its coordinator address is known only once every learner
host is placed) and never exits by itself; the driver watches it.

Files (the CurveZMQ keys, the run's config) arrive as bytes in the actor's creation arguments and
are written into a private directory (0700) on the host's node; "{dir}" in an argument names it,
so command lines carry paths, never secrets. The child
dies with its host (PR_SET_PDEATHSIG), so a host killed by Ray or by a lost node leaves no
orphan behind.

This module imports only the standard library: the driver ships it to the workers by value, so
the nodes need Cadence installed only for the processes themselves.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

LOG_CHUNK = 1 << 20
LAST_WORDS_S = 5.0  # a failed process's host waits at most this long for the driver to gather its output
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class ProcessHost:
    """The body of the Ray actor (ray_launch wraps it with ray.remote)."""

    def __init__(self, name: str, argv: list[str] | None = None, env: dict | None = None,
                 files: dict[str, bytes] | None = None, file_args: list[str] | None = None):
        import ray

        self.name = name
        self.incarnation = ray.get_runtime_context().was_current_actor_reconstructed
        self.dir = tempfile.mkdtemp(prefix=f"cadence-{name}-")  # 0700
        for rel, data in (files or {}).items():
            path = os.path.join(self.dir, rel)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        self.file_args = list(file_args or [])
        self.log_path = os.path.join(self.dir, "output.log")
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.stopping = False
        self.delivered = 0  # bytes of the output the driver has read (read_log)
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        if argv is not None:
            self.start(argv, env, restart_on_failure=True)

    def start(self, argv: list[str], env: dict | None = None, restart_on_failure: bool = False) -> int:
        full_env = {**os.environ, **(env or {})}
        with open(self.log_path, "ab") as log:
            argv = [a.replace("{dir}", self.dir) for a in (*argv, *self.file_args)]
            self.proc = subprocess.Popen([sys.executable, *argv], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                         preexec_fn=_die_with_parent)
        self.started_at = time.time()
        if restart_on_failure:
            threading.Thread(target=self._exit_with_child, daemon=True).start()
        return self.proc.pid

    def _exit_with_child(self) -> None:
        code = self.proc.wait()
        if code != 0 and not self.stopping:  # Ray restarts this host, and the host the process
            with open(self.log_path, "ab") as log:
                log.write(f"\n[ray host {self.name}] process exited with {code}; the host exits for Ray "
                          "to restart it\n".encode())
            # its last words (the error) go with this host: let the driver gather them first
            deadline = time.time() + LAST_WORDS_S
            while time.time() < deadline and self.delivered < os.path.getsize(self.log_path):
                time.sleep(0.05)
            os._exit(1)

    def info(self) -> dict:
        return {"name": self.name, "pid": self.proc.pid if self.proc else None, "node_ip": self.node_ip,
                "node_id": self.node_id, "hostname": socket.gethostname(), "host_pid": os.getpid(),
                "restarted": self.incarnation, "started_at": self.started_at, "exit": self.poll()}

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def free_port(self) -> int:
        """A free TCP port on this node's address (the learner's jax.distributed coordinator)."""
        with socket.socket() as s:
            s.bind((self.node_ip, 0))
            return s.getsockname()[1]

    def read_log(self, offset: int) -> bytes:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                data = f.read(LOG_CHUNK)
            self.delivered = max(self.delivered, offset + len(data))
            return data
        except FileNotFoundError:
            return b""

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL at the deadline; returns the exit status."""
        self.stopping = True
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for entry in os.listdir(self.dir):  # the keys go with it; the output stays for the driver to gather
            path = os.path.join(self.dir, entry)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif path != self.log_path:
                os.remove(path)
        return self.proc.returncode

    def close(self) -> None:
        """Everything this host wrote on its node goes (after the driver gathered the output)."""
        shutil.rmtree(self.dir, ignore_errors=True)

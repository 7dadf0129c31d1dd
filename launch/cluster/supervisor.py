"""Actor processes on this machine: start N, restart any that die, stop them all at the end.

    sup = ActorSupervisor(n, endpoint, run_dir, keys_dir="", backoff=1.0, on_exit=dispatcher_expel)
    sup.start()
    ...
    sup.kill("proc-1")          # e.g. the dispatcher found it hung: SIGKILL, then restarted
    sup.stop(timeout)           # SIGTERM (they leave cleanly, prompts go back), SIGKILL at the deadline

Started before the learner's dispatcher exists (endpoint None, `config` given), the processes are
`... actor --connect -`: they build their model and compile generation from the config while the
learner builds, and join once `connect(endpoint)` hands them the endpoint on stdin.

Each process is `python -m cadence.launch.cli actor --connect ENDPOINT --id proc-i`, its output in
RUN_DIR/actors/proc-i.log. When one exits unasked, `on_exit(actor_id, reason)` is told at once
(the dispatcher re-issues its prompts without waiting for the heartbeat timeout) and it is
started again after a backoff that doubles while processes keep dying soon after their start
(reset once one stays up for a minute). Restarts are counted.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from cadence._root import IMPORT_ROOT

STABLE_SECONDS = 60.0  # a process that lived this long resets the backoff
MAX_BACKOFF = 30.0


class _Child:
    def __init__(self, actor_id: str):
        self.actor_id = actor_id
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.backoff = 0.0
        self.exits: list[int] = []


class ActorSupervisor:
    def __init__(self, n: int, endpoint: str | None, run_dir: str, *, keys_dir: str = "", backoff: float = 1.0,
                 on_exit: Callable[[str, str], None] | None = None, message: Callable[[str], None] = print,
                 config: dict | None = None, extra_args: Callable[[str], list[str]] | None = None):
        """extra_args(actor_id): more `cadence actor` arguments for that process (e.g. its SGLang work dir)."""
        self.endpoint, self.run_dir, self.keys_dir = endpoint, run_dir, keys_dir
        self.config = config  # handed to processes started before the endpoint is known
        self.extra_args = extra_args or (lambda actor_id: [])
        self.base_backoff = backoff
        self.on_exit = on_exit or (lambda actor_id, reason: None)
        self.message = message
        self.children = [_Child(f"proc-{i}") for i in range(n)]
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="actor-supervisor", daemon=True)
        self.log_dir = os.path.join(run_dir, "actors")

    def command(self, actor_id: str) -> list[str]:
        cmd = [sys.executable, "-m", "cadence.launch.cli", "actor", "--connect", self.endpoint or "-", "--id", actor_id]
        return cmd + (["--keys", self.keys_dir] if self.keys_dir else []) + list(self.extra_args(actor_id))

    def start(self) -> "ActorSupervisor":
        os.makedirs(self.log_dir, exist_ok=True)
        for c in self.children:
            self._spawn(c)
        self._thread.start()
        return self

    def _spawn(self, c: _Child) -> None:
        log = open(os.path.join(self.log_dir, f"{c.actor_id}.log"), "ab")
        env = dict(os.environ)
        # Lets `python -m cadence.launch.cli` find this checkout even when the package is not installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (IMPORT_ROOT, env.get("PYTHONPATH", "")) if p)
        early = self.endpoint is None  # the endpoint (and the config first) come on stdin
        if c.proc is not None:
            _close(c.proc)  # the dead process's pipe
        c.proc = subprocess.Popen(self.command(c.actor_id), stdout=log, stderr=subprocess.STDOUT, env=env,
                                  stdin=subprocess.PIPE if early else subprocess.DEVNULL)
        log.close()  # the child holds its own descriptor
        c.started_at, c.restart_at = time.monotonic(), None
        if early and self.config is not None:
            self._tell(c, {"config": self.config})

    def connect(self, endpoint: str, on_exit: Callable[[str, str], None] | None = None) -> None:
        """The dispatcher is up: processes waiting on stdin join it; restarts connect directly.
        on_exit: told of every unasked exit from now on (before, no process had joined anything)."""
        with self._lock:
            self.endpoint = endpoint
            if on_exit is not None:
                self.on_exit = on_exit
            for c in self.children:
                if c.proc is not None and c.proc.stdin is not None:
                    self._tell(c, {"connect": endpoint})
                    _close(c.proc)

    @staticmethod
    def _tell(c: _Child, msg: dict) -> None:
        try:
            c.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            c.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it died: the watcher restarts it with the endpoint
            pass

    def alive(self) -> int:
        return sum(1 for c in self.children if c.proc is not None and c.proc.poll() is None)

    def pid(self, actor_id: str) -> int | None:
        for c in self.children:
            if c.actor_id == actor_id and c.proc is not None:
                return c.proc.pid
        return None

    def kill(self, actor_id: str) -> None:
        """SIGKILL one actor process (it is then restarted like any that died)."""
        with self._lock:
            for c in self.children:
                if c.actor_id == actor_id and c.proc is not None and c.proc.poll() is None:
                    c.proc.kill()

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):
            with self._lock:
                now = time.monotonic()
                for c in self.children:
                    if c.proc is None:
                        continue
                    code = c.proc.poll()
                    if code is not None and c.restart_at is None:
                        lived = now - c.started_at
                        c.exits.append(code)
                        c.backoff = self.base_backoff if lived >= STABLE_SECONDS or not c.backoff \
                            else min(c.backoff * 2, MAX_BACKOFF)
                        c.restart_at = now + c.backoff
                        reason = f"process exited with {_describe(code)} after {lived:.1f} s"
                        self.message(f"{c.actor_id}: {reason}; restarting in {c.backoff:.1f} s "
                                     f"(log: {os.path.join(self.log_dir, c.actor_id + '.log')})")
                        self.on_exit(c.actor_id, reason)
                    if c.restart_at is not None and now >= c.restart_at and not self._stopping.is_set():
                        self.restarts += 1
                        self._spawn(c)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process (each leaves with a Goodbye), SIGKILL what is left at the deadline."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(1.0)
        procs = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _close(proc: subprocess.Popen) -> None:
    """Close a child's stdin pipe; a child that died leaves unflushed bytes behind (BrokenPipeError)."""
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
        proc.stdin = None


def _describe(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"

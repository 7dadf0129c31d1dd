"""Environment calls with a time limit, many at once: what multi-turn episodes step with.

    envs = EnvRunner(threads=16, timeout_s=30.0)
    outcomes = envs.map([lambda: env.step(turn) for env, turn in ...])   # one Outcome per call
    outcomes[0].value / .error / .timed_out

An environment is user code: a tool call that hangs, or one slow row, must not stop the actor.
Every call of a batch (the environments of one turn, one per row) is handed to a pool of daemon
threads, so rows step concurrently (a tool that waits on I/O or sleeps does not serialize the
batch), and a call that runs longer than ``timeout_s`` from when it started is given up: its
Outcome says timed_out, the episode ends there (counted as env_timeout), and a fresh thread takes
the stuck one's place so the pool keeps its size.

What a thread cannot do: a Python thread cannot be killed, so a given-up call keeps running in
the background until it returns (``stuck`` counts those still running), and environments share the
actor process's memory (no memory limit). A step that spins the CPU forever costs a core; one
that waits on a socket or a lock costs nothing but its thread.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Outcome(NamedTuple):
    value: Any = None
    error: BaseException | None = None  # the call raised this
    timed_out: bool = False  # it ran past timeout_s and was given up


class _Call:
    def __init__(self, fn: Callable[[], Any], done: threading.Condition):
        self.fn, self.done = fn, done
        self.started_at: float | None = None
        self.thread: threading.Thread | None = None
        self.outcome: Outcome | None = None
        self.abandoned = False

    def run(self) -> None:
        with self.done:
            if self.abandoned:
                return
            self.started_at, self.thread = time.monotonic(), threading.current_thread()
            self.done.notify_all()  # its clock runs from now: the waiter sets its deadline
        try:
            outcome = Outcome(self.fn())
        except BaseException as e:  # noqa: BLE001 - user code: whatever it raises is its outcome
            outcome = Outcome(error=e)
        with self.done:
            if not self.abandoned:
                self.outcome = outcome
            self.done.notify_all()


class EnvRunner:
    """A pool of `threads` daemon threads running environment calls, each limited to `timeout_s`.

    map() may be called from several actor threads at once (they share the pool).
    """

    def __init__(self, threads: int = 16, timeout_s: float = 30.0):
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.threads, self.timeout_s = threads, float(timeout_s)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._stuck: list[threading.Thread] = []
        self.timeouts = 0  # calls given up so far
        for _ in range(threads):
            self._spawn()

    @classmethod
    def from_config(cls, task_cfg) -> "EnvRunner":
        """The runner a TaskConfig asks for (task.env_threads, task.env_timeout_s)."""
        return cls(task_cfg.env_threads, task_cfg.env_timeout_s)

    @property
    def stuck(self) -> int:
        """Given-up calls whose threads are still running."""
        self._stuck = [t for t in self._stuck if t.is_alive()]
        return len(self._stuck)

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="env-step", daemon=True).start()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            call.run()
            if call.abandoned:  # a fresh thread has taken this one's place
                return

    def map(self, fns: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Runs every fn concurrently; returns their outcomes in order once each has returned,
        raised, or run past timeout_s."""
        calls = [_Call(fn, self._done) for fn in fns]
        for call in calls:
            self._queue.put(call)
        with self._done:
            while True:
                now = time.monotonic()
                waiting = [c for c in calls if c.outcome is None]
                if not waiting:
                    break
                wake = None
                for c in waiting:
                    if c.started_at is None:
                        continue  # queued behind others: its clock starts when a thread takes it
                    left = c.started_at + self.timeout_s - now
                    if left <= 0:
                        self._give_up(c)
                    else:
                        wake = left if wake is None else min(wake, left)
                if any(c.outcome is None for c in calls):
                    self._done.wait(timeout=1.0 if wake is None else wake)
        return [c.outcome for c in calls]

    def _give_up(self, call: _Call) -> None:
        """(Under self._done.) The call is over for its caller; its thread is replaced."""
        call.abandoned = True
        call.outcome = Outcome(timed_out=True)
        self.timeouts += 1
        self._stuck.append(call.thread)
        self._spawn()

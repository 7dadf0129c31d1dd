"""RewardPool: rewards scored in spawned worker processes, each call under a time limit.

    pool = RewardPool(task_factory, workers=2, timeout_s=30, memory_mb=2048, group_timeout_s=300)
    scores = pool.score_groups([[(prompt, completion), ...], ...], progress)   # progress(done, total)
    pool.close()

task_factory builds what a worker scores with: the task's scoring function alone when the task has
one (Task.scoring: no dataset is loaded in the worker), else the whole task.

The groups of one call are split into one batch per worker (whole groups: a group is never
split), and the batches run on the workers at once.
The worker answers in a few messages per batch (whatever it scored, every few milliseconds) and,
before each completion, writes its index to a shared-memory counter, so the parent knows which
completion is running: one that runs longer than ``timeout_s``
scores 0 (reason "timeout"): its worker is killed, a new one spawned, and the rest of the batch is
scored there. A worker that dies (os._exit, a signal, the OOM killer) costs the completion it was
scoring (reason "crashed"); a reward that hits the address-space limit gets a MemoryError
(reason "memory"). A group has ``group_timeout_s`` from its first completion: the worker scores
no completion of a group past it (reason "group_timeout"), and one still running then is stopped
like a timeout, so a call costs at most its groups' budgets; the caller hears progress meanwhile
(the actor's liveness). Workers are spawned, never forked: forking a process that runs JAX threads can
deadlock the child. A task that cannot even be built in a worker fails the pool's start, loudly.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import cadence.actors.rewards.worker as worker_module
from cadence.actors.rewards.scoring import CRASHED, GROUP_TIMEOUT, TIMEOUT, Item, Progress, failed, wait_reporting
from cadence.actors.tasks.base import Score

_CONTEXT = multiprocessing.get_context("spawn")
# The worker itself skips the completions of a group out of time; the parent steps in (kills it)
# only when one completion runs past its group's budget, after this much slack.
GROUP_GRACE_S = 0.5


class RewardWorkerError(RuntimeError):
    """A worker could not start: the task does not build there (the message says why)."""


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, task_factory, memory_mb: int, startup_timeout_s: float):
        self.conn, child = _CONTEXT.Pipe(duplex=True)
        self.progress = _CONTEXT.RawValue("i", -1)  # index in the batch being scored (shared memory)
        self.process = _CONTEXT.Process(target=worker_module.main,
                                        args=(child, task_factory, memory_mb, self.progress),
                                        name="cadence-reward-worker", daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(startup_timeout_s):
            self.kill()
            raise RewardWorkerError(f"a reward worker did not start within {startup_timeout_s:.0f} s")
        try:
            hello = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            self.kill()
            raise RewardWorkerError("a reward worker died while building the task "
                                    f"(exit code {self.process.exitcode})") from None
        if not hello.get("ready"):
            self.kill()
            raise RewardWorkerError(f"the task does not build in a reward worker: {hello.get('error')}")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


def _gather(futures: list[Future]) -> Future:
    """One future holding the results of all (the first exception, if any, is its exception)."""
    out: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def settle(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            out.set_result([f.result() for f in futures])
        except BaseException as e:  # noqa: BLE001 - handed to the caller of score_groups
            out.set_exception(e)

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(settle)
    return out


def _parse_result(msg: dict) -> Score:
    """One entry of a worker's JSON answer as a Score (anything unexpected: the worker is broken)."""
    reward = float(msg["reward"])
    exact = msg.get("exact_match")
    metrics = {str(k): float(v) for k, v in (msg.get("metrics") or {}).items()}
    if not math.isfinite(reward) or exact not in (None, True, False):
        raise ValueError("bad result")
    return Score(reward, exact, metrics, str(msg.get("error") or ""))


class RewardPool:
    """See the module docstring. Thread-safe: several actor threads may score at once."""

    def __init__(self, task_factory, workers: int = 2, timeout_s: float = 30.0, memory_mb: int = 2048,
                 startup_timeout_s: float = 120.0, group_timeout_s: float = 300.0):
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self.task_factory, self.timeout_s, self.memory_mb = task_factory, timeout_s, memory_mb
        self.group_timeout_s = group_timeout_s
        self.workers = workers
        self.startup_timeout_s = startup_timeout_s
        self.respawns = 0  # workers replaced after a timeout or a crash
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._startup_error: BaseException | None = None
        self._dispatch = ThreadPoolExecutor(workers, thread_name_prefix="cadence-reward")
        # Workers start in the background (each imports the task: ~1 s), overlapping the caller's
        # own start-up; the first score waits for one, and a start-up failure is raised there.
        for _ in range(workers):
            threading.Thread(target=self._start_one, daemon=True, name="cadence-reward-start").start()

    def _start_one(self) -> None:
        try:
            self._idle.put(self._spawn())
        except BaseException as e:  # noqa: BLE001 - raised to the first caller of score_groups
            self._startup_error = e

    def _take_idle(self) -> _Worker:
        while True:
            if self._startup_error is not None:
                raise self._startup_error
            try:
                return self._idle.get(timeout=0.05)
            except queue.Empty:
                continue

    def wait_ready(self) -> None:
        """Blocks until at least one worker is up (raises RewardWorkerError if none can start)."""
        self._idle.put(self._take_idle())

    def _spawn(self) -> _Worker:
        w = _Worker(self.task_factory, self.memory_mb, self.startup_timeout_s)
        with self._lock:
            if self._closed:
                w.stop()
                raise RuntimeError("RewardPool is closed")
            self._all.append(w)
        return w

    def _retire(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            if w in self._all:  # close() may have taken it already
                self._all.remove(w)
        self.respawns += 1

    def _run_batch(self, items: Sequence[Item], groups: Sequence[int], done: list[int]) -> list[Score]:
        """Scores one batch on one worker, replacing the worker on a timeout or a crash.
        groups[i]: the group of items[i] (its time budget); done[0]: completions settled so far."""
        scores: list[Score | None] = [None] * len(items)
        todo = list(range(len(items)))  # indices still to score, in order
        spent: dict[int, float] = {}  # seconds a group already ran on a worker that was replaced
        w = self._take_idle()
        try:
            while todo:
                budgets = {g: self.group_timeout_s - spent.get(g, 0.0) for g in {groups[i] for i in todo}}
                for i in todo:  # a group out of time: its unscored completions are not sent again
                    if budgets[groups[i]] <= 0:
                        scores[i] = failed(GROUP_TIMEOUT)
                        done[0] += 1
                todo = [i for i in todo if scores[i] is None]
                if not todo:
                    break
                batch = {"items": [items[i] for i in todo], "groups": [groups[i] for i in todo], "budgets": budgets}
                try:
                    w.conn.send_bytes(pickle.dumps(batch))
                except (OSError, ValueError):  # died while idle: replace it, send again
                    self._retire(w)
                    w = None
                    w = self._spawn()
                    continue
                got, stuck, reason, ran = self._await(w, [groups[i] for i in todo], budgets, done)
                for i, score in zip(todo, got):
                    scores[i] = score
                if stuck < 0:
                    todo = todo[len(got):]
                    continue
                # The completion it was on (the worker's progress counter) costs its reward; the
                # ones it scored after its last answer are scored again, with the rest, elsewhere.
                group = groups[todo[stuck]]
                spent[group] = spent.get(group, 0.0) + ran
                scores[todo[stuck]] = failed(reason)
                done[0] += 1
                todo = todo[len(got):stuck] + todo[stuck + 1:]
                self._retire(w)
                w = None  # if no new one starts, the error ends the run: the task no longer builds
                w = self._spawn()
        finally:
            if w is not None:
                self._idle.put(w)
        return scores

    def _await(self, w: _Worker, groups: Sequence[int], budgets: dict[int, float],
               done: list[int]) -> tuple[list[Score], int, str, float]:
        """(scores received, -1, "", 0) once all came back; else (those received, index of the
        completion the worker was on, TIMEOUT / GROUP_TIMEOUT / CRASHED, seconds its group had run).
        A completion may run timeout_s (the clock restarts each time the worker moves on) and a
        group budgets[group] seconds from its first completion."""
        n = len(groups)
        got: list[Score] = []
        position, since = -1, time.monotonic()
        started: dict[int, float] = {}  # group -> when the worker was first seen on it
        while len(got) < n:
            if not w.conn.poll(0.05):
                now, current = time.monotonic(), w.progress.value
                if current != position:
                    position, since = current, now
                if not 0 <= current < n:
                    if now - since > self.timeout_s:
                        return got, max(min(current, n - 1), len(got)), TIMEOUT, 0.0
                    continue
                group = groups[current]
                ran = now - started.setdefault(group, now)
                if now - since > self.timeout_s:
                    return got, max(current, len(got)), TIMEOUT, ran
                if ran > budgets[group] + GROUP_GRACE_S:  # the worker skips what its group has no time for
                    return got, max(current, len(got)), GROUP_TIMEOUT, ran
                continue
            try:
                new = [_parse_result(r) for r in json.loads(w.conn.recv_bytes())]
            except (EOFError, OSError, ValueError, KeyError, TypeError):
                return got, min(max(w.progress.value, len(got)), n - 1), CRASHED, 0.0
            got += new
            done[0] += len(new)
        if len(got) != n:  # more answers than completions: a broken worker
            return got[:0], 0, CRASHED, 0.0
        return got, -1, "", 0.0

    def score_groups(self, groups: Sequence[Sequence[Item]], progress: Progress | None = None) -> list[list[Score]]:
        """Scores of each group's items. The groups of one call are split into one batch per
        worker (whole groups, in order), so a call costs each worker one message, not one per group.
        progress(done, total) is called from this thread while the batches run."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        groups = [list(g) for g in groups]
        n = max(1, min(self.workers, len(groups)))
        bounds = [round(i * len(groups) / n) for i in range(n + 1)]
        counters = [[0] for _ in range(n)]  # one per batch: each is written by one thread
        futures = []
        for (lo, hi), done in zip(zip(bounds, bounds[1:]), counters):
            items = [it for g in groups[lo:hi] for it in g]
            owners = [k for k in range(lo, hi) for _ in groups[k]]
            futures.append(self._dispatch.submit(self._run_batch, items, owners, done))
        total = sum(len(g) for g in groups)
        everything = _gather(futures)
        flat = [s for batch in wait_reporting(everything, lambda: sum(c[0] for c in counters), total, progress)
                for s in batch]
        out, k = [], 0
        for g in groups:
            out.append(flat[k:k + len(g)])
            k += len(g)
        return out

    def close(self) -> None:
        """Stops every worker now; a batch still running ends with an error in its caller."""
        self._closed = True
        dispatch = getattr(self, "_dispatch", None)
        if dispatch is not None:
            dispatch.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._all = list(self._all), []
        deadline = time.monotonic() + 10
        for w in workers:
            if time.monotonic() < deadline and self._idle_contains(w):
                w.stop()
            else:
                w.kill()

    def _idle_contains(self, w: _Worker) -> bool:
        with self._idle.mutex:
            return w in self._idle.queue

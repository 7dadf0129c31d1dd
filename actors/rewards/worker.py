"""The reward worker process (the child side of pool.RewardPool).

Started with multiprocessing's spawn context, so it is a fresh interpreter: it never inherits a
JAX runtime or the actor's threads. It limits its own address space (RLIMIT_AS), builds its copy
of the task from a picklable factory, says it is ready, then scores batches until told to stop.

Wire: the parent sends pickled batches ({"items": [(prompt, completion)], "groups": [group of each
item], "budgets": {group: seconds left}}; parent -> child only: the child trusts its parent); the
child answers with JSON lists of results: whatever it scored, once FLUSH_S has passed since its
last answer and at the end of the batch (few messages per batch, and a slow or fatal completion
does not take the results before it along). Before each completion it writes the completion's index
to a shared-memory counter, so the parent knows which one was running when a deadline passed or the
process died. A completion whose group has used up its budget (counted from the group's first
completion here) is not scored: it answers group_timeout at once. The parent never unpickles
anything from a worker, whose reward code may have run on hostile model output.
"""
from __future__ import annotations

import json
import os
import pickle
import resource
import time

from cadence.actors.rewards.scoring import GROUP_TIMEOUT, MEMORY, failed, safe_score


FLUSH_S = 0.005


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file behind


def _send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def main(conn, task_factory, memory_mb: int, progress) -> None:
    """Worker entry point: (ready | startup error), then per batch one JSON list of results."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # one core's worth per worker
    try:
        _limit_memory(memory_mb)
        task = task_factory()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run's start
        _send(conn, {"ready": False, "error": f"{type(e).__name__}: {e}"[:2000]})
        return
    _send(conn, {"ready": True})
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        batch = pickle.loads(data)
        if batch is None:
            return
        items, groups, budgets = batch["items"], batch["groups"], batch["budgets"]
        results, flushed = [], time.monotonic()
        started: dict[int, float] = {}  # group -> when its first completion began here
        for i, (prompt, completion) in enumerate(items):
            progress.value = i
            now = time.monotonic()
            if now - started.setdefault(groups[i], now) > budgets[groups[i]]:
                score = failed(GROUP_TIMEOUT)  # its group is out of time: not scored
            else:
                try:
                    score = safe_score(task, prompt, completion)
                except MemoryError:  # while building the Score itself
                    score = failed(MEMORY)
            results.append({"reward": score.reward, "exact_match": score.exact_match,
                            "metrics": dict(score.metrics), "error": score.error})
            if time.monotonic() - flushed >= FLUSH_S or i == len(items) - 1:
                conn.send_bytes(json.dumps(results).encode())
                results, flushed = [], time.monotonic()

"""RUN_DIR/heartbeat.json: a running process says it is alive, and where it is, every few seconds.

    hb = Heartbeat(run_dir, interval=5.0).start()   # state "running"
    hb.update(record)                               # step, samples, time of the newest record
                                                    # and how many this process wrote (records)
    hb.stop("finished")                             # or "preempted" / "failed": the last word

A daemon thread rewrites the file atomically (write, then rename), so a reader never sees half a
file. `cadence status` (launch/observe/status.py) tells running / stalled / finished / preempted / dead
from it: a fresh "running" heartbeat whose process exists is a running run, unless its newest
record (last_record_at) is much older than the recent updates took (stalled: the process lives
and beats, but training is stuck); a stale one, or one whose process is gone, is a dead run
(killed, crashed, or its machine lost). The beat comes from its own thread, so a fresh heartbeat
says only that the process lives; last_record_at says whether it makes progress.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

FILENAME = "heartbeat.json"


class Heartbeat:
    def __init__(self, run_dir: str, interval: float = 5.0):
        self.path = os.path.join(run_dir, FILENAME)
        self.interval = interval
        self._lock = threading.Lock()
        self._state = {"pid": os.getpid(), "host": socket.gethostname(), "state": "running",
                       "started_at": time.time(), "interval": interval, "step": None, "samples": None,
                       "last_record_at": None, "records": 0, "sinks_failed": {}}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        self._write()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def update(self, record: dict) -> None:
        with self._lock:
            self._state.update(step=record.get("step", self._state["step"]),
                               samples=record.get("samples", self._state["samples"]),
                               last_record_at=time.time(), records=self._state["records"] + 1)

    def note(self, **fields) -> None:
        """Extra fields for readers (e.g. sinks_failed={name: reason}), written at once."""
        with self._lock:
            self._state.update(fields)
        try:
            self._write()
        except OSError:
            pass

    def stop(self, state: str) -> None:
        """Write the final state and stop beating (idempotent; the first final state wins)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
        with self._lock:
            self._state["state"] = state
        self._write()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._write()
            except OSError:
                pass  # a full or vanished disk must not end the run; the staleness shows it

    def _write(self) -> None:
        with self._lock:
            data = dict(self._state, time=time.time())
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


def read(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, FILENAME)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

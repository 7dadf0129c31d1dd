"""A run's stop signals and its one deadline.

    with Lifecycle(timeout=60, on_stop=[engine.abort]) as life:
        state = loop.run(..., stop=life.stop)       # returns at a step boundary once stop is set
        threads_join(timeout=life.remaining())      # every join shares the same deadline
        save(final=True)
    # leaving the block cancels the deadline: a later run in this process is not killed by it

First SIGTERM/SIGINT: ask for a final checkpoint and a clean exit within `timeout` seconds. A second
signal exits at once (the last complete checkpoint stays as it is). The handler only sets a flag
and writes a pre-formatted line with os.write (no locks, no Python I/O: it can interrupt any code);
a watchdog thread sees the flag, sets `stop`, runs the on_stop callbacks (abort in-flight
generation, so actors do not finish long requests), and, if the run is still going when the
deadline passes, exits the process with status 1.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Iterable


class Lifecycle:
    def __init__(self, timeout: float, on_stop: Iterable[Callable[[], None]] = (), message: Callable[[str], None] = None):
        self.timeout = timeout
        self.on_stop = list(on_stop)
        self.message = message or (lambda text: None)
        self.stop = threading.Event()
        self.signalled: str | None = None  # "SIGTERM" / "SIGINT" once a signal came
        self.deadline: float | None = None  # monotonic time by which the process must be done
        self._signum = 0
        self._old: dict = {}
        self._done = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="lifecycle", daemon=True)
        text = "cadence: {}: saving a final checkpoint, then exiting (within {:.0f} s; send it again to exit at once)\n"
        self._notice = {s: text.format(signal.Signals(s).name, timeout).encode() for s in (signal.SIGTERM, signal.SIGINT)}

    def __enter__(self) -> "Lifecycle":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        self._watchdog.start()
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._done.set()  # cancels the deadline
        self._watchdog.join(1.0)

    def request_stop(self) -> None:
        """Stop from inside the process (not a signal): no deadline, callbacks run."""
        if not self.stop.is_set():
            self.stop.set()
            self._run_callbacks()

    def remaining(self, cap: float | None = None) -> float:
        """Seconds left before the deadline (cap, or the whole timeout, when no signal came)."""
        left = self.timeout if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        return left if cap is None else min(left, cap)

    # -- signal context: flags and os.write only ------------------------------------------------
    def _handle(self, signum, frame) -> None:
        if self._signum:
            os.write(2, b"cadence: second signal, exiting now; the last complete checkpoint is kept\n")
            os._exit(128 + signum)
        self._signum = signum
        self.deadline = time.monotonic() + self.timeout
        os.write(2, self._notice.get(signum, b""))

    # -- the watchdog thread --------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._done.wait(0.05):
            if self._signum and self.signalled is None:
                self.signalled = signal.Signals(self._signum).name
                self.stop.set()
                self._run_callbacks()
            if self.deadline is not None and time.monotonic() > self.deadline and not self._done.is_set():
                os.write(2, f"cadence: final checkpoint not done within {self.timeout:.0f} s; exiting, the last "
                            "complete checkpoint is kept\n".encode())
                os._exit(1)

    def _run_callbacks(self) -> None:
        for fn in self.on_stop:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - stopping must go on
                self.message(f"while stopping: {type(e).__name__}: {e}")

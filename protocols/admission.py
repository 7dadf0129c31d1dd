"""Admission control: an actor starts a sample only if it will not be too stale when consumed.

Counting is in samples, not steps, so the bound stays right when the batch size changes.

The learner consumes samples first-in first-out, B at a time. Say it has taken `consumed` samples
in `steps_taken` batches so far (a batch counts as taken when the learner starts the step that
uses it; that step will publish version `steps_taken`). A new sample is the
`issued - consumed`-th in line, so it is consumed by step index

    j = steps_taken + (issued - consumed) // B        (0-based; step j trains on version <= j)

and, produced under policy version v, it arrives with staleness j - v. Admission requires
j - v <= max_staleness for the last sample of the group. With max_staleness = 0 an actor can only
generate the very next batch, with the weights that batch will be trained from: synchronous,
on-policy training. This is AReaL's `issued <= (v + eta + 1) * B` rule, written for a changing B.

The learner still drops anything staler than the bound at consumption (`is_too_stale`); after a
shrink of B that can happen, and the drop is counted, never silent.
"""
from __future__ import annotations

import threading
import time


class AdmissionGate:
    """Thread-safe sample credits shared by actors (admit) and the learner (take/drop).

    Args:
      batch_size: B in force (the controller's; the learner loop applies its changes).
      max_staleness: the bound, in policy versions.
      on_change: called (outside the lock) when credits may have opened up.
      steps_taken: batches the learner has started (a resumed run: the step it resumes after).
      issued: samples already in line (a resumed run: those of the restored queued groups).
    """

    def __init__(self, batch_size: int, max_staleness: int, on_change=None, *, steps_taken: int = 0,
                 issued: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        if steps_taken < 0 or issued < 0:
            raise ValueError(f"steps_taken and issued: must be >= 0, got {steps_taken}, {issued}")
        self._cond = threading.Condition()
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.issued = issued   # samples admitted so far
        self.consumed = 0      # samples taken by the learner or dropped (they left the line)
        self.steps_taken = steps_taken  # batches the learner has started
        self.closed = False
        # Called (outside the lock) when credits may have opened up: the dispatcher re-checks the
        # actors waiting for work at once instead of at its next tick.
        self.on_change = on_change or (lambda: None)

    # -- actor side ------------------------------------------------------------------------------
    def consuming_step(self, n: int) -> int:
        """Step index that would consume the last of `n` samples admitted now."""
        ahead = self.issued + n - 1 - self.consumed
        return self.steps_taken + max(ahead, 0) // self.batch_size

    def try_admit(self, n: int, version: int) -> bool:
        """Admit `n` samples (one group) produced under `version` if they stay within the bound."""
        with self._cond:
            if self.closed or self.consuming_step(n) - version > self.max_staleness:
                return False
            self.issued += n
            return True

    def admit(self, n: int, version_fn, timeout: float | None = None) -> int | None:
        """Block until `n` samples can be admitted under the current `version_fn()`.

        Returns the version they were admitted under, or None on timeout or close. The version is
        read under the gate's lock, so the caller must generate with (at least) that version.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self.closed:
                version = version_fn()
                if self.consuming_step(n) - version <= self.max_staleness:
                    self.issued += n
                    return version
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(timeout=0.05 if remaining is None else min(remaining, 0.05))
            return None

    def cancel(self, n: int) -> None:
        """Give back credits for admitted samples that will never be sent (e.g. shutdown)."""
        with self._cond:
            self.issued -= n
            self._cond.notify_all()
        self.on_change()

    # -- learner side ----------------------------------------------------------------------------
    def take_batch(self, n: int) -> None:
        """The learner starts a step on `n` samples."""
        with self._cond:
            self.consumed += n
            self.steps_taken += 1
            self._cond.notify_all()
        self.on_change()

    def drop(self, n: int) -> None:
        """Samples removed from the line without training (too stale): they free their slots."""
        with self._cond:
            self.consumed += n
            self._cond.notify_all()
        self.on_change()

    def is_too_stale(self, version: int, step: int | None = None) -> bool:
        """Would a sample of `version` exceed the bound if the next step (or `step`) used it?"""
        step = self.steps_taken if step is None else step
        return step - version > self.max_staleness

    def set_batch_size(self, batch_size: int) -> None:
        with self._cond:
            self.batch_size = batch_size
            self._cond.notify_all()
        self.on_change()

    def notify(self) -> None:
        """Wake waiting actors (e.g. a new policy version was published)."""
        with self._cond:
            self._cond.notify_all()
        self.on_change()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def in_line(self) -> int:
        """Samples admitted but not yet consumed (in flight + queued)."""
        with self._cond:
            return self.issued - self.consumed

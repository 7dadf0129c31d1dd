"""The sample ledger: where every prompt of the stream is, so a resume can prove nothing is lost.

Each prompt handed out by the stream is, at any moment, in exactly one state:

    warmup     used by the supervised warm-up
    in_flight  taken by an actor, completions not yet produced      -> re-issued on resume
    queued     group produced, waiting for the learner (kept here)  -> restored on resume
    consumed   trained on by exactly one update (its step recorded)
    dropped    removed without training, with a reason (e.g. "stale", "zero_advantage")

The ledger is saved inside every checkpoint and restored with it, so events after the last
checkpoint are rolled back together with the weights they produced. `verify(position)` checks
that the indices 0..position-1 are each accounted for exactly once.

Thread-safety: actors and the learner call it concurrently; `lock` is also held by the
checkpoint snapshot so that the stream position, the ledger and the queued groups agree.
"""
from __future__ import annotations

import base64
import threading
from collections import Counter
from typing import Any

from protocols import codec as codec_mod

IN_FLIGHT, QUEUED, CONSUMED, DROPPED = "in_flight", "queued", "consumed", "dropped"


class LedgerError(RuntimeError):
    """An impossible transition (e.g. a prompt consumed twice): a bug, never silently absorbed."""


class SampleLedger:
    def __init__(self):
        self.lock = threading.RLock()
        self.warmup_end = 0  # indices [0, warmup_end) went to the supervised warm-up
        self.index_of: dict[str, int] = {}  # prompt_id -> stream index
        self.in_flight: dict[str, int] = {}  # prompt_id -> index
        self.queued: dict[str, Any] = {}  # prompt_id -> RolloutGroup, in arrival order
        self.consumed: dict[str, int] = {}  # prompt_id -> step that trained on it
        self.dropped: dict[str, str] = {}  # prompt_id -> reason

    # -- transitions ------------------------------------------------------------------------------
    def warmup(self, end: int) -> None:
        with self.lock:
            self.warmup_end = max(self.warmup_end, end)

    def issue(self, prompts) -> None:
        """Prompts (with .prompt_id, .index) taken by an actor."""
        with self.lock:
            for p in prompts:
                if p.prompt_id in self.in_flight or p.prompt_id in self.consumed or p.prompt_id in self.queued:
                    raise LedgerError(f"prompt {p.prompt_id} issued twice")
                self.in_flight[p.prompt_id] = p.index
                self.index_of[p.prompt_id] = p.index

    def queue(self, group) -> None:
        """An actor produced the group for an in-flight prompt."""
        with self.lock:
            pid = group.prompt_id
            if self.in_flight.pop(pid, None) is None:
                raise LedgerError(f"prompt {pid} produced but was not in flight")
            self.queued[pid] = group

    def consume(self, group, step: int) -> None:
        with self.lock:
            pid = group.prompt_id
            if pid in self.consumed:
                raise LedgerError(f"prompt {pid} consumed twice (steps {self.consumed[pid]} and {step})")
            if self.queued.pop(pid, None) is None:
                raise LedgerError(f"prompt {pid} consumed but was not queued")
            self.consumed[pid] = step

    def drop(self, group, reason: str) -> None:
        with self.lock:
            pid = group.prompt_id
            if self.queued.pop(pid, None) is None:
                raise LedgerError(f"prompt {pid} dropped but was not queued")
            self.dropped[pid] = reason

    # -- views ------------------------------------------------------------------------------------
    def counts(self) -> dict:
        with self.lock:
            return {"warmup": self.warmup_end, IN_FLIGHT: len(self.in_flight), QUEUED: len(self.queued),
                    CONSUMED: len(self.consumed), DROPPED: len(self.dropped),
                    "dropped_by_reason": dict(Counter(self.dropped.values()))}

    def verify(self, position: int, pending_reissue=()) -> dict:
        """Every stream index < position is in exactly one state; raise LedgerError otherwise.

        pending_reissue: indices a resumed stream will hand out again (in flight at the checkpoint)."""
        with self.lock:
            seen: Counter = Counter(pending_reissue)
            for book in (self.in_flight, self.queued, self.consumed, self.dropped):
                for pid in book:
                    seen[self.index_of[pid]] += 1
            twice = sorted(i for i, n in seen.items() if n > 1)
            if twice:
                raise LedgerError(f"stream indices in two states at once: {twice[:10]}")
            missing = sorted(set(range(self.warmup_end, position)) - set(seen))
            if missing:
                raise LedgerError(f"{len(missing)} stream indices unaccounted for, e.g. {missing[:10]}")
            beyond = sorted(i for i in seen if i >= position or i < self.warmup_end)
            if beyond:
                raise LedgerError(f"ledger holds indices outside [{self.warmup_end}, {position}): {beyond[:10]}")
            return self.counts()

    # -- persistence (JSON-able; groups through the versioned codec, never pickle) ---------------
    def state_dict(self) -> dict:
        """A copy (never the live dicts: an asynchronous checkpoint serialises it later)."""
        with self.lock:
            return {
                "warmup_end": self.warmup_end,
                "index_of": dict(self.index_of),
                "in_flight": dict(self.in_flight),
                "queued": [base64.b64encode(codec_mod.encode(g)).decode("ascii") for g in self.queued.values()],
                "consumed": dict(self.consumed),
                "dropped": dict(self.dropped),
            }

    @classmethod
    def from_state_dict(cls, d: dict) -> "SampleLedger":
        led = cls()
        led.warmup_end = int(d["warmup_end"])
        led.index_of = {k: int(v) for k, v in d["index_of"].items()}
        led.in_flight = {k: int(v) for k, v in d["in_flight"].items()}
        for blob in d["queued"]:
            g = codec_mod.decode(base64.b64decode(blob))
            led.queued[g.prompt_id] = g
        led.consumed = {k: int(v) for k, v in d["consumed"].items()}
        led.dropped = dict(d["dropped"])
        return led

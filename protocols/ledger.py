"""The sample ledger: where every prompt of the stream is, so a resume can prove nothing is lost.

Each prompt handed out by the stream is, at any moment, in exactly one state:

    warmup     used by the supervised warm-up
    in_flight  taken by an actor, completions not yet produced      -> re-issued on resume
    queued     group produced, waiting for the learner (kept here)  -> restored on resume
    consumed   trained on by exactly one update (its step recorded)
    dropped    removed without training, with a reason (e.g. "stale", "zero_advantage")

The ledger is saved inside every checkpoint and restored with it, so events after the last
checkpoint are rolled back together with the weights they produced. `verify(position)` checks
that the indices 0..position-1 are each accounted for exactly once. `release(ids)` returns prompts
of an actor that is gone to the stream (in_flight -> re-issued).

Size: a run of 100k steps settles millions of prompts, so settled prompts are compacted into a
watermark: every index in [warmup_end, watermark) is consumed or dropped, kept only as counts (by
reason). The newest `recent` settled prompts stay listed one by one, so a late duplicate is still
named as such; the checkpoint holds the watermark, the counts, the exceptions above it and the
queued groups, whatever the run's length.

Thread-safety: actors and the learner call it concurrently; `lock` is also held by the
checkpoint snapshot so that the stream position, the ledger and the queued groups agree.
"""
from __future__ import annotations

import base64
import threading
from collections import Counter
from typing import Any

from cadence.protocols import codec as codec_mod
from cadence.protocols.errors import SchemaVersionMismatch

IN_FLIGHT, QUEUED, CONSUMED, DROPPED = "in_flight", "queued", "consumed", "dropped"


class LedgerError(RuntimeError):
    """An impossible transition (e.g. a prompt consumed twice): a bug, never silently absorbed."""


class SampleLedger:
    def __init__(self, recent: int = 4096):
        self.lock = threading.RLock()
        self.recent = recent  # settled prompts kept listed above the watermark
        self.warmup_end = 0  # indices [0, warmup_end) went to the supervised warm-up
        self.watermark = 0  # indices [warmup_end, watermark) are all settled (consumed or dropped)
        self.settled_consumed = 0  # consumed prompts below the watermark
        self.settled_dropped: Counter = Counter()  # dropped prompts below the watermark, by reason
        self.index_of: dict[str, int] = {}  # prompt_id -> stream index (prompts above the watermark)
        self.in_flight: dict[str, int] = {}  # prompt_id -> index
        self.queued: dict[str, Any] = {}  # prompt_id -> RolloutGroup, in arrival order
        self.consumed: dict[str, int] = {}  # prompt_id -> step that trained on it (above the watermark)
        self.dropped: dict[str, str] = {}  # prompt_id -> reason (above the watermark)
        self._settled: dict[int, str] = {}  # index -> prompt_id of consumed/dropped above the watermark

    # -- transitions ------------------------------------------------------------------------------
    def warmup(self, end: int) -> None:
        with self.lock:
            self.warmup_end = max(self.warmup_end, end)
            self.watermark = max(self.watermark, self.warmup_end)

    def issue(self, prompts) -> None:
        """Prompts (with .prompt_id, .index) taken by an actor."""
        with self.lock:
            for p in prompts:
                if p.prompt_id in self.in_flight or p.prompt_id in self.consumed or p.prompt_id in self.queued \
                        or p.index < self.watermark or p.prompt_id in self.dropped:
                    raise LedgerError(f"prompt {p.prompt_id} issued twice")
                self.in_flight[p.prompt_id] = p.index
                self.index_of[p.prompt_id] = p.index

    def release(self, prompt_ids) -> list[int]:
        """In-flight prompts whose actor is gone: forget them here and return their stream indices,
        for the stream to hand out again (the caller re-issues them)."""
        with self.lock:
            indices = []
            for pid in prompt_ids:
                index = self.in_flight.pop(pid, None)
                if index is None:
                    raise LedgerError(f"prompt {pid} released but was not in flight")
                del self.index_of[pid]
                indices.append(index)
            return indices

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
            self._settle(pid)

    def drop(self, group, reason: str) -> None:
        with self.lock:
            pid = group.prompt_id
            if self.queued.pop(pid, None) is None:
                raise LedgerError(f"prompt {pid} dropped but was not queued")
            self.dropped[pid] = reason
            self._settle(pid)

    def _settle(self, pid: str) -> None:
        """Record a settled prompt and move the watermark over the settled prefix beyond `recent`."""
        self._settled[self.index_of[pid]] = pid
        while len(self._settled) > self.recent and self.watermark in self._settled:
            self._compact_one()

    def _compact_one(self) -> None:
        old = self._settled.pop(self.watermark)
        del self.index_of[old]
        if old in self.consumed:
            del self.consumed[old]
            self.settled_consumed += 1
        else:
            self.settled_dropped[self.dropped.pop(old)] += 1
        self.watermark += 1

    # -- views ------------------------------------------------------------------------------------
    def counts(self) -> dict:
        with self.lock:
            by_reason = Counter(self.dropped.values()) + self.settled_dropped
            return {"warmup": self.warmup_end, IN_FLIGHT: len(self.in_flight), QUEUED: len(self.queued),
                    CONSUMED: len(self.consumed) + self.settled_consumed,
                    DROPPED: len(self.dropped) + sum(self.settled_dropped.values()),
                    "dropped_by_reason": dict(by_reason)}

    def verify(self, position: int, pending_reissue=()) -> dict:
        """Every stream index < position is in exactly one state; raise LedgerError otherwise.

        pending_reissue: indices a resumed stream will hand out again (in flight at the checkpoint)."""
        with self.lock:
            seen: Counter = Counter(pending_reissue)
            for book in (self.in_flight, self.queued, self.consumed, self.dropped):
                for pid in book:
                    seen[self.index_of[pid]] += 1
            for i in range(self.warmup_end, self.watermark):  # settled, compacted
                seen[i] += 1
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
                "watermark": self.watermark,
                "settled_consumed": self.settled_consumed,
                "settled_dropped": dict(self.settled_dropped),
                "index_of": dict(self.index_of),
                "in_flight": dict(self.in_flight),
                "queued": [base64.b64encode(codec_mod.encode(g)).decode("ascii") for g in self.queued.values()],
                "consumed": dict(self.consumed),
                "dropped": dict(self.dropped),
            }

    @classmethod
    def from_state_dict(cls, d: dict, recent: int = 4096) -> "SampleLedger":
        led = cls(recent)
        led.warmup_end = int(d["warmup_end"])
        led.watermark = int(d.get("watermark", led.warmup_end))  # checkpoints before compaction: none
        led.settled_consumed = int(d.get("settled_consumed", 0))
        led.settled_dropped = Counter({k: int(v) for k, v in d.get("settled_dropped", {}).items()})
        led.index_of = {k: int(v) for k, v in d["index_of"].items()}
        led.in_flight = {k: int(v) for k, v in d["in_flight"].items()}
        for i, blob in enumerate(d["queued"]):
            try:
                g = codec_mod.decode(base64.b64decode(blob))
            except SchemaVersionMismatch as e:  # e.g. a checkpoint from before packed per-token fields
                raise LedgerError(f"checkpoint ledger: queued group {i} was saved in another wire schema "
                                  f"({e}); resume it with the Cadence version that wrote it, or start a "
                                  f"new run") from None
            led.queued[g.prompt_id] = g
        led.consumed = {k: int(v) for k, v in d["consumed"].items()}
        led.dropped = dict(d["dropped"])
        for pid in (*led.consumed, *led.dropped):
            led._settled[led.index_of[pid]] = pid
        with led.lock:  # an old checkpoint listed every settled prompt: compact it now
            while len(led._settled) > led.recent and led.watermark in led._settled:
                led._compact_one()
        return led

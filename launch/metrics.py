"""Run-directory outputs: metrics.jsonl (one JSON object per update) and the progress line."""
from __future__ import annotations

import json
import math
import os
import sys
import time


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line in flight."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(_clean(record), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


def _clean(v):
    """JSON has no NaN/inf: write null instead of a value a reader chokes on."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _fmt_k(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


class Progress:
    """One compact line per report; stderr, so stdout stays clean for machine-readable output."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.last_eval = None

    def line(self, m: dict) -> None:
        if not self.enabled:
            return
        # held-out exact match for tasks with answers; their reward for tasks without
        if m.get("eval/exact_match") is not None:
            self.last_eval = ("heldout EM", m["eval/exact_match"])
        elif m.get("eval/reward") is not None:
            self.last_eval = ("heldout reward", m["eval/reward"])
        label, value = self.last_eval or ("heldout EM", None)
        ev = f"{label} " + ("   -  " if value is None else f"{value:6.3f}")
        parts = [
            f"step {m['step']:>4}",
            f"samples {m['samples']:>7}",
            f"reward {m['reward/mean']:.3f}",
            ev,
            f"gen {_fmt_k(m.get('actors/tokens_per_second', 0.0))} tok/s",
            f"train {_fmt_k(m.get('learner/tokens_per_second', 0.0))} tok/s",
            f"stale {m['staleness/mean']:.2f} (max {m['staleness/max']})",
            f"{m['wall_time']:6.1f}s",
        ]
        print(" | ".join(parts), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)


class Clock:
    """Seconds since the run started (wall_time in metrics.jsonl)."""

    def __init__(self, offset: float = 0.0):
        self.t0 = time.perf_counter() - offset  # a resumed run continues its predecessor's clock

    def __call__(self) -> float:
        return time.perf_counter() - self.t0

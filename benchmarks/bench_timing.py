"""Shared timing for the benchmarks: the median of repeated back-to-back calls after warm-up."""
from __future__ import annotations

import statistics
import time


def median_seconds(call, repeats: int, inner: int, warmup: int = 1) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls (after `warmup` calls)."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def alternating_updates(steps: dict, states: dict, layouts, repeats: int) -> tuple[dict, dict]:
    """Train steps compared side by side: each side's first update (the warm-up: compilation) and
    then `repeats` timed updates, the sides alternating so a noisy neighbour hits them alike.
    layouts: a side's name -> (microbatches, stats), or one such pair for every side; states are
    replaced by what each update returns (it donates the Adam moments).
    Returns ({side: median seconds an update}, {side: its first update's metrics})."""
    first, seconds = {}, {name: [] for name in steps}

    def one_update(name: str) -> float:
        mbs, stats = layouts[name] if isinstance(layouts, dict) else layouts
        start = time.perf_counter()
        states[name], metrics = steps[name].update(states[name], mbs, stats["num_tokens"])  # host floats: synced
        first.setdefault(name, metrics)
        return time.perf_counter() - start

    for name in steps:
        one_update(name)
    for _ in range(repeats):
        for name in steps:
            seconds[name].append(one_update(name))
    return {name: statistics.median(t) for name, t in seconds.items()}, first

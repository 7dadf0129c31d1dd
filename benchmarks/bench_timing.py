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

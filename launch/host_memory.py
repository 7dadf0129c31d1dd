"""Host memory of a training process: large freed buffers go back to the OS.

XLA on CPU allocates every buffer with malloc. glibc serves a request above its mmap threshold
with its own mapping (unmapped on free), but it raises that threshold to the size of each mapped
block it frees, up to 32 MB; after the first update nearly every activation buffer then comes from
the heap, and a heap returns memory to the OS only from its top. With a 135M-parameter model the
process's resident size grew by ~0.35 GB per update for the same live arrays (3.6 -> 4.7 GB in
three updates); with the threshold fixed it stayed flat (docs/results/smollm2_memory.md).

Smaller blocks freed stay in the heaps (one per thread that allocated: arenas) until trimmed. At
SmolLM2's size a generate call left 0.2-0.5 GB of them resident, and an orbax checkpoint write
(tensorstore's threads) 0.3-0.5 GB, all of it still resident through the next update's gradient
pass. release_free_heap() hands them back (33-66 ms when there is that much, ~1 ms when there is
nothing); HeapTrimmer does it before each update once the resident size has grown enough to be
worth it, so a small model's millisecond updates never pay.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
# Blocks from 256 KB up are mapped and unmapped (a page fault per page when first written);
# smaller ones stay in the heap. SmolLM2's activations at 512 tokens a microbatch are 1.2-3 MB.
DEFAULT_THRESHOLD = 256 << 10


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, or None (off Linux, or another C library: musl has neither mallopt nor malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist
    except (OSError, AttributeError):
        return None
    return libc


def fix_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Sets glibc's mmap threshold (which also stops its dynamic growth); True if it was set.

    A no-op off Linux, with another C library, or when MALLOC_MMAP_THRESHOLD_ is in the
    environment (glibc read it at start: the user's choice stands).
    """
    libc = None if "MALLOC_MMAP_THRESHOLD_" in os.environ else _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1


def release_free_heap() -> bool:
    """Returns the free pages of every heap to the OS (glibc's malloc_trim(0)); True if any were.
    A no-op (False) where glibc is not the C library."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc.malloc_trim(0) == 1


def resident_bytes() -> int:
    """This process's resident size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """Calls release_free_heap when the resident size grew by `min_growth` bytes since it last ran
    (or since construction): a cheap check (one read of /proc) where nothing is to be gained."""

    def __init__(self, min_growth: int = 64 << 20):
        self.min_growth = int(min_growth)
        self._mark = resident_bytes()
        self.trims = 0

    def __call__(self) -> bool:
        if resident_bytes() - self._mark < self.min_growth:
            return False
        released = release_free_heap()
        self._mark = resident_bytes()
        self.trims += 1
        return released

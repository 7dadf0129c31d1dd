"""Host memory of a training process: large freed buffers go back to the OS.

XLA on CPU allocates every buffer with malloc. glibc serves a request above its mmap threshold
with its own mapping (unmapped on free), but it raises that threshold to the size of each mapped
block it frees, up to 32 MB; after the first update nearly every activation buffer then comes from
the heap, and a heap returns memory to the OS only from its top. With a 135M-parameter model the
process's resident size grew by ~0.35 GB per update for the same live arrays (3.6 -> 4.7 GB in
three updates); with the threshold fixed it stayed flat (docs/results/smollm2_memory.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
# Blocks from 256 KB up are mapped and unmapped (a page fault per page when first written);
# smaller ones stay in the heap. SmolLM2's activations at 512 tokens a microbatch are 1.2-3 MB.
DEFAULT_THRESHOLD = 256 << 10


def fix_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Sets glibc's mmap threshold (which also stops its dynamic growth); True if it was set.

    A no-op off Linux, with another C library, or when MALLOC_MMAP_THRESHOLD_ is in the
    environment (glibc read it at start: the user's choice stands).
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1

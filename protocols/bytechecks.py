"""Whole-buffer checks on little-endian arrays, for validating received messages.

Each answers one question about every element of a buffer: all int32 >= 0, all float32 finite, all
bytes 0 or 1. A NumPy reduction costs ~1-2 us however small the array, which is most of what a
small RolloutGroup costs to validate; so up to SMALL elements the checks read the bytes themselves
with C-speed `bytes` methods (~0.1-0.5 us), and beyond it use NumPy (faster per element).

The byte tricks rest on the IEEE and two's-complement layouts, little-endian: an int32 is negative
iff the high bit of its byte 3 is set; a float32 is inf or NaN iff its 8 exponent bits are all
ones, and 7 of them are the low bits of its byte 3, so a buffer whose bytes 3 never end in seven
ones holds only finite values (a byte 3 of 0x7F or 0xFF also marks |x| >= 2**127: rechecked exactly).
"""
from __future__ import annotations

import math

import numpy as np

SMALL = 512  # elements: below this the byte tricks beat a NumPy call (measured, bytes vs NumPy)

# byte 3 of a float32 -> 0x80 where its seven exponent bits are all ones (inf, NaN or |x| >= 2**127)
_TOP_EXPONENT = bytes(0x80 if i & 0x7F == 0x7F else 0 for i in range(256))
_BOOL_BYTES = b"\x00\x01"


def all_nonnegative_int32(data: bytes) -> bool:
    """True if every little-endian int32 in data is >= 0 (len(data) a multiple of 4)."""
    if len(data) <= 4 * SMALL:
        return data[3::4].isascii()  # no byte 3 with its sign bit set
    return bool(np.frombuffer(data, "<i4").min() >= 0)


def all_finite_float32(data: bytes) -> bool:
    """True if every little-endian float32 in data is finite (len(data) a multiple of 4)."""
    if len(data) <= 4 * SMALL and data[3::4].translate(_TOP_EXPONENT).isascii():
        return True
    values = np.frombuffer(data, "<f4")
    # One BLAS dot, the cheapest full NumPy pass: NaN or inf anywhere makes the sum of squares
    # non-finite (a finite overflow, |x| > 1.8e19, is rechecked exactly, hence no overflow warning).
    with np.errstate(over="ignore", invalid="ignore"):
        return math.isfinite(values.dot(values)) or bool(np.isfinite(values).all())


def all_zero_or_one(data: bytes) -> bool:
    """True if every byte of data is 0 or 1 (a valid NumPy bool array)."""
    if len(data) <= SMALL:
        return not data.translate(None, _BOOL_BYTES)
    return bool(np.frombuffer(data, np.uint8).max(initial=0) <= 1)

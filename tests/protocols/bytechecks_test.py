"""The byte-level buffer checks agree with plain NumPy on hand-made and random buffers, on both sides
of the size where they switch from reading bytes to calling NumPy."""
import numpy as np
import pytest

from cadence.protocols.bytechecks import SMALL, all_finite_float32, all_nonnegative_int32, all_zero_or_one

SIZES = (0, 1, 3, SMALL - 1, SMALL, SMALL + 1, 4 * SMALL)

INT_EDGES = [0, 1, 127, 128, 255, 256, 2**23, 2**24 - 1, 2**31 - 1, -1, -128, -2**31, -2**24]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38,
               2.0**127, -(2.0**127), 1.7e38, 2.0**64, -(2.0**64), 1.8e19, -1e30,
               np.inf, -np.inf, np.nan, -np.nan]


def place(n, value, where, dtype, fill):
    """n elements of `fill` with `value` at position `where` (0, middle or last)."""
    a = np.full(n, fill, dtype)
    a[where(n)] = value
    return a


POSITIONS = (lambda n: 0, lambda n: n // 2, lambda n: n - 1)


@pytest.mark.parametrize("n", [s for s in SIZES if s])
@pytest.mark.parametrize("value", INT_EDGES)
@pytest.mark.parametrize("where", POSITIONS)
def test_nonnegative_int32_matches_numpy(n, value, where):
    a = place(n, value, where, "<i4", 7)
    assert all_nonnegative_int32(a.tobytes()) == bool((a >= 0).all())


@pytest.mark.parametrize("n", [s for s in SIZES if s])
@pytest.mark.parametrize("value", FLOAT_EDGES)
@pytest.mark.parametrize("where", POSITIONS)
def test_finite_float32_matches_numpy(n, value, where):
    a = place(n, value, where, "<f4", -0.5)
    assert all_finite_float32(a.tobytes()) == bool(np.isfinite(a).all())


@pytest.mark.parametrize("n", [s for s in SIZES if s])
@pytest.mark.parametrize("value", [0, 1, 2, 127, 128, 254, 255])
@pytest.mark.parametrize("where", POSITIONS)
def test_zero_or_one_matches_numpy(n, value, where):
    a = place(n, value, where, np.uint8, 1)
    assert all_zero_or_one(a.tobytes()) == bool((a <= 1).all())


def test_empty_buffers_pass():
    assert all_nonnegative_int32(b"") and all_finite_float32(b"") and all_zero_or_one(b"")


@pytest.mark.parametrize("n", SIZES)
def test_random_buffers_match_numpy(n):
    rng = np.random.default_rng(n)
    for _ in range(50):
        raw = rng.integers(0, 256, 4 * n, dtype=np.uint8).tobytes()  # every bit pattern is fair game
        ints, floats = np.frombuffer(raw, "<i4"), np.frombuffer(raw, "<f4")
        assert all_nonnegative_int32(raw) == bool((ints >= 0).all())
        with np.errstate(invalid="ignore"):
            assert all_finite_float32(raw) == bool(np.isfinite(floats).all())
        small = (rng.random(n) < 0.99).astype(np.uint8)
        if n and rng.random() < 0.5:
            small[rng.integers(n)] = rng.integers(2, 256)
        assert all_zero_or_one(small.tobytes()) == bool((small <= 1).all())

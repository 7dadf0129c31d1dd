"""Ragged and Packed: rows in one little-endian buffer, read back as NumPy views."""
import msgspec
import numpy as np
import pytest

from cadence.protocols.ragged import Packed, Ragged


def test_rows_round_trip_through_the_buffer():
    r = Ragged.pack([[5, 6, 7], [], [8]], "int32")
    assert len(r) == 3 and r.tolist() == [[5, 6, 7], [], [8]]
    assert r.values.tolist() == [5, 6, 7, 8] and r.lengths.tolist() == [3, 0, 1]
    assert r.offsets.tolist() == [0, 3, 3, 4]
    assert r[2].tolist() == [8] and r[-3].tolist() == [5, 6, 7] and [x.tolist() for x in r] == r.tolist()
    assert r.row_lengths == np.array([3, 0, 1], "<i4").tobytes() and r.data == np.array([5, 6, 7, 8], "<i4").tobytes()
    with pytest.raises(IndexError, match="row 3 out of range for 3 rows"):
        r[3]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=Ragged) == r


def test_arrays_and_lists_pack_the_same():
    rows = [[-0.5, -0.25], [-1.0]]
    assert Ragged.pack([np.asarray(x, np.float64) for x in rows], "float32") == Ragged.pack(rows, "float32")
    assert Ragged.pack([np.array([True, False])], "bool").tolist() == [[True, False]]
    same = Ragged.pack(rows, "float32")
    assert Ragged.pack(same, "float32") is same


@pytest.mark.parametrize("rows", [[[2**40]], [np.array([2**40])], [np.array([1.5])]], ids=["list", "int64", "float"])
def test_values_int32_cannot_hold_are_refused(rows):
    with pytest.raises(ValueError, match="cannot pack rows as int32"):
        Ragged.pack(rows, "int32")


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype: must be one of"):
        Ragged.pack([[1]], "int64")


def test_packed_is_a_1d_array():
    p = Packed.pack([1, 5, 6], "int32")
    assert len(p) == 3 and p.tolist() == [1, 5, 6] and list(p) == [1, 5, 6] and p[1] == 5
    np.testing.assert_array_equal(np.asarray(p, np.int64), [1, 5, 6])
    assert Packed.pack(np.array([1, 5, 6]), "int32") == p
    with pytest.raises(ValueError, match="cannot pack values as int32"):
        Packed.pack(np.array([2**40]), "int32")

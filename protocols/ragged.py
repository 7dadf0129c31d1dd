"""Packed arrays for messages. Ragged: G rows of different lengths in one flat little-endian buffer
(the per-token fields of a RolloutGroup: completion ids, behavior logprobs, policy mask, kept
log-mass); Packed: one 1-D array (its prompt ids).

    r = Ragged.pack([[5, 6, 7], [8]], "int32")   # from lists (or 1-D arrays) of rows
    r.values          # int32 [4]: 5 6 7 8 (read-only view of the buffer, no copy)
    r.lengths         # int32 [2]: 3 1;  r.offsets: int64 [3]: 0 3 4
    r[1], len(r)      # row 1 as an array view, G
    r.tolist()        # [[5, 6, 7], [8]] (for tests and logs, not for hot paths)

On the wire it is the MessagePack array [dtype, row_lengths, data]: dtype names the element type,
row_lengths is G little-endian int32s and data the rows back to back, both MessagePack bin. So a
receiver gets NumPy views of the bytes it decoded instead of building Python lists of numbers, and
the learner copies rows straight into its batch arrays. Nothing here checks that the lengths fit
the data: the message holding a Ragged does that with its field's name (RolloutGroup.validate).
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np

DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "bool": np.dtype("|b1")}
_LENGTHS = np.dtype("<i4")


def _np_dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """values as dtype; an integer target must hold them exactly (int64 ids beyond int32 are refused,
    as np.fromiter refuses Python ints)."""
    out = values.astype(dtype)
    if dtype.kind == "i" and values.dtype != dtype and not np.array_equal(out, values):
        raise ValueError(f"values do not fit {dtype.name} exactly (range {values.min()}..{values.max()})")
    return out


class Ragged(msgspec.Struct, frozen=True, array_like=True):
    """[G][T_g] values of one dtype: row i is values[offsets[i]:offsets[i + 1]]."""

    dtype: str  # element type: "int32", "float32" or "bool"
    row_lengths: bytes  # [G] little-endian int32: T_g
    data: bytes  # sum(T_g) elements of dtype, little-endian, row after row

    @classmethod
    def pack(cls, rows: Sequence[Sequence[Any]] | Ragged, dtype: str) -> Ragged:
        """Packs rows (lists, tuples or 1-D arrays) as `dtype`; a Ragged of that dtype is returned as is.

        Raises:
          ValueError: unknown dtype, or a value that `dtype` cannot hold (e.g. an id beyond int32).
        """
        np_dtype = _np_dtype(dtype)
        if isinstance(rows, Ragged):
            if rows.dtype == dtype:
                return rows
            return cls.pack(rows.tolist(), dtype)
        lengths = np.fromiter((len(r) for r in rows), _LENGTHS, len(rows))
        try:
            if all(isinstance(r, np.ndarray) for r in rows):
                values = _cast(np.concatenate([np.zeros(0, np_dtype), *(r.reshape(-1) for r in rows)]), np_dtype)
            else:
                values = np.fromiter(itertools.chain.from_iterable(rows), np_dtype, int(lengths.sum()))
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"cannot pack rows as {dtype}: {e}") from None
        return cls(dtype, lengths.tobytes(), values.tobytes())

    @property
    def lengths(self) -> np.ndarray:
        """int32 [G]: the row lengths T_g (read-only)."""
        return np.frombuffer(self.row_lengths, _LENGTHS)

    @property
    def values(self) -> np.ndarray:
        """[sum T_g] all rows back to back (read-only view of the buffer)."""
        return np.frombuffer(self.data, DTYPES[self.dtype])

    @property
    def offsets(self) -> np.ndarray:
        """int64 [G + 1]: row i is values[offsets[i]:offsets[i + 1]]."""
        out = np.zeros(len(self) + 1, np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def __len__(self) -> int:
        return len(self.row_lengths) // 4

    def __getitem__(self, i: int) -> np.ndarray:
        """Row i (a read-only view). Negative i counts from the end."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        offsets = self.offsets
        i %= n
        return self.values[offsets[i]:offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        values, offsets = self.values, self.offsets
        return (values[offsets[i]:offsets[i + 1]] for i in range(len(self)))

    def tolist(self) -> list[list]:
        """The rows as Python lists (tests, logs; hot paths use values / lengths)."""
        values, offsets = self.values.tolist(), self.offsets.tolist()
        return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


class Packed(msgspec.Struct, frozen=True, array_like=True):
    """A 1-D array of one dtype in one little-endian buffer (a RolloutGroup's prompt ids): on the
    wire [dtype, data]; `values` is a read-only NumPy view, and np.asarray(packed) works."""

    dtype: str  # element type: "int32", "float32" or "bool"
    data: bytes  # the elements, little-endian

    @classmethod
    def pack(cls, values: Sequence[Any] | Packed, dtype: str) -> Packed:
        """Packs a list, tuple or 1-D array as `dtype`; a Packed of that dtype is returned as is.

        Raises:
          ValueError: unknown dtype, or a value that `dtype` cannot hold.
        """
        np_dtype = _np_dtype(dtype)
        if isinstance(values, Packed):
            return values if values.dtype == dtype else cls.pack(values.values, dtype)
        try:
            array = (_cast(values.reshape(-1), np_dtype) if isinstance(values, np.ndarray)
                     else np.fromiter(values, np_dtype, len(values)))
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"cannot pack values as {dtype}: {e}") from None
        return cls(dtype, array.tobytes())

    @property
    def values(self) -> np.ndarray:
        """The elements (read-only view of the buffer)."""
        return np.frombuffer(self.data, DTYPES[self.dtype])

    def __array__(self, dtype=None, copy=None):
        return self.values if dtype is None else self.values.astype(dtype)

    def __len__(self) -> int:
        return len(self.data) // DTYPES[self.dtype].itemsize

    def __getitem__(self, i):
        return self.values[i]

    def __iter__(self) -> Iterator:
        return iter(self.values)

    def tolist(self) -> list:
        return self.values.tolist()

"""Array columns as numpy: fixed-size lists as dense blocks, lists as values plus offsets.

Float nulls become NaN and a null list an empty row; other nulls block the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def is_number(typ: pa.DataType) -> bool:
    """Whether ``typ`` is an integer, float or boolean type."""
    return bool(pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ))


def fixed_shape(typ: pa.DataType) -> tuple[tuple[int, ...], pa.DataType] | None:
    """The dimensions and element type of a (nested) fixed-size list of numbers, or None.

    >>> fixed_shape(pa.list_(pa.list_(pa.float32(), 3), 2))
    ((2, 3), DataType(float))
    >>> fixed_shape(pa.list_(pa.string(), 2)) is None
    True
    """
    dims: list[int] = []
    while pa.types.is_fixed_size_list(typ):
        dims.append(typ.list_size)
        typ = typ.value_type
    if not dims or not is_number(typ):
        return None
    return tuple(dims), typ


def is_ragged_type(typ: pa.DataType) -> bool:
    """Whether a column is a list or large list of numbers (or of fixed-size lists of them).

    >>> [is_ragged_type(t) for t in (pa.list_(pa.int32()), pa.large_list(pa.list_(pa.float16(), 3)),
    ...  pa.list_(pa.string()), pa.list_(pa.list_(pa.int8())))]
    [True, True, False, False]
    """
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
        return False
    inner = typ.value_type
    return is_number(inner) or fixed_shape(inner) is not None


def _leaf(typ: pa.DataType) -> pa.DataType:
    while pa.types.is_fixed_size_list(typ) or pa.types.is_list(typ) or pa.types.is_large_list(typ):
        typ = typ.value_type
    return typ


def one_array(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The column as one Arrow array (its only chunk uncopied)."""
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def blocking_nulls(col: pa.Array | pa.ChunkedArray) -> int:
    """Nulls in a tensor-bound column that its tensor cannot hold (0 for float columns).

    >>> blocking_nulls(pa.array([[1, None], [2, 3]], pa.list_(pa.int8(), 2)))
    1
    >>> blocking_nulls(pa.array([[1.0, None], None], pa.list_(pa.float32(), 2)))
    0
    """
    if pa.types.is_floating(_leaf(col.type)):
        return 0
    arr = one_array(col)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = arr.flatten()  # the values of the non-null lists
    levels, leaf = _levels(arr)
    return int(sum(level.null_count for level in levels) + leaf.null_count)


def _levels(arr: pa.Array) -> tuple[list[pa.FixedSizeListArray], pa.Array]:
    """The fixed-size list levels of ``arr``, outermost first, and the innermost's values."""
    levels = []
    while pa.types.is_fixed_size_list(arr.type):
        levels.append(arr)
        size = arr.type.list_size
        arr = arr.values.slice(arr.offset * size, len(arr) * size)
    return levels, arr


def leaf_numpy(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A column of numbers as numpy, float nulls as NaN (the caller checks other nulls)."""
    if arr.null_count and pa.types.is_floating(arr.type):
        arr = pc.fill_null(arr, pa.scalar(np.nan, arr.type))
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def fixed_numpy(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A (nested) fixed-size list column as a ``(rows, D1, D2, ...)`` array.

    Float nulls, of elements or of whole lists, become NaN; the caller checks
    :func:`blocking_nulls` for other element types.
    """
    shape = fixed_shape(col.type)
    assert shape is not None, col.type
    levels, arr = _levels(one_array(col))
    values = leaf_numpy(arr).reshape(len(levels[0]), *shape[0])
    if pa.types.is_floating(arr.type) and any(level.null_count for level in levels):
        values = values if values.flags.writeable else values.copy()
        for level in levels:
            if level.null_count:
                valid = np.asarray(level.is_valid().to_numpy(zero_copy_only=False))
                values.reshape(len(level), -1)[~valid] = np.nan
    return values


def to_arrow(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    """A packed column (one row per element of ``values``) back as an Arrow array of ``typ``.

    >>> to_arrow(np.arange(4.0).reshape(2, 2), pa.list_(pa.float64(), 2)).to_pylist()
    [[0.0, 1.0], [2.0, 3.0]]
    """
    shape = fixed_shape(typ)
    if shape is None:
        return pa.array(values).cast(typ)
    arr = pa.array(np.ascontiguousarray(values).reshape(-1)).cast(shape[1])
    for size in reversed(shape[0]):
        arr = pa.FixedSizeListArray.from_arrays(arr, size)
    return arr.cast(typ)  # field names of the list types


@dataclass(frozen=True)
class Ragged:
    """A batch's variable-length column: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    ``offsets`` holds ``rows + 1`` int64 offsets, starting at 0.
    """

    values: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Elements per row."""
        return np.diff(self.offsets)

    def padded(self, pad: float | int) -> np.ndarray:
        """The rows padded with ``pad`` to the longest: ``(rows, max_len, *inner)``."""
        lengths = self.lengths
        width = int(lengths.max()) if len(lengths) else 0
        out = np.full((len(lengths), width, *self.values.shape[1:]), pad, self.values.dtype)
        out[np.arange(width) < lengths[:, None]] = self.values  # row-major: the values' order
        return out


def gather_ragged(parts: list[pa.Array], unit: np.ndarray, row: np.ndarray) -> Ragged | None:
    """Rows of a list-of-numbers column spread over units, in one copy of their values.

    ``parts`` is the column of each unit (one chunk each); ``unit`` and ``row`` say where each
    batch row is. None (the general path) when the elements are not plain numbers or hold a null.
    """
    values, starts, stops = [], np.zeros(len(unit), np.int64), np.zeros(len(unit), np.int64)
    for u, part in enumerate(parts):
        child = part.values
        if not is_number(child.type) or child.null_count:
            return None
        values.append(leaf_numpy(child))
        mine = np.flatnonzero(unit == u)
        if not len(mine):
            continue
        offsets = np.asarray(part.offsets.to_numpy(zero_copy_only=False), np.int64)
        local = row[mine]
        starts[mine], stops[mine] = offsets[local], offsets[local + 1]
        if part.null_count:  # a null list is an empty row, whatever its offsets say
            valid = np.asarray(part.is_valid().to_numpy(zero_copy_only=False))
            stops[mine] = np.where(valid[local], stops[mine], starts[mine])
    offsets = np.zeros(len(unit) + 1, np.int64)
    np.cumsum(stops - starts, out=offsets[1:])
    bounds = zip(unit.tolist(), starts.tolist(), stops.tolist(), strict=True)
    pieces = [values[u][a:b] for u, a, b in bounds]
    dtype = values[0].dtype if values else np.dtype(np.float32)
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return Ragged(flat, offsets)


def ragged_numpy(col: pa.Array | pa.ChunkedArray) -> Ragged:
    """A list column of numbers (or of fixed-size lists) as values and int64 offsets.

    Null lists become empty rows, float null elements NaN (see :func:`fixed_numpy`).
    """
    arr = one_array(col)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(arr) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    inner = arr.flatten()  # the non-null lists' values, slicing taken care of
    values = fixed_numpy(inner) if fixed_shape(inner.type) else leaf_numpy(inner)
    return Ragged(values, offsets)

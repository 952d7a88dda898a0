"""Decoded units in the form that makes batch assembly cheap: fixed-width columns as row bytes."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lakeloader.cache.arrays import blocking_nulls, fixed_numpy, fixed_shape, is_number, leaf_numpy
from lakeloader.cache.kernels import unsliced, unsliced_table
from lakeloader.cache.views import VIEW_BYTES, VIEW_DTYPE, VIEW_TYPES

#: Buffer bytes a table may hold beyond its rows' before ``compact`` copies it.
SLACK_BYTES = 64 << 10


def is_tensor_type(typ: pa.DataType) -> bool:
    """Whether a column becomes a dense tensor: numbers, temporals, fixed-size lists of numbers.

    >>> [is_tensor_type(t) for t in (pa.date32(), pa.list_(pa.float32(), 8), pa.string())]
    [True, True, False]
    """
    return is_number(typ) or pa.types.is_temporal(typ) or fixed_shape(typ) is not None


def tensor_dtype(typ: pa.DataType) -> np.dtype:
    """The numpy dtype of one row of a tensor-typed column (a subarray for fixed-size lists).

    >>> tensor_dtype(pa.list_(pa.list_(pa.int8(), 3), 2)), tensor_dtype(pa.timestamp("ms"))
    (dtype(('i1', (2, 3))), dtype('int64'))
    """
    empty = tensor_numpy(pa.array([], typ))
    return np.dtype((empty.dtype, empty.shape[1:]))


def tensor_numpy(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A tensor-typed column as numpy, temporal values as ticks in their own unit.

    The caller checks :func:`blocking_nulls`; float nulls become NaN.
    """
    typ = col.type
    if pa.types.is_fixed_size_list(typ):
        return fixed_numpy(col)
    if pa.types.is_temporal(typ):
        col = col.cast(pa.int64() if typ.bit_width == 64 else pa.int32())
    return leaf_numpy(col)


@dataclass(frozen=True)
class RowLayout:
    """Where each packed column (in schema order) sits in a row of the byte matrix.

    ``views`` are the string and binary columns kept as Arrow binary views, after the packed
    ones; ``row_bytes`` counts both.
    """

    names: tuple[str, ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    row_bytes: int
    views: tuple[str, ...] = ()

    @functools.cached_property
    def record(self) -> np.dtype:
        """The row as a numpy structured dtype: the packed columns, then a view per ``views``."""
        at = self.row_bytes - VIEW_BYTES * len(self.views)  # the views come last
        return np.dtype(
            {
                "names": [*self.names, *self.views],
                "formats": [*self.dtypes, *[VIEW_DTYPE] * len(self.views)],
                "offsets": [*self.offsets, *range(at, at + VIEW_BYTES * len(self.views), 16)],
                "itemsize": self.row_bytes,
            }
        )

    @functools.cached_property
    def void(self) -> np.dtype:
        """A field-less dtype of the row's size: ``np.take`` of it is a plain row copy."""
        return np.dtype((np.void, self.row_bytes))

    @classmethod
    def of(cls, schema: pa.Schema) -> RowLayout:
        """The layout of a schema's tensor-typed columns, then of its string/binary views.

        >>> RowLayout.of(pa.schema([("id", pa.int64()), ("s", pa.string()), ("x", pa.float32())]))
        RowLayout(names=('id', 'x'), dtypes=(dtype('int64'), dtype('float32')), offsets=(0, 8), row_bytes=28, views=('s',))
        """  # noqa: E501
        tensors = [f for f in schema if is_tensor_type(f.type)]
        dtypes = tuple(tensor_dtype(f.type) for f in tensors)
        ends = list(itertools.accumulate((d.itemsize for d in dtypes), initial=0))
        views = tuple(f.name for f in schema if f.type in VIEW_TYPES)
        names = tuple(f.name for f in tensors)
        return cls(names, dtypes, tuple(ends[:-1]), ends[-1] + VIEW_BYTES * len(views), views)


@dataclass(frozen=True)
class Packed:
    """A decoded unit: packed row bytes plus the columns left in Arrow form.

    Attributes:
        rows: The unit's rows of ``layout.record`` (a slice of the rank's arena), or None when
            nothing is packed.
        packed: The columns in ``rows`` (a non-float column of the layout that holds nulls in
            this unit stays in ``table`` instead).
        where: The unit's file, row group and rows, for error messages.
    """

    rows: np.ndarray | None
    packed: tuple[str, ...]
    table: pa.Table
    where: str = ""

    @property
    def num_rows(self) -> int:
        """Rows in the unit."""
        return self.table.num_rows if self.rows is None else len(self.rows)


def pack(table: pa.Table, layout: RowLayout, rows: np.ndarray) -> Packed:
    """Pack a unit's tensor-typed columns into its arena ``rows``; compact the others."""
    packed: list[str] = []
    for name in layout.names:
        col = table.column(name)
        if blocking_nulls(col):
            continue  # nulls an integer tensor cannot hold: the batch decides (NullValuesError)
        rows[name] = tensor_numpy(col)
        packed.append(name)
    return Packed(rows if packed else None, tuple(packed), compact(table.drop_columns(packed)))


def compact(table: pa.Table) -> pa.Table:
    """The table in one chunk per column that owns only its own rows' memory.

    A table whose buffers hold more than twice its own bytes (plus ``SLACK_BYTES``), such as a
    slice of a larger batch, is copied; affected columns are copied to offset 0
    (:mod:`lakeloader.cache.kernels`).

    >>> big = pa.table({"s": ["x" * 100] * 10_000})
    >>> compact(big.slice(0, 10)).get_total_buffer_size() < 2_000
    True
    """
    table = unsliced_table(table)
    if table.get_total_buffer_size() <= 2 * table.nbytes + SLACK_BYTES:
        return table.combine_chunks()
    return table.take(pa.array(np.arange(table.num_rows, dtype=np.int64)))


def column_of(unit: Packed, name: str) -> np.ndarray:
    """One packed column of a unit, as a contiguous array."""
    assert unit.rows is not None
    column: np.ndarray = unit.rows[name].copy()
    return column


@dataclass(frozen=True)
class Selection:
    """Rows of a batch grouped by unit: ``take`` sorted by unit, and the way back.

    Attributes:
        unit: Unit of each run of rows; ``bounds`` the run's ``[start, stop)`` when sorted.
        local: Row inside its unit, in the sorted order.
        inverse: Position in the sorted order of each batch row (``order``: the reverse).
    """

    unit: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]
    local: np.ndarray
    inverse: np.ndarray
    order: np.ndarray


def select(sizes: Sequence[int], take: np.ndarray) -> Selection:
    """Group the batch rows ``take`` (into the concatenation of units of ``sizes``) by unit.

    >>> s = select([2, 3], np.array([4, 0, 2, 1]))
    >>> s.unit, s.bounds, s.local.tolist(), s.inverse.tolist()
    ((0, 1), ((0, 2), (2, 4)), [0, 1, 2, 0], [2, 0, 3, 1])
    """
    base = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))[:-1]])
    piece = np.searchsorted(base, take, side="right") - 1
    order = np.argsort(piece, kind="stable")
    sorted_piece = piece[order]
    local = take[order] - base[sorted_piece]
    cuts = np.flatnonzero(np.diff(sorted_piece)) + 1
    starts = np.concatenate([[0], cuts]).astype(np.int64)
    stops = np.concatenate([cuts, [len(take)]]).astype(np.int64)
    inverse = np.empty(len(take), dtype=np.int64)
    inverse[order] = np.arange(len(take), dtype=np.int64)
    units = tuple(int(u) for u in sorted_piece[starts]) if len(take) else ()
    bounds = tuple(zip(starts.tolist(), stops.tolist(), strict=True)) if len(take) else ()
    return Selection(units, bounds, local, inverse, order)


def gather_arrow(columns: Sequence[pa.Array], sel: Selection) -> pa.Array:
    """The selected rows of one column given per unit, in batch order."""
    # pc.array_take skips Array.take's dispatch: a fifth less a call (measured at 2cc181c).
    parts = [
        pc.array_take(unsliced(columns[u]), sel.local[start:stop])
        for u, (start, stop) in zip(sel.unit, sel.bounds, strict=True)
    ]
    if not parts:
        return columns[0].slice(0, 0) if columns else pa.array([])
    return pc.array_take(pa.concat_arrays(parts), sel.inverse)


def gather_packed(
    records: np.ndarray, rows: np.ndarray, layout: RowLayout, names: Sequence[str]
) -> dict[str, np.ndarray]:
    """Columns ``names`` of arena ``rows``: one row copy, then one contiguous copy per column."""
    taken = np.take(records.view(layout.void), rows).view(layout.record)
    # .copy(), not ascontiguousarray: a one-row field view counts as contiguous but keeps the
    # row's stride, which torch.from_numpy refuses.
    return {name: taken[name].copy() for name in names}

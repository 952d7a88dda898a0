"""The row path: rows as dicts, as torch's DataLoader hands them to a ``transform``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lakeloader.cache.arrays import blocking_nulls, fixed_shape, is_ragged_type, ragged_numpy
from lakeloader.cache.packed import Packed, Selection, gather_arrow, select, tensor_numpy
from lakeloader.errors import ColumnNotFoundError
from lakeloader.pipeline.collate import Transform, python_values, to_tensor, unit_parts
from lakeloader.randomness import drawing


def row_values(col: pa.Array | pa.ChunkedArray) -> list[Any] | pa.Array:
    """One column's value for each row: tensors for array columns, else Python values.

    >>> [t.tolist() for t in row_values(pa.array([[1, 2], [3]], pa.list_(pa.int32())))]
    [[1, 2], [3]]
    >>> row_values(pa.array([[1, None]], pa.list_(pa.int32())))
    [[1, None]]
    """
    typ = col.type
    if fixed_shape(typ) is not None and not blocking_nulls(col):
        return list(to_tensor(tensor_numpy(col)).unbind(0))
    if is_ragged_type(typ) and not blocking_nulls(col):
        ragged = ragged_numpy(col)
        return list(torch.split(to_tensor(ragged.values), np.diff(ragged.offsets).tolist()))
    return python_values(col)


def to_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Rows as dicts: Python values, tensors for array columns."""
    columns = [list(row_values(col)) for col in table.columns]
    names = table.column_names  # once: pyarrow builds this list anew at each access
    return [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]


def gather_rows(units: Sequence[Packed], take: np.ndarray, schema: pa.Schema) -> list[Any]:
    """Rows ``take`` of the concatenation of ``units``, as dicts, in batch order.

    A number column without nulls goes through numpy (the same values as ``to_pylist``).
    """
    if not units:
        return []
    sel = select([u.num_rows for u in units], take)
    columns = [_column(units, sel, field) for field in schema]
    names = schema.names  # once: pyarrow builds this list anew at each access
    return [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]


def _column(units: Sequence[Packed], sel: Selection, field: pa.Field) -> list[Any]:
    """One column's values for the batch's rows, in batch order."""
    chunks = unit_parts(units, field)
    typ = field.type
    numbers = pa.types.is_integer(typ) or pa.types.is_float32(typ) or pa.types.is_float64(typ)
    if numbers and not any(c.null_count for c in chunks):
        picked = [
            chunks[u].to_numpy(zero_copy_only=True)[sel.local[a:b]]
            for u, (a, b) in zip(sel.unit, sel.bounds, strict=True)
        ]
        values: list[Any] = np.concatenate(picked)[sel.inverse].tolist()
        return values
    return list(row_values(gather_arrow(chunks, sel)))


def transform_rows(rows: list[Any], transform: Transform, seeds: np.ndarray) -> list[Any]:
    """``transform`` on each row, with :func:`lakeloader.rng` drawing from that row's seed."""
    out = []
    with drawing(seeds) as draws:
        for i, row in enumerate(rows):
            draws.row = i  # an attribute, not a call: this loop runs once per row
            out.append(transform(row))
    return out


def row_lists(rows: Sequence[Any], column: str) -> tuple[np.ndarray, np.ndarray]:
    """Each transformed row's ``column`` (integers): values end to end, and offsets.

    Raises:
        ColumnNotFoundError: If a transformed row has no ``column``.
        TypeError: If it is not a 1-D list, array or tensor of integers.
    """
    lists = []
    for row in rows:
        try:
            value = row[column]
        except (KeyError, TypeError, IndexError):
            raise ColumnNotFoundError(
                f"the transform's row has no packing column {column!r} (it gave "
                f"{type(row).__name__} {list(row) if isinstance(row, dict) else ''}): return "
                "a dict holding the row's token ids under it"
            ) from None
        array = np.asarray(value)
        if array.size == 0:
            array = array.astype(np.int64).reshape(0)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(
                f"packing needs the transform's {column!r} to be a 1-D list, array or tensor "
                f"of integers; it gave {type(value).__name__} of dtype {array.dtype} and shape "
                f"{array.shape}"
            )
        lists.append(array)
    lengths = np.fromiter((len(a) for a in lists), dtype=np.int64, count=len(lists))
    values = np.concatenate(lists).astype(np.int64) if lists else np.zeros(0, np.int64)
    return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

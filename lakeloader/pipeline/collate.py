"""Turning decoded units into a batch: gather rows, apply the transform, collate.

The default batch is a dict of column name to tensor, built column-wise with no per-row
Python work: numeric, boolean and temporal (as integer ticks) columns become tensors (nulls
in float columns as NaN), everything else (strings, nested types, decimals) a Python list.
With a ``transform`` or a ``collate_fn``, rows are materialised as dicts, as torch's
DataLoader would hand them over:
``transform(row)`` per row, then ``collate_fn(rows)`` (torch's ``default_collate`` when none).

Packed columns are gathered from the rank's arena with one row copy per batch, then copied out
column by column into arrays that tensors wrap without a further copy. The batches that
workers build for a transform or a collate_fn cross between processes as pickles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import default_collate

from lakeloader.cache.packed import (
    Packed,
    Selection,
    column_of,
    gather_arrow,
    is_tensor_type,
    select,
    tensor_numpy,
)
from lakeloader.errors import NullValuesError

Transform = Callable[[dict[str, Any]], Any]
Collate = Callable[[list[Any]], Any]

#: Tag of a payload in columnar form (numpy arrays to be turned into tensors).
COLUMNS = "columns"
#: Tag of a payload that is already the user's collated batch.
COLLATED = "collated"


def _tensor_view(
    name: str, col: pa.Array | pa.ChunkedArray, units: Sequence[Packed] = ()
) -> np.ndarray:
    """A numeric, boolean or temporal column as a numpy array fit for a tensor.

    Dates, times, timestamps and durations map to their integer ticks (int32 or int64, in
    the column's own unit), so that no value is lost to Python's datetime range. Nulls in a
    float column become NaN; an integer, boolean or temporal tensor cannot hold a null.

    Raises:
        NullValuesError: If a non-float column holds nulls.
    """
    if col.null_count and not pa.types.is_floating(col.type):
        where = [
            u.where
            for u in units
            if name in u.table.column_names and u.table.column(name).null_count
        ]
        raise NullValuesError(
            f"column {name!r} ({col.type}) holds {col.null_count} null(s) in this batch"
            + (f", from {'; '.join(where)}" if where else "")
            + f", and a {col.type} tensor cannot hold a null: fill them in a transform or a "
            "collate_fn, or leave the column out with columns=[...]"
        )
    return tensor_numpy(col)


def _arrow_column(units: Sequence[Packed], sel: Selection, field: pa.Field) -> pa.Array:
    """One column of the batch through Arrow (units that packed it give it from their bytes)."""
    parts = []
    for unit in units:
        if field.name in unit.table.column_names:
            col = unit.table.column(field.name)  # one chunk: combined when decoded
            parts.append(col.chunk(0) if col.num_chunks == 1 else col.combine_chunks())
        else:
            parts.append(pa.array(column_of(unit, field.name)).cast(field.type))
    return gather_arrow(parts, sel)


def gather_columns(
    units: Sequence[Packed],
    take: np.ndarray,
    schema: pa.Schema,
    ready: Mapping[str, np.ndarray],
) -> dict[str, Any]:
    """The batch in columnar form: rows ``take`` of the concatenation of ``units``.

    Columns in ``ready`` were already gathered from the arena (one row copy for the whole
    batch, see :func:`lakeloader.cache.packed.gather_packed`); the others come through Arrow, then
    as tensors or Python lists.

    Raises:
        NullValuesError: If an integer, boolean or temporal column holds nulls in the batch.
    """
    if len(ready) == len(schema):  # every column was packed: only the order to set
        return {name: ready[name] for name in schema.names}
    sel: Selection | None = None
    out: dict[str, Any] = {}
    for field in schema:
        if field.name in ready:
            out[field.name] = ready[field.name]
            continue
        if not units:
            col = pa.array([], field.type)
        else:
            sel = sel or select([u.num_rows for u in units], take)
            col = _arrow_column(units, sel, field)
        out[field.name] = (
            _tensor_view(field.name, col, units)
            if is_tensor_type(field.type)
            else python_values(col)
        )
    return out


def gather_table(units: Sequence[Packed], take: np.ndarray, schema: pa.Schema) -> pa.Table:
    """The batch as an Arrow table with the columns' own types (for the row path)."""
    sel = select([u.num_rows for u in units], take)
    arrays = [
        _arrow_column(units, sel, field) if units else pa.array([], field.type) for field in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def python_values(col: pa.Array | pa.ChunkedArray) -> list[Any] | pa.Array:
    """The column's values as Python objects, or the Arrow array if Python cannot hold them.

    >>> python_values(pa.array(["a", None]))
    ['a', None]
    """
    try:
        values: list[Any] = col.to_pylist()
    except (OverflowError, ValueError, pa.ArrowException):
        return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return values


def to_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Rows as dicts of Python values (Arrow scalars where Python cannot hold a value)."""
    columns = [list(python_values(col)) for col in table.columns]
    return [
        dict(zip(table.column_names, values, strict=True)) for values in zip(*columns, strict=True)
    ]


def columns_to_tensors(columns: dict[str, Any]) -> dict[str, Any]:
    """Turn the numpy arrays of a columnar payload into tensors (lists stay lists)."""
    out: dict[str, Any] = {}
    for name, value in columns.items():
        if isinstance(value, np.ndarray):
            out[name] = torch.from_numpy(value if value.flags.writeable else value.copy())
        else:
            out[name] = value
    return out


def build_payload(
    units: Sequence[Packed],
    take: np.ndarray,
    schema: pa.Schema,
    transform: Transform | None,
    collate_fn: Collate | None,
    ready: Mapping[str, np.ndarray],
) -> tuple[str, Any]:
    """Build one batch from decoded units (in a worker, or in the loader's process).

    Args:
        units: The batch's units.
        take: Row indices into their concatenation, in batch order.
        schema: The batch's columns.
        transform: Per-row transform, or None.
        collate_fn: The user's collate function, or None.
        ready: Columns already gathered from the arena (default path only).

    Returns:
        ``(COLUMNS, dict of numpy arrays or lists)`` on the default path, else
        ``(COLLATED, whatever collate_fn returned)``.
    """
    if transform is None and collate_fn is None:
        return COLUMNS, gather_columns(units, take, schema, ready)
    rows: list[Any] = to_rows(gather_table(units, take, schema))
    if transform is not None:
        rows = [transform(row) for row in rows]
    return COLLATED, (collate_fn or default_collate)(rows)


def finish_payload(payload: tuple[str, Any]) -> Any:
    """Turn a payload into the batch the training loop receives."""
    kind, value = payload
    return columns_to_tensors(value) if kind == COLUMNS else value


def pin(batch: Any) -> Any:
    """Pin every tensor of a batch (dicts, lists and tuples are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: pin(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(pin(v) for v in batch)
    return batch


def empty_like(batch: Any) -> Any:
    """A batch of the same structure with no row: tensors and arrays cut to length 0.

    An empty share (the short last global batch holds fewer rows than there are ranks, or all
    of a step's units are quarantined) still has to be a batch, so that every rank takes
    every step; on the row path it is made from a batch of one row, by this function.

    >>> b = empty_like({"x": torch.ones(3, 2), "tags": ["a", "b", "c"], "pair": (torch.ones(3),)})
    >>> b["x"].shape, b["tags"], b["pair"][0].shape
    (torch.Size([0, 2]), [], torch.Size([0]))

    Raises:
        TypeError: If the batch holds something that has no empty form (a number, a string or
            an object of the caller's own): say how to make one in the message.
    """
    if isinstance(batch, torch.Tensor | np.ndarray):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: empty_like(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return (
            type(batch)(*map(empty_like, batch))
            if hasattr(batch, "_fields")
            else tuple(map(empty_like, batch))
        )
    if isinstance(batch, list):
        return []
    raise TypeError(
        f"the collate_fn's batch holds a {type(batch).__name__}, of which lakeloader cannot make "
        "an empty batch for a rank whose share of a step is empty (a short last batch with "
        "fewer rows than ranks, or quarantined units): return tensors, arrays, lists, tuples "
        "or dicts of them, or pass drop_last=True"
    )

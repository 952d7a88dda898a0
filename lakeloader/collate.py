"""Turning decoded units into a batch: gather rows, apply the transform, collate.

The default batch is a dict of column name to tensor, built column-wise with no per-row
Python work: numeric, boolean and temporal (as integer ticks) columns become tensors (nulls
in float columns as NaN), everything else (strings, nested types, decimals) a Python list.
With a ``transform`` or a ``collate_fn``, rows are materialised as dicts, as torch's
DataLoader would hand them over:
``transform(row)`` per row, then ``collate_fn(rows)`` (torch's ``default_collate`` when none).

Workers return the columnar form as numpy arrays, which pickle as one buffer each; the process
that owns the loader turns them into tensors without a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import default_collate

from lakeloader.cache import UnitRef, load_unit
from lakeloader.errors import NullValuesError

Transform = Callable[[dict[str, Any]], Any]
Collate = Callable[[list[Any]], Any]

#: Tag of a payload in columnar form (numpy arrays to be turned into tensors).
COLUMNS = "columns"
#: Tag of a payload that is already the user's collated batch.
COLLATED = "collated"


def gather(units: Sequence[pa.Table], take: np.ndarray, schema: pa.Schema) -> pa.Table:
    """Rows ``take`` of the concatenation of ``units``, in that order."""
    if not units:
        return schema.empty_table()
    return pa.concat_tables(units).take(pa.array(take, type=pa.int64()))


def _is_tensor_type(typ: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(typ)
        or pa.types.is_floating(typ)
        or pa.types.is_boolean(typ)
        or pa.types.is_temporal(typ)
    )


def _tensor_view(name: str, col: pa.ChunkedArray) -> np.ndarray:
    """A numeric, boolean or temporal column as a numpy array fit for a tensor.

    Dates, times, timestamps and durations map to their integer ticks (int32 or int64, in
    the column's own unit), so that no value is lost to Python's datetime range. Nulls in a
    float column become NaN; an integer, boolean or temporal tensor cannot hold a null.

    Raises:
        NullValuesError: If a non-float column holds nulls.
    """
    typ = col.type
    if col.null_count and pa.types.is_floating(typ):
        col = pc.fill_null(col, pa.scalar(float("nan"), typ))
    elif col.null_count:
        raise NullValuesError(
            f"column {name!r} ({typ}) holds {col.null_count} null(s) in this batch, and a "
            f"{typ} tensor cannot hold a null: fill them in a transform or a collate_fn, or "
            "leave the column out with columns=[...]"
        )
    if pa.types.is_temporal(typ):
        col = col.cast(pa.int64() if typ.bit_width == 64 else pa.int32())
    return np.asarray(col.to_numpy())


def to_columns(table: pa.Table) -> dict[str, Any]:
    """Columns as numpy arrays where the type fits a tensor, else as Python lists.

    The choice depends on the column's type only, never on a batch's values, so a column has
    the same kind in every batch. A column whose values Python cannot represent (a date past
    year 9999 inside a struct, say) comes as an Arrow array rather than failing the batch.

    Raises:
        NullValuesError: If an integer, boolean or temporal column holds nulls.
    """
    out: dict[str, Any] = {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        if _is_tensor_type(col.type):
            out[name] = _tensor_view(name, col)
            continue
        out[name] = _python_values(col)
    return out


def _python_values(col: pa.ChunkedArray) -> list[Any] | pa.Array:
    """The column's values as Python objects, or the Arrow array if Python cannot hold them."""
    try:
        values: list[Any] = col.to_pylist()
    except (OverflowError, ValueError, pa.ArrowException):
        return col.combine_chunks()
    return values


def to_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Rows as dicts of Python values (Arrow scalars where Python cannot hold a value)."""
    columns = [list(_python_values(col)) for col in table.columns]
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
    refs: Sequence[UnitRef],
    take: np.ndarray,
    schema: pa.Schema,
    transform: Transform | None,
    collate_fn: Collate | None,
) -> tuple[str, Any]:
    """Build one batch from decoded units: the work a DataLoader worker does.

    Returns:
        ``(COLUMNS, dict of numpy arrays or lists)`` on the default path, else
        ``(COLLATED, whatever collate_fn returned)``.
    """
    table = gather([load_unit(r) for r in refs], take, schema)
    if transform is None and collate_fn is None:
        return COLUMNS, to_columns(table)
    if table.num_rows == 0 and collate_fn is None:
        return COLUMNS, to_columns(table)  # an empty share of a short last batch
    rows: list[Any] = to_rows(table)
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

"""Gathering a batch column by column: the default batch, a dict of column name to tensor.

Numeric, boolean and temporal (as integer ticks) columns become ``[B]`` tensors (nulls in
float columns as NaN), fixed-size lists of numbers ``[B, D1, ...]`` tensors, lists of numbers
jagged nested tensors (or padded, :class:`ListFormat`), anything else a Python list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from lakeloader.cache.arrays import (
    Ragged,
    blocking_nulls,
    gather_ragged,
    is_ragged_type,
    one_array,
    ragged_numpy,
    to_arrow,
)
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
BatchTransform = Callable[[Any], Any]

#: How a list column reaches the batch: a jagged nested tensor, or padded plus lengths.
ListKind = Literal["jagged", "padded"]
LIST_KINDS: tuple[ListKind, ...] = ("jagged", "padded")


@dataclass(frozen=True)
class ListFormat:
    """How list columns of numbers appear in a columnar batch.

    Attributes:
        kind: ``"jagged"``: a ``torch.nested`` tensor of jagged layout (``.values()``,
            ``.offsets()``, ``.to_padded_tensor(pad)``). ``"padded"``: a ``[B, max_len, ...]``
            tensor padded with ``pad_value``, and the rows' lengths in ``<name>_lengths``.
        pad_value: What pads the short rows.

    >>> ListFormat("padded").lengths_of("tokens")
    'tokens_lengths'
    """

    kind: ListKind = "jagged"
    pad_value: float = 0

    def __post_init__(self) -> None:
        if self.kind not in LIST_KINDS:
            raise ValueError(f"list_format must be one of {LIST_KINDS}, got {self.kind!r}")

    @property
    def padded(self) -> bool:
        """Whether lists are padded."""
        return self.kind == "padded"

    @staticmethod
    def lengths_of(name: str) -> str:
        """The key of a padded list column's lengths."""
        return f"{name}_lengths"


def _check_nulls(name: str, col: pa.Array | pa.ChunkedArray, units: Sequence[Packed]) -> None:
    """Raise unless the column's tensor can hold its nulls (floats hold them as NaN).

    Raises:
        NullValuesError: If a non-float column (or array column) holds nulls, naming the
            units (file, row group, rows) they come from.
    """
    nulls = blocking_nulls(col)
    if not nulls:
        return
    where = [
        u.where
        for u in units
        if name in u.table.column_names and blocking_nulls(u.table.column(name))
    ]
    raise NullValuesError(
        f"column {name!r} ({col.type}) holds {nulls} null(s) in this batch"
        + (f", from {'; '.join(where)}" if where else "")
        + f", and a {col.type} tensor cannot hold a null: fill them in a transform or a "
        "collate_fn, or leave the column out with columns=[...]"
    )


def unit_parts(units: Sequence[Packed], field: pa.Field) -> list[pa.Array]:
    """Each unit's column ``field`` as one Arrow array (units that packed it: from its bytes)."""
    parts = []
    for unit in units:
        at = unit.table.schema.get_field_index(field.name)  # not column_names: a new list
        if at >= 0:
            col = unit.table.column(at)  # one chunk: combined when decoded
            parts.append(one_array(col))
        else:
            parts.append(to_arrow(column_of(unit, field.name), field.type))
    return parts


def gather_columns(
    units: Sequence[Packed],
    take: np.ndarray,
    schema: pa.Schema,
    ready: Mapping[str, np.ndarray],
) -> dict[str, Any]:
    """The batch in columnar form: rows ``take`` of the concatenation of ``units``.

    Columns in ``ready`` were already gathered from the arena; the others come through Arrow.

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
            parts = unit_parts(units, field)
            if is_ragged_type(field.type):  # one copy of the values (None: the general path)
                runs = np.diff([0, *(b for _, b in sel.bounds)])
                unit = np.repeat(np.asarray(sel.unit, np.int64), runs)[sel.inverse]
                ragged = gather_ragged(parts, unit, sel.local[sel.inverse])
                if ragged is not None:
                    out[field.name] = ragged
                    continue
            col = gather_arrow(parts, sel)
        if is_tensor_type(field.type):
            _check_nulls(field.name, col, units)
            out[field.name] = tensor_numpy(col)
        elif is_ragged_type(field.type):
            _check_nulls(field.name, col, units)
            out[field.name] = ragged_numpy(col)
        else:
            out[field.name] = python_values(col)
    return out


def python_values(col: pa.Array | pa.ChunkedArray) -> list[Any] | pa.Array:
    """The column's values as Python objects, or the Arrow array if Python cannot hold them.

    >>> python_values(pa.array(["a", None]))
    ['a', None]
    """
    try:
        values: list[Any] = col.to_pylist()
    except (OverflowError, ValueError, pa.ArrowException):
        return one_array(col)
    return values


def columns_to_tensors(columns: dict[str, Any], lists: ListFormat) -> dict[str, Any]:
    """Turn the arrays of a columnar payload into tensors (lists of Python values stay lists).

    A :class:`~lakeloader.cache.arrays.Ragged` column becomes a jagged nested tensor, or with
    ``lists.padded`` a ``[B, max_len, ...]`` tensor plus ``<name>_lengths``.
    """
    out: dict[str, Any] = {}
    for name, value in columns.items():
        if isinstance(value, np.ndarray):
            out[name] = to_tensor(value)
        elif isinstance(value, Ragged):
            if lists.padded:
                out[name] = to_tensor(value.padded(lists.pad_value))
                out[lists.lengths_of(name)] = to_tensor(value.lengths)
            else:
                out[name] = torch.nested.nested_tensor_from_jagged(
                    to_tensor(value.values), to_tensor(value.offsets)
                )
        else:
            out[name] = value
    return out


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array`` (a copy when it is read-only)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


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

    >>> b = empty_like({"x": torch.ones(3, 2), "tags": ["a", "b", "c"], "pair": (torch.ones(3),)})
    >>> b["x"].shape, b["tags"], b["pair"][0].shape
    (torch.Size([0, 2]), [], torch.Size([0]))

    Raises:
        TypeError: If the batch holds something that has no empty form.
    """
    if isinstance(batch, torch.Tensor) and batch.is_nested:
        offsets = batch.offsets()  # type: ignore[attr-defined]
        return torch.nested.nested_tensor_from_jagged(batch.values()[:0], offsets[:1])
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

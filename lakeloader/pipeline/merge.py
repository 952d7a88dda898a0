"""Columns built apart (a mixture's parts of one batch), laid out as one batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from lakeloader.cache.arrays import Ragged
from lakeloader.order.plan import expand_runs


def merge_columns(
    parts: Sequence[dict[str, Any]], dests: Sequence[np.ndarray], num_rows: int
) -> dict[str, Any]:
    """One batch of ``num_rows`` rows: row ``r`` of part ``j`` goes to row ``dests[j][r]``.

    The parts have the same columns; ``dests`` together are a permutation of ``range(num_rows)``.

    >>> a = {"x": np.array([10, 11]), "s": ["p", "q"]}
    >>> b = {"x": np.array([20]), "s": ["r"]}
    >>> out = merge_columns([a, b], [np.array([0, 2]), np.array([1])], 3)
    >>> out["x"].tolist(), out["s"]
    ([10, 20, 11], ['p', 'r', 'q'])
    """
    if len(parts) == 1 and np.array_equal(dests[0], np.arange(num_rows)):
        return dict(parts[0])
    return {name: _merge([p[name] for p in parts], dests, num_rows) for name in parts[0]}


def _merge(values: list[Any], dests: Sequence[np.ndarray], num_rows: int) -> Any:
    first = values[0]
    if isinstance(first, np.ndarray):
        out = np.empty((num_rows, *first.shape[1:]), dtype=first.dtype)
        for value, dest in zip(values, dests, strict=True):
            out[dest] = value
        return out
    if isinstance(first, Ragged):
        lengths = np.zeros(num_rows, dtype=np.int64)
        for value, dest in zip(values, dests, strict=True):
            lengths[dest] = value.lengths
        offsets = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        inner = np.empty((int(offsets[-1]), *first.values.shape[1:]), dtype=first.values.dtype)
        for value, dest in zip(values, dests, strict=True):
            inner[expand_runs(offsets[dest], value.lengths, 1)] = value.values
        return Ragged(inner, offsets)
    if isinstance(first, list):
        rows: list[Any] = [None] * num_rows
        for value, dest in zip(values, dests, strict=True):
            for at, item in zip(dest.tolist(), value, strict=True):
                rows[at] = item
        return rows
    # else Arrow values that Python cannot hold (see collate.python_values)
    whole = pa.concat_arrays(
        [v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v for v in values]
    )
    where = np.empty(num_rows, dtype=np.int64)
    where[np.concatenate(list(dests))] = np.arange(num_rows)
    return whole.take(pa.array(where))

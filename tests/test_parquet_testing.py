"""Every file of Apache parquet-testing streams through the loader with pyarrow's values."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import lakeloader as ll
from lakeloader.pipeline.rows import to_rows

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "parquet-testing" / "data"
FILES = sorted(DATA.glob("*.parquet"))


def test_the_corpus_is_there() -> None:
    assert len(FILES) > 50, f"expected Apache parquet-testing files in {DATA}"


def _readable(path: Path) -> pa.Table | None:
    try:
        return pq.read_table(path)
    except Exception:
        return None


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):  # array columns
        return got.shape == want.shape and bool(torch.equal(got, want) or _same_floats(got, want))
    if isinstance(got, float) and isinstance(want, float):
        return got == want or (math.isnan(got) and math.isnan(want))
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
    return bool(got == want)


def _same_floats(got: torch.Tensor, want: torch.Tensor) -> bool:
    both_nan = got.isnan() & want.isnan() if got.is_floating_point() else False
    return got.dtype == want.dtype and bool(torch.all((got == want) | both_nan))


def _as_lists(want: list[Any]) -> list[Any]:
    """pyarrow's values of a list column as the loader gives them: [] for null, NaN for None."""
    nan = float("nan")
    return [[nan if v is None else v for v in row] if row is not None else [] for row in want]


def _check_column(name: str, parts: list[Any], want: pa.ChunkedArray) -> None:
    if parts and all(isinstance(p, torch.Tensor) and p.is_nested for p in parts):
        got_rows = [row.tolist() for p in parts for row in p.unbind()]
        assert _same(got_rows, _as_lists(want.to_pylist())), name
    elif parts and all(isinstance(p, torch.Tensor) for p in parts):
        got = torch.cat(parts).numpy()
        if pa.types.is_temporal(want.type):
            want = want.cast(pa.int64() if want.type.bit_width == 64 else pa.int32())
        np.testing.assert_array_equal(got, want.to_numpy(), err_msg=name)
    elif all(isinstance(p, list) for p in parts):
        got_list = [v for p in parts for v in p]
        assert _same(got_list, want.to_pylist()), name
    else:  # values Python cannot hold come back as Arrow arrays
        got_arrow = pa.chunked_array(
            [p if isinstance(p, pa.Array) else pa.array(p, want.type) for p in parts], want.type
        )
        assert got_arrow.equals(want), name


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_file_streams_like_pyarrow(path: Path) -> None:
    table = _readable(path)
    if table is None:
        with pytest.raises(ll.LakeDataError, match=path.name):
            ds = ll.LakeDataset(str(path), shuffle=False)
            list(ll.DataLoader(ds, batch_size=37))
        return
    ds = ll.LakeDataset(str(path), shuffle=False)
    assert len(ds) == table.num_rows
    try:
        batches = list(ll.DataLoader(ds, batch_size=37))
    except ll.NullValuesError as exc:
        # Integer columns with nulls cannot be tensors: the error names the column, and
        # rows handed to a collate_fn carry every value, nulls included.
        assert any(repr(c) in str(exc) for c in table.column_names)
        rows = [r for b in ll.DataLoader(ds, batch_size=37, collate_fn=list) for r in b]
        assert _same(rows, to_rows(table))
        return
    assert sum(len(next(iter(b.values()))) for b in batches) == table.num_rows
    for name in table.column_names:
        _check_column(name, [b[name] for b in batches], table.column(name))

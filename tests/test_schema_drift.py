"""Schema drift across a lake's files: safe widenings unify, unsafe ones fail at discovery.

The rules are those of lakeloader/schema.py; missing and added columns, and conflicts naming
both files, are covered in test_snapshot.py.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch
from test_snapshot import column, put, stream

import lakeloader as ll
from lakeloader.lake.schema import is_safe_widening


@pytest.mark.parametrize(
    ("old", "new", "values", "dtype"),
    [
        (pa.int32(), pa.int64(), [2**31 - 1, -(2**31)], torch.int64),
        (pa.float32(), pa.float64(), [0.5, -1.25], torch.float64),
        (pa.int16(), pa.float32(), [-(2**15), 2**15 - 1], torch.float32),
        (pa.uint32(), pa.int64(), [0, 2**32 - 1], torch.int64),
    ],
)
def test_safe_widenings_unify_to_the_wider_type(
    tmp_path: Path, old: pa.DataType, new: pa.DataType, values: list[float], dtype: torch.dtype
) -> None:
    put(tmp_path / "a.parquet", {"id": [0, 1], "v": pa.array(values, old)})
    put(tmp_path / "b.parquet", {"id": [2, 3], "v": pa.array(values, old).cast(new)})
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert ds.snapshot.schema.field("v").type == new
    batches = stream(ds)
    assert batches[0]["v"].dtype == dtype
    assert column(batches, "v") == values + values


def test_a_narrower_type_in_a_later_file_widens_to_the_earlier_one(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0], "v": pa.array([0.5], pa.float64())})
    put(tmp_path / "b.parquet", {"id": [1], "v": pa.array([1.5], pa.float32())})
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert ds.snapshot.schema.field("v").type == pa.float64()
    assert column(stream(ds), "v") == [0.5, 1.5]


def test_reordered_columns_are_matched_by_name(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0], "x": [0.5], "s": ["a"]})
    put(tmp_path / "b.parquet", {"s": ["b"], "id": [1], "x": [1.5]})
    batches = stream(ll.LakeDataset(tmp_path, shuffle=False))
    assert column(batches, "id") == [0, 1]
    assert column(batches, "x") == [0.5, 1.5] and column(batches, "s") == ["a", "b"]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (pa.int64(), pa.float64()),  # int64 -> float64 loses precision above 2**53
        (pa.int64(), pa.string()),
        (pa.float32(), pa.int64()),
    ],
)
def test_unsafe_or_incompatible_types_fail_at_discovery_naming_both(
    tmp_path: Path, first: pa.DataType, second: pa.DataType
) -> None:
    a = put(tmp_path / "a.parquet", {"id": [0], "v": pa.array([1], first)})
    b = put(tmp_path / "b.parquet", {"id": [1], "v": pa.array([1]).cast(second)})
    with pytest.raises(ll.SchemaMismatchError) as exc:
        ll.LakeDataset(tmp_path)
    message = str(exc.value)
    assert str(a) in message and str(b) in message
    assert f"v: {first}" in message and f"v: {second}" in message


def test_a_required_column_missing_from_some_files_is_an_error(tmp_path: Path) -> None:
    required = pa.schema([pa.field("id", pa.int64()), pa.field("r", pa.int64(), nullable=False)])
    put(tmp_path / "a.parquet", pa.table({"id": [0], "r": [5]}, schema=required))
    b = put(tmp_path / "b.parquet", {"id": [1]})
    with pytest.raises(ll.SchemaMismatchError, match=r"'r' is required") as exc:
        ll.LakeDataset(tmp_path, columns=["id", "r"])
    assert str(b) in str(exc.value) and "columns=[...]" in str(exc.value)
    assert column(stream(ll.LakeDataset(tmp_path, columns=["id"], shuffle=False)), "id") == [0, 1]


def test_a_nullable_column_missing_from_some_files_reads_as_nulls(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0], "extra": pa.array([7], pa.int64())})
    put(tmp_path / "b.parquet", {"id": [1]})
    ds = ll.LakeDataset(tmp_path, columns=["id", "extra"], shuffle=False)
    rows = [r for b in ll.DataLoader(ds, batch_size=2, collate_fn=list) for r in b]
    assert rows == [{"id": 0, "extra": 7}, {"id": 1, "extra": None}]


def test_safe_widening_rules() -> None:
    assert is_safe_widening(pa.timestamp("ms"), pa.timestamp("us"))
    assert not is_safe_widening(pa.timestamp("us", "UTC"), pa.timestamp("us"))
    assert not is_safe_widening(pa.int64(), pa.uint64())
    assert is_safe_widening(pa.string(), pa.large_string())
    assert is_safe_widening(
        pa.struct([("a", pa.int32())]), pa.struct([("a", pa.int64()), ("b", pa.string())])
    )
    assert not is_safe_widening(pa.float32(), pa.int64())

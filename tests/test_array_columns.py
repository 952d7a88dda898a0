"""Array columns on the columnar path: every Parquet list flavour against pyarrow's values.

Fixed-size lists (flat and nested) become dense ``[B, D, ...]`` tensors, lists and large lists
jagged nested tensors (or padded, with lengths); float nulls are NaN (a null fixed-size list
a row of NaN), a null list an empty row, and an integer null fails naming column and file.
Pieces are cut inside row groups (``max_unit_rows``), so every array is read from slices.
"""

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
from lakeloader.cache.arrays import fixed_numpy

FLOATS = {"f16": pa.float16(), "f32": pa.float32(), "f64": pa.float64()}
INTS = {
    "i8": pa.int8(),
    "i16": pa.int16(),
    "i32": pa.int32(),
    "i64": pa.int64(),
    "u16": pa.uint16(),
}
ROWS = 600


def _values(rng: np.random.Generator, typ: pa.DataType, n: int) -> pa.Array:
    if pa.types.is_floating(typ):
        return pa.array(rng.normal(size=n) * 100).cast(typ)
    return pa.array(rng.integers(0, 100, n)).cast(typ)


def _with_nulls(arr: pa.Array, rng: np.random.Generator, rate: float) -> pa.Array:
    mask = rng.random(len(arr)) < rate
    return pa.array(arr.to_pylist(), arr.type, mask=mask) if mask.any() else arr


def _fixed(
    rng: np.random.Generator, typ: pa.DataType, n: int, dims: tuple[int, ...], nulls: bool
) -> pa.Array:
    """A fixed-size list column; with ``nulls``, null elements and null lists."""
    values = _values(rng, typ, n * int(np.prod(dims)))
    if nulls:
        values = _with_nulls(values, rng, 0.1)
    arr = values
    for size in reversed(dims[1:]):
        arr = pa.FixedSizeListArray.from_arrays(arr, size)
    mask = pa.array(rng.random(n) < 0.1) if nulls else None
    return pa.FixedSizeListArray.from_arrays(arr, dims[0], mask=mask)


def _ragged(
    rng: np.random.Generator,
    typ: pa.DataType,
    n: int,
    large: bool,
    elem_nulls: bool,
    inner: int | None = None,
) -> pa.Array:
    lengths = rng.integers(0, 6, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = _values(rng, typ, int(offsets[-1]) * (inner or 1))
    if elem_nulls:
        values = _with_nulls(values, rng, 0.1)
    if inner:
        values = pa.FixedSizeListArray.from_arrays(values, inner)
    mask = pa.array(rng.random(n) < 0.1)  # null lists
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(
        pa.array(offsets, pa.int64() if large else pa.int32()), values, mask=mask
    )


def _write(root: Path, columns: dict[str, Any], files: int = 3) -> Path:
    table = pa.table({"id": np.arange(ROWS, dtype=np.int64), **columns})
    root.mkdir(parents=True, exist_ok=True)
    per = ROWS // files
    for f in range(files):
        pq.write_table(table.slice(f * per, per), root / f"part-{f}.parquet", row_group_size=90)
    return root


@pytest.fixture(scope="module")
def array_lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(5)
    cols: dict[str, Any] = {}
    for name, typ in {**FLOATS, **INTS}.items():
        floats = pa.types.is_floating(typ)
        cols[f"fix_{name}"] = _fixed(rng, typ, ROWS, (3,), nulls=floats)
        cols[f"list_{name}"] = _ragged(rng, typ, ROWS, large=False, elem_nulls=floats)
        cols[f"large_{name}"] = _ragged(rng, typ, ROWS, large=True, elem_nulls=floats)
    cols["nest_f32"] = _fixed(rng, pa.float32(), ROWS, (2, 3), nulls=True)
    cols["nest_i8"] = _fixed(rng, pa.int8(), ROWS, (4, 2), nulls=False)
    cols["list_of_fix_f64"] = _ragged(
        rng, pa.float64(), ROWS, large=False, elem_nulls=True, inner=2
    )
    return _write(tmp_path_factory.mktemp("arrays"), cols)


def _expected(lake: Path) -> dict[str, dict[int, Any]]:
    table = pq.read_table(lake)
    ids = table.column("id").to_pylist()
    return {n: dict(zip(ids, table.column(n).to_pylist(), strict=True)) for n in table.column_names}


def _nan_for_none(value: Any, shape: tuple[int, ...]) -> Any:
    """pyarrow's value of a fixed-size list as the tensor holds it (None: NaN everywhere)."""
    if value is None:
        return np.full(shape, math.nan).tolist()
    if shape[1:]:
        return [_nan_for_none(v, shape[1:]) for v in value]
    return [math.nan if v is None else v for v in value]


def _assert_rows(got: list[Any], want: list[Any], name: str) -> None:
    np.testing.assert_array_equal(
        np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), err_msg=name
    )


def _rows_of(value: torch.Tensor) -> list[Any]:
    """The rows of a dense or jagged tensor as lists."""
    return [row.tolist() for row in value.unbind(0)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_list_flavour_matches_pyarrow(array_lake: Path, num_workers: int) -> None:
    want = _expected(array_lake)
    ds = ll.LakeDataset(array_lake, seed=1, max_unit_rows=40)
    seen: list[int] = []
    for batch in ll.DataLoader(ds, batch_size=37, num_workers=num_workers):
        ids = batch["id"].tolist()
        seen += ids
        for name, value in batch.items():
            if name == "id":
                continue
            typ = ds.snapshot.schema.field(name).type
            assert isinstance(value, torch.Tensor), (name, type(value))
            elem = typ
            while not (pa.types.is_integer(elem) or pa.types.is_floating(elem)):
                elem = elem.value_type
            assert value.dtype == torch.from_numpy(np.empty(0, elem.to_pandas_dtype())).dtype
            if pa.types.is_fixed_size_list(typ):
                assert not value.is_nested and value.shape[0] == len(ids), name
                shape = tuple(value.shape[1:])
                rows = [_nan_for_none(want[name][i], shape) for i in ids]
            else:
                assert value.is_nested, name
                inner = tuple(value.values().shape[1:])
                rows = [
                    []
                    if want[name][i] is None
                    else [
                        _nan_for_none(v, inner) if inner else (math.nan if v is None else v)
                        for v in want[name][i]
                    ]
                    for i in ids
                ]
            got = _rows_of(value)
            for i, (g, w) in enumerate(zip(got, rows, strict=True)):
                _assert_rows(g, w, f"{name} row id {ids[i]}")
    assert sorted(seen) == list(range(ROWS))


def test_padded_lists_with_lengths(array_lake: Path) -> None:
    want = _expected(array_lake)
    ds = ll.LakeDataset(
        array_lake,
        columns=["id", "list_i32", "large_f32"],
        seed=1,
        list_format="padded",
        pad_value=-7,
    )
    for batch in ll.DataLoader(ds, batch_size=50):
        ids = batch["id"].tolist()
        lengths = batch["list_i32_lengths"]
        assert lengths.dtype == torch.int64
        padded = batch["list_i32"]
        assert padded.shape == (len(ids), int(lengths.max()))
        for row, n, i in zip(padded.tolist(), lengths.tolist(), ids, strict=True):
            assert row[:n] == (want["list_i32"][i] or []) and set(row[n:]) <= {-7}
        assert batch["large_f32"].shape[0] == len(ids)


def test_padded_lengths_key_must_not_be_a_column(tmp_path: Path) -> None:
    lake = _write(tmp_path / "l", {"t": pa.array([[1]] * ROWS), "t_lengths": np.zeros(ROWS)}, 1)
    with pytest.raises(ValueError, match="'t_lengths', which is a column of the lake"):
        ll.LakeDataset(lake, list_format="padded")
    with pytest.raises(ValueError, match="list_format must be one of"):
        ll.LakeDataset(lake, list_format="ragged")  # type: ignore[arg-type]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "column",
    [
        pa.FixedSizeListArray.from_arrays(
            pa.array([1, None] + [2] * (2 * ROWS - 2), pa.int32()), 2
        ),
        pa.array([[1, 2]] * 300 + [[None]] + [[3]] * 299, pa.list_(pa.int64())),
        pa.array([[1, 2]] * 300 + [None] + [[3, 4]] * 299, pa.list_(pa.int16(), 2)),
    ],
    ids=["fixed-null-element", "list-null-element", "fixed-null-list"],
)
def test_integer_nulls_fail_naming_column_and_file(
    tmp_path: Path, num_workers: int, column: pa.Array
) -> None:
    lake = _write(tmp_path / "l", {"v": column}, files=2)
    ds = ll.LakeDataset(lake, shuffle=False)
    bad = (
        "part-0.parquet"
        if column.slice(0, ROWS // 2).null_count or _deep_nulls(column.slice(0, ROWS // 2))
        else "part-1.parquet"
    )
    with pytest.raises(ll.NullValuesError, match=rf"'v'.*{bad}.*fill them in a transform"):
        list(ll.DataLoader(ds, batch_size=64, num_workers=num_workers))
    # The row path carries the nulls to the transform, which may fill them.
    rows = [
        r
        for b in ll.DataLoader(ds, batch_size=64, num_workers=num_workers, collate_fn=list)
        for r in b
    ]
    assert len(rows) == ROWS and any(
        r["v"] is None or (isinstance(r["v"], list) and None in r["v"]) for r in rows
    )


def _deep_nulls(arr: pa.Array) -> int:
    return int(arr.null_count) + int(arr.flatten().null_count)


def test_transform_rows_get_tensors_that_collate_to_blocks(array_lake: Path) -> None:
    ds = ll.LakeDataset(
        array_lake,
        columns=["id", "fix_f32", "nest_i8", "list_i64"],
        seed=1,
        transform=lambda row: (
            {k: v for k, v in row.items() if k != "list_i64"} | {"n": len(row["list_i64"])}
        ),
    )
    want = _expected(array_lake)
    batch = next(iter(ll.DataLoader(ds, batch_size=16, num_workers=0)))
    assert batch["fix_f32"].shape == (16, 3) and batch["nest_i8"].shape == (16, 4, 2)
    ids = batch["id"].tolist()
    assert batch["nest_i8"].tolist() == [want["nest_i8"][i] for i in ids]
    assert batch["n"].tolist() == [len(want["list_i64"][i] or []) for i in ids]


def test_null_fixed_lists_are_nan_whatever_their_child_values() -> None:
    # Parquet gives a null list null children; an array built in memory may not.
    values = pa.array(np.arange(6, dtype=np.float32))
    arr = pa.FixedSizeListArray.from_arrays(values, 2, mask=pa.array([False, True, False]))
    got = fixed_numpy(arr.slice(1))
    assert np.isnan(got[0]).all() and got[1].tolist() == [4.0, 5.0]

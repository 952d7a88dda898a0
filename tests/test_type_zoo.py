"""Every value of every Arrow type, delivered exactly: nested types read shuffled, by row id.

Hypothesis draws schemas of nested Arrow types (fixed-size lists of fixed-size lists, lists of
fixed-size lists, structs of lists, maps, dictionary strings, decimals, timestamps with time
zones, nulls at every level), writes them as multi-row-group Parquet files, and reads them
shuffled through the loader, with row ranges of row groups as units (slices of what pyarrow
decodes), at 0 and 2 workers and through a collate_fn; every value is compared with pyarrow's
own ``read_table`` by row id. This is how a kernel that gives wrong values (see
``docs/pyarrow-sliced-nested-take.md``) is found by the tests and not by a user.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.cache.arrays import blocking_nulls, fixed_shape, is_ragged_type
from lakeloader.cache.kernels import is_affected

pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")

LEAVES = [
    pa.int32(),
    pa.int64(),
    pa.float32(),
    pa.float64(),
    pa.bool_(),
    pa.string(),
    pa.binary(),
    pa.decimal128(9, 2),
    pa.timestamp("ms", tz="UTC"),
    pa.timestamp("us", tz="Europe/Paris"),
    pa.date32(),
]


def _types(depth: int) -> st.SearchStrategy[pa.DataType]:
    leaf = st.sampled_from(LEAVES)
    if depth == 0:
        return leaf
    inner = _types(depth - 1)
    return st.one_of(
        leaf,
        inner.map(pa.list_),
        inner.map(pa.large_list),
        st.tuples(inner, st.integers(1, 3)).map(lambda t: pa.list_(t[0], t[1])),
        st.tuples(inner, inner).map(lambda t: pa.struct([("a", t[0]), ("b", t[1])])),
        inner.map(lambda t: pa.map_(pa.string(), t)),
    )


#: Nested types up to 3 deep: Python objects, or tensors for arrays of numbers (see
#: :func:`delivered`).
COLUMN_TYPES = st.one_of(
    _types(3).filter(lambda t: pa.types.is_nested(t)),
    st.just(pa.dictionary(pa.int32(), pa.string())),
    st.just(pa.string()),
    st.just(pa.decimal128(9, 2)),
)


def _value(typ: pa.DataType, rng: np.random.Generator, nulls: float) -> Any:
    """One random Python value of ``typ``: None at any level with probability ``nulls``.

    Columns without any null matter as much as those with: pyarrow's kernels take other
    paths when there is no validity bitmap (the sliced nested fixed-size list bug shows only
    then).
    """
    if nulls and rng.random() < nulls:
        return None
    if pa.types.is_fixed_size_list(typ):
        return [_value(typ.value_type, rng, nulls) for _ in range(typ.list_size)]
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        return [_value(typ.value_type, rng, nulls) for _ in range(int(rng.integers(0, 4)))]
    if pa.types.is_map(typ):
        keys = {f"k{int(rng.integers(0, 9))}" for _ in range(int(rng.integers(0, 3)))}
        return [(k, _value(typ.item_type, rng, nulls)) for k in sorted(keys)]
    if pa.types.is_struct(typ):
        return {typ.field(i).name: _value(typ.field(i).type, rng, nulls) for i in range(2)}
    if pa.types.is_dictionary(typ) or pa.types.is_string(typ):
        return f"s{int(rng.integers(0, 50))}"
    if pa.types.is_binary(typ):
        return bytes(rng.integers(0, 256, int(rng.integers(0, 6))).astype(np.uint8))
    if pa.types.is_decimal(typ):
        return decimal.Decimal(int(rng.integers(-(10**6), 10**6))) / 100
    if pa.types.is_timestamp(typ):
        return dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(
            milliseconds=int(rng.integers(0, 10**10))
        )
    if pa.types.is_date(typ):
        return dt.date(2000, 1, 1) + dt.timedelta(days=int(rng.integers(0, 10_000)))
    if pa.types.is_boolean(typ):
        return bool(rng.integers(0, 2))
    if pa.types.is_floating(typ):
        return float(np.float32(rng.normal()))
    return int(rng.integers(-1000, 1000))


def write_zoo(
    root: Path,
    types: list[pa.DataType],
    rows: list[int],
    group: int,
    seed: int,
    nulls: list[float] | None = None,
) -> pa.Table:
    """One file per entry of ``rows``, row groups of ``group`` rows; returns the whole table.

    ``nulls`` gives each column's probability of a null at each level (default: none).
    """
    rates = nulls or [0.0] * len(types)
    rng = np.random.default_rng(seed)
    schema = pa.schema([("id", pa.int64())] + [(f"c{i}", t) for i, t in enumerate(types)])
    first = 0
    for f, n in enumerate(rows):
        columns = [pa.array(np.arange(first, first + n, dtype=np.int64))]
        for t, rate in zip(types, rates, strict=True):
            columns.append(pa.array([_value(t, rng, rate) for _ in range(n)], type=t))
        table = pa.Table.from_arrays(columns, schema=schema)
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=group)
        first += n
    return pq.read_table(root)


def _tensor_bound(typ: pa.DataType) -> bool:
    return fixed_shape(typ) is not None or is_ragged_type(typ)


def _nan_filled(typ: pa.DataType) -> Any:
    if pa.types.is_fixed_size_list(typ):
        return [_nan_filled(typ.value_type) for _ in range(typ.list_size)]
    return math.nan


def delivered(value: Any, typ: pa.DataType) -> Any:
    """pyarrow's value of an array column as its tensor holds it (``value.tolist()``).

    Float nulls are NaN (a null fixed-size list all NaN), a null list is empty.
    """
    if pa.types.is_fixed_size_list(typ):
        if value is None:
            return _nan_filled(typ)
        return [delivered(v, typ.value_type) for v in value]
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        return [delivered(v, typ.value_type) for v in value or []]
    return math.nan if value is None else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def wrong_rows(expected: pa.Table, loader: ll.DataLoader, *, rows_path: bool) -> dict[str, int]:
    """Per column, the rows whose delivered value differs from pyarrow's (each id once)."""
    truth = {name: expected.column(name).to_pylist() for name in expected.column_names}
    for name in truth:
        typ = expected.schema.field(name).type
        if name != "id" and _tensor_bound(typ) and not blocking_nulls(expected.column(name)):
            truth[name] = [delivered(v, typ) for v in truth[name]]
    index = {i: k for k, i in enumerate(truth["id"])}
    wrong = dict.fromkeys(expected.column_names[1:], 0)
    seen: list[int] = []
    for batch in loader:
        rows = (
            batch
            if rows_path
            else [{name: batch[name][k] for name in batch} for k in range(len(batch["id"]))]
        )
        for row in rows:
            i = int(row["id"])
            seen.append(i)
            for name in wrong:
                value = row[name]
                if isinstance(value, torch.Tensor):
                    value = value.tolist()
                wrong[name] += not _same(value, truth[name][index[i]])
    assert sorted(seen) == sorted(truth["id"]), "every row exactly once"
    return wrong


def _loader(root: Path, workers: int, rows_path: bool, **kwargs: Any) -> ll.DataLoader:
    ds = ll.LakeDataset(root, num_partitions=4, window=16, max_unit_rows=12, **kwargs)
    collate = list if rows_path else None
    return ll.DataLoader(ds, batch_size=10, num_workers=workers, collate_fn=collate)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    columns=st.lists(st.tuples(COLUMN_TYPES, st.sampled_from([0.0, 0.2])), min_size=1, max_size=3),
    rows=st.lists(st.integers(0, 60), min_size=1, max_size=3),
    group=st.integers(5, 25),
    seed=st.integers(0, 10**6),
    path=st.sampled_from([(0, False), (0, True), (2, False)]),
)
def test_every_value_of_every_type_arrives(
    tmp_path_factory: pytest.TempPathFactory,
    columns: list[tuple[pa.DataType, float]],
    rows: list[int],
    group: int,
    seed: int,
    path: tuple[int, bool],
) -> None:
    root = tmp_path_factory.mktemp("zoo")
    types, nulls = [t for t, _ in columns], [r for _, r in columns]
    expected = write_zoo(root, types, rows, group, seed, nulls)
    if expected.num_rows == 0:
        return
    workers, rows_path = path
    loader = _loader(root, workers, rows_path, seed=seed)
    bound = [
        n
        for n, t in zip(expected.column_names, expected.schema.types, strict=True)
        if _tensor_bound(t)
    ]
    if not rows_path and any(blocking_nulls(expected.column(n)) for n in bound):
        with pytest.raises(ll.NullValuesError, match="fill them in a transform"):
            list(loader)  # an integer or boolean array holds a null: no tensor can
        loader.close()
        return
    try:
        assert wrong_rows(expected, loader, rows_path=rows_path) == dict.fromkeys(
            expected.column_names[1:], 0
        )
    finally:
        loader.close()


NESTED_FIXED = {
    "fixed_size_list<fixed_size_list<float>[4]>[3]": pa.list_(pa.list_(pa.float32(), 4), 3),
    "struct<m: fixed_size_list<fixed_size_list<int32>[2]>[2]>": pa.struct(
        [("m", pa.list_(pa.list_(pa.int32(), 2), 2)), ("b", pa.string())]
    ),
    "fixed_size_list<fixed_size_list<fixed_size_list<double>[2]>[2]>[2]": pa.list_(
        pa.list_(pa.list_(pa.float64(), 2), 2), 2
    ),
}


@pytest.mark.parametrize("nulls", [0.0, 0.1], ids=["no-nulls", "nulls"])
@pytest.mark.parametrize("name", list(NESTED_FIXED))
@pytest.mark.parametrize(
    ("workers", "rows_path", "shuffle"),
    [(0, False, True), (2, False, True), (0, True, True), (2, True, True), (0, False, False)],
    ids=["w0", "w2", "w0-collate", "w2-collate", "w0-unshuffled"],
)
def test_the_types_pyarrow_takes_wrongly_from_slices(
    tmp_path: Path, name: str, workers: int, rows_path: bool, shuffle: bool, nulls: float
) -> None:
    typ = NESTED_FIXED[name]
    assert is_affected(typ)
    expected = write_zoo(tmp_path, [typ], [400, 333], 50, seed=1, nulls=[nulls])
    loader = _loader(tmp_path, workers, rows_path, seed=0, shuffle=shuffle)
    if not rows_path and _tensor_bound(typ) and blocking_nulls(expected.column("c0")):
        with pytest.raises(ll.NullValuesError, match="fill them in a transform"):
            list(loader)
        loader.close()
        return
    try:
        assert wrong_rows(expected, loader, rows_path=rows_path) == {"c0": 0}
    finally:
        loader.close()

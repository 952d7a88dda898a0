"""Discovery, hive partitions, snapshots, schema unification and footer reading on real files."""

from __future__ import annotations

import io
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.io.per_file import PROGRESS_MIN_FILES
from lakeloader.lake.discovery import discover_listed
from lakeloader.lake.snapshot import snapshot_lake
from tests.conftest import write_lake

# ------------------------------------------------------------------------------------ helpers


def put(path: Path, table: pa.Table | dict[str, Any], **kwargs: Any) -> Path:
    """Write a Parquet file (creating its folders) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table if isinstance(table, pa.Table) else pa.table(table), path, **kwargs)
    return path


def found_paths(source: Any) -> list[str]:
    return [f.path for f, _ in discover_listed(source)[1]]


def stream(ds: ll.LakeDataset, batch_size: int = 4) -> list[dict[str, Any]]:
    loader = ll.DataLoader(ds, batch_size=batch_size)
    try:
        return list(loader)
    finally:
        loader.close()


def column(batches: Sequence[dict[str, Any]], name: str) -> list[Any]:
    out: list[Any] = []
    for b in batches:
        value = b[name]
        out.extend(value if isinstance(value, list) else value.tolist())
    return out


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm only draws on terminals by default)."""

    def isatty(self) -> bool:
        return True


# ---------------------------------------------------------------------------------- discovery


def test_files_sorted_by_path_including_nested_folders(tmp_path: Path) -> None:
    names = ["b.parquet", "a/z.parquet", "c/d/e.parquet", "a.parquet", "a/b/c.parquet"]
    for i, name in enumerate(names):  # written out of order on purpose
        put(tmp_path / name, {"id": [i]})
    assert found_paths(tmp_path) == sorted(str(tmp_path / n) for n in names)
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert [f.path for f in ds.snapshot.files] == sorted(str(tmp_path / n) for n in names)
    by_path = {str(tmp_path / n): i for i, n in enumerate(names)}
    assert column(stream(ds), "id") == [by_path[p] for p in sorted(by_path)]


NON_DATA = [
    "_SUCCESS",
    "_metadata",
    "_common_metadata",
    ".part-0.parquet.crc",
    "_tmp.parquet",
    ".x.parquet",
    "_temporary/part.parquet",
    "_temporary/0/task/part.parquet",
    ".hidden/x.parquet",
    "sub/.hidden/y.parquet",
    "sub/_staging/z.parquet",
    "year=2024/_SUCCESS",
]


def test_non_data_files_and_folders_are_skipped(tmp_path: Path) -> None:
    data = ["part-0.parquet", "sub/part-1.parquet", "year=2024/part-2.parquet"]
    # every skipped name holds a valid Parquet file, so counting one would change the result
    for name in [*data, *NON_DATA]:
        put(tmp_path / name, {"id": [1, 2]})
    assert found_paths(tmp_path) == sorted(str(tmp_path / n) for n in data)
    assert found_paths(str(tmp_path / "**")) == sorted(str(tmp_path / n) for n in data)
    assert found_paths(str(tmp_path / "*" / "*.parquet")) == sorted(
        str(tmp_path / n) for n in data[1:]
    )


def test_folder_of_only_non_data_files_is_not_a_lake(tmp_path: Path) -> None:
    for name in NON_DATA:
        put(tmp_path / name, {"id": [1]})
    with pytest.raises(ll.LakeNotFoundError, match=re.escape(str(tmp_path))):
        ll.LakeDataset(tmp_path)


def test_glob_source(tmp_path: Path) -> None:
    for name in ["a.parquet", "b.parquet", "c.txt.parquet2", "sub/d.parquet"]:
        put(tmp_path / name, {"id": [1]})
    assert found_paths(str(tmp_path / "*.parquet")) == [
        str(tmp_path / "a.parquet"),
        str(tmp_path / "b.parquet"),
    ]
    assert found_paths(str(tmp_path / "[ab].parquet")) == found_paths(str(tmp_path / "*.parquet"))
    ds = ll.LakeDataset(str(tmp_path / "**" / "*.parquet"), shuffle=False)
    assert len(ds.snapshot.files) == 3 and len(ds) == 3


def test_single_file_source(tmp_path: Path) -> None:
    f = put(tmp_path / "a.parquet", {"id": [1, 2, 3]})
    put(tmp_path / "b.parquet", {"id": [4]})
    assert found_paths(str(f)) == [str(f)]
    ds = ll.LakeDataset(f, shuffle=False)
    assert len(ds) == 3
    assert column(stream(ds), "id") == [1, 2, 3]


def test_list_of_paths_collapses_duplicates(tmp_path: Path) -> None:
    a = put(tmp_path / "x" / "a.parquet", {"id": [1]})
    b = put(tmp_path / "y" / "b.parquet", {"id": [2]})
    c = put(tmp_path / "y" / "c.parquet", {"id": [3]})
    source = [str(b), str(a), str(a), a, f"file://{a}", str(tmp_path / "y")]
    assert found_paths(source) == [str(a), str(b), str(c)]
    ds = ll.LakeDataset(source, shuffle=False)
    assert len(ds) == 3
    assert column(stream(ds), "id") == [1, 2, 3]


def test_file_urls(tmp_path: Path) -> None:
    a = put(tmp_path / "a.parquet", {"id": [1]})
    b = put(tmp_path / "sub" / "b.parquet", {"id": [2]})
    assert found_paths(f"file://{tmp_path}") == [str(a), str(b)]
    assert found_paths(f"file://{tmp_path}/") == [str(a), str(b)]
    assert found_paths(f"file://{a}") == [str(a)]
    assert found_paths(f"file://{tmp_path}/*.parquet") == [str(a)]
    assert len(ll.LakeDataset(f"file://{tmp_path}")) == 2


def test_pathlib_path(tmp_path: Path) -> None:
    a = put(tmp_path / "a.parquet", {"id": [1, 2]})
    assert found_paths(tmp_path) == [str(a)]
    assert found_paths(a) == [str(a)]
    assert len(ll.LakeDataset(tmp_path)) == 2


@pytest.mark.parametrize("kind", ["empty folder", "glob matching nothing", "missing path"])
def test_no_data_raises_lake_not_found_naming_the_source(tmp_path: Path, kind: str) -> None:
    put(tmp_path / "other" / "a.parquet", {"id": [1]})
    (tmp_path / "empty").mkdir()
    source = {
        "empty folder": str(tmp_path / "empty"),
        "glob matching nothing": str(tmp_path / "other" / "*.csv"),
        "missing path": str(tmp_path / "nope"),
    }[kind]
    with pytest.raises(ll.LakeNotFoundError) as exc:
        ll.LakeDataset(source)
    assert source in str(exc.value)
    with pytest.raises(ll.LakeNotFoundError):
        ll.LakeDataset([str(tmp_path / "other"), source] if kind == "missing path" else source)


def test_empty_list_raises_lake_not_found() -> None:
    with pytest.raises(ll.LakeNotFoundError):
        ll.LakeDataset([])


# ---------------------------------------------------------------------------- hive partitions


def test_hive_partitions_become_columns(tmp_path: Path) -> None:
    layout = {
        "year=2023/month=12/region=eu": [0, 1, 2],
        "year=2024/month=5/region=us": [3, 4],
        "year=2024/month=06/region=eu": [5, 6, 7, 8],
    }
    for folder, ids in layout.items():
        put(tmp_path / folder / "part.parquet", {"id": ids, "v": [float(i) for i in ids]})
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    snap = ds.snapshot
    assert dict(snap.partition_types) == {
        "year": pa.int64(),
        "month": pa.int64(),
        "region": pa.string(),
    }
    assert snap.schema.names == ["id", "v", "year", "month", "region"]  # partitions last
    assert snap.schema.field("year").type == pa.int64()
    assert snap.schema.field("region").type == pa.string()

    batches = stream(ds, batch_size=3)
    assert [len(b["id"]) for b in batches] == [3, 3, 3]
    assert str(batches[0]["year"].dtype) == "torch.int64"
    assert isinstance(batches[0]["region"], list)
    expected = {}
    for folder, ids in layout.items():
        parts = dict(seg.split("=") for seg in folder.split("/"))
        for i in ids:
            expected[i] = (int(parts["year"]), int(parts["month"]), parts["region"])
    got = zip(
        column(batches, "id"),
        column(batches, "year"),
        column(batches, "month"),
        column(batches, "region"),
        strict=True,
    )
    rows = {i: (y, m, r) for i, y, m, r in got}
    assert rows == expected
    assert sorted(rows) == list(range(9))


def test_hive_partition_with_a_non_integer_value_is_a_string(tmp_path: Path) -> None:
    put(tmp_path / "k=1" / "a.parquet", {"id": [0, 1]})
    put(tmp_path / "k=x" / "b.parquet", {"id": [2]})
    put(tmp_path / "k=-3" / "c.parquet", {"id": [3]})
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert ds.snapshot.partition_types == (("k", pa.string()),)
    # paths sort as k=-3, k=1, k=x
    assert column(stream(ds, batch_size=2), "k") == ["-3", "1", "1", "x"]


def test_negative_integer_partitions_are_int64(tmp_path: Path) -> None:
    put(tmp_path / "k=-3" / "a.parquet", {"id": [0]})
    put(tmp_path / "k=7" / "b.parquet", {"id": [1, 2]})
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert ds.snapshot.partition_types == (("k", pa.int64()),)
    assert column(stream(ds, batch_size=2), "k") == [-3, 7, 7]


@pytest.mark.parametrize("value", ["--5", "99999999999999999999", "٣"])
def test_partition_value_that_int64_cannot_hold_is_a_string(tmp_path: Path, value: str) -> None:
    put(tmp_path / f"k={value}" / "a.parquet", {"id": [0, 1]})
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert ds.snapshot.partition_types == (("k", pa.string()),)
    assert column(stream(ds), "k") == [value, value]


def test_partition_key_colliding_with_a_file_column_raises(tmp_path: Path) -> None:
    put(tmp_path / "year=2024" / "a.parquet", {"id": [0], "year": [1999]})
    with pytest.raises(ll.SchemaMismatchError, match="year"):
        ll.LakeDataset(tmp_path)


def test_partition_key_colliding_with_a_column_of_another_file_raises(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0], "year": [1999]})
    put(tmp_path / "year=2024" / "b.parquet", {"id": [1]})
    with pytest.raises(ll.SchemaMismatchError, match="year"):
        ll.LakeDataset(tmp_path)


# ----------------------------------------------------------------------------------- snapshot


def test_snapshot_files_sizes_versions_and_row_groups(tmp_path: Path) -> None:
    layout = [[3, 2], [], [4, 0, 1], [5]]
    n = write_lake(tmp_path, layout)
    _, snap = snapshot_lake(tmp_path)
    assert [f.path for f in snap.files] == [
        str(tmp_path / f"file-{i:04d}.parquet") for i in range(len(layout))
    ]
    for f, rgs in zip(snap.files, layout, strict=True):
        assert f.size == os.path.getsize(f.path) > 0
        assert isinstance(f.version, str) and f.version and f.version != "none"
        assert f.row_group_rows == tuple(rgs)
        assert len(f.row_group_bytes) == len(rgs)
        assert f.num_rows == sum(rgs)
        assert f.schema is not None and f.schema.names == ["id", "x", "s", "label"]
    assert snap.num_rows == n == 15
    assert snap.num_row_groups == 6
    assert len(snap.fingerprint) > 0

    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert len(ds) == n
    assert column(stream(ds, batch_size=4), "id") == list(range(n))


def test_empty_files_and_empty_row_groups_stream_nothing(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("x", pa.float64())])
    put(tmp_path / "a-empty.parquet", schema.empty_table())
    with pq.ParquetWriter(tmp_path / "b-empty-groups.parquet", schema) as w:
        w.write_table(schema.empty_table())
        w.write_table(schema.empty_table())
    with pq.ParquetWriter(tmp_path / "c-no-groups.parquet", schema):
        pass
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert len(ds) == 0
    assert all(f.num_rows == 0 for f in ds.snapshot.files)
    assert len(ds.snapshot.files) == 3
    assert ds.snapshot.schema.names == ["id", "x"]
    assert stream(ds) == []

    put(tmp_path / "d.parquet", pa.table({"id": [7, 8, 9], "x": [0.5, 1.5, 2.5]}, schema=schema))
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert len(ds) == 3
    batches = stream(ds, batch_size=2)
    assert column(batches, "id") == [7, 8, 9]
    assert column(batches, "x") == [0.5, 1.5, 2.5]


def test_zero_byte_file_is_an_empty_file_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    put(tmp_path / "a.parquet", {"id": [1, 2, 3]})
    zero = tmp_path / "b.parquet"
    zero.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        ds = ll.LakeDataset(tmp_path, shuffle=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(zero) in warnings[0].getMessage()
    assert "zero-byte" in warnings[0].getMessage()
    info = ds.snapshot.files[1]
    assert (info.path, info.size, info.row_group_rows, info.num_rows) == (str(zero), 0, (), 0)
    assert len(ds) == 3
    assert column(stream(ds), "id") == [1, 2, 3]


def test_lake_of_only_a_zero_byte_file_streams_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "z.parquet").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert "zero-byte" in caplog.text
    assert len(ds) == 0
    assert stream(ds) == []


def test_fingerprint_stable_across_builds(tmp_path: Path) -> None:
    write_lake(tmp_path, [[3, 2], [], [4]], hive=True)
    first = ll.LakeDataset(tmp_path).fingerprint
    assert first and first == ll.LakeDataset(tmp_path).fingerprint
    assert first == snapshot_lake(str(tmp_path))[1].fingerprint
    assert first == snapshot_lake(f"file://{tmp_path}/")[1].fingerprint


def test_fingerprint_changes_with_content_additions_and_removals(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [1, 2, 3], "s": ["p", "q", "r"]})
    put(tmp_path / "b.parquet", {"id": [4], "s": ["t"]})
    seen = [ll.LakeDataset(tmp_path).fingerprint]

    # same path, same row count and schema, other values
    put(tmp_path / "a.parquet", {"id": [10, 20, 30], "s": ["pp", "qq", "rr"]})
    seen.append(ll.LakeDataset(tmp_path).fingerprint)

    put(tmp_path / "c.parquet", {"id": [5], "s": ["u"]})
    seen.append(ll.LakeDataset(tmp_path).fingerprint)

    (tmp_path / "b.parquet").unlink()
    seen.append(ll.LakeDataset(tmp_path).fingerprint)

    # adding a file that is not data changes nothing
    put(tmp_path / "_tmp.parquet", {"id": [6], "s": ["v"]})
    (tmp_path / "_SUCCESS").write_bytes(b"")
    seen.append(ll.LakeDataset(tmp_path).fingerprint)

    assert len(set(seen[:4])) == 4, seen
    assert seen[4] == seen[3]


def test_fingerprint_changes_when_the_version_token_changes(tmp_path: Path) -> None:
    a = put(tmp_path / "a.parquet", {"id": [1, 2, 3]})
    before = ll.LakeDataset(tmp_path)
    st = os.stat(a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    after = ll.LakeDataset(tmp_path)
    assert before.snapshot.files[0].size == after.snapshot.files[0].size
    assert before.snapshot.files[0].version != after.snapshot.files[0].version
    assert before.fingerprint != after.fingerprint


# ------------------------------------------------------------------------- schema unification


def test_files_with_different_columns_unify(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0, 1], "x": [0.5, 1.5]})
    put(tmp_path / "b.parquet", {"id": [2, 3], "s": ["two", "three"]})
    put(tmp_path / "c.parquet", {"id": [4], "x": [4.5], "s": ["four"]})
    ds = ll.LakeDataset(tmp_path, shuffle=False)
    assert ds.snapshot.schema.names == ["id", "x", "s"]
    batches = stream(ds, batch_size=5)
    assert len(batches) == 1
    (batch,) = batches
    assert batch["id"].tolist() == [0, 1, 2, 3, 4]
    x = batch["x"].tolist()
    assert x[:2] == [0.5, 1.5] and x[4] == 4.5
    assert math.isnan(x[2]) and math.isnan(x[3])
    assert batch["s"] == [None, None, "two", "three", "four"]


def test_missing_columns_across_batches(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0, 1, 2], "x": [0.0, 1.0, 2.0]})
    put(tmp_path / "b.parquet", {"id": [3, 4, 5], "s": ["d", "e", "f"]})
    batches = stream(ll.LakeDataset(tmp_path, shuffle=False), batch_size=2)
    assert column(batches, "s") == [None, None, None, "d", "e", "f"]
    x = column(batches, "x")
    assert x[:3] == [0.0, 1.0, 2.0] and all(math.isnan(v) for v in x[3:])


def test_conflicting_types_name_both_files_and_both_types(tmp_path: Path) -> None:
    a = put(tmp_path / "a.parquet", {"id": [0], "v": pa.array([1], pa.int64())})
    put(tmp_path / "b.parquet", {"id": [1]})
    c = put(tmp_path / "c.parquet", {"id": [2], "v": pa.array(["one"], pa.string())})
    with pytest.raises(ll.SchemaMismatchError) as exc:
        ll.LakeDataset(tmp_path)
    message = str(exc.value)
    assert str(a) in message and str(c) in message
    assert "v: int64" in message and "v: string" in message
    assert "'v'" in message


def test_conflict_names_the_file_that_set_the_conflicting_type(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0], "v": pa.nulls(1)})  # an all-null column: type null
    b = put(tmp_path / "b.parquet", {"id": [1], "v": pa.array([1], pa.int64())})
    c = put(tmp_path / "c.parquet", {"id": [2], "v": pa.array(["one"], pa.string())})
    with pytest.raises(ll.SchemaMismatchError) as exc:
        ll.LakeDataset(tmp_path)
    message = str(exc.value)
    assert str(b) in message and str(c) in message
    assert "v: int64" in message and "v: string" in message


def test_selecting_columns_avoids_a_conflict_in_other_columns(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [0], "v": pa.array([1], pa.int64())})
    put(tmp_path / "b.parquet", {"id": [1], "v": pa.array(["one"], pa.string())})
    ds = ll.LakeDataset(tmp_path, columns=["id"], shuffle=False)
    assert column(stream(ds), "id") == [0, 1]


# ---------------------------------------------------------------------------- unreadable files


def test_file_that_is_not_parquet_raises_unreadable_naming_it(tmp_path: Path) -> None:
    put(tmp_path / "a.parquet", {"id": [1]})
    bad = tmp_path / "b.parquet"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ll.LakeDataError) as exc:
        ll.LakeDataset(tmp_path)
    assert str(bad) in str(exc.value)
    assert isinstance(exc.value, ll.LakeError)


def test_truncated_parquet_file_raises_unreadable(tmp_path: Path) -> None:
    good = put(tmp_path / "a.parquet", {"id": list(range(100))})
    bad = tmp_path / "b.parquet"
    bad.write_bytes(good.read_bytes()[:-20])
    with pytest.raises(ll.LakeDataError, match=re.escape(str(bad))):
        ll.LakeDataset(tmp_path)


# ------------------------------------------------------------------------------------ columns


def test_unknown_column_raises_key_error_listing_available(tmp_path: Path) -> None:
    write_lake(tmp_path, [[2]], hive=True)
    with pytest.raises(KeyError) as exc:
        ll.LakeDataset(tmp_path, columns=["id", "nope"])
    message = str(exc.value)
    assert "nope" in message
    for name in ["id", "x", "s", "label", "part"]:
        assert repr(name) in message


def test_selected_columns_come_in_the_requested_order(tmp_path: Path) -> None:
    n = write_lake(tmp_path, [[3], [2]], hive=True)
    ds = ll.LakeDataset(tmp_path, columns=["label", "part", "id", "s"], shuffle=False)
    assert ds.config.columns == ("label", "part", "id", "s")
    batches = stream(ds, batch_size=2)
    assert all(list(b) == ["label", "part", "id", "s"] for b in batches)
    assert column(batches, "id") == list(range(n))
    assert column(batches, "s") == [f"row-{i}" for i in range(n)]
    assert column(batches, "part") == [0, 0, 0, 1, 1]


# ------------------------------------------------------------------------------------ progress


def test_progress_true_writes_reading_footers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_lake(tmp_path, [[2], [3]])
    capsys.readouterr()
    ll.LakeDataset(tmp_path, progress=True)
    assert "reading footers" in capsys.readouterr().err


def test_progress_true_on_a_terminal_writes_reading_footers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_lake(tmp_path, [[2], [3]])
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    ll.LakeDataset(tmp_path, progress=True)
    assert "reading footers" in term.getvalue()


@pytest.mark.parametrize("progress", [False, None])
def test_no_progress_for_a_small_lake_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, progress
) -> None:
    write_lake(tmp_path, [[2], [3]])
    capsys.readouterr()
    ll.LakeDataset(tmp_path, progress=progress)
    assert capsys.readouterr().err == ""
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    ll.LakeDataset(tmp_path, progress=progress)
    assert term.getvalue() == ""


def test_progress_by_default_for_many_files_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(PROGRESS_MIN_FILES):
        put(tmp_path / f"p-{i:03d}.parquet", {"id": [i]})
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    ds = ll.LakeDataset(tmp_path)
    assert len(ds) == PROGRESS_MIN_FILES
    assert "reading footers" in term.getvalue()
    term.truncate(0)
    ll.LakeDataset(tmp_path, progress=False)
    assert term.getvalue() == ""

"""A unit that is a row range of its row group is streamed, not read with its row group whole.

- every unit (and any row range) streamed equals the same rows of the row group read whole:
  nulls, strings, hive partition columns, columns missing from a file, the last short unit;
- a shuffled loader delivers every row once, in the order of the row-group-at-once reader;
- a file that changed after the snapshot fails naming file and row group;
- streaming one unit of a large row group holds a fraction of the row group, not all of it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import write_lake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.io import fetch, reader
from lakeloader.lake.files import FileInfo

#: Proxy memory pools made by :func:`_peak_bytes`. Kept for the life of the process: a
#: buffer allocated through a pool must not outlive it, and pyarrow may free some late.
_POOLS: list[pa.MemoryPool] = []


def _write_mixed(root: Path, layout: Sequence[Sequence[int]]) -> int:
    """One file per entry of ``layout`` (row group sizes), in hive folders ``part=0|1``.

    Columns: ``id`` (0..N-1), ``x`` (float64, every 7th null), ``s`` (string, every 5th
    null); files in ``part=0`` also have ``extra`` (int32, every 3rd null), missing from the
    others. Returns N.
    """
    next_id = 0
    for i, row_groups in enumerate(layout):
        folder = root / f"part={i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        fields = [("id", pa.int64()), ("x", pa.float64()), ("s", pa.string())]
        schema = pa.schema(fields + ([("extra", pa.int32())] if i % 2 == 0 else []))
        with pq.ParquetWriter(folder / f"file-{i:04d}.parquet", schema) as writer:
            for n in row_groups:
                ids = np.arange(next_id, next_id + n, dtype=np.int64)
                columns: dict[str, Any] = {
                    "id": ids,
                    "x": pa.array(ids * 0.25, mask=ids % 7 == 0),
                    "s": pa.array([f"row-{j}" for j in ids], mask=ids % 5 == 0),
                }
                if "extra" in schema.names:
                    columns["extra"] = pa.array(ids.astype(np.int32), mask=ids % 3 == 0)
                writer.write_table(pa.table(columns, schema=schema), row_group_size=max(1, n))
                next_id += n
    return next_id


def _whole(ds: ll.LakeDataset, file_index: int, row_group: int) -> pa.Table:
    """A row group as the reader returns it read whole (the reference)."""
    rows = ds.snapshot.files[file_index].row_group_rows[row_group]
    return ds.reader().read(file_index, row_group, 0, rows)


def _check_units(ds: ll.LakeDataset) -> None:
    """Every unit of ``ds`` streamed equals the same rows of its row group read whole."""
    r = ds.reader()
    units = ds.units
    for u in range(len(units)):
        fi, rg = int(units.file_index[u]), int(units.row_group[u])
        start, n = int(units.row_start[u]), int(units.num_rows[u])
        got = r.read(fi, rg, start, n)
        assert got.schema == r.schema
        assert got.equals(_whole(ds, fi, rg).slice(start, n)), (fi, rg, start, n)


def test_streamed_units_equal_the_row_group_read_whole(tmp_path: Path) -> None:
    rows = _write_mixed(tmp_path, [[1000, 333], [700], [1, 257]])
    ds = ll.LakeDataset(tmp_path, max_unit_rows=128)
    assert len(ds) == rows and ds.snapshot.schema.names == ["id", "x", "s", "extra", "part"]
    assert len(ds.units) > ds.snapshot.num_row_groups, "row groups are split"
    _check_units(ds)
    last = ds.reader().read(0, 0, 896, 104)  # the last, short unit of a row group
    assert last.column("id").to_pylist() == list(range(896, 1000))
    other = [f.path.endswith("part=1/file-0001.parquet") for f in ds.snapshot.files].index(True)
    missing = ds.reader().read(other, 0, 300, 200)
    assert missing.column("extra").null_count == 200, "a column the file lacks is null"
    assert missing.column("part").to_pylist() == [1] * 200, "the hive partition's value"
    assert ll.LakeDataset(tmp_path, columns=["part"], max_unit_rows=128).reader().read(
        0, 0, 300, 3
    ).column("part").to_pylist() == [0, 0, 0], "no column of the file at all"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    row_groups=st.lists(st.integers(1, 600), min_size=1, max_size=3),
    unit_rows=st.integers(1, 300),
    batch_rows=st.integers(1, 200),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_any_row_range_streams_like_the_row_group_read_whole(
    row_groups: list[int], unit_rows: int, batch_rows: int, cut: tuple[float, float]
) -> None:
    with (
        tempfile.TemporaryDirectory() as root,
        mock.patch.object(reader, "stream_batch_rows", lambda *_: batch_rows),
    ):
        _write_mixed(Path(root), [row_groups])
        ds = ll.LakeDataset(root, max_unit_rows=unit_rows)
        _check_units(ds)
        last = len(row_groups) - 1
        total = row_groups[last]
        start = int(cut[0] * (total - 1))
        rows = 1 + int(cut[1] * (total - start - 1))
        got = ds.reader().read(0, last, start, rows)  # a piece: any row range
        assert got.equals(_whole(ds, 0, last).slice(start, rows))


def _read_whole_then_slice(
    self: reader.UnitReader,
    info: FileInfo,
    row_group: int,
    row_start: int,
    num_rows: int,
    file_cols: list[str],
    fetched: object = None,
) -> pa.Table:
    """The reader before streaming: the whole row group, then a slice (local files)."""
    table: pa.Table = pq.ParquetFile(info.path).read_row_group(row_group, columns=file_cols)
    return table.slice(row_start, num_rows)


def _epoch(ds: ll.LakeDataset, **kwargs: Any) -> list[dict[str, list[Any]]]:
    """One pass of a loader, every batch as plain lists."""
    loader = ll.DataLoader(ds, batch_size=48, **kwargs)
    try:
        return [
            {k: v.tolist() if isinstance(v, torch.Tensor) else list(v) for k, v in b.items()}
            for b in loader
        ]
    finally:
        loader.close()


def test_a_shuffled_pass_delivers_every_row_once_in_the_same_order(tmp_path: Path) -> None:
    rows = write_lake(tmp_path, [[700, 300], [1000], [90, 410]])
    ds = ll.LakeDataset(tmp_path, seed=5, num_partitions=4, window=64, max_unit_rows=128)
    with mock.patch.object(reader.UnitReader, "_read_rows", _read_whole_then_slice):
        before = _epoch(ds)
    streamed = _epoch(ds)
    ids = [i for b in streamed for i in b["id"]]
    assert sorted(ids) == list(range(rows)) and ids != sorted(ids)
    assert streamed == before, "the same rows, in the same order, as reading row groups whole"
    assert _epoch(ds, num_workers=2) == before, "workers stream alike"


@pytest.fixture
def changing_lake(tmp_path: Path) -> tuple[ll.LakeDataset, Path]:
    write_lake(tmp_path, [[1000, 600]])
    return ll.LakeDataset(tmp_path, max_unit_rows=256), tmp_path / "file-0000.parquet"


def _streamed_unit_fails(ds: ll.LakeDataset, path: Path, row_group: int, *words: str) -> None:
    start = 512 if row_group == 0 else 256
    with pytest.raises(ll.LakeDataError) as err:
        ds.reader().read(0, row_group, start, 256)
    message = str(err.value)
    assert message.startswith(f"{path}, row group {row_group}: "), message
    assert all(w in message for w in words), message


@pytest.mark.parametrize("keep", [0.3, 0.7, 0.95])
def test_a_truncated_file_fails_naming_file_and_row_group(
    changing_lake: tuple[ll.LakeDataset, Path], keep: float
) -> None:
    ds, path = changing_lake
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    _streamed_unit_fails(ds, path, 1, "cannot read or decode", "on_error='skip'")


def test_a_file_rewritten_with_fewer_rows_fails_in_a_fresh_process(
    changing_lake: tuple[ll.LakeDataset, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ds, path = changing_lake
    table = pq.read_table(path)
    pq.write_table(table.slice(0, 1300), path, row_group_size=1000)
    # a process that did not build the snapshot (a spawned worker) has no footer cached
    monkeypatch.setattr(fetch, "_FOOTERS", fetch._FooterCache(fetch.FOOTER_CACHE_FILES))
    _streamed_unit_fails(ds, path, 1, "300 rows in its footer but the snapshot says 600")


def test_a_stream_that_ends_early_fails_naming_file_and_row_group(
    changing_lake: tuple[ll.LakeDataset, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ds, path = changing_lake
    iter_batches = pq.ParquetFile.iter_batches

    def short(self: pq.ParquetFile, **kwargs: Any) -> Iterator[pa.RecordBatch]:
        yield next(iter_batches(self, **kwargs))  # pages that end before the footer says

    monkeypatch.setattr(reader, "stream_batch_rows", lambda *_: 100)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", short)
    _streamed_unit_fails(ds, path, 0, "100 rows in its stream but the snapshot says 1000")


def _peak_bytes(read: Callable[[], pa.Table]) -> int:
    """Peak bytes allocated through pyarrow's default pool while ``read`` runs."""
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    _POOLS.append(pool)
    old = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        table = read()
        assert table.num_rows
        del table
    finally:
        pa.set_memory_pool(old)
    peak: int = pool.max_memory()
    return peak


def test_streaming_a_unit_holds_a_fraction_of_its_row_group(tmp_path: Path) -> None:
    rows = 2_000_000
    rng = np.random.default_rng(0)
    table = pa.table({f"c{i}": rng.random(rows) for i in range(4)})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=rows, compression="none")
    decoded = table.nbytes  # 64 MB
    del table
    ds = ll.LakeDataset(tmp_path, max_unit_rows=65_536)
    r = ds.reader()
    whole = _peak_bytes(lambda: r.read(0, 0, 0, rows))
    streamed = _peak_bytes(lambda: r.read(0, 0, 1_500_000, 65_536))
    assert whole >= 0.9 * decoded, "the measure sees a row group read whole"
    assert streamed <= 0.3 * decoded, (streamed, decoded)  # about 0.17: a unit, a batch, buffers

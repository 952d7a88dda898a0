"""``UnitDecoder``: a real Parquet file, read by the real reader, packed into a real arena.

Row group 0 has no nulls; row group 1 has nulls in the int32 column ``n``, which therefore
stays an Arrow column in that unit. ``s`` (a string) gets binary views in the arena, ``tags``
(a list) only ever takes the Arrow path.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lakeloader.cache.arena import Arena
from lakeloader.cache.decode import DecodeJob, UnitDecoder, UnitRef, read_ipc
from lakeloader.cache.packed import RowLayout
from lakeloader.cache.views import EMPTY_BUFFER, data_buffer, views_array
from lakeloader.errors import LakeDataError
from lakeloader.io.reader import UnitReader
from lakeloader.io.retry import RetryPolicy
from lakeloader.lake.snapshot import snapshot_lake
from lakeloader.state.quarantine import OnError, QuarantineEntry, Validate
from tests.conftest import damage_row_group

ROW_GROUPS = (20, 12)
VIEW_BUFFER = 1  # the index the unit's string data gets among the view buffers


SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("x", pa.float32()),
        ("s", pa.string()),
        ("tags", pa.list_(pa.int64())),
        ("n", pa.int32()),
    ]
)


def _table(first: int, rows: int, with_nulls: bool) -> pa.Table:
    ids = np.arange(first, first + rows, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "x": (ids * 0.25).astype(np.float32),
            "s": [f"value number {i}" if i % 3 else f"v{i}" for i in ids],  # inline and not
            "tags": [[int(i)] * int(i % 3) for i in ids],
            "n": [None if with_nulls and i % 4 == 0 else int(i) for i in ids],
        },
        schema=SCHEMA,
    )


def _write(path: Path) -> None:
    with pq.ParquetWriter(path, SCHEMA, compression="zstd") as writer:
        first = 0
        for i, rows in enumerate(ROW_GROUPS):
            writer.write_table(_table(first, rows, with_nulls=i == 1))
            first += rows


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decode-lake")
    _write(root / "data.parquet")
    return root


@pytest.fixture(scope="module")
def broken_lake(lake: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decode-broken")
    shutil.copy(lake / "data.parquet", root / "data.parquet")
    damage_row_group(root / "data.parquet", 1)
    return root


def _reader(root: Path) -> UnitReader:
    fs, snapshot = snapshot_lake(root)
    return UnitReader(fs, snapshot, snapshot.schema.names, RetryPolicy(deadline=0))


@pytest.fixture
def arena(tmp_path: Path, lake: Path) -> Iterator[Arena]:
    layout = RowLayout.of(_reader(lake).schema)
    arena = Arena(str(tmp_path), layout.record, capacity=64, keep_rows=0)
    yield arena
    arena.close()


def _decoder(
    root: Path, on_error: OnError = "raise", validate: Validate | None = None
) -> UnitDecoder:
    reader = _reader(root)
    return UnitDecoder(reader, RowLayout.of(reader.schema), on_error, validate)


def _job(
    rg: int,
    start: int,
    *,
    row_start: int = 0,
    rows: int | None = None,
    table_path: str | None = None,
    view_buffers: tuple[int, ...] = (),
) -> DecodeJob:
    """Decode rows of row group ``rg`` of the lake's one file into arena rows from ``start``."""
    rows = ROW_GROUPS[rg] - row_start if rows is None else rows
    return DecodeJob(0, 0, rg, row_start, rows, start, table_path, view_buffers)


def _ids(rg: int, row_start: int, rows: int) -> list[int]:
    first = sum(ROW_GROUPS[:rg]) + row_start
    return list(range(first, first + rows))


def test_a_row_group_is_packed_into_its_arena_rows(lake: Path, arena: Arena) -> None:
    decoder = _decoder(lake)
    assert decoder.layout is not None
    assert (decoder.layout.names, decoder.layout.views) == (("id", "x", "n"), ("s",))
    start = arena.alloc(20)
    ref = decoder.decode(_job(0, start, view_buffers=(VIEW_BUFFER,)), arena.records)
    assert isinstance(ref, UnitRef)
    assert (ref.start, ref.num_rows, ref.packed, ref.views) == (start, 20, ("id", "x", "n"), ("s",))
    rows = arena.records[start : start + 20]
    assert rows["id"].tolist() == _ids(0, 0, 20)
    assert rows["x"].tolist() == [i * 0.25 for i in _ids(0, 0, 20)]
    assert rows["n"].tolist() == _ids(0, 0, 20)
    # What is not packed stays Arrow; the string views point into that table's own data.
    assert isinstance(ref.table, pa.Table)
    assert ref.table.column_names == ["s", "tags"]
    strings = views_array(
        rows["s"].copy(),
        pa.string(),
        [EMPTY_BUFFER, data_buffer(ref.table.column("s").chunk(0))],
    )
    assert strings.to_pylist() == ref.table.column("s").to_pylist()
    assert strings.to_pylist() == _table(0, 20, False).column("s").to_pylist()


def test_integer_nulls_keep_a_column_out_of_the_arena(lake: Path, arena: Arena) -> None:
    start = arena.alloc(12)
    ref = _decoder(lake).decode(_job(1, start), arena.records)
    assert isinstance(ref, UnitRef) and isinstance(ref.table, pa.Table)
    assert ref.packed == ("id", "x")
    assert ref.views == ()  # no view buffer was given: no views written
    assert "n" in ref.table.column_names and ref.table.column("n").null_count == 3
    assert arena.records["id"][start : start + 12].tolist() == _ids(1, 0, 12)


def test_a_row_range_of_a_row_group_is_streamed(lake: Path, arena: Arena) -> None:
    start = arena.alloc(6)
    ref = _decoder(lake).decode(_job(0, start, row_start=5, rows=6), arena.records)
    assert isinstance(ref, UnitRef) and ref.num_rows == 6
    assert arena.records["id"][start : start + 6].tolist() == _ids(0, 5, 6)


def test_the_other_columns_go_to_an_ipc_file_for_another_process(
    lake: Path, arena: Arena, tmp_path: Path
) -> None:
    start = arena.alloc(20)
    path = str(tmp_path / "unit-0.arrow")
    job = _job(0, start, table_path=path, view_buffers=(VIEW_BUFFER,))
    ref = _decoder(lake).decode(job, arena.records)
    assert isinstance(ref, UnitRef) and ref.table == path
    table = read_ipc(path)
    assert table.column_names == ["s", "tags"]
    assert table.column("tags").to_pylist() == _table(0, 20, False).column("tags").to_pylist()
    # The views were written from the table as read back, pointing into the mapped file.
    rows = arena.records[start : start + 20]
    strings = views_array(
        rows["s"].copy(), pa.string(), [EMPTY_BUFFER, data_buffer(table.column("s").chunk(0))]
    )
    assert strings.to_pylist() == table.column("s").to_pylist()


def test_without_arena_rows_the_unit_stays_an_arrow_table(lake: Path) -> None:
    ref = _decoder(lake).decode(_job(1, -1), None)
    assert isinstance(ref, UnitRef) and isinstance(ref.table, pa.Table)
    assert (ref.start, ref.packed, ref.views) == (-1, (), ())
    assert ref.table.column_names == ["id", "x", "s", "tags", "n"]
    assert ref.table.column("id").to_pylist() == _ids(1, 0, 12)


def _few_rows(table: pa.Table) -> str | None:
    return "fewer than 15 rows" if table.num_rows < 15 else None


def test_a_rejected_unit_is_quarantined_with_the_verdict(
    lake: Path, arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    decoder = _decoder(lake, "skip", _few_rows)
    assert isinstance(decoder.decode(_job(0, arena.alloc(20)), arena.records), UnitRef)
    start = arena.alloc(12)
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        held = decoder.decode(_job(1, start), arena.records)
    path = str(lake / "data.parquet")
    assert held == QuarantineEntry(path, 1, 0, 12, "rejected by validate: fewer than 15 rows")
    assert "quarantined" in caplog.text and "row group 1" in caplog.text
    assert not arena.records["id"][start : start + 12].any(), "nothing was packed"


def test_a_validator_that_returns_false_quarantines_too(lake: Path) -> None:
    held = _decoder(lake, "skip", lambda t: False).decode(_job(0, -1), None)
    assert isinstance(held, QuarantineEntry)
    assert held.reason.startswith("rejected by validate")


def test_a_rejected_unit_raises_unless_skipping(lake: Path) -> None:
    decoder = _decoder(lake, "raise", _few_rows)
    with pytest.raises(LakeDataError) as info:
        decoder.decode(_job(1, -1, row_start=2, rows=10), None)
    message = str(info.value)
    assert str(lake / "data.parquet") in message
    assert "row group 1, rows [2, 12): rejected by validate: fewer than 15 rows" in message
    assert "on_error='skip'" in message


def test_a_corrupt_row_group_is_a_lake_data_error_naming_file_and_row_group(
    broken_lake: Path,
) -> None:
    decoder = _decoder(broken_lake)
    assert isinstance(decoder.decode(_job(0, -1), None), UnitRef)  # the other one reads
    with pytest.raises(LakeDataError) as info:
        decoder.decode(_job(1, -1), None)
    message = str(info.value)
    assert f"{broken_lake / 'data.parquet'}, row group 1: cannot read or decode" in message
    assert info.value.__cause__ is not None  # pyarrow's own error, chained


def test_a_corrupt_row_group_is_quarantined_when_skipping(broken_lake: Path) -> None:
    held = _decoder(broken_lake, "skip").decode(_job(1, -1), None)
    assert isinstance(held, QuarantineEntry)
    assert held.key == (str(broken_lake / "data.parquet"), 1, 0, 12)
    assert held.reason and "rejected" not in held.reason  # pyarrow's error, not a verdict

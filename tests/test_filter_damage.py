"""A filter that must read a damaged row group to count it: named, or quarantined like a unit.

The lake: two files of ids in row groups of 100, ``x = id % 7``, so that statistics cannot
decide ``x != 3`` and every row group is counted by reading ``x``. Row group 1 of the first
file is damaged (its column chunks overwritten, the footer intact).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from tests.conftest import damage_row_group, global_batches, make_loaders

ORDER: dict[str, Any] = {"seed": 3, "num_partitions": 4, "window": 16, "max_unit_rows": 40}
FILTER = pc.field("x") != 3
DAMAGED = range(100, 200)  # the ids of the damaged row group


def _write(root: Path) -> Path:
    """The lake; returns the file whose row group 1 is to be damaged."""
    root.mkdir()
    for name, first in (("a", 0), ("b", 300)):
        ids = np.arange(first, first + 300, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids % 7}), root / f"{name}.parquet", 100)
    return root / "a.parquet"


def _matching(left_out: range = DAMAGED) -> list[int]:
    return [i for i in range(600) if i % 7 != 3 and i not in left_out]


def _damage_column(path: Path, rg: int, name: str) -> None:
    """Overwrite the middle of one column chunk of one row group (the footer stays intact)."""
    group = pq.read_metadata(path).row_group(rg)
    chunk = next(
        group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema == name
    )
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + 8 : start + chunk.total_compressed_size - 2] = b"\xff" * (
        chunk.total_compressed_size - 10
    )
    path.write_bytes(bytes(data))


def test_a_row_group_the_filter_cannot_read_is_named_with_the_remedy(tmp_path: Path) -> None:
    damage_row_group(_write(tmp_path / "lake"), 1)
    with pytest.raises(ll.LakeDataError) as info:
        ll.LakeDataset(tmp_path / "lake", filter=FILTER, **ORDER)
    message = str(info.value)
    assert f"{tmp_path / 'lake' / 'a.parquet'}, row group 1: cannot read or decode" in message
    assert "on_error='skip'" in message and "\n" not in message
    assert info.value.__cause__ is not None, "pyarrow's own error, chained"


@pytest.mark.parametrize("resume", ["state", "checkpoint"])
def test_under_skip_it_is_quarantined_and_the_other_matching_rows_come_once(
    tmp_path: Path, resume: str, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = _write(tmp_path / "lake")
    damage_row_group(damaged, 1)

    def dataset() -> ll.LakeDataset:
        return ll.LakeDataset(tmp_path / "lake", filter=FILTER, on_error="skip", **ORDER)

    first = dataset()
    assert [(e.path, e.row_group, e.row_start, e.num_rows) for e in first.lost] == [
        (str(damaged), 1, 0, 100)
    ], "the whole row group, known to every rank before any read"
    loaders = make_loaders(first, 2, batch_size=4)
    seen = [i for b in itertools.islice(global_batches(loaders), 25) for i in b]
    state = json.loads(json.dumps(loaders[0].state_dict()))
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(25, loaders[0])
    for loader in loaders:
        loader.close()
    resumed = make_loaders(dataset(), 4, batch_size=3)  # another world size and batch size
    for loader in resumed:
        if resume == "state":
            loader.load_state_dict(state)
        else:
            ll.CheckpointManager(str(tmp_path / "ckpt")).load(loader)
    rest = [i for b in global_batches(resumed) for i in b]
    assert sorted(seen + rest) == _matching(), "every other matching row exactly once"
    skipped = {e for loader in resumed for e in loader.quarantine}
    for loader in resumed:
        loader.close()
    assert {(e.path, e.row_group) for e in skipped} == {(str(damaged), 1)}
    assert sum(e.num_rows for e in skipped) <= 100 and "thrift" in next(iter(skipped)).reason
    ll.CheckpointManager(str(tmp_path / "end")).save(1, resumed[0])
    from lakeloader.cli.main import main as cli_main

    assert cli_main(["inspect", str(tmp_path / "end")]) == 0
    out = capsys.readouterr().out
    assert "quarantine (units skipped for good" in out and "a.parquet" in out


def test_damage_in_an_unselected_filter_column_delivers_none_of_its_rows(
    tmp_path: Path,
) -> None:
    _damage_column(_write(tmp_path / "lake"), 1, "x")
    ds = ll.LakeDataset(tmp_path / "lake", columns=["id"], filter=FILTER, on_error="skip", **ORDER)
    loaders = make_loaders(ds, 2, batch_size=8)
    ids = [i for b in global_batches(loaders) for i in b]
    for loader in loaders:
        loader.close()
    assert sorted(ids) == _matching(), "not one row of it: its 'id' chunk reads, but unfiltered"

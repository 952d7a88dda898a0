"""``filter=``: exactly the matching rows, pruned row groups never fetched, exact resume.

The lake: 4 hive partitions ``part=0..3`` of one file each, 200 rows in row groups of 50, ids
in order (so statistics can rule whole row groups out), ``x = id % 7``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.io.reader import UnitReader
from tests.conftest import global_batches, make_loaders, roundtrip, run_epoch

if TYPE_CHECKING:
    from tests.stores import ObjectStore

pytest_plugins = ["tests.stores"]

ORDER: dict[str, Any] = {"seed": 5, "num_partitions": 4, "window": 32, "max_unit_rows": 25}
FILTER = (pc.field("id") >= 250) & (pc.field("x") != 3) & (pc.field("part") != 2)


def _expected() -> list[int]:
    return [i for i in range(800) if i >= 250 and i % 7 != 3 and i // 200 != 2]


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("filtered")
    for k in range(4):
        ids = np.arange(k * 200, (k + 1) * 200, dtype=np.int64)
        (root / f"part={k}").mkdir()
        table = pa.table({"id": ids, "x": ids % 7})
        pq.write_table(table, root / f"part={k}" / "data.parquet", row_group_size=50)
    return root


def _ids(loader: ll.DataLoader) -> list[int]:
    return [i for b in loader for i in b["id"].tolist()]


def test_exactly_the_matching_rows_and_ruled_out_row_groups_are_never_read(
    parts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: set[tuple[int, int]] = set()
    real = UnitReader.read

    def recording(self: UnitReader, file_index: int, row_group: int, *args: Any) -> pa.Table:
        read.add((file_index, row_group))
        return real(self, file_index, row_group, *args)

    monkeypatch.setattr(UnitReader, "read", recording)
    ds = ll.LakeDataset(parts, filter=FILTER, **ORDER)
    assert len(ds) == len(_expected())
    counts = [f.row_group_rows for f in ds.snapshot.files]
    assert counts[0] == counts[2] == (0, 0, 0, 0) and counts[1][0] == 0, "statistics, partitions"
    assert sum(counts[3]) == len([i for i in range(600, 800) if i % 7 != 3]), "counted"
    loader = ll.DataLoader(ds, batch_size=16)
    assert sorted(_ids(loader)) == _expected()
    loader.close()
    matching = {
        (f, rg)
        for f, info in enumerate(ds.snapshot.files)
        for rg, n in enumerate(info.row_group_rows)
        if n
    }
    assert read == matching, "only row groups with matching rows are read"
    assert len(matching) == 7, "of 16: 5 ruled out by statistics, 4 by the partition value"
    assert ds.fingerprint == ll.LakeDataset(parts, **ORDER).fingerprint, "the same lake"
    assert ds.config.filter == str(FILTER)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_filtered_lake_is_topology_independent_and_resumes_exactly(
    parts: Path, workers: int
) -> None:
    ds = ll.LakeDataset(parts, filter=FILTER, **ORDER)
    one = run_epoch(ds, 1, batch_size=12)
    assert run_epoch(ds, 3, batch_size=4, num_workers=workers) == one
    for stop in (1, 7, 20):
        loaders = make_loaders(ds, 2, batch_size=6)
        seen = [i for b in itertools.islice(global_batches(loaders), stop) for i in b]
        state = roundtrip(loaders[0].state_dict())
        for loader in loaders:
            loader.close()
        again = ll.LakeDataset(parts, filter=FILTER, **ORDER)
        loaders = make_loaders(again, 4, batch_size=5, num_workers=workers)
        for loader in loaders:
            loader.load_state_dict(state)
        rest = [i for b in global_batches(loaders) for i in b]
        for loader in loaders:
            loader.close()
        assert sorted(seen + rest) == _expected(), f"stop {stop}: every match exactly once"


def test_a_state_under_another_filter_is_refused_with_both(parts: Path) -> None:
    loader = ll.DataLoader(ll.LakeDataset(parts, filter=FILTER, **ORDER), batch_size=8)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    other = ll.DataLoader(ll.LakeDataset(parts, filter=pc.field("id") > 5, **ORDER), batch_size=8)
    with pytest.raises(ll.StateMismatchError, match=r"'filter': \('.*id >= 250.*', '\(id > 5\)'\)"):
        other.load_state_dict(state)
    bare = ll.DataLoader(ll.LakeDataset(parts, **ORDER), batch_size=8)
    with pytest.raises(ll.StateMismatchError, match="filter"):
        bare.load_state_dict(state)


def test_a_checkpoint_keeps_the_filtered_counts(parts: Path, tmp_path: Path) -> None:
    loader = ll.DataLoader(ll.LakeDataset(parts, filter=FILTER, **ORDER), batch_size=10)
    seen = [i for b in itertools.islice(loader, 5) for i in b["id"].tolist()]
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(5, loader)
    loader.close()
    resumed = ll.DataLoader(ll.LakeDataset(parts, filter=FILTER, **ORDER), batch_size=7)
    manager.load(resumed)
    assert sorted(seen + _ids(resumed)) == _expected()


def test_bad_filters_say_what_is_wrong(parts: Path) -> None:
    with pytest.raises(ValueError, match=r"evaluated on the lake's columns \['id', 'x', 'part'\]"):
        ll.LakeDataset(parts, filter=pc.field("nope") > 1)
    with pytest.raises(TypeError, match=r"pyarrow\.compute\.Expression"):
        ll.LakeDataset(parts, filter="id > 1")


def test_a_filter_on_s3_fetches_fewer_row_groups(s3_store: ObjectStore, parts: Path) -> None:
    _, url = s3_store.upload(parts, "filtered")
    options = s3_store.storage_options
    plain = ll.DataLoader(ll.LakeDataset(url, storage_options=options, **ORDER), batch_size=16)
    assert len(_ids(plain)) == 800
    kept = ll.DataLoader(
        ll.LakeDataset(url, storage_options=options, filter=FILTER, **ORDER), batch_size=16
    )
    assert sorted(_ids(kept)) == _expected()
    assert kept.stats()["requests"] < plain.stats()["requests"]
    assert kept.stats()["units_decoded"] < plain.stats()["units_decoded"] * 5 // 8

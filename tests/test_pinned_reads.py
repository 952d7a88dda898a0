"""Reads pinned to the snapshot's version of each file, on real S3 and GCS servers.

A file rewritten in the middle of an epoch must fail at once, naming it, rather than be read
as if it were the file the epoch was planned over (S3 ``If-Match`` on the ETag, GCS
``generation``). Prefetched units of the old version are still the right bytes; the units not
fetched yet are what the rewrite catches, so the loader is held to one step ahead
(``cache_bytes=1``) to leave most units unread when the files are rewritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from tests.conftest import write_lake

if TYPE_CHECKING:
    from tests.stores import ObjectStore

pytest_plugins = ["tests.stores"]

LAYOUT = [[300, 300]] * 6


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    found: ObjectStore = request.getfixturevalue(
        {"s3": "s3_store", "gs": "gcs_store"}[request.param]
    )
    return found


def _rewrite(store: ObjectStore, local: Path, remote_dir: str) -> list[str]:
    """Rewrite every file of the lake in place: the same rows and row groups, other values."""
    fs = store.filesystem()
    urls = []
    for path in sorted(local.glob("*.parquet")):
        table = pq.read_table(path)
        table = table.set_column(0, "id", pc.add(table.column("id"), 1_000_000))
        changed = path.with_suffix(".new")
        pq.write_table(table, changed, row_group_size=300)
        fs.put_file(str(changed), f"{remote_dir}/{path.name}")
        urls.append(store.url(f"{remote_dir}/{path.name}"))
    fs.invalidate_cache()
    return urls


@pytest.mark.filterwarnings("ignore::lakeloader.CacheBudgetWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_rewritten_mid_epoch_fails_naming_it(
    store: ObjectStore, tmp_path: Path, workers: int
) -> None:
    local = tmp_path / "lake"
    rows = write_lake(local, LAYOUT)
    bucket, url = store.upload(local, "pinned")
    config = {"seed": 3, "max_unit_rows": 100, "num_partitions": 2, "window": 64}
    ds = ll.LakeDataset(url, storage_options=store.storage_options, **config)
    loader = ll.DataLoader(ds, batch_size=50, num_workers=workers, cache_bytes=1)
    seen: list[int] = []
    try:
        batches = iter(loader)
        for _ in range(2):
            seen += next(batches)["id"].tolist()
        urls = _rewrite(store, local, f"{bucket}/lake")
        with pytest.raises(ll.LakeChangedError) as err:
            for batch in batches:
                seen += batch["id"].tolist()
    finally:
        loader.close()
    message = str(err.value)
    assert any(message.startswith(f"{u}: the file was rewritten") for u in urls), message
    assert "pinned" in message and "rebuild the dataset" in message, message
    assert all(i < rows for i in seen), "no row of a rewritten file was delivered"
    assert len(seen) == len(set(seen)) < rows


def test_a_file_rewritten_after_the_snapshot_fails_before_any_row(
    store: ObjectStore, tmp_path: Path
) -> None:
    local = tmp_path / "lake"
    write_lake(local, LAYOUT[:2])
    bucket, url = store.upload(local, "pinned")
    ds = ll.LakeDataset(url, storage_options=store.storage_options, seed=3)
    urls = _rewrite(store, local, f"{bucket}/lake")
    loader = ll.DataLoader(ds, batch_size=50)
    try:
        with pytest.raises(ll.LakeChangedError) as err:
            next(iter(loader))
    finally:
        loader.close()
    assert any(str(err.value).startswith(f"{u}: the file was rewritten") for u in urls), err.value

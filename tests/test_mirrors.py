"""Issue 32, item 3: a lake mirrored in two places is one dataset (``mirrors=``).

The copies are checked at open (a file missing or different is named, with both values); with
two real S3 servers (SeaweedFS on loopback), the one in use is killed mid-epoch and the epoch
goes on from the other: the same global sequence as the lake read locally, every row once,
under 0 and 1 worker per rank, and the same state and fingerprint as without a mirror.
"""

from __future__ import annotations

import itertools
import shutil
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.lake.files import FileInfo
from lakeloader.lake.mirrors import check_same
from tests.conftest import global_batches, make_loaders, write_lake
from tests.stores import ObjectStore, RestartableStore

pytest_plugins = ["tests.stores"]

LAYOUT = [[250] * 4] * 8
ORDER = {"seed": 3, "num_partitions": 4, "window": 500}
SMALL_CACHE = {"cache_bytes": 40_000, "io_threads": 2}


@pytest.fixture(scope="module")
def local_lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mirror-lake") / "lake"
    root.mkdir()
    write_lake(root, LAYOUT)
    return root


def test_a_mirror_is_checked_file_by_file(local_lake: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(local_lake, copy)
    ds = ll.LakeDataset(str(local_lake), mirrors=[str(copy)], **ORDER)
    assert ds.fingerprint == ll.LakeDataset(str(local_lake), **ORDER).fingerprint
    reader = ds.reader()
    assert [f.path for f in reader.mirrors[0].snapshot.files] == [
        str(copy / Path(f.path).name) for f in ds.snapshot.files
    ]
    victim = sorted(copy.glob("*.parquet"))[1]
    pq.write_table(pa.table({"id": [1, 2, 3]}), victim)
    with pytest.raises(
        ll.LakeDataError,
        match=rf"{victim.name} differs in size: \d+ on the primary, \d+ on the mirror",
    ):
        ll.LakeDataset(str(local_lake), mirrors=[str(copy)], **ORDER)
    victim.unlink()
    with pytest.raises(ll.LakeDataError, match=rf"{victim.name} is missing from the mirror"):
        ll.LakeDataset(str(local_lake), mirrors=[str(copy)], **ORDER)
    (copy / victim.name).write_bytes((local_lake / victim.name).read_bytes())
    shutil.copy(
        victim.parent / sorted(p.name for p in copy.glob("*.parquet"))[0], copy / "extra.parquet"
    )
    with pytest.raises(ll.LakeDataError, match=r"extra\.parquet is missing from the primary"):
        ll.LakeDataset(str(local_lake), mirrors=[str(copy)], **ORDER)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_the_store_in_use_killed_mid_epoch_the_other_copy_serves(
    restartable_s3_store: RestartableStore,
    s3_store: ObjectStore,
    local_lake: Path,
    workers: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    primary, mirror = restartable_s3_store, s3_store
    url = primary.upload(local_lake, "primary")[1]
    copy = mirror.upload(local_lake, "mirror")[1]
    retry = ll.RetryPolicy(deadline=3, initial_delay=0.2)
    ds = ll.LakeDataset(
        url,
        storage_options=primary.storage_options,
        retry=retry,
        mirrors=[(copy, mirror.storage_options)],
        **ORDER,
    )
    lone = ll.LakeDataset(url, storage_options=primary.storage_options, retry=retry, **ORDER)
    plain = ll.LakeDataset(str(local_lake), **ORDER)
    reference = list(global_batches(make_loaders(plain, 2, batch_size=50)))
    loaders = make_loaders(ds, 2, batch_size=50, num_workers=workers, **SMALL_CACHE)
    got, states, times = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(global_batches(loaders)):
            times.append(time.monotonic())
            got.append(batch)
            if step == 10:
                primary.stop(kill=True)  # for the rest of the epoch
                times[-1] = time.monotonic()
            if step in (5, 30):
                states.append(loaders[0].state_dict())
    gaps = [b - a for a, b in itertools.pairwise(times[10:])]
    with capsys.disabled():
        print(
            f"\nmirror failover ({workers} workers, retry deadline 3 s): longest wait for a "
            f"batch after the kill {max(gaps):.2f} s, median {sorted(gaps)[len(gaps) // 2]:.3f} s"
        )
    for loader in loaders:
        loader.close()
    assert got == reference, "the same sequence: every row once"
    if workers == 0:  # a worker's warning goes to its own stderr
        moved = [w for w in caught if issubclass(w.category, ll.MirrorWarning)]
        assert moved and "reads go on from the copy holding s3://" in str(moved[0].message)
    # the state does not know which copy served: a mirrorless loader over the primary takes it
    assert states[0]["fingerprint"] == states[1]["fingerprint"] == lone.fingerprint
    with ll.DataLoader(lone, batch_size=50, rank=0, world_size=2) as other:
        other.load_state_dict(states[1])
        assert other.state_dict()["position"] == states[1]["position"] == 31 * 100


@pytest.mark.slow
def test_a_mirror_down_at_open_is_left_out_with_a_warning(
    restartable_s3_store: RestartableStore, local_lake: Path
) -> None:
    down = restartable_s3_store
    copy = down.upload(local_lake, "down")[1]
    down.stop()
    retry = ll.RetryPolicy(deadline=1, initial_delay=0.2)
    with pytest.warns(ll.MirrorWarning, match="did not answer.*left out of this dataset's reads"):
        ds = ll.LakeDataset(
            str(local_lake), mirrors=[(copy, down.storage_options)], retry=retry, **ORDER
        )
    assert ds.mirrors == ()


def test_a_table_with_deleted_rows_is_checked_by_the_rows_in_its_files() -> None:
    """A Delta file with 2 of its 10 rows deleted, the same on both copies, is the same file."""
    schema = pa.schema([("id", pa.int64())])

    def snapshot(root: str, physical: int) -> Any:
        info = FileInfo(
            f"{root}/t/part-0.parquet", 100, "v", (8,), (80,), (), schema, (1, 2), (physical,)
        )
        return SimpleNamespace(files=(info,))

    fs = fsspec.filesystem("file")
    check_same(snapshot("/a", 10), fs, snapshot("/b", 10), fs)
    with pytest.raises(
        ll.LakeDataError, match=r"differs in row groups' rows: \(10,\) on the primary, \(9,\)"
    ):
        check_same(snapshot("/a", 10), fs, snapshot("/b", 9), fs)

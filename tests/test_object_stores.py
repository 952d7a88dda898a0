"""Lakes and checkpoints in object storage, against real servers on loopback.

S3 is SeaweedFS ``weed mini`` and GCS is fake-gcs-server (see tests/stores.py). The lake of
``conftest.write_lake(root, LAYOUT)`` is uploaded to a bucket with fsspec, and read back through
s3fs and gcsfs must give what the local copy gives: the same rows, the same global batches for
any topology, exact resume, and checkpoints that only count once committed.
"""

from __future__ import annotations

import io
import itertools
import posixpath
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.checkpoint.layout import STATE_FILE, step_dir_name
from lakeloader.lake.files import FileInfo
from tests.conftest import (
    GLOBAL_BATCH,
    LAYOUT_ROWS,
    global_batches,
    make_loaders,
    roundtrip,
    run_epoch,
)

if TYPE_CHECKING:
    from tests.stores import ObjectStore

pytest_plugins = ["tests.stores"]

#: The order configuration of conftest's ``dataset`` (the local copy of the lake).
CONFIG: dict[str, Any] = {"seed": 7, "num_partitions": 4, "window": 64, "max_unit_rows": 128}


class Remote(NamedTuple):
    store: ObjectStore
    bucket: str
    lake: str  # the lake's URL

    def open(self, url: str | None = None, **config: Any) -> ll.LakeDataset:
        return ll.LakeDataset(
            url or self.lake, storage_options=self.store.storage_options, **(config or CONFIG)
        )


def _upload(store: ObjectStore, lake: Path) -> Remote:
    return Remote(store, *store.upload(lake, "lake"))


@pytest.fixture(scope="module")
def s3_lake(s3_store: ObjectStore, lake: Path) -> Remote:
    return _upload(s3_store, lake)


@pytest.fixture(scope="module")
def gcs_lake(gcs_store: ObjectStore, lake: Path) -> Remote:
    return _upload(gcs_store, lake)


@pytest.fixture(scope="module", params=["s3", "gs"])
def remote(request: pytest.FixtureRequest) -> Remote:
    lake: Remote = request.getfixturevalue({"s3": "s3_lake", "gs": "gcs_lake"}[request.param])
    return lake


@pytest.fixture(scope="module")
def remote_dataset(remote: Remote) -> ll.LakeDataset:
    return remote.open()


def _identity(f: FileInfo) -> tuple[Any, ...]:
    """What a file is, apart from where it lives and its version token."""
    return posixpath.basename(f.path), f.size, f.row_group_rows, f.row_group_bytes, f.partitions


# --------------------------------------------------------------------------- reading
def test_same_lake_as_the_local_copy(
    remote_dataset: ll.LakeDataset, dataset: ll.LakeDataset
) -> None:
    remote, local = remote_dataset, dataset
    assert len(remote) == len(local) == LAYOUT_ROWS
    assert [_identity(f) for f in remote.snapshot.files] == [
        _identity(f) for f in local.snapshot.files
    ]
    for theirs, ours in zip(remote.snapshot.files, local.snapshot.files, strict=True):
        assert theirs.schema == ours.schema
    assert remote.snapshot.schema == local.snapshot.schema
    assert (remote.config, remote.config_hash) == (local.config, local.config_hash)
    for name in ("file_index", "row_group", "row_start", "num_rows"):
        np.testing.assert_array_equal(getattr(remote.units, name), getattr(local.units, name))
    theirs_reader, ours_reader = remote.reader(), local.reader()
    units = remote.units
    for unit in zip(
        units.file_index.tolist(),
        units.row_group.tolist(),
        units.row_start.tolist(),
        units.num_rows.tolist(),
        strict=True,
    ):
        assert theirs_reader.read(*unit).equals(ours_reader.read(*unit)), unit


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 3])
def test_same_global_batches_as_the_local_copy(
    remote_dataset: ll.LakeDataset, reference: list[list[int]], world_size: int, num_workers: int
) -> None:
    batches = run_epoch(
        remote_dataset, world_size, batch_size=GLOBAL_BATCH // world_size, num_workers=num_workers
    )
    assert batches == reference


@pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")
@pytest.mark.parametrize(
    ("before", "after"),
    [
        (
            {"world_size": 2, "batch_size": 24, "num_workers": 0},
            {"world_size": 3, "batch_size": 16, "num_workers": 2},
        ),
        (
            {"world_size": 1, "batch_size": 48, "num_workers": 2},
            {"world_size": 4, "batch_size": 7, "num_workers": 0},
        ),
    ],
)
def test_exact_resume_over_s3_into_another_topology(
    s3_lake: Remote,
    reference: list[list[int]],
    slot_order: list[int],
    before: dict[str, int],
    after: dict[str, int],
) -> None:
    before, after = dict(before), dict(after)
    ws0, ws1 = before.pop("world_size"), after.pop("world_size")
    steps = LAYOUT_ROWS // 2 // (ws0 * before["batch_size"])
    loaders = make_loaders(s3_lake.open(), ws0, **before)
    seen = list(itertools.islice(global_batches(loaders), steps))
    states = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    assert all(s["position"] == states[0]["position"] for s in states), "ranks disagree"
    assert seen == reference[:steps]
    state = roundtrip(states[0])
    # A fresh listing of the store: the same snapshot, or load_state_dict would refuse it.
    loaders = make_loaders(s3_lake.open(), ws1, **after)
    for loader in loaders:
        loader.load_state_dict(state)
    try:
        rest, next_epoch = (list(global_batches(loaders)) for _ in range(2))
    finally:
        for loader in loaders:
            loader.close()
    ids = [i for b in seen + rest for i in b]
    assert sorted(ids) == list(range(LAYOUT_ROWS)), "every row of the epoch exactly once"
    assert sorted(i for b in next_epoch for i in b) == list(range(LAYOUT_ROWS))
    position = 0
    for batch in seen + rest:  # each batch holds exactly its global slots
        assert sorted(batch) == sorted(slot_order[position : position + len(batch)])
        position += len(batch)
    if ws1 * after["batch_size"] == GLOBAL_BATCH:
        assert rest == reference[steps:]


# ----------------------------------------------------------------------- checkpoints
def test_checkpoints_round_trip_and_keep(
    remote: Remote, remote_dataset: ll.LakeDataset, reference: list[list[int]]
) -> None:
    store, path = remote.store, f"{remote.bucket}/ckpt-round-trip"
    loader = ll.DataLoader(remote_dataset, batch_size=GLOBAL_BATCH)
    it = iter(loader)
    ckpt = ll.CheckpointManager(store.url(path), keep=2, storage_options=store.storage_options)
    for step in range(1, 5):
        next(it)
        ckpt.save(step, loader, extra={"step": step})
    loader.close()
    assert ckpt.steps() == [3, 4] and ckpt.latest() == 4, "keep=2 prunes the oldest"
    fs = store.filesystem()
    fs.invalidate_cache()
    objects = fs.find(path)
    # Folders holding objects (SeaweedFS still lists a folder emptied by pruning as a prefix).
    assert {posixpath.relpath(p, path).split("/")[0] for p in objects} == {
        "ledger",
        "manifests",
        step_dir_name(3),
        step_dir_name(4),
    }
    segments = [p for p in objects if posixpath.relpath(p, path).startswith("ledger/")]
    assert segments and all(p.endswith(".jsonl") for p in segments), "the audit ledger's segments"
    secrets = [str(v).encode() for k, v in store.storage_options.items() if k in ("key", "secret")]
    for obj in objects:
        data = fs.cat_file(obj)
        assert not any(secret in data for secret in secrets), f"credentials in {obj}"
    ranks = make_loaders(remote_dataset, 2, batch_size=GLOBAL_BATCH // 2)
    assert [ckpt.load(r) for r in ranks] == [{"step": 4}] * 2
    assert list(global_batches(ranks)) == reference[4:]
    pinned = ckpt.dataset(storage_options=store.storage_options)  # from the stored manifest
    assert pinned.fingerprint == remote_dataset.fingerprint
    ckpt.close()


def test_a_step_folder_without_commit_is_ignored(
    remote: Remote, remote_dataset: ll.LakeDataset
) -> None:
    store, path = remote.store, f"{remote.bucket}/ckpt-uncommitted"
    loader = ll.DataLoader(remote_dataset, batch_size=GLOBAL_BATCH)
    it = iter(loader)
    ckpt = ll.CheckpointManager(store.url(path), storage_options=store.storage_options)
    for step in (1, 2):
        next(it)
        ckpt.save(step, loader, extra=step)
    loader.close()
    # A save that died after its state and before its COMMIT marker, written past the store's
    # back (a good state, so only the missing marker can make it invisible).
    fs = store.filesystem()
    half = f"{path}/{step_dir_name(7)}/{STATE_FILE}"
    fs.pipe(half, fs.cat_file(f"{path}/{step_dir_name(2)}/{STATE_FILE}"))
    fs.invalidate_cache()
    ckpt = ll.CheckpointManager(store.url(path), storage_options=store.storage_options)
    assert ckpt.steps() == [1, 2] and ckpt.latest() == 2
    fresh = ll.DataLoader(remote_dataset, batch_size=GLOBAL_BATCH)
    assert ckpt.load(fresh) == 2
    assert fresh.state_dict()["position"] == 2 * GLOBAL_BATCH
    with pytest.raises(ll.CheckpointError, match=step_dir_name(7)):
        ckpt.load(fresh, step=7)
    ckpt.save(3, fresh)  # a later save removes the half-written folder
    fs.invalidate_cache()
    assert not fs.exists(half)
    assert ckpt.steps() == [1, 2, 3]
    ckpt.close()


# ---------------------------------------------------------------------- versions
def test_s3_version_token_is_the_etag(s3_lake: Remote) -> None:
    first = s3_lake.open().snapshot.files[0]
    info = s3_lake.store.filesystem().info(first.path)
    assert first.version.startswith("ETag:")
    assert first.version == f"ETag:{info['ETag']}"


def test_gcs_version_token_is_the_generation(gcs_lake: Remote) -> None:
    first = gcs_lake.open().snapshot.files[0]
    info = gcs_lake.store.filesystem().info(first.path)
    assert first.version == f"generation:{info['generation']}"


def _fixed_size_parquet(first_id: int) -> bytes:
    """100 int64 ids, uncompressed and plainly encoded: the same size whatever the ids."""
    ids = pa.array(range(first_id, first_id + 100), pa.int64())
    buf = io.BytesIO()
    pq.write_table(
        pa.table({"id": ids}),
        buf,
        compression="none",
        use_dictionary=False,
        write_statistics=False,
    )
    return buf.getvalue()


@pytest.mark.parametrize("writer", ["same-client", "other-client"])
def test_rewriting_an_object_changes_the_fingerprint(remote: Remote, writer: str) -> None:
    store, path = remote.store, f"{remote.bucket}/rewrite-{writer}"
    url, obj = store.url(path), f"{path}/a.parquet"
    store.filesystem().pipe(obj, _fixed_size_parquet(0))
    before = remote.open(url, seed=0)
    # The library's own (cached) client, or another process's client with caches of its own.
    rewriter = store.filesystem(fresh=writer == "other-client")
    rewriter.pipe(obj, _fixed_size_parquet(1000))
    after = remote.open(url, seed=0)
    was, now = before.snapshot.files[0], after.snapshot.files[0]
    assert (now.size, now.row_group_rows) == (was.size, was.row_group_rows)
    assert now.version != was.version
    assert after.fingerprint != before.fingerprint


@pytest.mark.parametrize("store_name", ["s3_store", "gcs_store"])
def test_a_rewrite_by_another_client_is_caught_at_recovery(
    store_name: str, request: pytest.FixtureRequest
) -> None:
    store = request.getfixturevalue(store_name)
    bucket, options = store.new_bucket(), store.storage_options
    store.filesystem().pipe(f"{bucket}/lake/a.parquet", _fixed_size_parquet(0))
    ds = ll.LakeDataset(store.url(f"{bucket}/lake/"), storage_options=options, num_partitions=1)
    loader = ll.DataLoader(ds, batch_size=10)
    next(iter(loader))
    ckpt = ll.CheckpointManager(store.url(f"{bucket}/ckpt"), storage_options=options)
    ckpt.save(1, loader)
    loader.close()
    # Same size and row counts, new content, written by a client this process never used.
    store.filesystem(fresh=True).pipe(f"{bucket}/lake/a.parquet", _fixed_size_parquet(1000))
    with pytest.raises(ll.LakeChangedError, match=r"changed: .*a\.parquet"):
        ckpt.dataset(storage_options=options)

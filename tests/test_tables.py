"""Delta Lake and Iceberg tables as lakes: written by ``deltalake`` and ``pyiceberg`` themselves.

Each table's rows carry a unique ``id``; the tests check which ids a table version delivers
(deletes applied, nothing else), that a version is pinned across a resume after the table has
moved on, that the order does not depend on the topology, and that renamed and added columns
follow the version's schema. Locally and on SeaweedFS S3.
"""

from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
from pyiceberg.typedef import Record
from pyiceberg.types import DoubleType

import lakeloader as ll
from lakeloader.cli.main import main as cli_main
from lakeloader.lake.tables.options import delta_options, iceberg_properties
from tests.conftest import checkpointed, global_batches, make_loaders, roundtrip, run_epoch

if TYPE_CHECKING:
    from tests.stores import ObjectStore

pytest_plugins = ["tests.stores"]

ORDER: dict[str, Any] = {"seed": 3, "num_partitions": 4, "window": 32, "max_unit_rows": 40}


def _rows(start: int, stop: int) -> pa.Table:
    ids = np.arange(start, stop, dtype=np.int64)
    return pa.table({"id": ids, "p": ids % 3, "x": ids * 0.5})


def _ids(ds: ll.LakeDataset, **kwargs: Any) -> list[int]:
    loader = ll.DataLoader(ds, batch_size=16, **kwargs)
    try:
        return [i for b in loader for i in b["id"].tolist()]
    finally:
        loader.close()


def _delta(uri: str, options: dict[str, str] | None = None) -> None:
    """Version 0: ids 0-299 in 3 partitions; 1: ids 300-449 with a new column; 2: ids < 20 gone."""
    write_deltalake(uri, _rows(0, 300), partition_by=["p"], storage_options=options)
    more = _rows(300, 450).append_column("tag", pa.array([f"t{i}" for i in range(300, 450)]))
    write_deltalake(uri, more, mode="append", schema_mode="merge", storage_options=options)
    DeltaTable(uri, storage_options=options).delete("id < 20")


@pytest.fixture(scope="module")
def delta_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    uri = str(tmp_path_factory.mktemp("delta") / "table")
    _delta(uri)
    return uri


# --------------------------------------------------------------------------------- Delta
def test_a_delta_version_delivers_its_rows_with_partitions_and_new_columns(delta_uri: str) -> None:
    ds = ll.LakeDataset.from_delta(delta_uri, columns=["id", "p", "tag"], **ORDER)
    assert ds.snapshot.table is not None and ds.snapshot.table.version == 2
    assert ds.snapshot.table.table_id == DeltaTable(delta_uri).metadata().id
    rows: list[tuple[int, int, str | None]] = []
    for batch in ll.DataLoader(ds, batch_size=32):
        rows += zip(batch["id"].tolist(), batch["p"].tolist(), batch["tag"], strict=True)
    assert sorted(r[0] for r in rows) == list(range(20, 450)), "the delete is applied"
    assert all(p == i % 3 for i, p, _ in rows), "partition values from the table's log"
    assert all((t is None) == (i < 300) for i, _, t in rows), "the added column: nulls before"
    old = ll.LakeDataset.from_delta(delta_uri, version=0, **ORDER)
    assert sorted(_ids(old)) == list(range(300))
    assert old.fingerprint != ds.fingerprint
    assert "tag" not in old.snapshot.schema.names


@pytest.mark.parametrize("workers", [0, 2])
def test_a_delta_table_is_topology_independent(delta_uri: str, workers: int) -> None:
    ds = ll.LakeDataset.from_delta(delta_uri, columns=["id"], **ORDER)
    one = run_epoch(ds, 1, batch_size=24)
    for world in (2, 3):
        other = run_epoch(ds, world, batch_size=24 // world, num_workers=workers)
        assert other == one
    assert sorted(i for b in one for i in b) == list(range(20, 450))


def test_a_delta_resume_finishes_the_epoch_on_the_pinned_version(
    tmp_path: Path, delta_uri: str
) -> None:
    uri = str(tmp_path / "table")
    write_deltalake(uri, _rows(0, 400), partition_by=["p"])
    loaders = make_loaders(ll.LakeDataset.from_delta(uri, **ORDER), 2, batch_size=10)
    seen = [i for b in itertools.islice(global_batches(loaders), 7) for i in b]
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(7, loaders[0])
    for loader in loaders:
        loader.close()
    # The table moves on: rows appended, and a delete that rewrites files the epoch still needs.
    write_deltalake(uri, _rows(400, 500), mode="append")
    DeltaTable(uri).delete("id >= 350 AND id < 400")
    live = ll.LakeDataset.from_delta(uri, **ORDER)
    assert live.snapshot.table is not None and live.snapshot.table.version == 2
    resumed = ll.DataLoader(live, batch_size=9)
    manager.load(resumed)
    rest = [i for b in resumed for i in b["id"].tolist()]
    following = [i for b in resumed for i in b["id"].tolist()]
    resumed.close()
    assert sorted(seen + rest) == list(range(400)), "the pinned version, exactly once"
    assert sorted(following) == list(range(350)) + list(range(400, 500)), "then the new one"


def test_a_missing_delta_table_or_version_is_named(tmp_path: Path, delta_uri: str) -> None:
    with pytest.raises(ll.LakeNotFoundError, match="no Delta table there"):
        ll.LakeDataset.from_delta(str(tmp_path / "nothing"))
    with pytest.raises(ll.LakeNotFoundError, match=r"version 9 .*go up to 2"):
        ll.LakeDataset.from_delta(delta_uri, version=9)


def test_a_delta_file_whose_footer_is_damaged_is_named_or_left_out_with_on_error_skip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = str(tmp_path / "table")
    write_deltalake(uri, _rows(0, 100))
    write_deltalake(uri, _rows(100, 160), mode="append")
    damaged = sorted(Path(uri).glob("*.parquet"), key=os.path.getmtime)[-1]
    damaged.write_bytes(b"not parquet" * 10)
    with pytest.raises(ll.LakeDataError, match=damaged.name):
        ll.LakeDataset.from_delta(uri)
    with caplog.at_level("WARNING", logger="lakeloader"):
        ds = ll.LakeDataset.from_delta(uri, on_error="skip")
    assert "left out of the snapshot" in caplog.text and damaged.name in caplog.text
    assert sorted(_ids(ds)) == list(range(100)), "the readable version-0 file's rows, once each"


def test_lakeloader_plan_reads_a_delta_table(
    delta_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["plan", delta_uri, "--table-version", "1", "--columns", "id"]) == 0
    out = capsys.readouterr().out
    assert "delta table" in out and "at version 1" in out
    assert "450" in out


# ------------------------------------------------------------------------------- Iceberg
def _catalog(root: Path, warehouse: str, **properties: str) -> SqlCatalog:
    catalog = SqlCatalog(
        "default", uri=f"sqlite:///{root}/catalog.db", warehouse=warehouse, **properties
    )
    catalog.create_namespace("ns")
    return catalog


def _position_deletes(table: Any, data_path: str, positions: list[int], folder: str) -> None:
    """Commit a position delete file for ``data_path`` (pyiceberg does not write them itself)."""
    schema = pa.schema(
        [
            pa.field("file_path", pa.string(), False, {"PARQUET:field_id": "2147483546"}),
            pa.field("pos", pa.int64(), False, {"PARQUET:field_id": "2147483545"}),
        ]
    )
    local = f"{folder}/pos-del-{uuid.uuid4()}.parquet"
    rows = pa.table({"file_path": [data_path] * len(positions), "pos": positions}, schema=schema)
    pq.write_table(rows, local)
    delete = DataFile.from_args(
        content=DataFileContent.POSITION_DELETES,
        file_path=f"file://{local}",
        file_format=FileFormat.PARQUET,
        partition=Record(),
        record_count=len(positions),
        file_size_in_bytes=os.path.getsize(local),
    )
    delete.spec_id = 0
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        append.append_data_file(delete)


@pytest.fixture(scope="module")
def iceberg(tmp_path_factory: pytest.TempPathFactory) -> tuple[SqlCatalog, int, Path]:
    root = tmp_path_factory.mktemp("iceberg")
    catalog = _catalog(root, f"file://{root}/wh")
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("s", pa.string())])
    table = catalog.create_table("ns.t", schema=schema)
    table.append(pa.table({"id": np.arange(200), "s": [f"s{i}" for i in range(200)]}, schema))
    first = table.current_snapshot().snapshot_id
    with table.update_schema() as update:
        update.add_column("x", DoubleType())
        update.rename_column("s", "name")
    table = catalog.load_table("ns.t")
    table.append(pa.table({"id": np.arange(200, 260), "name": ["n"] * 60, "x": [1.0] * 60}))
    data = next(t.file.file_path for t in table.scan(snapshot_id=first).plan_files())
    _position_deletes(table, data, [0, 5, 199], f"{root}/wh")
    return catalog, first, root


def test_an_iceberg_snapshot_applies_position_deletes_and_renames(
    iceberg: tuple[SqlCatalog, int, Path],
) -> None:
    catalog, first, _ = iceberg
    table = catalog.load_table("ns.t")
    ds = ll.LakeDataset.from_iceberg(table, columns=["id", "name"], **ORDER)
    assert ds.snapshot.table is not None
    assert ds.snapshot.table.version == table.current_snapshot().snapshot_id
    rows = {
        i: n
        for b in ll.DataLoader(ds, batch_size=32)
        for i, n in zip(b["id"].tolist(), b["name"], strict=True)
    }
    assert sorted(rows) == sorted(set(range(260)) - {0, 5, 199}), "position deletes applied"
    assert rows[7] == "s7" and rows[250] == "n", "the renamed column keeps its old data"
    old = ll.LakeDataset.from_iceberg(table.metadata_location, snapshot_id=first, **ORDER)
    assert old.snapshot.schema.names == ["id", "s"] and sorted(_ids(old)) == list(range(200))


def test_an_iceberg_snapshot_is_topology_independent_and_resumes(
    iceberg: tuple[SqlCatalog, int, Path],
) -> None:
    ds = ll.LakeDataset.from_iceberg(iceberg[0].load_table("ns.t"), columns=["id"], **ORDER)
    one = run_epoch(ds, 1, batch_size=12)
    assert run_epoch(ds, 3, batch_size=4, num_workers=2) == one
    loaders = make_loaders(ds, 2, batch_size=6)
    seen = [i for b in itertools.islice(global_batches(loaders), 9) for i in b]
    state = roundtrip(loaders[0].state_dict())
    for loader in loaders:
        loader.close()
    loaders = make_loaders(ds, 4, batch_size=5)
    for loader in loaders:
        loader.load_state_dict(state)
    rest = [i for b in global_batches(loaders) for i in b]
    for loader in loaders:
        loader.close()
    assert sorted(seen + rest) == sorted(set(range(260)) - {0, 5, 199})


def test_iceberg_equality_deletes_are_refused_naming_the_table(tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, f"file://{tmp_path}/wh")
    schema = pa.schema([pa.field("id", pa.int64())])
    table = catalog.create_table("ns.eq", schema=schema)
    table.append(pa.table({"id": np.arange(10)}, schema))
    local = f"{tmp_path}/eq-del.parquet"
    pq.write_table(pa.table({"id": pa.array([3], pa.int64())}), local)
    delete = DataFile.from_args(
        content=DataFileContent.EQUALITY_DELETES,
        file_path=f"file://{local}",
        file_format=FileFormat.PARQUET,
        partition=Record(),
        record_count=1,
        file_size_in_bytes=os.path.getsize(local),
        equality_ids=[1],
    )
    delete.spec_id = 0
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        append.append_data_file(delete)
    table = catalog.load_table("ns.eq")
    with pytest.raises(
        ll.LakeDataError, match=r"metadata\.json, snapshot \d+: has equality delete"
    ):
        ll.LakeDataset.from_iceberg(table)


# ------------------------------------------------------------------------------------ S3
def test_a_delta_table_on_s3_reads_and_resumes_like_a_local_one(
    s3_store: ObjectStore, delta_uri: str
) -> None:
    bucket = s3_store.new_bucket("delta")
    uri = s3_store.url(f"{bucket}/table")
    _delta(uri, delta_options(s3_store.storage_options))
    ds = ll.LakeDataset.from_delta(
        uri, storage_options=s3_store.storage_options, columns=["id"], **ORDER
    )
    local = ll.LakeDataset.from_delta(delta_uri, columns=["id"], **ORDER)
    assert len(ds) == len(local) == 430
    spelled = ll.LakeDataset.from_delta(  # deltalake's own spelling of the options serves too
        uri, storage_options=delta_options(s3_store.storage_options), columns=["id"], **ORDER
    )
    assert spelled.fingerprint == ds.fingerprint
    assert sorted(_ids(spelled)) == list(range(20, 450))
    loaders = make_loaders(ds, 2, batch_size=8)
    seen = [i for b in itertools.islice(global_batches(loaders), 5) for i in b]
    state = roundtrip(loaders[0].state_dict())
    for loader in loaders:
        loader.close()
    again = ll.LakeDataset.from_delta(
        uri, storage_options=s3_store.storage_options, columns=["id"], **ORDER
    )
    loaders = make_loaders(again, 3, batch_size=4, num_workers=1)
    for loader in loaders:
        loader.load_state_dict(state)
    rest = [i for b in global_batches(loaders) for i in b]
    for loader in loaders:
        loader.close()
    assert sorted(seen + rest) == list(range(20, 450))


def test_an_iceberg_table_on_s3_reads_like_a_local_one(
    s3_store: ObjectStore, tmp_path: Path
) -> None:
    bucket = s3_store.new_bucket("iceberg")
    properties = iceberg_properties(s3_store.storage_options)
    catalog = _catalog(tmp_path, f"s3://{bucket}/wh", **properties)
    schema = pa.schema([pa.field("id", pa.int64())])
    table = catalog.create_table("ns.t", schema=schema)
    table.append(pa.table({"id": np.arange(100)}, schema))
    table.append(pa.table({"id": np.arange(100, 180)}, schema))
    ds = ll.LakeDataset.from_iceberg(catalog.load_table("ns.t"), **ORDER)
    assert ds.snapshot.files[0].version.startswith("ETag:"), "reads pinned to the object version"
    assert sorted(_ids(ds)) == list(range(180))
    by_location = ll.LakeDataset.from_iceberg(
        table.metadata_location, storage_options=s3_store.storage_options, **ORDER
    )
    assert by_location.fingerprint == ds.fingerprint


def test_a_manifest_keeps_deleted_rows_renames_and_the_table_version(
    iceberg: tuple[SqlCatalog, int, Path],
) -> None:
    from lakeloader.lake.manifest import from_manifest, pack_manifest, unpack_manifest

    ds = ll.LakeDataset.from_iceberg(iceberg[0].load_table("ns.t"))
    back = from_manifest(unpack_manifest(pack_manifest(ds.snapshot, ds.source.describe())))
    assert back == ds.snapshot
    assert any(f.deleted for f in back.files) and any(f.renames for f in back.files)
    assert back.table == ds.snapshot.table


def test_filters_on_tables_apply_after_deletes_and_renames(
    iceberg: tuple[SqlCatalog, int, Path], delta_uri: str
) -> None:
    import pyarrow.compute as pc

    wanted = (pc.field("id") < 100) & (pc.field("name") != "s7")
    ds = ll.LakeDataset.from_iceberg(iceberg[0].load_table("ns.t"), filter=wanted, **ORDER)
    assert sorted(_ids(ds)) == sorted(set(range(100)) - {0, 5, 7})
    on_partition = (pc.field("p") == 1) & (pc.field("id") > 100)
    delta = ll.LakeDataset.from_delta(delta_uri, columns=["id"], filter=on_partition, **ORDER)
    assert sorted(_ids(delta)) == [i for i in range(101, 450) if i % 3 == 1]


def test_a_delta_resume_on_s3_after_the_table_moved_on(
    s3_store: ObjectStore, tmp_path: Path
) -> None:
    bucket = s3_store.new_bucket("moved")
    uri, options = s3_store.url(f"{bucket}/table"), s3_store.storage_options
    delta = delta_options(options)
    write_deltalake(uri, _rows(0, 300), partition_by=["p"], storage_options=delta)
    ds = ll.LakeDataset.from_delta(uri, storage_options=options, **ORDER)
    seen = checkpointed(ds, 2, 10, 6, tmp_path / "ckpt")
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    write_deltalake(uri, _rows(300, 350), mode="append", storage_options=delta)
    DeltaTable(uri, storage_options=delta).delete("id >= 250")
    resumed = ll.DataLoader(
        ll.LakeDataset.from_delta(uri, storage_options=options, **ORDER), batch_size=7
    )
    manager.load(resumed)
    rest = _ids_of(resumed)
    following = _ids_of(resumed)
    resumed.close()
    assert sorted(seen + rest) == list(range(300)), "version 0 on S3, exactly once"
    assert sorted(following) == list(range(250)), "then the newest version"


def _ids_of(loader: ll.DataLoader) -> list[int]:
    return [i for b in loader for i in b["id"].tolist()]


def test_an_iceberg_resume_finishes_on_the_pinned_snapshot_of_a_partitioned_table(
    tmp_path: Path,
) -> None:
    catalog = _catalog(tmp_path, f"file://{tmp_path}/wh")
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("p", pa.int64())])
    table = catalog.create_table("ns.parts", schema=schema)
    with table.update_spec() as spec:
        spec.add_identity("p")
    table = catalog.load_table("ns.parts")
    ids = np.arange(300, dtype=np.int64)
    table.append(pa.table({"id": ids, "p": ids % 3}, schema))
    ds = ll.LakeDataset.from_iceberg(table, **ORDER)
    assert len(ds.snapshot.files) == 3, "one file per partition"
    seen = checkpointed(ds, 2, 10, 6, tmp_path / "ckpt")
    table = catalog.load_table("ns.parts")
    table.delete(delete_filter="id < 100")  # rewrites files the epoch still needs
    table = catalog.load_table("ns.parts")
    more = np.arange(300, 330, dtype=np.int64)
    table.append(pa.table({"id": more, "p": more % 3}, schema))
    live = ll.LakeDataset.from_iceberg(catalog.load_table("ns.parts"), **ORDER)
    resumed = ll.DataLoader(live, batch_size=7)
    ll.CheckpointManager(str(tmp_path / "ckpt")).load(resumed)
    rest = [i for b in resumed for i in b["id"].tolist()]
    rows = [(i, p) for b in resumed for i, p in zip(b["id"].tolist(), b["p"].tolist(), strict=True)]
    resumed.close()
    assert sorted(seen + rest) == list(range(300)), "the pinned snapshot, exactly once"
    assert sorted(i for i, _ in rows) == list(range(100, 330)), "then the newest snapshot"
    assert all(p == i % 3 for i, p in rows)


def test_a_table_checkpoint_rebuilds_its_dataset_on_the_table(tmp_path: Path) -> None:
    uri = str(tmp_path / "table")
    write_deltalake(uri, _rows(0, 200), partition_by=["p"])
    seen = checkpointed(ll.LakeDataset.from_delta(uri, **ORDER), 1, 10, 4, tmp_path / "ckpt")
    DeltaTable(uri).delete("id >= 150")
    DeltaTable(uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    ds = manager.dataset(on_lake_change="skip")
    assert ds.snapshot.table is not None and ds.snapshot.table.version == 0
    later = ds.for_epoch(1)
    assert later.snapshot.table is not None
    assert later.snapshot.table.version == DeltaTable(uri).version(), "the newest version"
    assert len(later) == 150, "the newest version, not the folder's files"
    loader = ll.DataLoader(ds, batch_size=10)
    manager.load(loader, on_lake_change="skip")
    rest = _ids_of(loader)
    loader.close()
    assert len(set(seen + rest)) == len(seen + rest), "nothing twice"

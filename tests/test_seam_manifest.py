"""The manifest a checkpoint pins: a real snapshot survives the round trip, damage is refused.

The snapshot is taken of a real lake on disk (hive folders, an empty row group, a zero-byte
file, two file schemas), so every field of every file goes through ``to_manifest``,
msgpack and ``from_manifest``.
"""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lakeloader.errors import StateFormatError
from lakeloader.lake.manifest import (
    MANIFEST_KIND,
    MANIFEST_VERSION,
    from_manifest,
    pack_manifest,
    to_manifest,
    unpack_manifest,
)
from lakeloader.lake.snapshot import Snapshot, snapshot_lake
from tests.conftest import write_lake

SOURCE = "s3://bucket/lake/"  # a source keeps its protocol; the files' paths do not


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    root = tmp_path_factory.mktemp("manifest-lake")
    write_lake(root, [[30, 0, 20], [15], [40, 10]], hive=True)
    # A second file schema (a column more), and a zero-byte file (no schema at all).
    pq.write_table(
        pa.table({"id": pa.array([1], pa.int64()), "extra": [0.5]}), root / "part=1" / "z.parquet"
    )
    (root / "part=2" / "empty.parquet").write_bytes(b"")
    _, snap = snapshot_lake(root)
    return snap


def test_round_trip_through_msgpack_gives_back_the_same_snapshot(snapshot: Snapshot) -> None:
    assert any(f.schema is None for f in snapshot.files), "the lake has a zero-byte file"
    assert any(0 in f.row_group_rows for f in snapshot.files), "and an empty row group"
    manifest = unpack_manifest(pack_manifest(snapshot, SOURCE))
    assert manifest["source"] == SOURCE
    assert (manifest["kind"], manifest["version"]) == (MANIFEST_KIND, MANIFEST_VERSION)
    back = from_manifest(manifest)
    assert back == snapshot
    assert back.files == snapshot.files  # paths, sizes, versions, row groups, hive values
    assert back.schema == snapshot.schema
    assert back.partition_types == snapshot.partition_types


def test_each_distinct_schema_is_stored_once(snapshot: Snapshot) -> None:
    manifest = to_manifest(snapshot, [SOURCE])
    distinct = {f.schema.serialize().to_pybytes() for f in snapshot.files if f.schema}
    assert len(distinct) == 2
    assert sorted(manifest["schemas"]) == sorted(distinct)
    refs = [entry[-1] for entry in manifest["files"]]
    assert sorted(set(refs)) == [-1, 0, 1]  # the zero-byte file refers to no schema


def test_selected_columns_narrow_the_rebuilt_schema(snapshot: Snapshot) -> None:
    back = from_manifest(to_manifest(snapshot, SOURCE), columns=["id", "part"])
    assert back.schema.names == ["id", "part"]
    assert back.fingerprint == snapshot.fingerprint  # the files are the same files


def _corrupt(manifest: dict[str, Any], field: str) -> None:
    """Change one field of the first file with rows, as a damaged checkpoint would."""
    entry = next(e for e in manifest["files"] if sum(e[3]))
    if field == "path":
        entry[0] += ".moved"
    elif field == "size":
        entry[1] += 1
    elif field == "version":
        entry[2] = "another-etag"
    elif field == "row_group_rows":
        entry[3][0] += 1
    elif field == "partitions":
        entry[5] = [["part", "9"]]
    elif field == "schema":
        entry[6] = 1 - entry[6]
    else:
        raise AssertionError(field)


@pytest.mark.parametrize(
    "field", ["path", "size", "version", "row_group_rows", "partitions", "schema"]
)
def test_the_fingerprint_is_recomputed_and_a_changed_file_is_refused(
    snapshot: Snapshot, field: str
) -> None:
    manifest = to_manifest(snapshot, SOURCE)
    _corrupt(manifest, field)
    with pytest.raises(StateFormatError, match="manifest is corrupt") as info:
        from_manifest(manifest)
    assert snapshot.fingerprint in str(info.value)  # the fingerprint it claims


def test_row_group_bytes_are_not_part_of_the_identity(snapshot: Snapshot) -> None:
    """Uncompressed sizes only feed memory estimates: a change there is taken as it is."""
    manifest = to_manifest(snapshot, SOURCE)
    entry = next(e for e in manifest["files"] if e[4])
    entry[4][0] += 1
    assert from_manifest(manifest).fingerprint == snapshot.fingerprint


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1, 2, 3], "not a lakeloader manifest"),
        ({"files": []}, "not a lakeloader manifest"),
        ({"kind": "lakeloader.state", "version": 1}, "not a lakeloader manifest"),
        ({"kind": MANIFEST_KIND}, "manifest version None is not supported"),
        ({"kind": MANIFEST_KIND, "version": 3}, "manifest version 3 is not supported"),
        ({"kind": MANIFEST_KIND, "version": "1"}, "manifest version '1' is not supported"),
    ],
)
def test_foreign_and_future_manifests_are_refused(value: Any, message: str) -> None:
    with pytest.raises(StateFormatError, match=message):
        from_manifest(value)


def _without_files(manifest: dict[str, Any]) -> None:
    del manifest["files"]


def _short_entry(manifest: dict[str, Any]) -> None:
    manifest["files"][0] = manifest["files"][0][:-1]


def _bad_schema(manifest: dict[str, Any]) -> None:
    manifest["schemas"][0] = b"not an arrow schema"


def _dangling_schema(manifest: dict[str, Any]) -> None:
    manifest["files"][0][-1] = 7


def _text_size(manifest: dict[str, Any]) -> None:
    manifest["files"][0][1] = "large"


@pytest.mark.parametrize(
    ("damage", "cause"),
    [
        (_without_files, "KeyError('files')"),
        (_short_entry, "ValueError"),
        (_bad_schema, "ArrowInvalid"),
        (_dangling_schema, "IndexError"),
        (_text_size, "ValueError"),
    ],
)
def test_a_malformed_manifest_is_refused_naming_the_problem(
    snapshot: Snapshot, damage: Any, cause: str
) -> None:
    manifest = copy.deepcopy(to_manifest(snapshot, SOURCE))
    damage(manifest)
    with pytest.raises(StateFormatError, match="malformed lakeloader manifest") as info:
        from_manifest(manifest)
    assert cause in str(info.value)


def test_a_manifest_without_its_fingerprint_is_refused(snapshot: Snapshot) -> None:
    manifest = to_manifest(snapshot, SOURCE)
    del manifest["fingerprint"]
    with pytest.raises(StateFormatError, match="not to its fingerprint None"):
        from_manifest(manifest)


@pytest.mark.parametrize("data", [b"\xc1", b"\x92\x01", b"\x01\x02", b""])
def test_bytes_that_are_not_msgpack_are_refused(data: bytes) -> None:
    with pytest.raises(StateFormatError, match="manifest is not valid msgpack"):
        unpack_manifest(data)


def test_msgpack_that_is_not_a_manifest_is_refused_on_load() -> None:
    with pytest.raises(StateFormatError, match="not a lakeloader manifest"):
        from_manifest(unpack_manifest(msgpack.packb(["lakeloader.manifest", 1])))

"""The sources of ``LakeDataset.from_delta`` and ``from_iceberg``; what a lake URL names."""

from __future__ import annotations

import os
from typing import Any, Literal

from fsspec.core import url_to_fs

from lakeloader.lake.snapshot import TableVersion
from lakeloader.lake.tables.delta import DeltaSource
from lakeloader.lake.tables.iceberg import IcebergSource
from lakeloader.lake.tables.options import (
    delta_options,
    from_iceberg_properties,
    fsspec_options,
    iceberg_properties,
)

TableKind = Literal["folder", "delta", "iceberg"]


def delta_source(
    uri: str | os.PathLike[str], version: int | None, storage_options: dict[str, Any] | None
) -> tuple[DeltaSource, dict[str, Any]]:
    """A Delta table version's source, and the fsspec options that read its files.

    >>> delta_source("t", 3, {"key": "k"})[1]
    {'key': 'k'}
    """
    options = dict(storage_options or {})
    found = DeltaSource(os.fspath(uri), version, tuple(sorted(delta_options(options).items())))
    return found, fsspec_options(options)


def checkpoint_source(
    described: Any, table: TableVersion | None, storage_options: dict[str, Any] | None
) -> tuple[Any, dict[str, Any]]:
    """The source of a checkpoint's lake, and its fsspec options.

    A folder as the checkpoint describes it, or the table its snapshot is a version of
    (opened at its newest version).
    """
    if table is None:
        return described, dict(storage_options or {})
    if table.format == "delta":
        return delta_source(table.location, None, storage_options)
    return iceberg_source(table.location, None, storage_options)


def iceberg_source(
    table: Any, snapshot_id: int | None, storage_options: dict[str, Any] | None
) -> tuple[IcebergSource, dict[str, Any]]:
    """An Iceberg snapshot's source, and the fsspec options that read its files.

    A ``Table``'s own FileIO properties serve when no storage options are given.
    """
    options = dict(storage_options or {})
    properties = iceberg_properties(options)
    if isinstance(table, str | os.PathLike):
        location = os.fspath(table)
    else:
        location = str(table.metadata_location)
        properties = {**{k: str(v) for k, v in table.io.properties.items()}, **properties}
        if not fsspec_options(options):
            options = from_iceberg_properties(properties)
    found = IcebergSource(location, snapshot_id, tuple(sorted(properties.items())))
    return found, fsspec_options(options)


def table_kind(url: str, storage_options: dict[str, Any]) -> TableKind:
    """What ``url`` names (one metadata request at most).

    ``"iceberg"`` for a ``*.metadata.json`` file, ``"delta"`` for a folder with a
    ``_delta_log/``, else ``"folder"`` (also when the store cannot be asked: reading the URL
    as a folder then reports why).

    >>> table_kind("warehouse/t/metadata/00002-ab.metadata.json", {})
    'iceberg'
    """
    if url.endswith(".metadata.json"):
        return "iceberg"
    try:
        fs, path = url_to_fs(url, **storage_options)
        delta = fs.isdir(f"{path.rstrip('/')}/_delta_log")
    except Exception:  # unreachable or refused: reading it as a folder says what went wrong
        return "folder"
    return "delta" if delta else "folder"

"""What a lake URL names: a Delta table, an Iceberg metadata file, or a folder of files."""

from __future__ import annotations

from typing import Any, Literal

from fsspec.core import url_to_fs

TableKind = Literal["folder", "delta", "iceberg"]


def table_kind(url: str, storage_options: dict[str, Any]) -> TableKind:
    """What ``url`` names (one metadata request at most).

    ``"iceberg"`` for a ``*.metadata.json`` file, ``"delta"`` for a folder with a
    ``_delta_log/``, else ``"folder"``.

    >>> table_kind("warehouse/t/metadata/00002-ab.metadata.json", {})
    'iceberg'
    """
    if url.endswith(".metadata.json"):
        return "iceberg"
    fs, path = url_to_fs(url, **storage_options)
    return "delta" if fs.isdir(f"{path.rstrip('/')}/_delta_log") else "folder"

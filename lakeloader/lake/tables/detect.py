"""What a lake URL names: a Delta table, an Iceberg metadata file, or a folder of files."""

from __future__ import annotations

from typing import Any, Literal

from fsspec.core import url_to_fs

TableKind = Literal["folder", "delta", "iceberg"]


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

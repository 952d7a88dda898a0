"""Ranged reads pinned to the version of a file that the snapshot saw.

S3 sends ``IfMatch`` on the listed ETag (or ``VersionId``), GCS the ``generation``; other
filesystems read unpinned. A read of a version that is gone raises
:class:`~lakeloader.errors.LakeChangedError` naming the URL and the version pinned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import fsspec
from fsspec.asyn import sync

from lakeloader.errors import LakeChangedError
from lakeloader.io.direct import direct_for
from lakeloader.io.retry import causes, describe, response_of
from lakeloader.io.sparse import Blob
from lakeloader.lake.discovery import version_value


def _is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    return hasattr(fs, "_call_s3")


def pins(fs: fsspec.AbstractFileSystem, version: str) -> bool:
    """Whether reads of a file with this version token are pinned on this filesystem.

    >>> from fsspec.implementations.local import LocalFileSystem
    >>> pins(LocalFileSystem(), "mtime:1700000000.0")
    False
    """
    if _is_s3(fs):
        return any(version_value(version, key) is not None for key in ("ETag", "version_id"))
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    gcs = "gs" in protocol and hasattr(fs, "_cat_file")
    return gcs and version_value(version, "generation") is not None


async def _s3_range(fs: Any, path: str, version: str, start: int, end: int) -> bytes:
    bucket, key, _ = fs.split_path(path)
    condition: dict[str, str] = {}
    if (version_id := version_value(version, "version_id")) is not None:
        condition["VersionId"] = version_id
    elif (etag := version_value(version, "ETag")) is not None:
        condition["IfMatch"] = etag
    response = await fs._call_s3(
        "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **condition
    )
    try:
        data: bytes = await response["Body"].read()
    finally:
        response["Body"].close()
    return data


async def _gcs_range(fs: Any, path: str, version: str, start: int, end: int) -> bytes:
    generation = version_value(version, "generation")
    data: bytes = await fs._cat_file(path, start=start, end=end, generation=generation)
    return data


def cat_ranges(
    fs: fsspec.AbstractFileSystem, path: str, version: str, ranges: Sequence[tuple[int, int]]
) -> list[Blob]:
    """Read byte ranges ``[start, end)`` of a file at once, pinned to ``version`` if possible.

    Raises:
        LakeChangedError: If the store no longer has that version of the file.
        Exception: Whatever the client raised otherwise (classified by the caller's retry).
    """
    if not ranges:
        return []
    try:
        if (direct := direct_for(fs)) is not None:  # S3 past s3fs (see lakeloader.io.direct)
            return direct.read_all(path, version, ranges)
        if not pins(fs, version):
            starts, ends = [s for s, _ in ranges], [e for _, e in ranges]
            blobs: list[Blob] = fs.cat_ranges([path] * len(ranges), starts, ends, on_error="raise")
            return blobs
        one = _s3_range if _is_s3(fs) else _gcs_range

        async def gather() -> list[Blob]:
            return list(await asyncio.gather(*(one(fs, path, version, s, e) for s, e in ranges)))

        return sync(fs.loop, gather)  # type: ignore[no-any-return]
    except Exception as exc:
        if pins(fs, version) and is_version_mismatch(exc):
            raise LakeChangedError(
                f"{fs.unstrip_protocol(path)}: the file was rewritten or deleted after the "
                f"snapshot was taken (the snapshot pinned {version}; the store answered "
                f"{describe(exc)}). Rows read from it now would not be the rows this epoch's "
                "order was planned over. Restore the file as it was, or rebuild the dataset "
                "and resume from the last checkpoint with CheckpointManager.load(..., "
                "on_lake_change='skip') (the epoch finishes without the file's units) or "
                "'restart_epoch'"
            ) from exc
        raise


def is_version_mismatch(exc: BaseException) -> bool:
    """Whether a failed pinned read means the pinned version is gone (412, or a missing object).

    >>> is_version_mismatch(FileNotFoundError("gone")), is_version_mismatch(TimeoutError())
    (True, False)
    """
    for seen in causes(exc):
        if isinstance(seen, FileNotFoundError):
            return True
        status, s3_code = response_of(seen)
        if s3_code == "PreconditionFailed" or status == 412:  # a rewritten object, If-Match
            return True
    return False

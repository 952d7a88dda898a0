"""Reading a checkpoint back: every part checked against its ``COMMIT`` before it is used."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from lakeloader.checkpoint.folders import CheckpointFolders
from lakeloader.checkpoint.kind_record import (
    KindCheckpoint,
    KindRecord,
    record_kind,
    verify_manifests,
)
from lakeloader.checkpoint.layout import (
    COMMIT_FILE,
    STATE_FILE,
    Checkpoint,
    CommitRecord,
    StateRecord,
    sha256,
)
from lakeloader.checkpoint.whole import check_parts, read_training
from lakeloader.errors import CheckpointError, StateFormatError
from lakeloader.io.fetch import url_of
from lakeloader.lake.manifest import from_manifest, unpack_manifest

C = TypeVar("C")


def read_checkpoint(folders: CheckpointFolders, step: int) -> Checkpoint | KindCheckpoint:
    """Read and verify one checkpoint: its state, manifests and every part ``COMMIT`` lists.

    Raises:
        CheckpointError: If it is missing, incomplete, truncated or corrupt.
    """
    folder = folders.step_folder(step)
    store = folders.store
    try:
        marker = CommitRecord.from_bytes(store.cat(posixpath.join(folder, COMMIT_FILE)))
        payload = store.cat(posixpath.join(folder, STATE_FILE))
        if len(payload) != marker.state_bytes or sha256(payload) != marker.state_sha256:
            raise CheckpointError(
                f"{STATE_FILE} is {len(payload)} bytes with SHA-256 {sha256(payload)[:12]}"
                f"..., its COMMIT says {marker.state_bytes} bytes, "
                f"{marker.state_sha256[:12]}...: truncated or overwritten"
            )
        if record_kind(payload) is not None:
            kind = KindRecord.from_bytes(payload)
            verify_manifests(kind, lambda rel: store.cat(folders.path(rel)))
            check_parts(store, folder, marker.parts)
            return KindCheckpoint(
                step, folder, kind, len(payload), read_training(store, folder, marker.parts)
            )
        record = StateRecord.from_bytes(payload)
        manifest_bytes = store.cat(folders.path(marker.manifest))
        if sha256(manifest_bytes) != marker.manifest_sha256:
            raise CheckpointError(
                f"manifest {marker.manifest} does not match the SHA-256 its COMMIT "
                "records: torn or overwritten"
            )
        manifest = unpack_manifest(manifest_bytes)
        snapshot = from_manifest(manifest, record.loader.config.get("columns"))
        if snapshot.fingerprint != record.loader.fingerprint:
            raise CheckpointError(
                f"its state refers to snapshot {record.loader.fingerprint} but its manifest "
                f"{marker.manifest} describes {snapshot.fingerprint}"
            )
        check_parts(store, folder, marker.parts)
        training = read_training(store, folder, marker.parts)
    except FileNotFoundError as exc:
        where = url_of(store.fs, folder)
        raise CheckpointError(f"{where}: incomplete or missing ({exc})") from exc
    except (CheckpointError, StateFormatError) as exc:
        raise CheckpointError(f"{url_of(store.fs, folder)}: {exc}") from exc
    return Checkpoint(
        step,
        folder,
        record.loader,
        record.context,
        record.extra,
        snapshot,
        manifest,
        len(payload),
        training,
    )


def newest_usable(read: Callable[[int], C], steps: list[int], url: str) -> tuple[C, list[str]]:
    """The newest checkpoint of ``steps`` that reads, and one line per newer one passed over.

    Args:
        read: Reads and verifies one step's checkpoint (raises CheckpointError if unusable).
        steps: The committed steps, oldest first.
        url: The checkpoints' root, for the error.

    Raises:
        CheckpointError: Listing every checkpoint, if none is usable (or none is committed).
    """
    skipped: list[str] = []
    for step in reversed(steps):
        try:
            return read(step), skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
    if not steps:
        raise CheckpointError(f"no usable checkpoint under {url}: no committed checkpoint")
    raise CheckpointError(
        f"no usable checkpoint under {url}: all {len(steps)} committed checkpoints are "
        f"damaged ({'; '.join(skipped)}); restore one from a copy, or start afresh"
    )


def agreed_checkpoint(
    newest: Callable[[int | None], Checkpoint | KindCheckpoint],
    read: Callable[[int], Checkpoint | KindCheckpoint],
    step: int | None,
) -> Checkpoint | KindCheckpoint:
    """Rank 0's choice of checkpoint, read on every rank.

    Rank 0 alone walks the checkpoints (``newest``); its choice, or its error, goes to every
    rank, so that all of them load the same step or raise alike.

    Raises:
        CheckpointError: On every rank, if rank 0 found none.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return newest(step)
    chosen: list[Any] = [None]
    mine: Checkpoint | KindCheckpoint | None = None
    if dist.get_rank() == 0:
        try:
            mine = newest(step)
            chosen = [mine.step]
        except CheckpointError as exc:
            chosen = [str(exc)]
    dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], str):
        raise CheckpointError(f"rank 0 found no checkpoint to load: {chosen[0]}")
    return mine if mine is not None else read(int(chosen[0]))

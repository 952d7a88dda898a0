"""Reading a checkpoint back: every part checked against its ``COMMIT`` before it is used."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lakeloader.checkpoint.folders import CheckpointFolders
from lakeloader.checkpoint.layout import (
    COMMIT_FILE,
    ROOT,
    STATE_FILE,
    Checkpoint,
    CommitRecord,
    StateRecord,
    sha256,
)
from lakeloader.checkpoint.training import TRAINING_FILE, TrainingRecord
from lakeloader.checkpoint.whole import check_parts
from lakeloader.errors import CheckpointError, StateFormatError
from lakeloader.io.fetch import url_of
from lakeloader.lake.manifest import from_manifest, unpack_manifest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.state.formats import LAKE, read


def read_checkpoint(folders: CheckpointFolders, step: int) -> Checkpoint:
    """:meth:`CheckpointManager.read <lakeloader.CheckpointManager.read>`."""
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
        record = StateRecord.from_bytes(payload, (marker.manifest, marker.manifest_sha256))
        manifests = {
            leaf: _manifest(folders, leaf, rel, digest)
            for leaf, (rel, digest) in record.manifests.items()
        }
        lake = _lake(record, manifests)
        check_parts(store, folder, marker.parts)
        training = None  # a checkpoint written before there was a training record has none
        if TRAINING_FILE in marker.parts:
            training = TrainingRecord.from_bytes(store.cat(posixpath.join(folder, TRAINING_FILE)))
    except FileNotFoundError as exc:
        where = url_of(store.fs, folder)
        raise CheckpointError(f"{where}: incomplete or missing ({exc})") from exc
    except (CheckpointError, StateFormatError) as exc:
        raise CheckpointError(f"{url_of(store.fs, folder)}: {exc}") from exc
    return Checkpoint(
        step,
        folder,
        dict(record.state),
        record.context,
        record.extra,
        manifests,
        record.sources,
        len(payload),
        training,
        lake,
    )


def _manifest(folders: CheckpointFolders, leaf: str, rel: str, digest: str) -> dict[str, Any]:
    """A leaf's manifest, checked against the SHA-256 that the record holds.

    Raises:
        CheckpointError: If it is missing or its digest differs.
    """
    name = f"manifest {rel}" + (f" of {leaf!r}" if leaf else "")
    try:
        data = folders.store.cat(folders.path(rel))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{name} is missing") from exc
    if sha256(data) != digest:
        raise CheckpointError(
            f"{name} does not match the SHA-256 its checkpoint records: torn or overwritten"
        )
    return unpack_manifest(data)


def _lake(record: StateRecord, manifests: dict[str, dict[str, Any]]) -> Snapshot | None:
    """The snapshot of a loader over one lake, which its state must refer to (else None).

    Raises:
        CheckpointError: If the manifest's fingerprint is not the state's.
    """
    manifest = manifests.get(ROOT)
    if manifest is None:
        return None
    state = read(record.state, LAKE)
    snapshot = from_manifest(manifest, state.config.get("columns"))
    if snapshot.fingerprint != state.fingerprint:
        raise CheckpointError(
            f"its state refers to snapshot {state.fingerprint} but its manifest "
            f"{record.manifests[ROOT][0]} describes {snapshot.fingerprint}"
        )
    return snapshot


def newest_usable(
    read: Callable[[int], Checkpoint], steps: list[int], url: str
) -> tuple[Checkpoint, list[str]]:
    """The newest checkpoint of ``steps`` (committed, oldest first) that ``read`` reads.

    Returns it with one line per newer one passed over (``read`` raised CheckpointError).

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


def agreed_checkpoint(newest: Callable[[int | None], Checkpoint], step: int | None) -> Checkpoint:
    """Rank 0's choice of checkpoint (``newest(step)``), read on every rank (``newest(chosen)``).

    Raises:
        CheckpointError: On every rank, if rank 0 found none.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return newest(step)
    chosen: list[Any] = [None]
    mine: Checkpoint | None = None
    if dist.get_rank() == 0:
        try:
            mine = newest(step)
            chosen = [mine.step]
        except CheckpointError as exc:
            chosen = [str(exc)]
    dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], str):
        raise CheckpointError(f"rank 0 found no checkpoint to load: {chosen[0]}")
    return mine if mine is not None else newest(int(chosen[0]))

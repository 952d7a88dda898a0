"""The checkpoint root on its store: step folders, shared manifests, commits and pruning.

:class:`CheckpointFolders` is the one writer and reader of the layout
:mod:`lakeloader.checkpoint.layout` describes, through the retried
:class:`~lakeloader.checkpoint.store.CheckpointStore`; a checkpoint read back has every part
checked against its ``COMMIT`` before it is used.
"""

from __future__ import annotations

import logging
import posixpath
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from lakeloader.checkpoint.layout import (
    COMMIT_FILE,
    MANIFEST_DIR,
    ROOT,
    STATE_FILE,
    STEP_DIR_RE,
    Checkpoint,
    CommitRecord,
    StateRecord,
    sha256,
    step_dir_name,
)
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.checkpoint.training import TRAINING_FILE, TrainingRecord
from lakeloader.errors import CheckpointError, StateFormatError
from lakeloader.io.fetch import url_of
from lakeloader.lake.manifest import from_manifest, pack_manifest, unpack_manifest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.state.formats import LAKE, read

logger = logging.getLogger(__name__)


class CheckpointFolders:
    """Step folders and manifests under one root (``root``: a path of ``store``'s filesystem)."""

    def __init__(self, store: CheckpointStore, root: str, keep: int) -> None:
        self.store = store
        self.root = root
        self.keep = keep
        self._manifests: dict[str, str] = {}  # manifests known intact: path -> SHA-256

    def path(self, *parts: str) -> str:
        """A path under the root."""
        return posixpath.join(self.root, *parts)

    def step_folder(self, step: int) -> str:
        """The folder of a step's checkpoint."""
        return self.path(step_dir_name(step))

    def step_dirs(self) -> dict[int, str]:
        """Every step folder, committed or not."""
        try:
            entries = self.store.ls(self.root)
        except FileNotFoundError:
            return {}
        names = [entry.rstrip("/") for entry in entries]
        return {int(m.group(1)): name for name in names if (m := STEP_DIR_RE.search(name))}

    def committed(self, dirs: dict[int, str] | None = None) -> list[int]:
        """Steps with a ``COMMIT``, oldest first (of ``dirs``; None: every step folder)."""
        dirs = self.step_dirs() if dirs is None else dirs
        exists = self.store.exists
        return sorted(s for s, d in dirs.items() if exists(posixpath.join(d, COMMIT_FILE)))

    def manifest(self, snapshot: Snapshot, source: Any) -> tuple[str, str]:
        """Write the snapshot's manifest unless an intact one is there; (relative path, sha)."""
        rel = posixpath.join(MANIFEST_DIR, f"{snapshot.fingerprint}.msgpack")
        known = self._manifests.get(rel)
        if known is not None:
            return rel, known
        data = pack_manifest(snapshot, source)
        digest = sha256(data)
        path = self.path(rel)
        try:
            intact = sha256(self.store.cat(path)) == digest
        except FileNotFoundError:
            intact = False
        if not intact:  # absent, or torn by an earlier crash: (re)write it whole
            self.store.makedirs(self.path(MANIFEST_DIR))
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self.store.put(tmp, data)
            self.store.mv(tmp, path)
        self._manifests[rel] = digest
        return rel, digest

    def uncommit(self, folder: str) -> None:
        """Make a step folder's checkpoint invisible, then remove the folder."""
        commit = posixpath.join(folder, COMMIT_FILE)
        if self.store.exists(commit):
            self.store.rm(commit)
        if self.store.exists(folder):
            self.store.rm(folder, recursive=True)

    def commit(
        self,
        step: int,
        payload: bytes,
        manifest: tuple[str, str],
        parts: Mapping[str, tuple[int, str]],
    ) -> None:
        """Write a step's state, then its ``COMMIT`` listing every part; prune.

        The folder is there, emptied (:meth:`uncommit`) before any rank wrote into it.
        """
        folder = self.step_folder(step)
        self.store.put(posixpath.join(folder, STATE_FILE), payload)
        marker = CommitRecord(step, len(payload), sha256(payload), *manifest, parts=parts)
        self.store.put(posixpath.join(folder, COMMIT_FILE), marker.to_bytes())
        size = len(payload) + sum(n for n, _ in parts.values())
        logger.info("checkpoint of step %d written to %s (%d bytes)", step, folder, size)
        self.prune(step)

    def prune(self, current: int) -> None:
        """Keep the newest ``keep`` committed checkpoints; drop half-written folders."""
        dirs = self.step_dirs()
        committed = self.committed(dirs)
        doomed = committed[: -self.keep] + [s for s in dirs if s not in committed and s != current]
        for s in doomed:
            self.uncommit(dirs[s])

    def read(self, step: int) -> Checkpoint:
        """:meth:`CheckpointManager.read <lakeloader.CheckpointManager.read>`."""
        folder = self.step_folder(step)
        store = self.store
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
                leaf: self._read_manifest(leaf, rel, digest)
                for leaf, (rel, digest) in record.manifests.items()
            }
            lake = _lake(record, manifests)
            self._check_parts(folder, marker.parts)
            training = None  # a checkpoint written before there was a training record has none
            if TRAINING_FILE in marker.parts:
                training = TrainingRecord.from_bytes(
                    store.cat(posixpath.join(folder, TRAINING_FILE))
                )
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

    def _read_manifest(self, leaf: str, rel: str, digest: str) -> dict[str, Any]:
        """A leaf's manifest, checked against the SHA-256 that the record holds.

        Raises:
            CheckpointError: If it is missing or its digest differs.
        """
        name = f"manifest {rel}" + (f" of {leaf!r}" if leaf else "")
        try:
            data = self.store.cat(self.path(rel))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{name} is missing") from exc
        if sha256(data) != digest:
            raise CheckpointError(
                f"{name} does not match the SHA-256 its checkpoint records: torn or overwritten"
            )
        return unpack_manifest(data)

    def _check_parts(self, folder: str, parts: Mapping[str, tuple[int, str]]) -> None:
        """Check that every part ``COMMIT`` lists is there, whole (sizes; digests where given).

        Raises:
            CheckpointError: Naming the first part missing, torn or overwritten.
        """
        if not parts:
            return
        sizes = self.store.sizes(folder)
        for name, (size, digest) in sorted(parts.items()):
            path = posixpath.join(folder, name)
            found = sizes.get(path)
            if found is None:
                raise CheckpointError(f"{name} is missing (COMMIT lists it, {size} bytes)")
            if found != size:
                raise CheckpointError(f"{name} is {found} bytes, its COMMIT says {size}: torn")
            if digest and sha256(self.store.cat(path)) != digest:
                raise CheckpointError(f"{name} does not match the SHA-256 its COMMIT records")


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

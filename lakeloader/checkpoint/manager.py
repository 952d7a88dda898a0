"""The checkpoint manager: the loader's position, saved at a sync barrier to any fsspec URL.

The folder layout and the records of each file are :mod:`lakeloader.checkpoint.layout`. A
checkpoint is visible only once its ``COMMIT`` marker exists, which works the same on a local
disk and on object stores that cannot rename; a save killed half-way leaves a folder without a
marker, which ``load`` ignores and the next save removes. Loading hands the checkpoint to the
:class:`~lakeloader.recovery.coordinator.RecoveryCoordinator`, which maps it onto the lake and
topology of now.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import posixpath
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec
import torch.distributed as dist
from fsspec.core import url_to_fs

from lakeloader._version import __version__
from lakeloader.checkpoint.barrier import confirm_same_position
from lakeloader.checkpoint.kind_record import (
    KindCheckpoint,
    KindRecord,
    check_same_kind,
    kind_record,
    record_kind,
    verify_manifests,
)
from lakeloader.checkpoint.layout import (
    COMMIT_FILE,
    MANIFEST_DIR,
    STATE_FILE,
    STEP_DIR_RE,
    Checkpoint,
    CheckpointContext,
    CommitRecord,
    StateRecord,
    manifest_name,
    sha256,
    step_dir_name,
)
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.dataset import LakeDataset
from lakeloader.errors import CheckpointError, StateFormatError, StoreAccessError
from lakeloader.io.retry import RetryPolicy
from lakeloader.lake.manifest import from_manifest, pack_manifest, unpack_manifest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.loader import DataLoader
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.recovery.lake_changes import LakeChangePolicy
from lakeloader.signals import main_thread_only

logger = logging.getLogger(__name__)

#: Loader kinds whose checkpoints are a lake's state and manifest (a followed lake's too).
LAKE_KINDS = ("lake", "follow")


class CheckpointManager:
    """Save and load loader positions under one URL, with ``keep`` checkpoints retained.

    Args:
        url: Root folder, any fsspec URL (a local path, ``s3://``, ``gs://``, ...).
        keep: Complete checkpoints kept; older ones are deleted after each save.
        async_save: Write in a background thread; ``save`` returns once the state is
            captured. A second save waits for the first; errors surface on the next call or
            on :meth:`wait`.
        storage_options: fsspec options for the URL.
        retry: How transient storage failures of checkpoint reads and writes are retried
            (default: as data reads, up to 5 minutes per call); a refused request fails at
            once with :class:`~lakeloader.errors.StoreAccessError` naming the URL.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> from lakeloader import LakeDataset, DataLoader
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> pq.write_table(pa.table({"id": range(100)}), f"{root}/a.parquet")
        >>> loader = DataLoader(LakeDataset(root), batch_size=16)
        >>> batches = iter(loader); _ = next(batches); _ = next(batches)
        >>> runs = tempfile.TemporaryDirectory()
        >>> ckpt = CheckpointManager(runs.name)
        >>> ckpt.save(2, loader, extra={"lr": 0.1})
        >>> fresh = DataLoader(LakeDataset(root), batch_size=32)
        >>> ckpt.load(fresh), fresh.state_dict()["position"]
        ({'lr': 0.1}, 32)
        >>> tmp.cleanup(); runs.cleanup()
    """

    def __init__(
        self,
        url: str,
        *,
        keep: int = 3,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.url = url
        self.keep = keep
        self.async_save = async_save
        self.fs: fsspec.AbstractFileSystem
        self.fs, self.root = url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.store = CheckpointStore(self.fs, url, retry or RetryPolicy())
        self._writer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lakeloader-ckpt", initializer=main_thread_only
        )
        self._pending: Future[None] | None = None
        self._manifests: dict[str, str] = {}  # manifests known intact: path -> SHA-256
        self._closed = False

    # ------------------------------------------------------------------ listing
    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _step_dirs(self) -> dict[int, str]:
        try:
            entries = self.store.ls(self.root)
        except FileNotFoundError:
            return {}
        out = {}
        for entry in entries:
            match = STEP_DIR_RE.search(entry.rstrip("/"))
            if match:
                out[int(match.group(1))] = entry.rstrip("/")
        return out

    def steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, oldest first."""
        dirs = self._step_dirs()
        exists = self.store.exists
        return sorted(s for s, d in dirs.items() if exists(posixpath.join(d, COMMIT_FILE)))

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------- saving
    def save(self, step: int, loader: DataLoader, extra: Any = None) -> None:
        """Save the loader's position (collective when torch.distributed is initialised).

        Every rank calls it at the same step; ranks confirm that they hold the same position
        (and that the previous background save succeeded) and the save fails on every rank,
        naming the ranks, if they do not. Rank 0 writes; ``extra`` is taken from rank 0.

        Raises:
            CheckpointError: If ranks disagree, the write fails (sync), a previous background
                save failed, or the manager is closed.
        """
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.url!r}) is closed")
        previous = self._settle()
        if loader.dataset.loader_kind not in LAKE_KINDS:  # a Mixture's or a packed loader
            self._save_kind(step, loader, extra, previous)
            return
        ds = loader.dataset
        state = loader.tracker.state(ds.fingerprint, ds.config.to_dict(), len(ds))
        everyone = confirm_same_position(state, previous)
        if previous is not None:
            raise previous
        if everyone:
            loader.tracker.merge_quarantine(everyone)
            state = loader.tracker.state(ds.fingerprint, ds.config.to_dict(), len(ds))
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        payload = StateRecord(state, _context(loader, step), extra).to_bytes()
        manifest = (ds.snapshot, loader.dataset.source.describe())
        self._submit(step, functools.partial(self._write, step, payload, manifest))

    def _save_kind(
        self, step: int, loader: Any, extra: Any, previous: CheckpointError | None
    ) -> None:
        """Save a Mixture's or a packed loader: its state (every rank's), its manifests."""
        confirm_same_position(loader.barrier_position(), previous)
        if previous is not None:
            raise previous
        state = loader.checkpoint_state()  # a collective for a packed loader
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

        def write() -> None:
            record = kind_record(loader, state, step, extra, created, __version__, self._manifest)
            self._write_folder(step, record.to_bytes(), "", "")

        self._submit(step, write)

    def _submit(self, step: int, write: Callable[[], None]) -> None:
        """Write now, or in the background with ``async_save``."""
        if self.async_save:
            self._pending = self._writer.submit(write)
            return
        try:
            write()
        except StoreAccessError:
            raise  # names the URL and where credentials come from: nothing to add
        except Exception as exc:
            raise CheckpointError(f"saving step {step} to {self.url} failed: {exc!r}") from exc

    def _settle(self) -> CheckpointError | None:
        """Wait for a background save; return (not raise) its error, if any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.result()
        except Exception as exc:
            error = CheckpointError(f"background checkpoint save failed: {exc!r}")
            error.__cause__ = exc
            return error
        return None

    def wait(self) -> None:
        """Wait for a background save; raise its error if it failed.

        Raises:
            CheckpointError: If the background save failed.
        """
        error = self._settle()
        if error is not None:
            raise error

    def _manifest(self, snapshot: Snapshot, source: Any) -> tuple[str, str]:
        """Write the snapshot's manifest unless an intact one is there; (relative path, sha)."""
        rel = manifest_name(snapshot.fingerprint)
        known = self._manifests.get(rel)
        if known is not None:
            return rel, known
        data = pack_manifest(snapshot, source)
        digest = sha256(data)
        path = self._path(rel)
        try:
            intact = sha256(self.store.cat(path)) == digest
        except FileNotFoundError:
            intact = False
        if not intact:  # absent, or torn by an earlier crash: (re)write it whole
            self.store.makedirs(self._path(MANIFEST_DIR))
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self.store.put(tmp, data)
            self.store.mv(tmp, path)
        self._manifests[rel] = digest
        return rel, digest

    def _write(self, step: int, payload: bytes, manifest: tuple[Snapshot, Any]) -> None:
        self._write_folder(step, payload, *self._manifest(*manifest))

    def _write_folder(
        self, step: int, payload: bytes, manifest_rel: str, manifest_sha: str
    ) -> None:
        """Write a step's state, then its COMMIT (a mixture's names no manifest)."""
        folder = self._path(step_dir_name(step))
        commit = posixpath.join(folder, COMMIT_FILE)
        if self.store.exists(commit):
            self.store.rm(commit)  # invisible first, then overwrite
        self.store.makedirs(folder)
        self.store.put(posixpath.join(folder, STATE_FILE), payload)
        marker = CommitRecord(step, len(payload), sha256(payload), manifest_rel, manifest_sha)
        self.store.put(commit, marker.to_bytes())
        logger.info("checkpoint of step %d written to %s (%d bytes)", step, folder, len(payload))
        self._prune(step)

    def _prune(self, current: int) -> None:
        """Keep the newest ``keep`` committed checkpoints; drop half-written folders."""
        dirs = self._step_dirs()
        committed = sorted(
            s for s, d in dirs.items() if self.store.exists(posixpath.join(d, COMMIT_FILE))
        )
        doomed = committed[: -self.keep] + [s for s in dirs if s not in committed and s != current]
        for s in doomed:
            commit = posixpath.join(dirs[s], COMMIT_FILE)
            if self.store.exists(commit):
                self.store.rm(commit)  # invisible before it is incomplete
            self.store.rm(dirs[s], recursive=True)

    # ------------------------------------------------------------------ loading
    def read(self, step: int) -> Checkpoint | KindCheckpoint:
        """Read and verify one checkpoint.

        Raises:
            CheckpointError: If it is missing, incomplete, truncated or corrupt.
        """
        folder = self._path(step_dir_name(step))
        try:
            marker = CommitRecord.from_bytes(self.store.cat(posixpath.join(folder, COMMIT_FILE)))
            payload = self.store.cat(posixpath.join(folder, STATE_FILE))
            if len(payload) != marker.state_bytes or sha256(payload) != marker.state_sha256:
                raise CheckpointError(
                    f"{STATE_FILE} is {len(payload)} bytes with SHA-256 {sha256(payload)[:12]}"
                    f"..., its COMMIT says {marker.state_bytes} bytes, "
                    f"{marker.state_sha256[:12]}...: truncated or overwritten"
                )
            if record_kind(payload) is not None:
                kind = KindRecord.from_bytes(payload)
                verify_manifests(kind, lambda rel: self.store.cat(self._path(rel)))
                return KindCheckpoint(step, folder, kind, len(payload))
            record = StateRecord.from_bytes(payload)
            manifest_bytes = self.store.cat(self._path(marker.manifest))
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
        except FileNotFoundError as exc:
            raise CheckpointError(f"{folder}: incomplete or missing ({exc})") from exc
        except (CheckpointError, StateFormatError) as exc:
            raise CheckpointError(f"{folder}: {exc}") from exc
        return Checkpoint(
            step,
            folder,
            record.loader,
            record.context,
            record.extra,
            snapshot,
            manifest,
            len(payload),
        )

    def load_checkpoint(self, step: int | None = None) -> Checkpoint | KindCheckpoint:
        """The newest usable checkpoint (or the given step), falling back past corrupt ones.

        Raises:
            CheckpointError: If the given step, or every checkpoint, is unusable.
        """
        if step is not None:
            return self.read(step)
        failures = []
        for candidate in reversed(self.steps()):
            try:
                ckpt = self.read(candidate)
            except CheckpointError as exc:
                logger.warning("%s; falling back to the previous checkpoint", exc)
                failures.append(str(exc))
                continue
            return ckpt
        detail = "\n".join(failures) or "no committed checkpoint"
        raise CheckpointError(f"no usable checkpoint under {self.url}:\n{detail}")

    def load(
        self,
        loader: DataLoader,
        step: int | None = None,
        *,
        on_lake_change: LakeChangePolicy = "error",
    ) -> Any:
        """Restore the loader from the newest usable checkpoint; return the saved extras.

        The loader may have any world size, worker count or batch size. The
        :class:`~lakeloader.RecoveryCoordinator` compares the checkpoint's snapshot with the
        loader's dataset: files added since join at the next epoch boundary (the saved epoch
        finishes on the pinned snapshot). For files gone or rewritten that the rest of the
        saved epoch needs, ``on_lake_change="error"`` raises :class:`LakeChangedError` listing
        them; ``"skip"`` finishes the epoch without their units (their rows are counted as
        skipped); ``"restart_epoch"`` runs the saved epoch again from its start on the lake as
        it is now (at least once, not exactly once, for that epoch).

        Raises:
            CheckpointError: If no checkpoint is usable.
            LakeChangedError: If needed files changed and the policy is ``"error"``.
            StateMismatchError: If the order configuration differs.
            ValueError: For an unknown ``on_lake_change`` (whether or not the lake changed).
        """
        coordinator = RecoveryCoordinator(on_lake_change)
        ckpt = self.load_checkpoint(step)
        saved = ckpt.kind if isinstance(ckpt, KindCheckpoint) else "lake"
        kind = loader.dataset.loader_kind
        check_same_kind(ckpt.path, saved, "lake" if kind in LAKE_KINDS else kind)
        if isinstance(ckpt, KindCheckpoint):
            loader.load_state_dict(dict(ckpt.record.state))
        else:
            loader._resume(coordinator.resume(ckpt, loader.dataset))
        return ckpt.extra

    def dataset(
        self,
        step: int | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        on_lake_change: LakeChangePolicy = "error",
        **settings: Any,
    ) -> LakeDataset:
        """The dataset a checkpoint was taken on, from its manifest: no listing, no footers.

        Each pinned file is checked with one metadata request. With files gone or rewritten
        that the rest of the saved epoch needs, ``on_lake_change="error"`` raises listing
        them; ``"skip"`` finishes the epoch without their units (later epochs list the lake
        afresh); ``"restart_epoch"`` lists the lake afresh (pass the same policy to
        :meth:`load`, which then restarts the saved epoch). Files added since are not seen
        here: build a :class:`LakeDataset` on the live lake and call :meth:`load`, which
        finishes the saved epoch on the pinned snapshot and lets them join at the next epoch.

        Args:
            step: The checkpoint's step (None: the newest usable one).
            storage_options: fsspec options for the lake (never stored in checkpoints).
            on_lake_change: One of ``"error"``, ``"skip"``, ``"restart_epoch"``.
            **settings: Other :class:`LakeDataset` arguments that do not change the order
                (``transform``, ``retry``, ``on_error``, ``validate``, ``progress``).

        Raises:
            CheckpointError: If no checkpoint is usable.
            LakeChangedError: If pinned files changed and the policy is ``"error"``.
        """
        coordinator = RecoveryCoordinator(on_lake_change)
        ckpt = self.load_checkpoint(step)
        if isinstance(ckpt, KindCheckpoint):
            raise CheckpointError(
                f"{ckpt.path} is a {ckpt.kind} loader's checkpoint: build the dataset on its "
                "lake(s) and load the checkpoint into a DataLoader over it"
            )
        return coordinator.pinned_dataset(ckpt, {"storage_options": storage_options, **settings})

    def close(self) -> None:
        """Finish a pending background save and stop the writer thread."""
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)


def _context(loader: DataLoader, step: int) -> CheckpointContext:
    ds = loader.dataset
    return CheckpointContext(
        step=step,
        library_version=__version__,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        fingerprint=ds.fingerprint,
        config=ds.config.to_dict(),
        topology=loader.topology,
        drop_last=loader.drop_last,
        workers_build=loader.tracker.workers_build,
        source=loader.dataset.source.describe(),
    )

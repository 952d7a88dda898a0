"""The checkpoint manager: the loader's position, saved at a sync barrier to any fsspec URL.

Layout under the root URL::

    manifests/<fingerprint>.msgpack   the pinned snapshot, written once and shared
    step-000000001200/state.msgpack   loader state, context and the caller's extras
    step-000000001200/COMMIT          written last: sizes and SHA-256 of the parts

A checkpoint is visible only once its ``COMMIT`` marker exists, which works the same on a local
disk and on object stores that cannot rename; a save killed half-way leaves a folder without a
marker, which ``load`` ignores and the next save removes.
"""

from __future__ import annotations

import datetime as dt
import logging
import posixpath
import re
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import fsspec
import msgpack
import torch.distributed as dist
from fsspec.core import url_to_fs

from lakeloader._version import __version__
from lakeloader.checkpoint.barrier import confirm_same_position, sha256
from lakeloader.dataset import LakeDataset
from lakeloader.errors import CheckpointError, StateFormatError
from lakeloader.lake.manifest import from_manifest, pack_manifest, unpack_manifest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.loader import DataLoader
from lakeloader.recovery.lake_changes import LakeChangePolicy, pinned_dataset, restore
from lakeloader.state.loader_state import LoaderState
from lakeloader.state.quarantine import QuarantineEntry

logger = logging.getLogger(__name__)

STATE_FILE: Final = "state.msgpack"
COMMIT_FILE: Final = "COMMIT"
MANIFEST_DIR: Final = "manifests"
STEP_PREFIX: Final = "step-"
STEP_DIR_RE: Final = re.compile(r"step-(\d{12})$")
CHECKPOINT_FORMAT_VERSION: Final = 1

# Keys of state.msgpack.
KEY_LOADER: Final = "loader"
KEY_CONTEXT: Final = "context"
KEY_EXTRA: Final = "extra"


def step_dir_name(step: int) -> str:
    """Folder name of a step's checkpoint (zero-padded so that names sort by step).

    >>> step_dir_name(1200)
    'step-000000001200'
    """
    return f"{STEP_PREFIX}{step:012d}"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint.

    Attributes:
        step: The training step it was saved at.
        path: Its folder.
        state: The loader state (plain dict).
        context: Library version, config, topology, time, fingerprint, manifest path.
        extra: The caller's extras.
        snapshot: The pinned snapshot from the manifest.
        manifest: The manifest itself (plain dict).
        nbytes: Size of ``state.msgpack``.
    """

    step: int
    path: str
    state: dict[str, Any]
    context: dict[str, Any]
    extra: Any
    snapshot: Snapshot
    manifest: dict[str, Any]
    nbytes: int


class CheckpointManager:
    """Save and load loader positions under one URL, with ``keep`` checkpoints retained.

    Args:
        url: Root folder, any fsspec URL (a local path, ``s3://``, ``gs://``, ...).
        keep: Complete checkpoints kept; older ones are deleted after each save.
        async_save: Write in a background thread; ``save`` returns once the state is
            captured. A second save waits for the first; errors surface on the next call or
            on :meth:`wait`.
        storage_options: fsspec options for the URL.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> from lakeloader import LakeDataset, DataLoader
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"id": range(100)}), f"{root}/a.parquet")
        >>> loader = DataLoader(LakeDataset(root), batch_size=16)
        >>> batches = iter(loader); _ = next(batches); _ = next(batches)
        >>> ckpt = CheckpointManager(tempfile.mkdtemp())
        >>> ckpt.save(2, loader, extra={"lr": 0.1})
        >>> fresh = DataLoader(LakeDataset(root), batch_size=32)
        >>> ckpt.load(fresh), fresh.state_dict()["position"]
        ({'lr': 0.1}, 32)
    """

    def __init__(
        self,
        url: str,
        *,
        keep: int = 3,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.url = url
        self.keep = keep
        self.async_save = async_save
        self.fs: fsspec.AbstractFileSystem
        self.fs, self.root = url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lakeloader-ckpt")
        self._pending: Future[None] | None = None
        self._manifests: dict[str, str] = {}  # manifests known intact: path -> SHA-256
        self._closed = False

    # ------------------------------------------------------------------ listing
    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _step_dirs(self) -> dict[int, str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
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
        return sorted(s for s, d in dirs.items() if self.fs.exists(posixpath.join(d, COMMIT_FILE)))

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
        state = loader.state_dict()
        everyone = confirm_same_position(state, previous)
        if previous is not None:
            raise previous
        if everyone:
            loader.adopt_quarantine([QuarantineEntry.from_dict(q) for q in everyone])
            state = loader.state_dict()
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        record = {
            KEY_LOADER: state,
            KEY_CONTEXT: _context(loader, step),
            KEY_EXTRA: extra,
        }
        try:
            payload: bytes = msgpack.packb(record, use_bin_type=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"extra for step {step} is not msgpack-serialisable ({exc}); pass plain types "
                "(dicts, lists, numbers, strings, bytes)"
            ) from exc
        manifest = (loader.dataset.snapshot, _source(loader))
        if self.async_save:
            self._pending = self._writer.submit(self._write, step, payload, manifest)
            return
        try:
            self._write(step, payload, manifest)
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
        rel = posixpath.join(MANIFEST_DIR, f"{snapshot.fingerprint}.msgpack")
        known = self._manifests.get(rel)
        if known is not None:
            return rel, known
        data = pack_manifest(snapshot, source)
        digest = sha256(data)
        path = self._path(rel)
        try:
            intact = sha256(self.fs.cat_file(path)) == digest
        except FileNotFoundError:
            intact = False
        if not intact:  # absent, or torn by an earlier crash: (re)write it whole
            self.fs.makedirs(self._path(MANIFEST_DIR), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self._put(tmp, data)
            self.fs.mv(tmp, path)
        self._manifests[rel] = digest
        return rel, digest

    def _write(self, step: int, payload: bytes, manifest: tuple[Snapshot, Any]) -> None:
        manifest_rel, manifest_sha = self._manifest(*manifest)
        folder = self._path(step_dir_name(step))
        commit = posixpath.join(folder, COMMIT_FILE)
        if self.fs.exists(commit):
            self.fs.rm(commit)  # invisible first, then overwrite
        self.fs.makedirs(folder, exist_ok=True)
        self._put(posixpath.join(folder, STATE_FILE), payload)
        marker = {
            "version": CHECKPOINT_FORMAT_VERSION,
            "step": step,
            "files": {STATE_FILE: [len(payload), sha256(payload)]},
            "manifest": manifest_rel,
            "manifest_sha256": manifest_sha,
        }
        self._put(commit, msgpack.packb(marker))
        logger.info("checkpoint of step %d written to %s (%d bytes)", step, folder, len(payload))
        self._prune(step)

    def _put(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "wb") as fh:
            fh.write(data)

    def _prune(self, current: int) -> None:
        """Keep the newest ``keep`` committed checkpoints; drop half-written folders."""
        dirs = self._step_dirs()
        committed = sorted(
            s for s, d in dirs.items() if self.fs.exists(posixpath.join(d, COMMIT_FILE))
        )
        doomed = committed[: -self.keep] + [s for s in dirs if s not in committed and s != current]
        for s in doomed:
            commit = posixpath.join(dirs[s], COMMIT_FILE)
            if self.fs.exists(commit):
                self.fs.rm(commit)  # invisible before it is incomplete
            self.fs.rm(dirs[s], recursive=True)

    # ------------------------------------------------------------------ loading
    def read(self, step: int) -> Checkpoint:
        """Read and verify one checkpoint.

        Raises:
            CheckpointError: If it is missing, incomplete, truncated or corrupt.
        """
        folder = self._path(step_dir_name(step))
        try:
            marker = msgpack.unpackb(self.fs.cat_file(posixpath.join(folder, COMMIT_FILE)))
            payload = self.fs.cat_file(posixpath.join(folder, STATE_FILE))
            size, digest = marker["files"][STATE_FILE]
            if len(payload) != size or sha256(payload) != digest:
                raise CheckpointError(
                    f"{folder}: {STATE_FILE} is {len(payload)} bytes with SHA-256 "
                    f"{sha256(payload)[:12]}..., its COMMIT says {size} bytes, {digest[:12]}...: "
                    "truncated or overwritten"
                )
            record = msgpack.unpackb(payload, raw=False)
            manifest_bytes = self.fs.cat_file(self._path(marker["manifest"]))
            if sha256(manifest_bytes) != marker["manifest_sha256"]:
                raise CheckpointError(
                    f"manifest {marker['manifest']} does not match the SHA-256 its COMMIT "
                    "records: torn or overwritten"
                )
            manifest = unpack_manifest(manifest_bytes)
            state = record[KEY_LOADER]
            loader_state = LoaderState.from_dict(state)
            snapshot = from_manifest(manifest, loader_state.config.get("columns"))
            if snapshot.fingerprint != loader_state.fingerprint:
                raise CheckpointError(
                    f"its state refers to snapshot {loader_state.fingerprint} but its manifest "
                    f"{marker['manifest']} describes {snapshot.fingerprint}"
                )
        except FileNotFoundError as exc:
            raise CheckpointError(f"{folder}: incomplete or missing ({exc})") from exc
        except CheckpointError as exc:
            message = str(exc)
            raise CheckpointError(
                message if message.startswith(folder) else f"{folder}: {message}"
            ) from exc
        except StateFormatError as exc:
            raise CheckpointError(f"{folder}: {exc}") from exc
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise CheckpointError(f"{folder}: corrupt ({exc!r})") from exc
        return Checkpoint(
            step,
            folder,
            state,
            record[KEY_CONTEXT],
            record[KEY_EXTRA],
            snapshot,
            manifest,
            len(payload),
        )

    def load_checkpoint(self, step: int | None = None) -> Checkpoint:
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

        The loader may have any world size, worker count or batch size. If its dataset's
        snapshot differs from the checkpoint's, the recovery coordinator lists the files gone,
        rewritten or added: ``on_lake_change="error"`` raises :class:`LakeChangedError` with
        that list; ``"restart_epoch"`` runs the saved epoch again from its start on the lake as
        it is now (at least once, not exactly once, for that epoch).

        Raises:
            CheckpointError: If no checkpoint is usable.
            LakeChangedError: If the lake changed and the policy is ``"error"``.
            StateMismatchError: If the order configuration differs.
        """
        ckpt = self.load_checkpoint(step)
        restore(loader, ckpt, on_lake_change)
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
        ckpt = self.load_checkpoint(step)
        return pinned_dataset(
            ckpt, on_lake_change, {"storage_options": storage_options, **settings}
        )

    def close(self) -> None:
        """Finish a pending background save and stop the writer thread."""
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)


def _source(loader: DataLoader) -> Any:
    src = loader.dataset.source
    return str(src) if isinstance(src, str) or hasattr(src, "__fspath__") else [str(s) for s in src]


def _context(loader: DataLoader, step: int) -> dict[str, Any]:
    ds = loader.dataset
    return {
        "step": step,
        "library_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": ds.fingerprint,
        "config": ds.config.to_dict(),
        "topology": {
            "world_size": loader.world_size,
            "num_workers": loader.num_workers,
            "batch_size": loader.batch_size,
            "drop_last": loader.drop_last,
        },
        "source": _source(loader),
    }

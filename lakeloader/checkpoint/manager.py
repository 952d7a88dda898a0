"""The checkpoint manager: whole checkpoints saved at a sync barrier to any fsspec URL."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from fsspec.core import url_to_fs

from lakeloader._version import __version__
from lakeloader.audit.ledger import Ledger
from lakeloader.checkpoint.barrier import confirm_same_position
from lakeloader.checkpoint.folders import CheckpointFolders
from lakeloader.checkpoint.layout import ROOT, Checkpoint, CheckpointContext, StateRecord
from lakeloader.checkpoint.reading import agreed_checkpoint, newest_usable, read_checkpoint
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.checkpoint.training import CodeVersion, code_version
from lakeloader.checkpoint.whole import capture, process_rank, restore
from lakeloader.dataset import LakeDataset
from lakeloader.errors import CheckpointError, StateFormatError, StoreAccessError
from lakeloader.io.fetch import url_of
from lakeloader.io.retry import RetryPolicy
from lakeloader.loader import DataLoader
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.recovery.lake_changes import LakeChangePolicy
from lakeloader.signals import main_thread_only

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Save and load whole training checkpoints under one URL, with ``keep`` retained.

    A checkpoint holds the loader's position, optionally the model's and optimizer's shards,
    every rank's random generators and its context, all under one ``COMMIT``. Rank 0 also
    keeps the audit ledger beside the checkpoints (:mod:`lakeloader.audit`).

    Args:
        url: Root folder, any fsspec URL (a local path or ``Path``, ``s3://``, ``gs://``, ...).
        keep: Complete checkpoints kept; older ones are deleted after each save.
        async_save: Write in the background; ``save`` returns once the state is captured
            (the model's and optimizer's copied to memory by DCP's ``async_save``). A second
            save waits for the first; errors surface on the next call or on :meth:`wait`.
        storage_options: fsspec options for the URL.
        retry: How transient storage failures of checkpoint reads and writes are retried
            (default: as data reads, up to 5 minutes per call); a refused request fails at
            once with :class:`~lakeloader.errors.StoreAccessError` naming the URL.
        ledger: Keep the audit ledger (``lakeloader audit``).
        ledger_flush_seconds: Longest time a delivered step waits before the ledger writes it
            (0: a ledger segment per step); a save always writes one.

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
        >>> ckpt.close(); tmp.cleanup(); runs.cleanup()
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        keep: int = 3,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        ledger: bool = True,
        ledger_flush_seconds: float = 10.0,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.url = url = os.fspath(url)
        self.keep = keep
        self.async_save = async_save
        self.storage_options = dict(storage_options or {})
        self.fs: fsspec.AbstractFileSystem
        self.fs, root = url_to_fs(url, **self.storage_options)
        self.root = root.rstrip("/")
        self.store = CheckpointStore(self.fs, url, retry or RetryPolicy())
        self.folders = CheckpointFolders(self.store, self.root, keep)
        self.ledger = Ledger(self.store, self.root, flush_seconds=ledger_flush_seconds)
        self._keep_ledger = ledger
        self._writer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lakeloader-ckpt", initializer=main_thread_only
        )
        self._pending: Future[Any] | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._closed = False

    @functools.cached_property
    def _code(self) -> CodeVersion:
        """The training code's git commit."""
        return code_version()

    def steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, oldest first."""
        return self.folders.committed()

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def attach(self, loader: DataLoader) -> bool:
        """Record every step ``loader`` delivers in the audit ledger (on rank 0).

        :meth:`save` and :meth:`load` attach their loader; the steps it delivered since it
        began (or was restored) are recorded at attachment. Only steps delivered before a
        restore by ``load_state_dict`` (rather than :meth:`load`) stay unrecorded, which the
        audit reports as unverified.

        Returns:
            Whether the ledger records ``loader``'s steps (only ever on rank 0).
        """
        if not (self._keep_ledger and loader.rank == 0):
            return False
        loader.observe_steps(self.ledger.step)
        return True

    # ------------------------------------------------------------------- saving
    def save(
        self,
        step: int,
        loader: DataLoader,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
    ) -> None:
        """Save a whole checkpoint (collective when torch.distributed is initialised).

        Every rank calls it at the same step, and it fails on every rank if they do not hold
        the same loader position. Each rank writes its shards of ``model`` and ``optimizer``
        (plain, DDP or FSDP2 modules); ``extra`` is taken from rank 0 (plain msgpack-able types).

        Raises:
            CheckpointError: If ranks disagree, the write fails (sync), a previous background
                save failed, an optimizer comes without its model, or the manager is closed.
        """
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.url!r}) is closed")
        previous = self._settle()
        stand = loader.barrier_position()
        everyone = confirm_same_position(stand, previous)
        if previous is not None:
            raise previous
        state = loader.checkpoint_state(everyone or ())  # every rank's quarantine merged in
        datasets = loader.checkpoint_datasets()  # as they are now: the loop goes on
        recorded = self.attach(loader)
        folder = self.folders.step_folder(step)
        if process_rank() == 0:
            self.folders.uncommit(folder)  # invisible before any rank writes into the folder
        captured = capture(
            step,
            url_of(self.fs, folder),
            model=model,
            optimizer=optimizer,
            attempt=self.ledger.attempt,
            code=self._code,  # looked up at the first save (inspect and audit need none)
            storage_options=self.storage_options,
            asynchronous=self.async_save,
            async_group=self._group() if self.async_save and model is not None else None,
        )
        if process_rank() != 0:
            self._pending = captured.pending  # the next save waits for this rank's shards
            return
        created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        context = CheckpointContext(
            step, __version__, created, loader.topology, loader.drop_last, loader.workers_build
        )
        position = (stand.epoch, stand.position)
        # the steps in this checkpoint, taken now: the loop goes on during a background write
        mark = self.ledger.mark(*position, captured.record.world_size) if recorded else (0, 0)

        def write() -> None:
            parts = captured.parts(self.store, folder)
            if recorded:  # before COMMIT: no committed step goes unrecorded
                self.ledger.saved(step, mark, *position)
            sources = {leaf: ds.source.describe() for leaf, ds in datasets.items()}
            manifests = {
                leaf: self.folders.manifest(ds.snapshot, sources[leaf])
                for leaf, ds in datasets.items()
            }
            payload = StateRecord(state, context, extra, manifests, sources).to_bytes()
            self.folders.commit(step, payload, manifests.get(ROOT, ("", "")), parts)

        if self.async_save:
            self._pending = self._writer.submit(write)
            return
        try:
            write()
        except StoreAccessError:
            raise  # names the URL and where credentials come from: nothing to add
        except Exception as exc:
            raise CheckpointError(f"saving step {step} to {self.url} failed: {exc!r}") from exc

    def _group(self) -> dist.ProcessGroup | None:
        """The process group of background weight saves (made once, on every rank)."""
        if self._async_group is None and dist.is_available() and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

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

    # ------------------------------------------------------------------ loading
    def read(self, step: int) -> Checkpoint:
        """Read and verify one checkpoint: its state, manifests and every part ``COMMIT`` lists.

        Raises:
            CheckpointError: If it is missing, incomplete, truncated or corrupt.
        """
        return read_checkpoint(self.folders, step)

    def load_checkpoint(self, step: int | None = None) -> Checkpoint:
        """The newest usable checkpoint (or the given step), falling back past corrupt ones.

        Raises:
            CheckpointError: If the given step, or every checkpoint, is unusable.
        """
        if step is not None:
            return self.read(step)
        ckpt, skipped = newest_usable(self.read, self.steps(), self.url)
        for failure in skipped:  # each said once: here, or in newest_usable's error
            logger.warning("%s; falling back to the checkpoint of step %d", failure, ckpt.step)
        return ckpt

    def load(
        self,
        loader: DataLoader,
        step: int | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        rng: bool = True,
        on_lake_change: LakeChangePolicy = "error",
    ) -> Any:
        """Restore the loader, model, optimizer and generators; return the saved extras.

        It takes the newest usable checkpoint, or ``step``. With ``model`` (and
        ``optimizer``), every rank must call it (a collective): rank 0 picks the checkpoint,
        and each rank reads the shards its parameters need, whatever the world size that saved
        them. ``rng`` restores each rank's random generators as they were at the save (ranks
        the saving run did not have keep theirs).

        The loader may have any world size, worker count or batch size. Files added to a lake
        since the checkpoint join at the next epoch boundary (the saved epoch finishes on the
        pinned snapshot). For files gone or rewritten that the rest of the saved epoch needs,
        ``on_lake_change="error"`` raises :class:`LakeChangedError` listing them; ``"skip"``
        finishes the epoch without their units (their rows are counted as skipped);
        ``"restart_epoch"`` runs the saved epoch again from its start on the lake as it is now
        (at least once, not exactly once, for that epoch).

        Raises:
            CheckpointError: If no checkpoint is usable.
            LakeChangedError: If needed files changed and the policy is ``"error"``.
            StateMismatchError: If the order configuration differs.
            StateFormatError: If the checkpoint holds another kind of loader's state.
            ValueError: For an unknown ``on_lake_change`` (whether or not the lake changed).
        """
        coordinator = RecoveryCoordinator(on_lake_change)
        if model is not None or optimizer is not None:  # the weights load collectively
            ckpt = agreed_checkpoint(self.load_checkpoint, step)
        else:
            ckpt = self.load_checkpoint(step)
        try:
            loader.restore_checkpoint(ckpt, coordinator)
        except StateFormatError as exc:
            raise StateFormatError(
                f"{ckpt.path} holds a {ckpt.state_dict.get('kind')!r} state, which this "
                f"DataLoader over a {loader.root.what} does not take ({exc}): load it into a "
                "loader over the same kind of dataset"
            ) from exc
        restore(
            ckpt.training,
            url_of(self.fs, ckpt.path),
            model=model,
            optimizer=optimizer,
            rng=rng,
            storage_options=self.storage_options,
        )
        self.ledger.resumed(ckpt.step, ckpt.training.attempt if ckpt.training else "")
        self.attach(loader)
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
        :meth:`load`). Files added since are not seen here: build a :class:`LakeDataset` on the
        live lake and call :meth:`load`, which lets them join at the next epoch.

        Args:
            step: The checkpoint's step (None: the newest usable one).
            storage_options: fsspec options for the lake (never stored in checkpoints).
            on_lake_change: One of ``"error"``, ``"skip"``, ``"restart_epoch"``.
            **settings: Other :class:`LakeDataset` arguments that do not change the order
                (``transform``, ``retry``, ``on_error``, ``validate``, ``progress``).

        Raises:
            CheckpointError: If no checkpoint is usable, or it is not a loader's over one lake.
            LakeChangedError: If pinned files changed and the policy is ``"error"``.
        """
        coordinator = RecoveryCoordinator(on_lake_change)
        ckpt = self.load_checkpoint(step)
        ckpt.snapshot  # noqa: B018  (raises CheckpointError unless it pins one lake)
        return coordinator.pinned_dataset(ckpt, {"storage_options": storage_options, **settings})

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish a pending background save, write the ledger, stop the writer threads.

        A failure to write the ledger's last steps (delivered after the last save) is logged,
        not raised.
        """
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            try:
                self.ledger.close()
            except Exception as exc:
                logger.error(
                    "the audit ledger's last steps could not be written under %s (%r): "
                    "lakeloader audit will not count them as replayed",
                    self.url,
                    exc,
                )

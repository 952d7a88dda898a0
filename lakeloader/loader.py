"""``DataLoader``: a drop-in for ``torch.utils.data.DataLoader`` over a :class:`LakeDataset`.

It takes torch's keyword arguments with torch's meaning, plus ``rank`` and ``world_size``.
Each iteration is one epoch; ``state_dict()`` says how far the training loop got, and
``load_state_dict()`` continues the same global sequence under any topology.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lakeloader.cache.decode import UnitDecoder
from lakeloader.cache.packed import RowLayout
from lakeloader.cache.store import Screening, default_cache_dir, make_unit_dir
from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import UnitReader
from lakeloader.order.plan import steps_in_epoch
from lakeloader.pipeline.collate import Collate
from lakeloader.pipeline.iterator import Delivery, EpochIterator, IterConfig
from lakeloader.state import keys as K
from lakeloader.state.loader_state import LoaderState
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.topology import resolve_topology
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)

#: Default byte budget of the decoded-unit cache of one rank.
DEFAULT_CACHE_BYTES = 2 << 30
#: Default number of threads fetching and decoding units for one rank.
DEFAULT_IO_THREADS = 4


class PartitionWarning(UserWarning):
    """``C`` does not divide the global batch: exact, but ranks re-read each other's units."""


class DataLoader:
    """Streams batches of a :class:`LakeDataset`, deterministically and resumably.

    Args:
        dataset: The lake.
        batch_size: Rows per batch on this rank (the global batch is ``world_size`` times it).
        shuffle: Must be None or equal the dataset's ``shuffle`` (the order is the dataset's).
        sampler: Not supported (the order is planned); must be None.
        batch_sampler: Not supported; must be None.
        num_workers: Worker processes building batches (0: in this process).
        collate_fn: Receives the list of row dicts of a batch, as in torch.
        pin_memory: Copy tensors to pinned memory (when CUDA is available).
        drop_last: Drop the last global batch if it is short (its rows are counted).
        timeout: Seconds to wait for a batch from the workers before failing (0: forever).
        worker_init_fn: Called with the worker id in each worker, as in torch.
        multiprocessing_context: Context (or its name) for the workers.
        generator: Not supported (the dataset's seed defines the order); must be None.
        prefetch_factor: Work handed to each worker ahead (default 2 with workers): units to
            decode on the default tensor path, batches to build with a transform or
            collate_fn.
        persistent_workers: Keep the workers alive between epochs.
        pin_memory_device: Accepted for compatibility; pinning uses the default device.
        in_order: Must be True: batches are always delivered in step order.
        rank: This process's rank (default: torch.distributed, then ``RANK``, then 0).
        world_size: Ranks in the run (default: torch.distributed, then ``WORLD_SIZE``, then 1).
        cache_dir: Folder for decoded units and what workers share (default: ``/dev/shm``).
        cache_bytes: Byte budget for decoded units held ahead of use.
        io_threads: Threads fetching and decoding units in this process: without workers, or
            with a transform or collate_fn (on the tensor path the workers decode).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> from lakeloader import LakeDataset
        >>> root = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"id": range(10)}), f"{root}/a.parquet")
        >>> loader = DataLoader(LakeDataset(root, shuffle=False), batch_size=4)
        >>> [b["id"].tolist() for b in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        >>> loader.state_dict()["position"], loader.state_dict()["epoch"]
        (10, 0)
    """

    def __init__(
        self,
        dataset: LakeDataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Collate | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        cache_dir: str | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        io_threads: int = DEFAULT_IO_THREADS,
    ) -> None:
        _check_unsupported(dataset, batch_size, shuffle, sampler, batch_sampler, generator)
        if not in_order:
            raise ValueError("in_order=False is not supported: batches come in step order")
        if num_workers < 0 or timeout < 0:
            raise ValueError(f"num_workers ({num_workers}) and timeout ({timeout}) must be >= 0")
        if num_workers == 0 and (prefetch_factor is not None or persistent_workers):
            raise ValueError(
                "prefetch_factor and persistent_workers need num_workers > 0 (as in torch)"
            )
        assert batch_size is not None
        self._base = dataset
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.collate_fn = collate_fn
        self.pin_memory = bool(pin_memory)
        self.pin_memory_device = pin_memory_device
        self.drop_last = bool(drop_last)
        self.timeout = float(timeout)
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.prefetch_factor = prefetch_factor if prefetch_factor is not None else 2
        self.persistent_workers = bool(persistent_workers)
        self.rank, self.world_size = resolve_topology(rank, world_size)
        self.cache_dir = cache_dir
        self.cache_bytes = int(cache_bytes)
        self.io_threads = int(io_threads)
        self._reader: UnitReader
        self._row_layout: RowLayout | None
        self._use_reader(dataset.reader())
        self._epoch = 0
        self._position = 0
        self._dropped = 0
        self._fresh = True
        self._rows_delivered = 0
        self._rows_skipped = 0
        self._quarantine: list[QuarantineEntry] = []
        self._iterator: EpochIterator | None = None
        self._pool: WorkerPool | None = None
        self._worker_restarts = 0
        self._unit_dir: str | None = None
        if self.pin_memory and not torch.cuda.is_available():
            warnings.warn(
                "pin_memory=True but no accelerator is available: batches are not pinned",
                UserWarning,
                stacklevel=2,
            )
            self.pin_memory = False
        self._warn_partitions()

    # ----------------------------------------------------------------- topology
    @property
    def global_batch_size(self) -> int:
        """Rows all ranks together consume in one step."""
        return self.batch_size * self.world_size

    def _warn_partitions(self) -> None:
        c, b = self.dataset.config.num_partitions, self.global_batch_size
        if b % c:
            divisors = [d for d in range(1, b + 1) if b % d == 0 and d <= c]
            warnings.warn(
                f"C={c} canonical partitions do not divide the global batch of {b} rows "
                f"({self.world_size} ranks x {self.batch_size}): the order is still exact, "
                f"but ranks re-read each other's units. Choose num_partitions={divisors[-1]} "
                "(or a global batch that is a multiple of C)",
                PartitionWarning,
                stacklevel=3,
            )

    def __len__(self) -> int:
        """Steps in a whole epoch for this topology (as torch's ``len(loader)``)."""
        return steps_in_epoch(0, len(self.dataset), self.global_batch_size, self.drop_last)

    # -------------------------------------------------------------------- epochs
    @property
    def epoch(self) -> int:
        """The epoch the loader is in (or has just finished)."""
        return self._epoch

    def set_epoch(self, epoch: int, *, restart: bool = False) -> None:
        """Make the next iteration run ``epoch`` from its start.

        Calling it with the epoch a loaded state is in keeps the loaded position, so the
        usual ``loader.set_epoch(epoch)`` at the top of an epoch loop is safe after a resume;
        ``restart=True`` drops the position in any case.
        """
        if epoch == self._epoch and self._fresh and not restart:
            return
        self._close_iterator()
        self._epoch, self._position, self._dropped, self._fresh = int(epoch), 0, 0, True

    def __iter__(self) -> Iterator[Any]:
        self._close_iterator()
        n = len(self.dataset)
        if not self._fresh:
            if self._position + self._dropped < n:
                logger.info("epoch %d left before its end; starting the next", self._epoch)
            self._epoch, self._position, self._dropped = self._epoch + 1, 0, 0
        self._fresh = False
        if self.drop_last and not steps_in_epoch(
            self._position, n, self.global_batch_size, self.drop_last
        ):
            self._dropped = n - self._position  # nothing left but a short tail: dropped
        self._follow_dataset()
        pool = self._ensure_pool() if self.num_workers else None
        if self._unit_dir is None:  # the arena lives there, with or without workers
            self._unit_dir = make_unit_dir(self._cache_root())
        self._iterator = EpochIterator(
            self._iter_config(),
            self._reader,
            self._on_delivered,
            self._on_epoch_end,
            pool,
            self._unit_dir,
        )
        return self._iterator

    def _follow_dataset(self, epoch: int | None = None) -> None:
        """Switch to the dataset that an epoch (default: the current one) runs on."""
        epoch = self._epoch if epoch is None else epoch
        current = self._base.for_epoch(epoch)
        if current is not self.dataset:
            logger.info(
                "epoch %d runs on snapshot %s (was %s)",
                epoch,
                current.fingerprint,
                self.dataset.fingerprint,
            )
            self._shutdown_workers()  # their schema may have widened
            self.dataset = current
            self._use_reader(current.reader())

    def rebase(self, dataset: LakeDataset) -> None:
        """Use another dataset (same order configuration); the recovery coordinator's hook."""
        self._close_iterator()
        self._shutdown_workers()
        self._base = self.dataset = dataset
        self._use_reader(dataset.reader())

    def _ensure_pool(self) -> WorkerPool:
        """Start the workers (before any decoding thread exists, which keeps fork safe)."""
        if self._pool is None:
            layout = self._row_layout
            decoder = None
            if (
                layout is not None and layout.names
            ):  # the workers decode; see lakeloader.workers.dispatch
                ds = self.dataset
                decoder = UnitDecoder(self._reader, layout, ds.on_error, ds.validate)
            setup = WorkerSetup(
                schema=self._reader.schema,
                layout=layout,
                transform=self.dataset.transform,
                collate_fn=self.collate_fn,
                worker_init_fn=self.worker_init_fn,
                base_seed=self.dataset.config.seed * 1_000_003 + self.rank * 1_009,
                num_workers=self.num_workers,
                decoder=decoder,
            )
            self._pool = WorkerPool(setup, self.num_workers, self.multiprocessing_context)
        return self._pool

    def _use_reader(self, reader: UnitReader) -> None:
        """Read through ``reader``, and work out now how its rows are packed.

        Tensor-typed columns are packed unless rows go to a transform or a collate_fn. The
        layout is computed here, not at ``iter()``, because it is pyarrow's first conversion
        in the process: where pandas is installed, pyarrow imports it then (about 0.3 s),
        which belongs to building the loader rather than to the wait for the first batch.
        """
        self._reader = reader
        self._row_layout = None
        if self.dataset.transform is None and self.collate_fn is None:
            self._row_layout = RowLayout.of(reader.schema)

    def _cache_root(self) -> str | None:
        if self.cache_dir is not None:
            return self.cache_dir
        return default_cache_dir(self.cache_bytes)

    def _iter_config(self) -> IterConfig:
        return IterConfig(
            plan=self.dataset.plan(self._epoch),
            start=self._position,
            global_batch=self.global_batch_size,
            world_size=self.world_size,
            rank=self.rank,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            timeout=self.timeout,
            cache_bytes=self.cache_bytes,
            io_threads=self.io_threads,
            pin_memory=self.pin_memory,
            transform=self.dataset.transform,
            collate_fn=self.collate_fn,
            screening=Screening(
                self.dataset.on_error,
                self.dataset.validate,
                tuple(self._quarantine) + self.dataset.lost,
            ),
            layout=self._row_layout,
        )

    def _on_delivered(self, d: Delivery) -> None:
        """Called by the iterator just before it hands a batch to the training loop."""
        self._position = d.slot_stop
        self._rows_delivered += d.rows
        self._rows_skipped += d.rows_skipped
        if d.skipped:
            self._quarantine = merge(self._quarantine, d.skipped)
        if d.last and self.drop_last:
            self._dropped = len(self.dataset) - d.slot_stop

    def _on_epoch_end(self) -> None:
        if not self.persistent_workers:
            self._shutdown_workers()

    def _close_iterator(self, wait: bool = True) -> None:
        if self._iterator is not None:
            self._iterator.close(wait)
            self._iterator = None

    def _shutdown_workers(self, graceful: bool = True) -> None:
        if self._pool is not None:
            self._worker_restarts += self._pool.restarts
            self._pool.shutdown(graceful)
            self._pool = None
        if self._unit_dir is not None:
            shutil.rmtree(self._unit_dir, ignore_errors=True)
            self._unit_dir = None

    def close(self) -> None:
        """Stop workers and threads and delete cached units (done anyway when the loader dies)."""
        self._close_iterator()
        self._shutdown_workers()

    def __del__(self) -> None:
        # A finaliser can run on any thread, one of the loader's own decoding threads
        # included: it must not wait for them.
        try:
            self._close_iterator(wait=False)
            self._shutdown_workers(graceful=False)
        except Exception:
            logger.debug("error while closing a DataLoader", exc_info=True)

    # --------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The position of the training loop: plain types, O(1) in the size of the lake."""
        return LoaderState(
            fingerprint=self.dataset.fingerprint,
            config_hash=self.dataset.config_hash,
            config=self.dataset.config.to_dict(),
            epoch=self._epoch,
            position=self._position,
            rows_dropped=self._dropped,
            num_rows=len(self.dataset),
            topology={
                K.TOPO_WORLD_SIZE: self.world_size,
                K.TOPO_RANK: self.rank,
                K.TOPO_NUM_WORKERS: self.num_workers,
                K.TOPO_BATCH_SIZE: self.batch_size,
            },
            quarantine=[e.to_dict() for e in self._quarantine],
        ).to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state taken under any world size, worker count or batch size.

        Raises:
            StateFormatError: If the dict is not a lakeloader state of a known version.
            StateMismatchError: If it belongs to another lake snapshot or configuration.
        """
        state = LoaderState.from_dict(state_dict)
        self._close_iterator()
        self._follow_dataset(state.epoch)
        state.check_matches(self.dataset.fingerprint, self.dataset.config.to_dict())
        self._epoch, self._position, self._dropped = state.epoch, state.position, state.rows_dropped
        self._quarantine = merge(QuarantineEntry.from_dict(q) for q in state.quarantine)
        if state.position + state.rows_dropped >= len(self.dataset):
            # A finished epoch: the next pass is the next epoch, and set_epoch(epoch + 1) at
            # the top of the caller's loop keeps it that way.
            self._epoch, self._position, self._dropped = state.epoch + 1, 0, 0
        self._fresh = True

    @property
    def quarantine(self) -> list[QuarantineEntry]:
        """Units skipped so far (``on_error="skip"``), sorted; merged across ranks at saves."""
        return list(self._quarantine)

    def adopt_quarantine(self, entries: list[QuarantineEntry]) -> None:
        """Add other ranks' quarantine entries (the checkpoint barrier does this)."""
        self._quarantine = merge(self._quarantine, entries)

    def stats(self) -> dict[str, int]:
        """Counters for tests and benchmarks (cumulative over the loader's life)."""
        it = self._iterator
        return {
            "units_decoded": self._reader.counters.units_decoded,
            "bytes_read": self._reader.counters.bytes_read,
            "rows_delivered": self._rows_delivered,
            "rows_skipped": self._rows_skipped,
            "cache_bytes": it.cache_bytes() if it is not None else 0,
            "cache_peak_bytes": it.cache_peak_bytes() if it is not None else 0,
            "worker_restarts": self._worker_restarts + (self._pool.restarts if self._pool else 0),
        }


def _check_unsupported(
    dataset: LakeDataset,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    generator: Any,
) -> None:
    if not isinstance(dataset, LakeDataset):
        raise TypeError(f"dataset must be a lakeloader.LakeDataset, got {type(dataset).__name__}")
    if batch_size is None or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if shuffle is not None and bool(shuffle) != dataset.config.shuffle:
        raise ValueError(
            f"shuffle={shuffle} but the dataset has shuffle={dataset.config.shuffle}: the order "
            "belongs to the dataset, so pass shuffle= to LakeDataset(...)"
        )
    for name, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        if value is not None:
            raise ValueError(f"{name} is not supported: lakeloader plans the order itself")
    if generator is not None:
        raise ValueError("generator is not supported: the order comes from LakeDataset(seed=...)")

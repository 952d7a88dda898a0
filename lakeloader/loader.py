"""``DataLoader``: a drop-in for ``torch.utils.data.DataLoader`` over a :class:`LakeDataset`.

It takes torch's keyword arguments with torch's meaning, plus ``rank`` and ``world_size``.
Each iteration is one epoch; ``state_dict()`` says how far the training loop got, and
``load_state_dict()`` continues the same global sequence under any topology.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from lakeloader.cache.decode import UnitDecoder
from lakeloader.cache.packed import RowLayout
from lakeloader.dataset import LakeDataset
from lakeloader.errors import PartitionWarning as PartitionWarning  # its home before errors
from lakeloader.io.reader import UnitReader
from lakeloader.loader_args import (
    TorchNames,
    check_unsupported,
    warn_cpu_contention,
    warn_partitions,
)
from lakeloader.loader_position import LakePosition
from lakeloader.mixture import Mixture
from lakeloader.options import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_IO_THREADS,
    DEFAULT_PREFETCH_FACTOR,
    LoaderOptions,
)
from lakeloader.order.plan import steps_in_epoch
from lakeloader.passes import Deferred, Endless
from lakeloader.pipeline.collate import Collate
from lakeloader.pipeline.iterator import EpochIterator
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.resources import LoaderResources
from lakeloader.pipeline.stores import Leaf, Stores
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.state.tracker import ReaderStateTracker
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


#: The loader class of each other kind of dataset (its ``loader_kind``), registered by its
#: module, which builds on this one: ``"mixture"`` (:mod:`lakeloader.mixture_loader`),
#: ``"packed"`` (:mod:`lakeloader.packed_loader`).
LOADER_FOR: dict[str, type[DataLoader]] = {}
L = TypeVar("L", bound="DataLoader")


class DataLoader(TorchNames, LakePosition):
    """Streams batches of a :class:`LakeDataset`, deterministically and resumably.

    Args:
        dataset: The lake, or a :class:`~lakeloader.Mixture` of lakes (the loader is then a
            :class:`~lakeloader.mixture_loader.MixtureLoader`).
        batch_size: Rows per batch on this rank (the global batch is ``world_size`` times it).
        shuffle: Must be None or equal the dataset's ``shuffle`` (the order is the dataset's).
        sampler: Not supported (the order is planned); must be None.
        batch_sampler: Not supported; must be None.
        num_workers: Worker processes (0: everything in this process). On the default tensor
            path (no code of the user's on rows or batches, and a column to pack) they decode
            units, the ``j``-th a rank needs on worker ``j mod num_workers``, and this process
            assembles each batch with one row copy; otherwise they build batches, step ``k`` of
            a pass on worker ``k mod num_workers``, sent back through shared memory.
        collate_fn: Receives the list of row dicts of a batch, as in torch.
        pin_memory: Copy tensors to pinned memory (when CUDA is available).
        drop_last: Drop the last global batch if it is short (its rows are counted); a
            followed lake carries it into its next increment instead.
        timeout: Seconds to wait for a batch (its units' decoding, or the worker building it)
            before failing (0: forever).
        worker_init_fn: Called with the worker id in each worker, as in torch.
        multiprocessing_context: Context (or its name) for the workers.
        generator: Not supported (the dataset's seed defines the order); must be None.
        prefetch_factor: Work handed to each worker ahead (default 2 with workers): units to
            decode on the default tensor path, batches to build with a transform or
            collate_fn.
        persistent_workers: Keep the workers alive between epochs.
        pin_memory_device: Accepted for compatibility; pinning uses the default device.
        in_order: Must be True: batches are always delivered in step order.
        rank: This process's rank (default: torch.distributed, then ``RANK``, then 0), resolved
            when a pass starts, not when the loader is made.
        world_size: Ranks in the run (default: torch.distributed, then ``WORLD_SIZE``, then 1),
            resolved with the rank.
        cache_dir: Folder for decoded units and what workers share (default: ``/dev/shm`` when
            it has ``cache_bytes`` free, else the system's temporary folder, with a warning).
        cache_bytes: Byte budget for decoded units held ahead of use.
        io_threads: Threads decoding units in this process whenever the workers do not decode
            (no workers, a transform or collate_fn, or nothing to pack); fetching is apart.
        restart_on_iter: Every ``iter()`` is a whole pass over the epoch under way, as with
            torch's loaders (for evaluation); by default a new ``iter()`` continues it.
        endless: One ``iter()`` runs epoch after epoch, for step-based trainers (the loader
            then has no ``len()``).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> from lakeloader import LakeDataset
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> pq.write_table(pa.table({"id": range(10)}), f"{root}/a.parquet")
        >>> with DataLoader(LakeDataset(root, shuffle=False), batch_size=4) as loader:
        ...     [b["id"].tolist() for b in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        >>> loader.state_dict()["position"], loader.state_dict()["epoch"]
        (10, 0)
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        dataset: LakeDataset | Mixture,
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
        restart_on_iter: bool = False,
        endless: bool = False,
    ) -> None:
        check_unsupported(dataset, shuffle, sampler, batch_sampler, generator)
        if restart_on_iter and dataset.loader_kind != "lake":
            raise ValueError(
                f"restart_on_iter=True needs a LakeDataset: a {dataset.loader_kind} stream "
                "cannot be rewound to its start at every iter()"
            )
        if not in_order:
            raise ValueError("in_order=False is not supported: batches come in step order")
        if num_workers == 0 and (prefetch_factor is not None or persistent_workers):
            raise ValueError(
                "prefetch_factor and persistent_workers need num_workers > 0 (as in torch)"
            )
        if pin_memory and not torch.cuda.is_available():
            warnings.warn(
                "pin_memory=True but no accelerator is available: batches are not pinned",
                UserWarning,
                stacklevel=2,
            )
            pin_memory = False
        self.options = LoaderOptions(
            batch_size=batch_size,  # type: ignore[arg-type]  # checked there
            num_workers=int(num_workers),
            collate_fn=collate_fn,
            pin_memory=bool(pin_memory),
            drop_last=bool(drop_last),
            timeout=float(timeout),
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=DEFAULT_PREFETCH_FACTOR if prefetch_factor is None else prefetch_factor,
            persistent_workers=bool(persistent_workers),
            pin_memory_device=pin_memory_device,
            cache_dir=cache_dir,
            cache_bytes=int(cache_bytes),
            io_threads=int(io_threads),
            restart_on_iter=bool(restart_on_iter),
            endless=bool(endless),
        )
        self._placement = (rank, world_size)
        self.topology  # noqa: B018  (explicit arguments are checked now)
        self._coordinator = RecoveryCoordinator()
        self._init_dataset(dataset)

    def __new__(cls, dataset: LakeDataset | Mixture, *args: Any, **kwargs: Any) -> DataLoader:
        """A loader over a :class:`~lakeloader.Mixture` is a ``MixtureLoader``."""
        kind = getattr(dataset, "loader_kind", None)
        variant = LOADER_FOR.get(kind) if cls is DataLoader and kind else None
        return super().__new__(variant or cls)

    def _init_dataset(self, dataset: LakeDataset | Mixture) -> None:
        """Take the dataset in (options and topology are set)."""
        assert isinstance(dataset, LakeDataset)
        self._base = dataset
        self.dataset = dataset
        #: The reader-state tracker: the position, and where every rank and worker stands.
        self.tracker = ReaderStateTracker(self.topology, drop_last=self.options.drop_last)
        self._reader: UnitReader
        self._row_layout: RowLayout | None
        self._use_reader(dataset.reader())
        self._res = LoaderResources(self)
        self._warned: Topology | None = None  # the topology a PartitionWarning was checked for

    def __len__(self) -> int:
        """Steps in a whole pass for this topology (as torch's ``len(loader)``).

        Raises:
            TypeError: For an ``endless`` loader, or a stream with no end (as torch's loader
                over an iterable dataset).
        """
        if self.options.endless:
            raise TypeError("an endless loader (endless=True) has no len(): it never ends")
        return self._pass_steps()

    def _pass_steps(self) -> int:
        """Steps in a whole epoch for this topology."""
        return steps_in_epoch(0, len(self.dataset), self.global_batch_size, self.drop_last)

    # -------------------------------------------------------------------- epochs
    @property
    def epoch(self) -> int:
        """The epoch the loader is in (or has just finished)."""
        return self.tracker.epoch

    def set_epoch(self, epoch: int, *, restart: bool = False) -> None:
        """Make the next iteration run ``epoch`` from its start.

        Calling it with the epoch the loader is in keeps the position while that epoch is not
        over (after a resume, or a pass left early), so the usual ``loader.set_epoch(epoch)``
        at the top of an epoch loop never repeats or skips a row; ``restart=True`` drops the
        position in any case. An epoch ends when its rows are delivered, or by this method:
        a new ``iter(loader)`` on an unfinished epoch continues it (unlike torch's loaders,
        whose every ``iter()`` starts a new pass), and the iterator it replaces raises if it
        is used again.
        """
        if self.tracker.set_epoch(epoch, restart=restart):
            self._close_iterator("set_epoch()")

    def __iter__(self) -> Iterator[Any]:
        """A pass over the epoch under way, or the next one (see the class docstring).

        The pass begins at the first ``next()``: a ``set_epoch`` between ``iter()`` and it
        (Lightning's order when it resumes) moves the pass it begins. Rank and world size are
        resolved then: a pass runs on the topology of its start. The iterator's ``num_steps``
        is the number of batches the pass delivers from where it starts (None, or no such
        attribute, where the end is not known: ``endless``, a followed lake, a packed stream).

        Raises:
            TopologyError: At the first ``next()``, if the world size is above 1 but this
                process's rank is unknown.
        """
        return Deferred(self._begin)

    def _begin(self) -> Iterator[Any]:
        """Begin a pass (or, ``endless``, passes) on the topology of now."""
        self._placed(self._resolve_topology(strict=True))
        if self.options.restart_on_iter:
            self.set_epoch(self.epoch, restart=True)
        if self.options.endless:
            return Endless(self._pass)
        return self._pass()

    def _placed(self, topology: Topology) -> None:
        """Take the topology a pass starts on (workers of another rank are stopped)."""
        if topology != self.tracker.topology:
            self._close_iterator("a pass on another topology")
            self._shutdown_workers()
            self.tracker.topology = topology
        if topology != self._warned:  # once a topology
            self._warned = topology
            warn_partitions(self.dataset.config.num_partitions, topology)

    def _pass(self) -> Iterator[Any]:
        self._close_iterator("a newer iter(loader)")
        self._follow_dataset(self.tracker.start_pass())
        self.tracker.settle_tail(len(self.dataset))
        pool = self._ensure_pool() if self.num_workers else None
        if pool is not None:
            warn_cpu_contention(self.num_workers)
        res = self._res
        unit_dir = res.unit_folder(self.options.cache_dir, self.options.cache_bytes)
        leaf = Leaf(self.dataset, self._reader, tuple(self.tracker.quarantine), self._recipe())
        stores = Stores(
            [leaf],
            self.options,
            self.topology,
            unit_dir,
            pool,
            self._row_layout,
            not self.tracker.workers_build,
        )
        it = EpochIterator(
            stores,
            self.tracker.epoch,
            self.tracker.position,
            self.tracker,
            pool,
            functools.partial(res.pass_ended, self.options.persistent_workers),
            owner=self,
        )
        res.iterator = it
        return it

    def _follow_dataset(self, epoch: int) -> None:
        """Switch to the dataset that ``epoch`` runs on."""
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

    def _ensure_pool(self) -> WorkerPool:
        """Start the workers (before any decoding thread exists, which keeps fork safe)."""
        if self._res.pool is None:
            self._res.pool = WorkerPool(
                self._worker_setup(), self.num_workers, self.options.multiprocessing_context
            )
        return self._res.pool

    def _worker_setup(self) -> WorkerSetup:
        """What this loader's workers need: the lake's decoder, or what builds its batches."""
        layout, ds = self._row_layout, self.dataset
        decoders: tuple[UnitDecoder, ...] = ()
        if layout is not None and not self.tracker.workers_build:  # they decode
            decoders = (UnitDecoder(self._reader, layout, ds.on_error, ds.validate),)
        return WorkerSetup(
            schema=self._reader.schema,
            layout=layout,
            recipe=self._recipe(),
            worker_init_fn=self.options.worker_init_fn,
            seed=ds.config.seed,
            rank=self.rank,
            num_workers=self.num_workers,
            decoders=decoders,
        )

    def _decoding_setup(
        self, sources: Sequence[tuple[LakeDataset, UnitReader, RowLayout]], seed: int
    ) -> WorkerSetup:
        """Workers that decode the units of ``sources`` (a mixture's, a packed stream's).

        A decode task names its source by its index in ``sources``; each is packed by its
        layout (the one its unit store packs by).
        """
        return WorkerSetup(
            schema=sources[0][1].schema,
            layout=None,
            recipe=BatchRecipe(),
            worker_init_fn=self.options.worker_init_fn,
            seed=seed,
            rank=self.rank,
            num_workers=self.num_workers,
            decoders=tuple(
                UnitDecoder(reader, layout, ds.on_error, ds.validate)
                for ds, reader, layout in sources
            ),
        )

    def _use_reader(self, reader: UnitReader) -> None:
        """Read through ``reader``, and work out now how its rows are packed.

        Tensor-typed columns are packed unless rows go to a transform or a collate_fn. The
        layout is computed here, not at ``iter()``, because it is pyarrow's first conversion
        in the process: where pandas is installed, pyarrow imports it then, which belongs to
        building the loader rather than to the wait for the first batch.
        """
        self._reader = reader
        self._row_layout = None
        recipe = self._recipe()
        if not recipe.rows_path:
            self._row_layout = RowLayout.of(reader.schema)
        # Workers decode when columns are packed and no user code runs; else they build.
        packs = self._row_layout is not None and bool(self._row_layout.names)
        self.tracker.workers_build = not packs or recipe.user_code
        self.tracker.lost = self.dataset.lost

    def _recipe(self) -> BatchRecipe:
        """How this loader's rows become batches (the dataset's transforms, our collate_fn)."""
        ds = self.dataset
        return BatchRecipe(ds.transform, self.collate_fn, ds.batch_transform, ds.list_format)

    @property
    def _pool(self) -> WorkerPool | None:
        """The worker processes of the pass under way (tests look at their pids)."""
        return self._res.pool

    def _close_iterator(self, ended_by: str) -> None:
        self._res.close_iterator(True, ended_by)

    def _shutdown_workers(self) -> None:
        self._res.shutdown_workers()

    def close(self) -> None:
        """Stop workers and threads and delete cached units.

        Done anyway when the loader is garbage-collected, and at interpreter exit, and at the
        end of a ``with DataLoader(...) as loader:`` block. A closed loader can still be
        iterated: it starts what it needs again.
        """
        self._close_iterator("loader.close()")
        self._shutdown_workers()

    def __enter__(self: L) -> L:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle and copy a loader as its configuration and position, never what it runs.

        ``pickle`` and ``copy.deepcopy`` give a loader of the same class over an equal dataset
        (its snapshot included: nothing is listed again), with the same arguments, standing
        where this one stands (an equal ``state_dict()``); iterated, it continues from there.
        Workers, threads, shared memory and a pass under way are not copied (the copy starts
        its own when iterated), nor a checkpoint manager's hold on the position.
        """
        kept = {name: value for name, value in vars(self).items() if name != "_res"}
        return _rebuilt, (type(self), kept)

    def stats(self) -> dict[str, int]:
        """Counters for tests and benchmarks (cumulative over the loader's life)."""
        it, pool = self._res.iterator, self._res.pool
        return {
            "units_decoded": self._reader.counters.units_decoded,
            "bytes_read": self._reader.counters.bytes_read,
            "requests": self._reader.counters.requests,
            "rows_delivered": self.tracker.rows_delivered,
            "rows_skipped": self.tracker.rows_skipped,
            "cache_bytes": it.cache_bytes() if it is not None else 0,
            "cache_peak_bytes": it.cache_peak_bytes() if it is not None else 0,
            "worker_restarts": self._res.worker_restarts + (pool.restarts if pool else 0),
        }


def _rebuilt(cls: type[DataLoader], kept: dict[str, Any]) -> DataLoader:
    """A loader from what :meth:`DataLoader.__reduce__` kept, with resources of its own."""
    loader = object.__new__(cls)
    loader.__dict__.update(kept)
    loader._res = LoaderResources(loader)
    return loader

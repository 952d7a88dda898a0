"""``DataLoader``: a drop-in for ``torch.utils.data.DataLoader`` over a :class:`LakeDataset`.

It takes torch's keyword arguments with torch's meaning, plus ``rank`` and ``world_size``.
Each iteration is one epoch; ``state_dict()`` says how far the training loop got, and
``load_state_dict()`` continues the same global sequence under any topology.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from lakeloader.checkpoint.barrier import Stand
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.errors import PartitionWarning as PartitionWarning  # its home before errors
from lakeloader.loader_args import RootViews, TorchNames, check_unsupported
from lakeloader.mixture import Mixture
from lakeloader.nodes import as_node
from lakeloader.options import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_IO_THREADS,
    DEFAULT_PREFETCH_FACTOR,
    LoaderOptions,
)
from lakeloader.pipeline.collate import Collate
from lakeloader.pipeline.resources import LoaderResources
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.state.journal import Runs
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.requests import REQUESTS_KEY
from lakeloader.steering import Endless, Steered, Steering, Step
from lakeloader.workers.pool import WorkerPool

L = TypeVar("L", bound="DataLoader")


class DataLoader(TorchNames, RootViews):
    """Streams batches of a :class:`LakeDataset`, deterministically and resumably.

    Args:
        dataset: What to read: a :class:`LakeDataset` (followed or not, packed or not), or a
            :class:`~lakeloader.Mixture` of lakes (see :mod:`lakeloader.nodes`).
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
        self._res = LoaderResources(self)
        self.root = as_node(self, dataset)
        self._steering = Steering()  # what the training loop asks of the order
        if restart_on_iter and self.root.what != "lake":
            raise ValueError(
                f"restart_on_iter=True needs a LakeDataset: a {self.root.what} cannot be "
                "rewound to its start at every iter()"
            )

    def __len__(self) -> int:
        """Steps in a whole pass for this topology (as torch's ``len(loader)``).

        Raises:
            TypeError: For an ``endless`` loader, or a stream with no end (as torch's loader
                over an iterable dataset).
        """
        if self.options.endless:
            raise TypeError("an endless loader (endless=True) has no len(): it never ends")
        return self.root.pass_steps()

    # -------------------------------------------------------------------- epochs
    @property
    def epoch(self) -> int:
        """The epoch the loader is in (or has just finished)."""
        return self.root.epoch

    def set_epoch(self, epoch: int, *, restart: bool = False) -> None:
        """Make the next iteration run ``epoch`` from its start.

        Calling it with the epoch the loader is in keeps the position while that epoch is not
        over (after a resume, or a pass left early), so the usual ``loader.set_epoch(epoch)``
        at the top of an epoch loop never repeats or skips a row; ``restart=True`` drops the
        position in any case. An epoch ends when its rows are delivered, or by this method:
        a new ``iter(loader)`` on an unfinished epoch continues it (unlike torch's loaders,
        whose every ``iter()`` starts a new pass), and the iterator it replaces raises if it
        is used again. A mixture takes the pass under way or the next one; a packed stream
        runs through its epochs by itself (TypeError).
        """
        self.root.set_epoch(epoch, restart)

    def __iter__(self) -> Iterator[Any]:
        """A pass over the epoch under way, or the next one (see the class docstring).

        The pass begins at the first ``next()``: a ``set_epoch`` between ``iter()`` and it
        (Lightning's order when it resumes) moves the pass it begins. Rank and world size are
        resolved then: a pass runs on the topology of its start. Its ``num_steps``: the batches
        the pass delivers from where it starts (None or absent: ``endless``, followed, packed,
        ``backfill=True``, whose quarantine shortens the pass).

        Raises:
            TopologyError: At the first ``next()``, if the world size is above 1 but this
                process's rank is unknown.
        """
        root = self.root
        start = (lambda: Endless(root.begin)) if self.options.endless else root.begin
        return Steered(self._steering, root, self._placed, start)

    def _placed(self) -> None:
        """Place the pass on the topology of now (``restart_on_iter``: at its epoch's start)."""
        self.root.placed(self._resolve_topology(strict=True))
        if self.options.restart_on_iter:
            self.set_epoch(self.epoch, restart=True)

    # --------------------------------------------------------------------- state
    def state_dict(self, *, fetched_ahead: int = 0) -> dict[str, Any]:
        """The position of the training loop: plain types, small.

        Args:
            fetched_ahead: Batches delivered that the training loop has not trained on yet
                (a framework that fetches ahead of its step, as Lightning does for a loader
                without ``len()``): the state stands before them, so that a resume gives
                them again. Up to the last 8 steps of the pass.

        Raises:
            ValueError: If fewer steps than ``fetched_ahead`` were delivered since the
                position was set, or they reach back before the increment a followed lake
                began or resumed in.
        """
        requests = self._steering.state(fetched_ahead)
        return {**self.root.state(fetched_ahead), REQUESTS_KEY: requests}

    def load_state_dict(self, state_dict: Any) -> None:
        """Continue from a state taken under any world size, worker count or batch size.

        It takes any one rank's state, or a list of every rank's of one step (their
        quarantines merged).

        Raises:
            StateFormatError: If it is not a state of this kind of loader, of a known version.
            StateMismatchError: If it belongs to another lake snapshot or configuration.
        """
        self.root.restore(state_dict)
        self._steering.restored(state_dict)

    def steps_left(self) -> int:
        """Global steps left in the epoch under way, for the topology of now.

        With ``len(loader)``, where a framework stands in the epoch: ``len(loader) -
        steps_left()`` steps are done, whatever topology the position was saved under (0
        left: the epoch is over, the next pass begins the next one).

        Raises:
            TypeError: For a loader whose passes have no end (followed, packed, endless).
        """
        len(self)
        return self.root.steps_left()

    def skip(self, steps: int) -> None:
        """Skip the rows of the next ``steps`` global steps (a loss spike's data, say).

        The position moves as if they were trained on; they are not handed over, and
        ``lakeloader audit`` reports them as skipped on request. The request is in the state
        and ``lakeloader inspect`` (:mod:`lakeloader.steering`). Every rank must ask the same.

        Raises:
            ValueError: If ``steps`` is not an int >= 0.
        """
        self._steering.skip(steps)

    def quarantine_step(self, step: int) -> list[QuarantineEntry]:
        """Quarantine the units behind delivered ``step`` (``NaN`` loss: bad data).

        ``step`` counts the batches handed over in the run from 0 (the count is in the
        state). The units that every rank's share of the step read are skipped for good, in
        this and every later epoch, reason ``quarantine_step(<step>)``; it returns the entries
        added. A step to come (restored from before it) is dropped with its units as it comes
        (:mod:`lakeloader.steering`). Every rank must ask the same.

        Raises:
            ValueError: If ``step`` is not an int, or came before the last 64 since the loader
                began or restored.
        """
        return self._steering.quarantine_step(self.root, step)

    # --------------------------------------------- what a CheckpointManager calls
    def barrier_position(self) -> Stand:
        """What the checkpoint barrier compares across ranks (with this rank's quarantine)."""
        return self.root.barrier_position()

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """The state a checkpoint holds, with every rank's quarantine (from the barrier)."""
        state = self.root.checkpoint_state(quarantine)
        return {**state, REQUESTS_KEY: self._steering.requests.to_json()}

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins, by leaf path."""
        return self.root.checkpoint_datasets()

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint, on the lake of now (see ``RecoveryCoordinator.resume``).

        Raises:
            StateFormatError: If it holds another kind of loader's state.
        """
        self.root.restore_checkpoint(ckpt, coordinator)
        self._steering.restored(ckpt.state_dict)

    def observe_steps(self, observer: Callable[[Runs], None]) -> None:
        """Tell ``observer`` of every step delivered (each source's runs of rows or samples)."""
        self.root.observe_steps(observer)

    def _reslice(self, rank: int, world_size: int) -> None:
        """Place the next pass on ``rank`` of ``world_size`` (FaultTolerantLoader: per quorum)."""
        self._placement = (rank, world_size)

    def _roll_back(self, state: dict[str, Any], kept: Step | None) -> None:
        """Stand at FaultTolerantLoader's committed ``state`` again.

        The steps known before that state stay known, with ``kept`` (the last committed), and
        ``restored_before`` stays as it was.
        """
        steering = self._steering
        recent, restored = list(steering.recent), steering.restored_before
        self.load_state_dict(state)
        steering.recent.extend(s for s in recent if s[0] < steering.requests.delivered)
        last = steering.recent[-1][0] if steering.recent else -1
        if kept is not None and last < kept[0] < steering.requests.delivered:
            steering.recent.append(kept)
        steering.restored_before = restored

    # ------------------------------------------------------------------ resources
    def _ensure_pool(self) -> WorkerPool:
        """Start the workers (before any decoding thread exists, which keeps fork safe)."""
        if self._res.pool is None:
            self._res.pool = WorkerPool(
                self.root.worker_setup(), self.num_workers, self.options.multiprocessing_context
            )
        return self._res.pool

    @property
    def _pool(self) -> WorkerPool | None:
        """The worker processes of the pass under way (tests look at their pids)."""
        return self._res.pool

    def _close_iterator(self, ended_by: str) -> None:
        self._res.close_iterator(True, ended_by)

    def close(self) -> None:
        """Stop workers and threads and delete cached units.

        Done anyway when the loader is garbage-collected, and at interpreter exit, and at the
        end of a ``with DataLoader(...) as loader:`` block. A closed loader can still be
        iterated: it starts what it needs again.
        """
        self._close_iterator("loader.close()")
        self._res.shutdown_workers()

    def __enter__(self: L) -> L:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle and copy a loader as its configuration and position, never what it runs.

        ``pickle`` and ``copy.deepcopy`` give a loader over an equal dataset (its snapshot
        included: nothing is listed again), with the same arguments, standing where this one
        stands (an equal ``state_dict()``); iterated, it continues from there. Workers,
        threads, shared memory and a pass under way are not copied (the copy starts its own
        when iterated), nor a checkpoint manager's hold on the position.
        """
        kept = {name: value for name, value in vars(self).items() if name != "_res"}
        return _rebuilt, (type(self), kept)

    def stats(self) -> dict[str, int]:
        """Counters for tests and benchmarks (cumulative over the loader's life)."""
        it, pool, res = self._res.iterator, self._res.pool, self._res
        return {
            **self.root.stats(),
            # Between passes, what the last one left (a mixture's stores) is held for the next.
            "cache_bytes": it.cache_bytes() if it is not None else res.carried_bytes(),
            "cache_peak_bytes": it.cache_peak_bytes() if it is not None else 0,
            "worker_restarts": res.worker_restarts + (pool.restarts if pool else 0),
        }


def _rebuilt(cls: type[DataLoader], kept: dict[str, Any]) -> DataLoader:
    """A loader from what :meth:`DataLoader.__reduce__` kept, with resources of its own."""
    loader = object.__new__(cls)
    loader.__dict__.update(kept)
    loader._res = LoaderResources(loader)
    loader.root.host = loader
    return loader

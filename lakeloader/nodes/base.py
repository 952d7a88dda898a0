"""What a source of batches is to the one :class:`~lakeloader.DataLoader`: the node protocol.

Everything that depends on what the loader reads is a node's; its position (its state) moves
only when a batch is handed over, in the pass the node begins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from lakeloader.cache.decode import UnitDecoder
from lakeloader.cache.packed import RowLayout
from lakeloader.checkpoint.barrier import Stand
from lakeloader.checkpoint.layout import ROOT, Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import ReadCounters, UnitReader
from lakeloader.options import LoaderOptions
from lakeloader.order.plan import slot_units
from lakeloader.pipeline.collate import Transform
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.resources import LoaderResources
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.state.journal import DeliveredRun, Runs
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import ReaderStateTracker, ReaderView
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import WorkerSetup


class Host(Protocol):
    """What a node uses of the :class:`~lakeloader.DataLoader` that holds it."""

    options: LoaderOptions
    _res: LoaderResources

    @property
    def topology(self) -> Topology:
        """Rank, world size, workers and batch size as of now."""

    def _ensure_pool(self) -> WorkerPool:
        """The loader's workers, started."""

    def _close_iterator(self, ended_by: str) -> None:
        """End the pass under way, if any."""


class Node:
    """A source of batches for ``host``, the loader that holds it; a kind overrides what differs."""

    #: What it reads (a followed lake: the increment under way).
    dataset: Any
    #: The reader-state tracker: the position (a lake's epoch and rows; a mixture's pass; a
    #: packed stream's samples), the record of the steps delivered, the rows counted.
    tracker: ReaderStateTracker

    #: The snapshots the loader's workers were set up to decode (see :meth:`_pool_for`).
    _pool_snapshots: tuple[str, ...] | None = None

    def __init__(self, host: Host) -> None:
        self.host = host

    def _pool_for(self, readers: Iterable[UnitReader]) -> WorkerPool:
        """The loader's workers, set up to decode these readers' snapshots.

        Workers set up for other snapshots stop first: a decode task names a file by its place
        in the snapshot its worker knows (a lake that grew, a followed lake's increment).
        """
        snapshots = tuple(reader.snapshot.fingerprint for reader in readers)
        if self._pool_snapshots not in (None, snapshots):
            self.host._res.shutdown_workers()
        self._pool_snapshots = snapshots
        return self.host._ensure_pool()

    @property
    def what(self) -> str:
        """What it reads, as messages name it (``"lake"``, ``"mixture"``, ...)."""
        return "stream"

    def __getstate__(self) -> dict[str, Any]:
        """What a copy keeps: all but the loader (the copy's own loader attaches itself)."""
        return {name: value for name, value in vars(self).items() if name != "host"}

    # ------------------------------------------------------------------ passes
    def pass_steps(self) -> int:
        """Global steps in a whole pass for the topology of now (``len(loader)``).

        Raises:
            TypeError: For a stream with no end.
        """
        raise TypeError(f"a {self.what} is endless: it has no len()")

    @property
    def epoch(self) -> int:
        """The epoch (a mixture's pass) the node is in, or has just finished: its tracker's."""
        return self.tracker.epoch

    def set_epoch(self, epoch: int, restart: bool) -> None:
        """Make the next pass run ``epoch`` (see ``DataLoader.set_epoch``).

        Raises:
            TypeError: For a packed stream, which runs through its epochs by itself.
        """
        raise TypeError(
            "a packed stream is endless, running through its epochs by itself: iterate it for "
            "as many steps as you train, without set_epoch()"
        )

    def placed(self, topology: Topology) -> None:
        """Take the topology a pass starts on."""
        self.tracker.topology = topology

    def begin(self) -> Iterator[Any]:
        """A pass from where the node stands (its iterator; batches in step order)."""
        raise NotImplementedError

    def steps_left(self) -> int:
        """Global steps left in the pass under way, for the topology of now (see pass_steps)."""
        self.pass_steps()  # no end, no steps left to count
        steps = self.view().steps_remaining
        assert steps is not None  # a pass with a length has an end
        return steps

    def worker_setup(self) -> WorkerSetup:
        """What the loader's workers need."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The position: plain types (the loader's ``state_dict()``)."""
        raise NotImplementedError

    def restore(self, state: Any) -> None:
        """Continue from a state (the loader's ``load_state_dict()``)."""
        raise NotImplementedError

    def view(self) -> ReaderView:
        """Where the position leaves every rank and worker (a stream's: and every source)."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Counters for tests and benchmarks."""
        raise NotImplementedError

    @property
    def quarantine(self) -> list[QuarantineEntry]:
        """Units skipped so far, sorted; merged across ranks at saves."""
        return list(self.tracker.quarantine)

    # --------------------------------------------- what a CheckpointManager calls
    def barrier_position(self) -> Stand:
        """What the checkpoint barrier compares across ranks."""
        raise NotImplementedError

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """The state a checkpoint holds, with every rank's quarantine (from the barrier)."""
        self.add_quarantine(quarantine)
        return self.state()

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins, by leaf path (a lake's: its own, at the root)."""
        return {ROOT: self.dataset}

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint's state, on the lakes of now."""
        raise NotImplementedError

    def observe_steps(self, observer: Callable[[Runs], None]) -> None:
        """Tell ``observer`` of every step delivered (each stream's runs of rows or samples)."""
        self.tracker.record.attach(observer)

    @property
    def workers_build(self) -> bool:
        """Whether workers build batches (a transform or collate_fn) rather than decode."""
        return self.tracker.workers_build

    # ------------------------------------------------- what the training loop asks
    def mark_skipping(self, on: bool) -> None:
        """Whether the steps delivered from now on are skipped on request (``skip``)."""
        self.tracker.record.skipping = on

    def last_runs(self) -> tuple[DeliveredRun, ...]:
        """The runs of the last step delivered."""
        return self.tracker.record.last

    def units_behind(self, runs: Iterable[DeliveredRun], reason: str) -> list[QuarantineEntry]:
        """The units whose rows (or tokens) these runs of a step took, as quarantine entries."""
        raise NotImplementedError

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Skip these units for good, from the next pass on (``quarantine_step``)."""
        self.tracker.merge_quarantine(entries)


def row_units(dataset: LakeDataset, run: DeliveredRun, reason: str) -> list[QuarantineEntry]:
    """The units whose rows a run of a row stream (a lake, a mixture's source) took."""
    plan = dataset.plan(run.epoch)
    return unit_entries(dataset, slot_units(plan, run.start, run.stop), reason)


def unit_entries(dataset: LakeDataset, units: np.ndarray, reason: str) -> list[QuarantineEntry]:
    """Quarantine entries of ``dataset``'s units (indices into ``dataset.units``)."""
    u, files = dataset.units, dataset.snapshot.files
    return [
        QuarantineEntry(
            files[int(u.file_index[i])].path,
            int(u.row_group[i]),
            int(u.row_start[i]),
            int(u.num_rows[i]),
            reason,
        )
        for i in units.tolist()
    ]


def make_setup(
    host: Host,
    schema: pa.Schema,
    seed: int,
    recipe: BatchRecipe | None = None,
    layout: RowLayout | None = None,
    decoders: tuple[UnitDecoder, ...] = (),
    transforms: tuple[Transform | None, ...] = (),
) -> WorkerSetup:
    """What ``host``'s workers need on the topology of now (see :class:`WorkerSetup`)."""
    init, recipe = host.options.worker_init_fn, BatchRecipe() if recipe is None else recipe
    rank = host.topology.rank
    return WorkerSetup(schema, layout, recipe, init, seed, rank, decoders, transforms)


def decoding_setup(
    host: Host,
    sources: Sequence[tuple[LakeDataset, UnitReader, RowLayout | None]],
    seed: int,
    recipe: BatchRecipe | None = None,
) -> WorkerSetup:
    """Workers that decode the units of ``sources`` (a task names its source by index).

    Each is packed by its layout (the one its unit store packs by); ``recipe``: what they
    run on packed samples (see :class:`~lakeloader.workers.process.SamplesTask`).
    """
    decoders = tuple(UnitDecoder(r, layout, ds.on_error, ds.validate) for ds, r, layout in sources)
    transforms = tuple(ds.transform for ds, _, _ in sources)
    return make_setup(host, sources[0][1].schema, seed, recipe, None, decoders, transforms)


def read_counts(counters: Iterable[ReadCounters]) -> dict[str, int]:
    """What readers did, by their counters, summed: units decoded, bytes read, requests."""
    counters, names = list(counters), ("units_decoded", "bytes_read", "requests")
    return {name: sum(getattr(c, name) for c in counters) for name in names}

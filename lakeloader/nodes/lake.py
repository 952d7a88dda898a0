"""A lake as a source of batches: one epoch a pass, or a followed lake's increments.

A followed lake (``follow=``) is one stream of rows, its increments end to end: a pass runs
through them until none comes within ``Follow.timeout``, and never moves to the next epoch
before that increment exists. Its state holds the increment it stands in (its marks). With
``drop_last=True`` an increment's short tail opens the next one (:mod:`lakeloader.nodes.carried`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from lakeloader.cache.decode import UnitDecoder
from lakeloader.cache.packed import RowLayout
from lakeloader.checkpoint.barrier import Stand
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import UnitReader
from lakeloader.lake.following import CaughtUpError
from lakeloader.loader_args import warn_cpu_contention, warn_partitions
from lakeloader.nodes.base import Host, Node, make_setup, read_counts, row_units
from lakeloader.nodes.carried import carried_step
from lakeloader.order.plan import steps_in_epoch
from lakeloader.pipeline.backfill import Backfill, backfill_tracker, backfill_view, finisher
from lakeloader.pipeline.iterator import EpochIterator
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.stores import Leaf, Stores
from lakeloader.recovery.coordinator import RecoveryCoordinator, Resumption
from lakeloader.state.journal import DeliveredRun
from lakeloader.state.loader_state import LoaderState
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import ReaderStateTracker, ReaderView
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


class LakeNode(Node):
    """A lake, followed or not (see the module docstring)."""

    dataset: LakeDataset  # the epoch under way's (a followed lake's increment)

    def __init__(self, host: Host, dataset: LakeDataset) -> None:
        super().__init__(host)
        self._base = self.dataset = dataset
        opts = host.options
        #: The reader-state tracker: the position, and where every rank and worker stands.
        self.tracker = ReaderStateTracker(host.topology, drop_last=opts.drop_last)
        if dataset.follow:
            self.tracker.drop_last = False  # a short tail is carried, never counted dropped
        if dataset.config.backfill and opts.collate_fn is not None:
            raise TypeError(
                "backfill=True cuts the default columnar batches to keep every step whole; a "
                "collate_fn's batches cannot be cut: give the dataset a batch_transform instead"
            )
        self.reader: UnitReader
        self.layout: RowLayout | None
        self._use_reader(dataset.reader())
        self._warned: Topology | None = None  # the topology a PartitionWarning was checked for

    @property
    def what(self) -> str:
        """What it reads: a lake, or a followed lake."""
        return "followed lake" if self._base.follow else "lake"

    # ------------------------------------------------------------------ passes
    def pass_steps(self) -> int:
        """Steps in a whole epoch for this topology.

        Raises:
            TypeError: For a followed lake (endless).
        """
        if self._base.follow:
            raise TypeError("a followed lake is endless: it has no len(); see loader.dataset's")
        opts = self.host.options
        return steps_in_epoch(0, len(self.dataset), self.host.topology.global_batch, opts.drop_last)

    def set_epoch(self, epoch: int, restart: bool) -> None:
        """Make the next pass run ``epoch`` from its start (see ``DataLoader.set_epoch``)."""
        if self.tracker.set_epoch(epoch, restart=restart):
            self.host._close_iterator("set_epoch()")

    def placed(self, topology: Topology) -> None:
        """Take the topology a pass starts on (workers of another rank are stopped)."""
        if topology != self.tracker.topology:
            self.host._close_iterator("a pass on another topology")
            self.host._res.shutdown_workers()
            self.tracker.topology = topology
        if topology != self._warned:  # once a topology
            self._warned = topology
            warn_partitions(self.dataset.config.num_partitions, topology)

    def begin(self) -> Iterator[Any]:
        """One epoch's pass; a followed lake's increments one after the other."""
        return self._increments() if self._base.follow else self._epoch_pass()

    def _epoch_pass(self) -> EpochIterator | Backfill:
        host = self.host
        host._close_iterator("a newer iter(loader)")
        self.follow_dataset(self.tracker.start_pass())
        self.tracker.settle_tail(len(self.dataset))
        opts = host.options
        pool = host._ensure_pool() if opts.num_workers else None
        if pool is not None:
            warn_cpu_contention(opts.num_workers)
        res = host._res
        unit_dir = res.unit_folder(opts.cache_dir, opts.cache_bytes)
        leaf = Leaf(self.dataset, self.reader, tuple(self.tracker.quarantine), self.recipe())
        layout, topology = self.layout, host.topology
        tracker, backfill = self.tracker, self.dataset.config.backfill
        if backfill:  # one rank's pass over the whole global steps (pipeline/backfill.py)
            topology = Topology(1, 0, topology.num_workers, topology.global_batch)
            opts = dataclasses.replace(opts, drop_last=False, pin_memory=False)
            tracker = backfill_tracker(self.tracker, topology)
        stores = Stores([leaf], opts, topology, unit_dir, pool, layout, not tracker.workers_build)
        it: EpochIterator | Backfill = EpochIterator(
            stores,
            tracker,
            pool,
            functools.partial(res.pass_ended, opts.persistent_workers),
            owner=host,
        )
        if backfill:
            ds, options = self.dataset, host.options
            finish = finisher(ds.batch_transform, options.pin_memory)
            plan, lists = ds.plan(tracker.epoch), ds.list_format
            args = (plan, ds.snapshot, host.topology, options.drop_last, lists, finish)
            it = Backfill(it, tracker, self.tracker, *args)
        res.iterator = it
        return it

    def _increments(self) -> Iterator[Any]:
        while True:
            try:
                self.follow_dataset(self.tracker.epoch)  # a state at an increment's end: next
                if self.tracker.epoch_over(len(self.dataset)):
                    # make sure the next increment exists before the epoch moves on
                    self._base.for_epoch(self.tracker.epoch + 1)
                    carried = None
                else:
                    carried = carried_step(self)
            except CaughtUpError as caught:
                logger.info("caught up with the lake: %s", caught)
                return
            if carried is None:
                yield from self._epoch_pass()
            else:
                yield carried

    def follow_dataset(self, epoch: int) -> None:
        """Switch to the dataset that ``epoch`` runs on."""
        current = self._base.for_epoch(epoch)
        if current is not self.dataset:
            logger.info(
                "epoch %d runs on snapshot %s (was %s)",
                epoch,
                current.fingerprint,
                self.dataset.fingerprint,
            )
            self.host._res.shutdown_workers()  # their schema may have widened
            self.dataset = current
            self._use_reader(current.reader())

    def _use_reader(self, reader: UnitReader) -> None:
        """Read through ``reader``, and work out now how its rows are packed.

        Tensor-typed columns are packed unless rows go to a transform or a collate_fn (worked
        out here, not at ``iter()``: pyarrow may import pandas then).
        """
        before = getattr(self, "reader", None)
        if before is not None:  # another increment or snapshot: its reads go on counting
            reader.count_into(before.counters)
        self.reader = reader
        recipe = self.recipe()
        self.layout = None if recipe.rows_path else RowLayout.of(reader.schema)
        # Workers decode when columns are packed and no user code runs; else they build.
        packs = self.layout is not None and bool(self.layout.names)
        self.tracker.workers_build = not packs or recipe.user_code
        self.tracker.lost = self.dataset.lost

    def recipe(self) -> BatchRecipe:
        """How rows become batches (the dataset's transforms, the loader's collate_fn)."""
        ds = self.dataset
        collate = self.host.options.collate_fn
        after = None if ds.config.backfill else ds.batch_transform  # backfill: once cut
        return BatchRecipe(ds.transform, collate, after, ds.list_format)

    def worker_setup(self) -> WorkerSetup:
        """What the workers need: the lake's decoder, or what builds its batches."""
        layout, ds = self.layout, self.dataset
        decoders: tuple[UnitDecoder, ...] = ()
        if layout is not None and not self.tracker.workers_build:  # they decode
            decoders = (UnitDecoder(self.reader, layout, ds.on_error, ds.validate),)
        schema, seed = self.reader.schema, ds.config.seed
        return make_setup(self.host, schema, seed, self.recipe(), layout, decoders)

    # ------------------------------------------------------------------ state
    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The position of the training loop: plain types, O(1) in the size of the lake.

        A followed lake's holds the increment it stands in.

        Raises:
            ValueError: If fewer steps than ``fetched_ahead`` were delivered since the
                position was set, or they reach back before the increment a followed lake
                began or resumed in.
        """
        return self._position(fetched_ahead).to_dict()

    def _epoch_dataset(self, epoch: int) -> LakeDataset:
        """The dataset ``epoch`` runs on, also before a pass of it began.

        A checkpoint's pinned snapshot for its epoch, then the lake of now; a followed lake's
        increments since the one it began or resumed in (a carried step's, steps fetched ahead).
        """
        if self._base.follow and epoch == self.tracker.epoch:
            return self.dataset
        if self._base.follow and not _increment(self._base) <= epoch < self.tracker.epoch:
            raise ValueError(
                f"cannot stand before batches of increment {epoch} of a followed lake from "
                f"increment {self.tracker.epoch}: it began (or resumed) at increment "
                f"{_increment(self._base)}"
            )
        return self._base.for_epoch(epoch)

    def restore(self, state: Any) -> None:
        """Continue from a state taken under any world size, worker count or batch size.

        A followed lake's state whose increment the lake no longer holds: ``StateMismatchError``.
        """
        self.resume(RecoveryCoordinator().resume_state(state, self._base))

    def resume(self, resumption: Resumption) -> None:
        """Apply what the recovery coordinator decided (the one way a position is restored)."""
        self.host._close_iterator("load_state_dict() or CheckpointManager.load()")
        if resumption.dataset is not None:
            self.host._res.shutdown_workers()
            self._base = self.dataset = resumption.dataset
            self._use_reader(resumption.dataset.reader())
        if resumption.state is None:
            assert resumption.restart_epoch is not None
            self.tracker.set_epoch(resumption.restart_epoch, restart=True)
            return
        self.follow_dataset(resumption.state.epoch)
        ds = self.dataset  # the dataset that the saved epoch runs on here
        resumption.state.check_matches(ds.fingerprint, ds.config.to_dict())
        self.tracker.restore(resumption.state)

    def view(self) -> ReaderView:
        """Where the position leaves every rank and worker (see ``DataLoader.view``)."""
        self.placed(self.host.topology)  # the ranks of now, not those of the last pass
        tracker = self.tracker  # a loaded state's epoch may be the next one
        ds = self._epoch_dataset(tracker.epoch)
        if ds.config.backfill:
            return backfill_view(tracker, ds.plan(tracker.epoch), ds.snapshot, self.host.topology)
        return tracker.view(ds.plan(tracker.epoch), ds.snapshot)

    def stats(self) -> dict[str, int]:
        """Counters of the lake's reads and of the rows delivered and skipped."""
        return {
            **read_counts([self.reader.counters]),
            "rows_delivered": self.tracker.rows_delivered,
            "rows_skipped": self.tracker.rows_skipped,
        }

    # --------------------------------------------- what a CheckpointManager calls
    def _position(self, back: int = 0) -> LoaderState:
        """The state ``back`` steps delivered back (a followed lake's names its increment)."""
        ds = self._epoch_dataset(self.tracker.before(back)[0])
        state = self.tracker.state(ds.fingerprint, ds.config.to_dict(), len(ds), back=back)
        if self._base.follow and ds.snapshot.increment is not None:
            state = dataclasses.replace(state, increment=ds.snapshot.increment.to_list())
        return state

    def barrier_position(self) -> Stand:
        """What the checkpoint barrier compares across ranks (with this rank's quarantine)."""
        s = self._position()
        return Stand(s.fingerprint, s.config_hash, s.epoch, s.position, s.quarantine)

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint, on the lake of now (see ``RecoveryCoordinator.resume``)."""
        self.resume(coordinator.resume(ckpt, self.dataset))

    # ------------------------------------------------- what the training loop asks
    def units_behind(self, runs: Iterable[DeliveredRun], reason: str) -> list[QuarantineEntry]:
        """The units whose rows these runs took (every rank's share of the step)."""
        return [e for r in runs for e in row_units(self._epoch_dataset(r.epoch), r, reason)]


def _increment(dataset: LakeDataset) -> int:
    """The number of a followed lake's increment (its epoch)."""
    increment = dataset.snapshot.increment
    return 0 if increment is None else increment.index

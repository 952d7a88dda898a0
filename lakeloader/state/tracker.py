"""The reader-state tracker: what the training loop has been given, and where everyone stands.

:class:`ReaderStateTracker` owns a lake loader's position (epoch, ``G`` global rows delivered,
rows dropped, quarantine), moved only when a batch is handed over; from it the per-rank and
per-worker view is derived (:meth:`ReaderStateTracker.view`). A mixture's or a packed stream's
tracker mirrors its node's cursor, which is that loader's state: move it through the loader,
not by its own methods.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from lakeloader.lake.snapshot import Snapshot
from lakeloader.order.plan import EpochPlan, steps_in_epoch
from lakeloader.state.journal import DeliveredRun, StepRecord
from lakeloader.state.loader_state import LoaderState, config_hash
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.state.view import RankView, SourceView, WorkerView, step_shares, worker_views
from lakeloader.topology import Topology

logger = logging.getLogger(__name__)

#: Steps delivered whose earlier positions a tracker keeps (see ``ReaderStateTracker.before``).
RECENT_STEPS = 8


class Delivery(NamedTuple):
    """What the tracker learns as a batch is handed over (a tuple: made at every ``next()``).

    Attributes:
        slot_stop: One past the last global slot of the step (the new position G).
        rows: Rows this rank delivered.
        last: Whether it is the pass's last step.
        skipped: Quarantined units whose rows this step would have held.
        rows_skipped: Rows of this rank's share left out for them.
    """

    slot_stop: int
    rows: int
    last: bool
    skipped: tuple[QuarantineEntry, ...]
    rows_skipped: int


@dataclass(frozen=True)
class ReaderView:
    """Where a position leaves every rank and worker (see :mod:`lakeloader.state.view`).

    Attributes:
        epoch: The epoch.
        position: Global rows of the epoch delivered (G); a mixture's: of its pass; a packed
            stream's: samples delivered, over every epoch.
        num_rows: Rows in the epoch (N); a mixture's: rows its pass delivers (whole global
            batches); None for a packed stream (endless).
        rows_dropped: Rows dropped by ``drop_last`` so far.
        steps_remaining: Global steps left in the epoch under the topology; None for a
            packed stream.
        rows_to_drop: Rows that ``drop_last`` will drop at the epoch's end.
        ranks: Each rank's share of the next step (a packed stream's: samples, located at
            the unit its first sample begins in).
        workers: What each worker of each rank does first (a lake's; none is derived for a
            mixture or a packed stream, whose workers take work as it is planned).
        sources: A mixture's or a packed stream's sources: where each stands.
    """

    epoch: int
    position: int
    num_rows: int | None
    rows_dropped: int = field(default=0, kw_only=True)
    steps_remaining: int | None
    rows_to_drop: int = field(default=0, kw_only=True)
    ranks: tuple[RankView, ...]
    workers: tuple[WorkerView, ...] = field(default=(), kw_only=True)
    sources: tuple[SourceView, ...] = ()


class ReaderStateTracker:
    """The delivered position of one loader, and the view derived from it.

    Args:
        topology: The loader's topology.
        drop_last: Whether a short last global batch is dropped (its rows are counted).
        workers_build: Whether workers build batches (a transform or a collate_fn) rather
            than decode units; it decides what the per-worker view says.

    Example:
        >>> from lakeloader.topology import Topology
        >>> t = ReaderStateTracker(Topology(1, 0, 0, 4), drop_last=False)
        >>> t.start_pass(), t.epoch
        (0, 0)
        >>> t.delivered(Delivery(4, 4, False, (), 0)); t.position
        4
    """

    def __init__(self, topology: Topology, *, drop_last: bool, workers_build: bool = False) -> None:
        self.topology = topology
        self.drop_last = drop_last
        self.workers_build = workers_build
        self.epoch = 0
        self.position = 0
        self.rows_dropped = 0
        self.quarantine: tuple[QuarantineEntry, ...] = ()
        #: Units of the current dataset that can no longer be read (files gone or rewritten
        #: since a checkpoint, ``on_lake_change="skip"``): skipped like the quarantine.
        self.lost: tuple[QuarantineEntry, ...] = ()
        self._num_rows: int | None = None  # rows of the epoch under way, once known
        #: Rows delivered and rows skipped (quarantine) over the loader's life.
        self.rows_delivered = 0
        self.rows_skipped = 0
        #: Whether the next pass continues the position as it is (a fresh loader, a loaded
        #: state, or ``set_epoch``) rather than starting the next epoch.
        self._fresh = True
        #: The runs of the steps delivered, for the audit ledger (journaled until attached).
        self.record = StepRecord()
        #: (epoch, position, rows dropped) before each of the last steps delivered.
        self._before: deque[tuple[int, int, int]] = deque(maxlen=RECENT_STEPS)

    @classmethod
    def standing_at(
        cls, state: LoaderState, topology: Topology, *, drop_last: bool, workers_build: bool
    ) -> ReaderStateTracker:
        """A tracker standing exactly at a saved position (for inspection).

        Unlike :meth:`restore`, a position at its epoch's end stays there.
        """
        tracker = cls(topology, drop_last=drop_last, workers_build=workers_build)
        tracker.epoch, tracker.position = state.epoch, state.position
        tracker.rows_dropped, tracker.quarantine = state.rows_dropped, state.quarantine
        return tracker

    # ------------------------------------------------------------------ transitions
    def set_epoch(self, epoch: int, *, restart: bool = False) -> bool:
        """Make the next pass run ``epoch`` from its start; False if nothing changed.

        The epoch under way keeps its position while it is not over; ``restart=True`` drops
        it in any case.
        """
        if epoch == self.epoch and not restart and not self.epoch_over(self._num_rows):
            return False
        self.epoch, self.position, self.rows_dropped, self._fresh = int(epoch), 0, 0, True
        self._before.clear()
        return True

    def epoch_over(self, num_rows: int | None) -> bool:
        """Whether the epoch under way (of ``num_rows`` rows, None: not known) is begun and out."""
        if num_rows is None:
            return False
        return not self._fresh and self.position + self.rows_dropped >= num_rows

    def start_pass(self) -> int:
        """Begin a pass and return its epoch (the next one if this one's rows are all out).

        A pass left early does not end an epoch; one whose rows are delivered or dropped does.
        """
        if self.epoch_over(self._num_rows):
            self.epoch, self.position, self.rows_dropped = self.epoch + 1, 0, 0
        elif not self._fresh:
            logger.info(
                "epoch %d continues from row %d of %s (a pass left early does not end it)",
                self.epoch,
                self.position,
                self._num_rows,
            )
        self._fresh = False
        return self.epoch

    def settle_tail(self, num_rows: int) -> None:
        """Note the epoch's rows; with ``drop_last``, count a tail too short for a step dropped."""
        self._num_rows = num_rows
        if self.drop_last and not self.steps_left(num_rows):
            self.rows_dropped = num_rows - self.position

    def steps_left(self, num_rows: int) -> int:
        """Global steps left in the epoch of ``num_rows`` rows under this topology."""
        return steps_in_epoch(self.position, num_rows, self.topology.global_batch, self.drop_last)

    def delivered(
        self, d: Delivery, num_rows: int | None = None, runs: Sequence[DeliveredRun] | None = None
    ) -> None:
        """A batch was handed to the training loop: the position moves to ``d.slot_stop``.

        Args:
            d: The delivery.
            num_rows: Rows in the epoch; with ``drop_last``, the rows after the last step
                of the pass are counted as dropped.
            runs: What the step moved, for the audit (a mixture's sources, a packed
                stream's samples); a lake's step moves the position itself.
        """
        self._before.append((self.epoch, self.position, self.rows_dropped))
        start = self.moved(d, num_rows)
        if runs is None:
            runs = (DeliveredRun(self.epoch, start, d.slot_stop, num_rows or 0, self.topology),)
        self.record.step(runs)

    def moved(self, d: Delivery, num_rows: int | None = None) -> int:
        """Move the position as :meth:`delivered` does, recording no step; where it was.

        For the parts of a followed lake's carried step, which :meth:`stepped` records.
        """
        start, self.position = self.position, d.slot_stop
        self.rows_delivered += d.rows
        self.rows_skipped += d.rows_skipped
        if d.skipped:
            self.merge_quarantine(d.skipped)
        if d.last and self.drop_last and num_rows is not None:
            self.rows_dropped = num_rows - d.slot_stop
        return start

    def stepped(self, before: tuple[int, int, int], runs: Sequence[DeliveredRun]) -> None:
        """A step whose parts were :meth:`moved` (a followed lake's carried step), one step.

        ``before``: (epoch, position, rows dropped) when it began, what :meth:`before` gives.
        """
        self._before.append(before)
        self.record.step(runs)

    def restore(self, state: LoaderState) -> None:
        """Take a saved position (checked by the recovery coordinator beforehand).

        A position at its epoch's end continues with the next epoch, and ``set_epoch`` of
        that epoch keeps it so.
        """
        if state.at_epoch_end:
            state = replace(state, epoch=state.epoch + 1, position=0, rows_dropped=0)
        self.epoch, self.position = state.epoch, state.position
        self.rows_dropped, self.quarantine = state.rows_dropped, tuple(merge(state.quarantine))
        self._fresh = True
        self.record.restored()
        self._before.clear()

    def merge_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add quarantine entries (this rank's, or all ranks' at a checkpoint's barrier)."""
        self.quarantine = tuple(merge(self.quarantine, entries))

    # ---------------------------------------------------------------------- reading
    def before(self, steps: int) -> tuple[int, int, int]:
        """(epoch, position, rows dropped) as they were ``steps`` deliveries ago.

        Raises:
            ValueError: If fewer steps than that were delivered since the pass, the restore
                or the ``set_epoch`` that the position comes from (or more than are kept).
        """
        if steps == 0:
            return self.epoch, self.position, self.rows_dropped
        if not 0 < steps <= len(self._before):
            raise ValueError(
                f"cannot stand {steps} steps back: {len(self._before)} were delivered since "
                f"the position was last set (at most {RECENT_STEPS} are kept)"
            )
        return self._before[-steps]

    def state(
        self, fingerprint: str, config: dict[str, Any], num_rows: int, *, back: int = 0
    ) -> LoaderState:
        """The position as a versioned state.

        Args:
            fingerprint: The fingerprint of the snapshot this epoch runs on.
            config: The order configuration (plain types).
            num_rows: Rows in the epoch.
            back: Stand this many delivered steps back (see :meth:`before`).
        """
        epoch, position, rows_dropped = self.before(back)
        return LoaderState(
            fingerprint=fingerprint,
            config_hash=config_hash(config),
            config=dict(config),
            epoch=epoch,
            position=position,
            rows_dropped=rows_dropped,
            num_rows=num_rows,
            topology=self.topology,
            quarantine=self.quarantine,
        )

    def view(self, plan: EpochPlan, snapshot: Snapshot) -> ReaderView:
        """What a loader continuing from here does first: each rank's share, each worker's task.

        Args:
            plan: The plan of this epoch.
            snapshot: Its snapshot.
        """
        n, g = plan.num_rows, self.position
        remaining = max(0, n - g - self.rows_dropped)
        steps = self.steps_left(n) if remaining else 0
        deliver_stop = min(n, g + steps * self.topology.global_batch)
        return ReaderView(
            epoch=self.epoch,
            position=g,
            num_rows=n,
            rows_dropped=self.rows_dropped,
            steps_remaining=steps,
            rows_to_drop=remaining - (deliver_stop - g),
            ranks=tuple(step_shares(plan, snapshot, g, steps, self.topology, 0)),
            workers=tuple(
                worker_views(
                    plan,
                    snapshot,
                    g,
                    self.topology,
                    steps=steps,
                    workers_build=self.workers_build,
                    skipped=(*self.quarantine, *self.lost),
                )
            ),
        )

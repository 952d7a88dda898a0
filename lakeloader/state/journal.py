"""The delivery journal: what a loader delivered before anyone recorded it.

A loader's position moves only when a batch is handed to the training loop, so the steps it
delivered since it began (fresh, or from a restored state) are known from its position alone:
consecutive steps of one epoch under one topology form a *run* ``[start, stop)``. The journal
keeps those runs (a handful per epoch, whatever the number of steps) until an observer, the
checkpoint manager's audit ledger, is attached; the ledger then records them as they were
delivered, so that a training loop that never calls ``CheckpointManager.attach`` is audited
from its first step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lakeloader.topology import Topology


@dataclass(frozen=True)
class DeliveredRun:
    """Consecutive steps of one epoch under one topology.

    Attributes:
        epoch: The epoch.
        start: The global position before the first step.
        stop: The global position after the last step.
        num_rows: Rows in the epoch.
        topology: The loader's topology.
        steps: Steps in the run.
    """

    epoch: int
    start: int
    stop: int
    num_rows: int
    topology: Topology
    steps: int = 1

    def same_run(self, epoch: int, num_rows: int, topology: Topology) -> bool:
        """Whether a step of ``epoch`` may extend this run (its start is checked apart)."""
        return epoch == self.epoch and num_rows == self.num_rows and topology == self.topology


class DeliveryJournal:
    """The runs of steps delivered since the loader began or was restored.

    The open run is kept as plain fields, so that a step costs a comparison and two
    additions (it is recorded in every ``next()``).

    Example:
        >>> from lakeloader.topology import Topology
        >>> t = Topology(2, 0, 0, 4)
        >>> j = DeliveryJournal()
        >>> for g in range(0, 24, 8):
        ...     j.record(0, g, g + 8, 30, t)
        >>> j.record(0, 24, 30, 30, t); j.record(1, 0, 8, 30, t)
        >>> [(r.epoch, r.start, r.stop, r.steps) for r in j.take()]
        [(0, 0, 30, 4), (1, 0, 8, 1)]
        >>> j.take()
        []
    """

    def __init__(self) -> None:
        self._runs: list[DeliveredRun] = []
        self._open: DeliveredRun | None = None  # epoch, start, num_rows, topology of the run
        self._stop = 0
        self._steps = 0

    def record(self, epoch: int, start: int, stop: int, num_rows: int, topology: Topology) -> None:
        """A step of ``epoch`` covering global positions ``[start, stop)`` was delivered."""
        run = self._open
        if run is None or start != self._stop or not run.same_run(epoch, num_rows, topology):
            self._close()
            self._open = DeliveredRun(epoch, start, stop, num_rows, topology)
            self._steps = 0
        self._stop = stop
        self._steps += 1

    def _close(self) -> None:
        if self._open is not None:
            self._runs.append(replace(self._open, stop=self._stop, steps=self._steps))
            self._open = None

    def take(self) -> list[DeliveredRun]:
        """The runs recorded so far; the journal is empty afterwards."""
        self._close()
        runs, self._runs = self._runs, []
        return runs

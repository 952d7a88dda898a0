"""``MixtureState``: where a mixture loader stands, as versioned plain data, O(sources)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from lakeloader.state.loader_state import Quarantined, quarantine_json
from lakeloader.state.quarantine import QuarantineEntry

#: The ``kind`` of a mixture state.
MIXTURE_KIND: Final = "mixture"


@dataclass(frozen=True)
class WeightChange:
    """Weights in force from global slot ``start`` on, as the user gave them."""

    start: int
    weights: Mapping[str, float]


def epoch_start_keys(increment: list[Any] | None, start: int, epoch: int) -> dict[str, Any]:
    """Where a stream's epoch (a followed lake's: its increment) begins, as a state keeps it.

    Both keys always: ``torch.distributed.checkpoint`` fills only the keys a fresh state has.
    """
    if increment is not None:
        return {"increment": increment, "start": start}
    return {"start": start, "from_epoch": epoch}


@dataclass(frozen=True)
class SourceRecord:
    """What a source was when the state was taken.

    Attributes:
        config: The hash of its order configuration.
        rows: Rows in one of its epochs.
        increment: A followed lake's: the marks of the increment its count stands in (the
            record is that increment's), or None.
        start: The offset in the source's stream of the first row of the epoch the record is
            of (a followed lake's: of the increment); 0 when its epochs all hold ``rows`` from
            offset 0 (they do not after its lake grew, or an epoch restarted, at a resume).
        epoch: The number of that epoch (0 with ``start`` 0; a followed lake's: see
            ``increment``).
    """

    fingerprint: str
    config: str
    rows: int
    increment: list[Any] | None = None
    start: int = 0
    epoch: int = 0

    def same_source(self, other: SourceRecord) -> bool:
        """Whether both are of the same snapshot, configuration and increment (wherever in it)."""
        return (self.fingerprint, self.config, self.rows, self.increment) == (
            other.fingerprint,
            other.config,
            other.rows,
            other.increment,
        )

    def where(self, count: int) -> tuple[int, int]:
        """The epoch that offset ``count`` of the source's stream stands in, and its place."""
        if self.increment is not None:
            return int(self.increment[0]), count - self.start
        epoch, position = divmod(count - self.start, max(self.rows, 1))
        return self.epoch + epoch, position

    def to_dict(self, count: int) -> dict[str, Any]:
        """Plain types, with where ``count`` stands: its epoch and position (for readers)."""
        epoch, position = self.where(count)  # derived from the count, for people reading it
        return {
            "fingerprint": self.fingerprint,
            "config": self.config,
            "rows": self.rows,
            **epoch_start_keys(self.increment, self.start, self.epoch),
            "epoch": epoch,
            "position": position,
        }


@dataclass(frozen=True)
class MixtureState(Quarantined):
    """A mixture loader's position (see the module docstring).

    Attributes:
        slot: Global slots delivered since the start of the run.
        counts: ``{name: slots drawn from it}``, sources removed at a resume included (one
            added back continues from its count).
        history: Weight changes, the first at slot 0.
        epoch: The pass over the mixture under way (or just finished).
        epoch_start: The slot that pass started at.
        sources: Those of the mixture now, by name.
        topology: The topology of the loader that took the state (for reports).
        quarantine: Units of every source skipped for good (entries name their files).
    """

    seed: int
    slot: int
    counts: Mapping[str, int]
    history: tuple[WeightChange, ...]
    epoch: int
    epoch_start: int
    epoch_rows: int
    sources: Mapping[str, SourceRecord]
    topology: Mapping[str, int] = field(default_factory=dict)
    quarantine: tuple[QuarantineEntry, ...] = ()

    @property
    def epoch_done(self) -> bool:
        """Whether the pass under way has delivered its rows."""
        return self.slot - self.epoch_start >= self.epoch_rows

    def to_dict(self) -> dict[str, Any]:
        """Plain types (what ``DataLoader.state_dict()`` returns for a mixture)."""
        # version 2: a source record names the epoch it stands in (``start``, ``from_epoch``: a
        # lake grew at a resume), which an older lakeloader refuses to misread
        return {
            "kind": MIXTURE_KIND,
            "version": 2
            if any(r.increment is None and r.start for r in self.sources.values())
            else 1,
            "seed": self.seed,
            "slot": self.slot,
            "counts": dict(self.counts),
            "history": [{"start": c.start, "weights": dict(c.weights)} for c in self.history],
            "epoch": self.epoch,
            "epoch_start": self.epoch_start,
            "epoch_rows": self.epoch_rows,
            "sources": {
                name: r.to_dict(self.counts.get(name, 0)) for name, r in self.sources.items()
            },
            "topology": dict(self.topology),
            "quarantine": quarantine_json(self.quarantine),
        }

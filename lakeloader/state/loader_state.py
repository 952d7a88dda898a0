"""A lake loader's position ``(epoch, G)`` as versioned plain data; what every state shares."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import Field, dataclass, replace
from typing import Any, ClassVar, Final, TypeVar

import msgpack

from lakeloader.errors import StateMismatchError
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.topology import Topology

#: The ``kind`` of a lake's state (a mixture's is ``"mixture"``, a packed stream's ``"packed"``).
LAKE_KIND: Final = "lakeloader.loader_state"
#: Version of a lake's state (2: the quarantine is one JSON string); 1 is read too.
LAKE_VERSION: Final = 2


def config_hash(config: dict[str, Any]) -> str:
    """Stable hash of an order-defining configuration (keys sorted, msgpack-encoded).

    >>> config_hash({"seed": 0, "shuffle": True}) == config_hash({"shuffle": True, "seed": 0})
    True
    """
    packed = msgpack.packb(sorted(config.items()), use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()[:16]


def quarantine_json(entries: Iterable[QuarantineEntry]) -> str:
    """A state's quarantine: one JSON string, so ``torch.distributed.checkpoint`` sees one value."""
    return json.dumps([q.to_dict() for q in entries])


class Quarantined:
    """What every state has: a quarantine, of units skipped for good, merged and sorted."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    quarantine: tuple[QuarantineEntry, ...]

    def with_quarantine(self: Q, entries: Iterable[QuarantineEntry]) -> Q:
        """This state with ``entries`` added to its quarantine (merged, sorted)."""
        return replace(self, quarantine=tuple(merge(self.quarantine, entries)))


Q = TypeVar("Q", bound=Quarantined)


@dataclass(frozen=True)
class LoaderState(Quarantined):
    """A lake loader's position, with what it is valid for.

    Attributes:
        fingerprint: Of the snapshot the position refers to.
        config: The order-defining configuration (seed, C, window, shuffle, columns, ...).
        position: Global rows of the epoch delivered to the training loop (G).
        rows_dropped: Rows of the epoch dropped by ``drop_last`` (counted, never silent).
        num_rows: Rows in the epoch (N), for reports.
        topology: The topology the state was taken under (information, not a constraint).
        increment: A followed lake's: the marks of the increment its epoch is (written as
            ``follow_increment``), else None.
    """

    fingerprint: str
    config_hash: str
    config: dict[str, Any]
    epoch: int
    position: int
    rows_dropped: int
    num_rows: int
    topology: Topology
    quarantine: tuple[QuarantineEntry, ...] = ()
    increment: list[Any] | None = None

    @property
    def at_epoch_end(self) -> bool:
        """Whether the position sits at its epoch's end (the rest of the epoch is empty)."""
        return self.position + self.rows_dropped >= self.num_rows

    def to_dict(self) -> dict[str, Any]:
        """Plain types only: msgpack- and JSON-serialisable."""
        return {
            "kind": LAKE_KIND,
            "version": LAKE_VERSION,
            "fingerprint": self.fingerprint,
            "config_hash": self.config_hash,
            "config": dict(self.config),
            "epoch": self.epoch,
            "position": self.position,
            "rows_dropped": self.rows_dropped,
            "num_rows": self.num_rows,
            "topology": self.topology.to_dict(),
            "quarantine": quarantine_json(self.quarantine),
            **({} if self.increment is None else {"follow_increment": self.increment}),
        }

    def check_matches(self, fingerprint: str, config: dict[str, Any]) -> None:
        """Refuse a state of another lake snapshot or another configuration.

        Raises:
            StateMismatchError: Showing the saved and the current values.
        """
        if self.fingerprint != fingerprint:
            raise StateMismatchError(
                f"the state belongs to another lake snapshot: saved fingerprint "
                f"{self.fingerprint}, this dataset's {fingerprint}. Point the dataset at the "
                "lake the state was taken from, unchanged"
            )
        if self.config_hash != config_hash(config):
            diff = {
                k: (self.config.get(k), config.get(k))
                for k in sorted(set(self.config) | set(config))
                if self.config.get(k) != config.get(k)
            }
            raise StateMismatchError(
                "the state was taken under another order configuration; "
                f"(saved, current) by key: {diff}. Build the dataset with the saved values"
            )

"""The loader's position as plain data: what the training loop has been given, nothing more.

The whole position of a run is ``(epoch, G)``: ``G`` global rows of the epoch delivered (see
docs/design.md). Together with the snapshot fingerprint and the configuration hash it restores
the exact global sequence under any world size, worker count or batch size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import msgpack

from lakeloader.errors import StateFormatError, StateMismatchError
from lakeloader.state import keys as K
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology


def config_hash(config: dict[str, Any]) -> str:
    """Stable hash of an order-defining configuration (keys sorted, msgpack-encoded).

    >>> config_hash({"seed": 0, "shuffle": True}) == config_hash({"shuffle": True, "seed": 0})
    True
    """
    packed = msgpack.packb(sorted(config.items()), use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()[:16]


@dataclass(frozen=True)
class LoaderState:
    """A loader's position, with what it is valid for.

    Attributes:
        fingerprint: Fingerprint of the snapshot the position refers to.
        config_hash: Hash of ``config``.
        config: The order-defining configuration (seed, C, window, shuffle, columns, ...).
        epoch: The epoch.
        position: Global rows of the epoch delivered to the training loop (G).
        rows_dropped: Rows of the epoch dropped by ``drop_last`` (counted, never silent).
        num_rows: Rows in the epoch (N), for reports.
        topology: The topology the state was taken under (information, not a constraint).
        quarantine: Units skipped for good (``on_error="skip"``), merged and sorted.
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

    @property
    def at_epoch_end(self) -> bool:
        """Whether the position sits at its epoch's end (the rest of the epoch is empty)."""
        return self.position + self.rows_dropped >= self.num_rows

    def to_dict(self) -> dict[str, Any]:
        """Plain types only: msgpack- and JSON-serialisable."""
        return {
            K.STATE_KIND: K.STATE_KIND_VALUE,
            K.STATE_VERSION: K.STATE_FORMAT_VERSION,
            K.STATE_FINGERPRINT: self.fingerprint,
            K.STATE_CONFIG_HASH: self.config_hash,
            K.STATE_CONFIG: dict(self.config),
            K.STATE_EPOCH: self.epoch,
            K.STATE_POSITION: self.position,
            K.STATE_DROPPED: self.rows_dropped,
            K.STATE_NUM_ROWS: self.num_rows,
            K.STATE_TOPOLOGY: self.topology.to_dict(),
            K.STATE_QUARANTINE: json.dumps([q.to_dict() for q in self.quarantine]),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LoaderState:
        """Parse a dict made by :meth:`to_dict` (possibly after a msgpack or JSON trip).

        Raises:
            StateFormatError: If it is not a lakeloader state or has an unknown version.
        """
        if not isinstance(state, dict) or state.get(K.STATE_KIND) != K.STATE_KIND_VALUE:
            raise StateFormatError(
                f"not a lakeloader state (expected {K.STATE_KIND}={K.STATE_KIND_VALUE!r}); "
                f"got a {type(state).__name__}"
            )
        version = state.get(K.STATE_VERSION)
        if version not in K.STATE_VERSIONS_READ:
            raise StateFormatError(
                f"state format version {version!r} is not supported (this lakeloader reads "
                f"versions {list(K.STATE_VERSIONS_READ)}); use the lakeloader that wrote it"
            )
        try:
            return cls(
                fingerprint=str(state[K.STATE_FINGERPRINT]),
                config_hash=str(state[K.STATE_CONFIG_HASH]),
                config=dict(state[K.STATE_CONFIG]),
                epoch=int(state[K.STATE_EPOCH]),
                position=int(state[K.STATE_POSITION]),
                rows_dropped=int(state[K.STATE_DROPPED]),
                num_rows=int(state[K.STATE_NUM_ROWS]),
                topology=Topology.from_dict(state[K.STATE_TOPOLOGY]),
                quarantine=_quarantine(state[K.STATE_QUARANTINE], version),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFormatError(f"malformed lakeloader state: {exc!r}") from exc

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


def _quarantine(value: Any, version: int) -> tuple[QuarantineEntry, ...]:
    """The quarantine of a state: JSON text since version 2, a list of dicts in version 1.

    One string, not a list, so that ``torch.distributed.checkpoint``, which flattens lists
    into keys, sees one value whatever the number of entries, and a fresh loader's state (no
    entries) has the same keys as a saved one.
    """
    entries = json.loads(value) if version >= 2 else value
    if not isinstance(entries, list):
        raise TypeError(f"quarantine must be a list of entries, got {type(entries).__name__}")
    return tuple(QuarantineEntry.from_dict(q) for q in entries)

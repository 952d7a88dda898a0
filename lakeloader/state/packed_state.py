"""``PackedState``: where a packed loader stands, as versioned plain data, O(partitions).

Each rank reads whole partitions (:mod:`lakeloader.order.packing`), so each rank knows the
position of its own partitions only: ``state_dict()`` holds those, and a resume under another
world size loads the states of every rank (a list), merged here. A state also names the units
skipped so far (``on_error="skip"``, ``validate``): its ``quarantine``, the union of the
ranks' at a merge. A state written before it had one loads with none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from lakeloader.errors import StateFormatError, StateMismatchError
from lakeloader.state.mixture_state import MixtureState
from lakeloader.state.quarantine import QuarantineEntry, merge

#: The ``kind`` of a packed state.
PACKED_KIND: Final = "packed"
#: Version of the format below; states of other versions are refused.
PACKED_STATE_VERSION: Final = 1


@dataclass(frozen=True)
class PartitionPosition:
    """Where one partition's token stream stands, and what it has delivered.

    Attributes:
        epoch: The epoch its next rows come from.
        row: Its next row's position in the partition.
        offset: Tokens of that row already delivered.
        tokens: Tokens delivered so far (separators included, padding not).
        padding: Padding tokens delivered so far (ends of epochs).
    """

    epoch: int
    row: int
    offset: int
    tokens: int = 0
    padding: int = 0


@dataclass(frozen=True)
class PackedState:
    """A packed loader's position (see the module docstring).

    Attributes:
        fingerprint: The snapshot's fingerprint.
        config: Hash of the order configuration and the packing.
        num_partitions: C.
        samples: Samples delivered by each partition (all advance together).
        partitions: ``{partition: PartitionPosition}`` of the partitions this state covers.
        quarantine: Units skipped for good, sorted (their rows counted by the positions as
            rows of no token).
    """

    fingerprint: str
    config: str
    num_partitions: int
    samples: int
    partitions: Mapping[int, PartitionPosition]
    quarantine: tuple[QuarantineEntry, ...] = ()

    @property
    def config_hash(self) -> str:
        """The hash of the order configuration and the packing (what the barrier compares)."""
        return self.config

    @property
    def epoch(self) -> int:
        """0: each partition has its own epoch, so the barrier compares the samples only."""
        return 0

    @property
    def position(self) -> int:
        """Samples delivered by each partition (the same on every rank)."""
        return self.samples

    def with_quarantine(self, entries: Iterable[QuarantineEntry]) -> PackedState:
        """This state with ``entries`` added to its quarantine (merged, sorted)."""
        return replace(self, quarantine=tuple(merge(self.quarantine, entries)))

    def to_dict(self) -> dict[str, Any]:
        """Plain types.

        >>> s = PackedState("f", "c", 2, 3, {0: PartitionPosition(0, 5, 2, 24, 0)})
        >>> s = s.with_quarantine([QuarantineEntry("a.parquet", 1, 0, 8, "bad page")])
        >>> PackedState.from_dict(s.to_dict()) == s
        True
        """
        return {
            "kind": PACKED_KIND,
            "version": PACKED_STATE_VERSION,
            "fingerprint": self.fingerprint,
            "config": self.config,
            "num_partitions": self.num_partitions,
            "samples": self.samples,
            "partitions": {
                str(p): [x.epoch, x.row, x.offset, x.tokens, x.padding]
                for p, x in sorted(self.partitions.items())
            },
            "quarantine": json.dumps([q.to_dict() for q in self.quarantine]),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PackedState:
        """Read a state back.

        Raises:
            StateFormatError: If it is not a packed state of this version, or is malformed.
        """
        if not isinstance(data, Mapping) or data.get("kind") != PACKED_KIND:
            raise StateFormatError(
                "not a packed state (no kind='packed'): a packed loader loads only the states "
                "of packed loaders"
            )
        if data.get("version") != PACKED_STATE_VERSION:
            raise StateFormatError(
                f"packed state version {data.get('version')!r}; this lakeloader reads version "
                f"{PACKED_STATE_VERSION}"
            )
        try:
            return cls(
                fingerprint=str(data["fingerprint"]),
                config=str(data["config"]),
                num_partitions=int(data["num_partitions"]),
                samples=int(data["samples"]),
                partitions={
                    int(p): PartitionPosition(*(int(v) for v in x))
                    for p, x in data["partitions"].items()
                },
                quarantine=tuple(
                    QuarantineEntry.from_dict(q) for q in json.loads(data.get("quarantine", "[]"))
                ),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateFormatError(f"malformed packed state: {exc!r}") from exc

    @classmethod
    def merge(cls, states: Sequence[PackedState]) -> PackedState:
        """One state from the states of several ranks (each holding its own partitions).

        Their quarantines are merged.

        Raises:
            StateMismatchError: If they belong to different snapshots, configurations or
                steps, or two hold the same partition at different positions.
        """
        first = states[0]
        merged: dict[int, PartitionPosition] = {}
        for state in states:
            mine = (state.fingerprint, state.config, state.num_partitions, state.samples)
            theirs = (first.fingerprint, first.config, first.num_partitions, first.samples)
            if mine != theirs:
                raise StateMismatchError(
                    f"packed states of different runs or steps: (snapshot, config, C, samples) "
                    f"{theirs} and {mine}; pass the states every rank took at the same step"
                )
            for p, position in state.partitions.items():
                if merged.setdefault(p, position) != position:
                    raise StateMismatchError(
                        f"two states hold partition {p} at different positions: "
                        f"{merged[p]} and {position}"
                    )
        quarantine = tuple(merge(*(s.quarantine for s in states)))
        return cls(
            first.fingerprint, first.config, first.num_partitions, first.samples, merged, quarantine
        )


#: The ``kind`` of a packed mixture's state.
PACKED_MIXTURE_KIND: Final = "packed-mixture"


@dataclass(frozen=True)
class PackedMixtureState:
    """A packed mixture's position: the rounds' cursor, and every source's partitions.

    A round takes one sample from every partition of one source (:mod:`lakeloader.order.packing`),
    so the mixture's cursor counts rounds: ``mixture.slot`` rounds drawn, ``mixture.counts``
    from each source, which is also the samples each partition of that source delivered. The
    units the sources skipped are the cursor's ``quarantine`` (as a mixture's: entries name
    their files), the sources' own states holding none.

    Attributes:
        mixture: The rounds' cursor, weights history and sources (a mixture's state).
        sources: ``{name: PackedState}`` of each source, for this rank's partitions.
    """

    mixture: MixtureState
    sources: Mapping[str, PackedState]

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        return {
            "kind": PACKED_MIXTURE_KIND,
            "version": PACKED_STATE_VERSION,
            "mixture": self.mixture.to_dict(),
            "sources": {name: s.to_dict() for name, s in sorted(self.sources.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PackedMixtureState:
        """Read a state back.

        Raises:
            StateFormatError: If it is not a packed mixture's state of this version.
        """
        if not isinstance(data, Mapping) or data.get("kind") != PACKED_MIXTURE_KIND:
            raise StateFormatError(
                "not a packed mixture's state (no kind='packed-mixture'): a loader over a "
                "packed Mixture loads only the states of such loaders"
            )
        if data.get("version") != PACKED_STATE_VERSION:
            raise StateFormatError(
                f"packed mixture state version {data.get('version')!r}; this lakeloader reads "
                f"version {PACKED_STATE_VERSION}"
            )
        try:
            sources = {str(n): PackedState.from_dict(s) for n, s in data["sources"].items()}
            return cls(MixtureState.from_dict(data["mixture"]), sources)
        except (KeyError, TypeError, AttributeError) as exc:
            raise StateFormatError(f"malformed packed mixture state: {exc!r}") from exc

    @classmethod
    def merge(cls, states: Sequence[PackedMixtureState]) -> PackedMixtureState:
        """One state from the states of several ranks.

        Their quarantines are merged.

        Raises:
            StateMismatchError: If their cursors differ, or a source's partitions conflict.
        """
        first = states[0].mixture
        for state in states[1:]:
            if (state.mixture.slot, dict(state.mixture.counts)) != (first.slot, dict(first.counts)):
                raise StateMismatchError(
                    f"packed mixture states of different steps: {first.slot} rounds and "
                    f"{state.mixture.slot}; pass the states every rank took at the same step"
                )
        names = {n for s in states for n in s.sources}
        sources = {
            n: PackedState.merge([s.sources[n] for s in states if n in s.sources]) for n in names
        }
        quarantine = tuple(merge(*(s.mixture.quarantine for s in states)))
        return cls(replace(first, quarantine=quarantine), sources)

"""Where a packed loader stands, as versioned plain data: one number per source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from lakeloader.errors import StateFormatError
from lakeloader.state.loader_state import (
    Quarantined,
    format_version,
    quarantine_json,
    quarantine_of,
)
from lakeloader.state.mixture_state import MixtureState, epoch_start_keys
from lakeloader.state.quarantine import QuarantineEntry

#: The ``kind`` of a packed state.
PACKED_KIND: Final = "packed"
#: The ``kind`` of a packed mixture's state.
PACKED_MIXTURE_KIND: Final = "packed-mixture"
#: Version of the formats below.
PACKED_STATE_VERSION: Final = 2
#: Version of a packed lake's state that names the epoch it stands in (``start``,
#: ``from_epoch``: its lake grew at a resume), which an older lakeloader refuses to misread.
PACKED_EPOCH_VERSION: Final = 3


@dataclass(frozen=True)
class PackedState(Quarantined):
    """A packed lake's position (see docs/design.md).

    Attributes:
        config: Hash of the order configuration and the packing.
        samples: Samples delivered, its epochs one after the other.
        quarantine: Units skipped for good (their tokens delivered as padding).
        increment: A followed lake's: the marks of the increment ``samples`` stands in (its
            ``fingerprint`` is that increment's), or None.
        start: The samples before that increment; or, for a lake that grew at a resume, before
            the epoch ``samples`` stands in (its epochs were not all of one size); else 0.
        from_epoch: That epoch's number (a lake that grew); else 0.
    """

    fingerprint: str
    config: str
    samples: int
    quarantine: tuple[QuarantineEntry, ...] = ()
    increment: list[Any] | None = None
    start: int = 0
    from_epoch: int = 0

    @property
    def config_hash(self) -> str:
        """The hash of the order configuration and the packing (what the barrier compares)."""
        return self.config

    @property
    def epoch(self) -> int:
        """0: the barrier compares the samples, which count the epochs too."""
        return 0

    @property
    def position(self) -> int:
        """Samples delivered (the same on every rank)."""
        return self.samples

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        return {
            "kind": PACKED_KIND,
            "version": PACKED_EPOCH_VERSION
            if self.increment is None and self.start
            else PACKED_STATE_VERSION,
            "fingerprint": self.fingerprint,
            "config": self.config,
            "samples": self.samples,
            "quarantine": quarantine_json(self.quarantine),
            **epoch_start_keys(self.increment, self.start, self.from_epoch),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], per_epoch: int) -> PackedState:
        """Read a state back (``per_epoch``: samples in an epoch, to read a version 1 state).

        Raises:
            StateFormatError: If it is not a packed state, of an unknown version, malformed,
                or a version 1 state in the middle of an epoch.
        """
        refusal = (
            "not a packed state (no kind='packed'): a packed loader loads only the states "
            "of packed loaders"
        )
        version = format_version(data, PACKED_KIND, (1, 2, PACKED_EPOCH_VERSION), refusal)
        try:
            quarantine = quarantine_of(data.get("quarantine", "[]"))
            if version == 1:
                samples = _epoch_start(data["partitions"]) * per_epoch
            else:
                samples = int(data["samples"])
            increment = data.get("increment")
            return cls(
                str(data["fingerprint"]),
                str(data["config"]),
                samples,
                quarantine,
                None if increment is None else list(increment),
                int(data.get("start", 0)),
                int(data.get("from_epoch", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateFormatError(f"malformed packed state: {exc!r}") from exc


def _epoch_start(partitions: Mapping[str, Any]) -> int:
    """The epoch a version 1 state's partitions all start at (one taken mid-epoch is refused)."""
    at = {(int(x[0]), int(x[1]), int(x[2])) for x in partitions.values()}
    if len(at) != 1 or next(iter(at))[1:] != (0, 0):
        raise StateFormatError(
            "a packed state of version 1 (per-partition packing) taken in the middle of an "
            f"epoch (partitions at (epoch, row, token) {sorted(at)[:4]}...): today's packing "
            "orders samples otherwise, so it resumes only from an epoch's start; resume from a "
            "checkpoint taken at one, or finish the epoch with the lakeloader that wrote it"
        )
    return next(iter(at))[0]


@dataclass(frozen=True)
class PackedMixtureState:
    """A packed mixture's position: the samples' cursor (a mixture's state, in samples)."""

    mixture: MixtureState

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        return {
            "kind": PACKED_MIXTURE_KIND,
            "version": PACKED_STATE_VERSION,
            "mixture": self.mixture.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PackedMixtureState:
        """Read a state back (version 1 is refused: see the remedy).

        Raises:
            StateFormatError: If it is not a packed mixture's state of this version.
        """
        refusal = (
            "not a packed mixture's state (no kind='packed-mixture'): a loader over a "
            "packed Mixture loads only the states of such loaders"
        )
        remedy = (
            "version 1 (rounds of per-partition packing) cannot continue in today's order of "
            "samples; resume from the start of the run's data, or finish it with the "
            "lakeloader that wrote it"
        )
        format_version(data, PACKED_MIXTURE_KIND, (PACKED_STATE_VERSION,), refusal, remedy)
        try:
            return cls(MixtureState.from_dict(data["mixture"]))
        except (KeyError, TypeError, AttributeError) as exc:
            raise StateFormatError(f"malformed packed mixture state: {exc!r}") from exc

"""Where a packed loader stands, as versioned plain data: one number per source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from lakeloader.state.loader_state import Quarantined, quarantine_json
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


def packed_mixture_dict(mixture: MixtureState) -> dict[str, Any]:
    """A packed mixture's state: its samples' cursor (a mixture's state, in samples)."""
    return {
        "kind": PACKED_MIXTURE_KIND,
        "version": PACKED_STATE_VERSION,
        "mixture": mixture.to_dict(),
    }

"""``Follow``: how a dataset with ``follow=True`` waits for, and takes in, what is appended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

#: What to do when data already consumed is rewritten (a Delta commit that removes rows:
#: DELETE, UPDATE, MERGE, overwrite): ``"skip"`` the commit (its files carry no new rows; it is
#: logged as a warning with its version and operation), or ``"error"``: refuse, naming it.
#: Compactions (``OPTIMIZE``: files rearranged, ``dataChange`` false) are always skipped.
OnRewrite = Literal["skip", "error"]
ON_REWRITE: Final = ("skip", "error")


@dataclass(frozen=True)
class Follow:
    """Follow mode's settings (``LakeDataset(..., follow=Follow(...))``; ``True`` = defaults).

    Attributes:
        poll_interval: Seconds between looks at the lake once every increment is consumed.
        timeout: Seconds to wait for a new increment before the iteration ends (it goes on
            at the next ``iter(loader)``); None waits for ever.
        on_rewrite: See :data:`OnRewrite`.

    Example:
        >>> Follow(poll_interval=0.5, timeout=60).on_rewrite
        'skip'
    """

    poll_interval: float = 2.0
    timeout: float | None = None
    on_rewrite: OnRewrite = "skip"

    def __post_init__(self) -> None:
        if not self.poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {self.poll_interval}")
        if self.timeout is not None and self.timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {self.timeout}")
        if self.on_rewrite not in ON_REWRITE:
            raise ValueError(f"on_rewrite must be one of {ON_REWRITE}, got {self.on_rewrite!r}")

    @classmethod
    def of(cls, follow: bool | Follow | None) -> Follow | None:
        """The settings of a ``follow=`` argument (None when not following)."""
        if follow is None or follow is False:
            return None
        if follow is True:
            return cls()
        if isinstance(follow, Follow):
            return follow
        raise TypeError(f"follow must be a bool or a lakeloader.Follow, got {follow!r}")

"""Follow mode's side of a dataset: its first increment, and waiting for the next one.

Under ``torch.distributed``, rank 0 looks at the lake and decides, and every rank takes the
same increment (all ranks ask at the same step, so the broadcast is a collective).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Final

import fsspec
import torch.distributed as dist

from lakeloader.errors import StateMismatchError
from lakeloader.follow import Follow
from lakeloader.lake.increments import Increment, Mark, SourceRequest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.lake.source import Growing, Source

logger = logging.getLogger(__name__)

#: Rank 0's word that the wait is over (no increment within the timeout).
_STOP: Final = "caught up"

Found = tuple[fsspec.AbstractFileSystem, Snapshot] | None


class CaughtUpError(Exception):
    """No new increment within the follow timeout: every appended row was delivered."""


def growing(source: Source) -> Growing:
    """``source`` as a source of increments (a TypeError naming it if it cannot be)."""
    if not isinstance(source, Growing):
        raise TypeError(
            f"follow=True needs a folder, a Delta or an Iceberg table; {source!r} is neither"
        )
    return source


def _agreed(source: Source, after: Increment | None, decide: Any, request: SourceRequest) -> Found:
    """The increment after ``after`` as rank 0 finds it (``decide(found)`` may stop the wait).

    Raises:
        CaughtUpError: When rank 0 says so.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        found = growing(source).increment(after, request)
        decide(found)
        return found
    word: list[Mark | str | None] = [None]
    found = None
    if dist.get_rank() == 0:
        found = growing(source).increment(after, request)
        try:
            decide(found)
        except CaughtUpError:
            word[0] = _STOP
        else:
            word[0] = (
                None if found is None or found[1].increment is None else found[1].increment.upto
            )
    dist.broadcast_object_list(word, src=0)
    if word[0] == _STOP:
        raise CaughtUpError("rank 0 found no new increment within the follow timeout")
    if dist.get_rank() == 0 or word[0] is None:
        return found
    assert isinstance(word[0], Mark)
    return growing(source).increment(after, dataclasses.replace(request, upto=word[0]))


def first_increment(
    source: Source, follow: Follow, request: SourceRequest
) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
    """Increment 0: the lake as it is now (as rank 0 sees it)."""
    request = dataclasses.replace(request, on_rewrite=follow.on_rewrite)
    found = _agreed(source, None, lambda _: None, request)
    assert found is not None, "the first increment of a lake holds its files"
    return found


def increment_at(
    source: Source, increment: Increment, request: SourceRequest
) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
    """The files of ``increment`` found again from its marks (a resume from a state alone).

    Raises:
        StateMismatchError: If the lake no longer gives that increment (files gone).
    """
    before = None if increment.after is None else Increment(increment.index - 1, increment.after)
    found = growing(source).increment(before, dataclasses.replace(request, upto=increment.upto))
    if found is None or found[1].increment != increment:
        raise StateMismatchError(
            f"the lake no longer holds increment {increment.index} as the state saw it (up to "
            f"{increment.upto}): files were removed; resume from a CheckpointManager "
            "checkpoint, whose manifest pins the increment's files"
        )
    return found


def next_increment(
    source: Source, follow: Follow, now: Increment | None, request: SourceRequest
) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
    """The increment after ``now``, waiting for one (CaughtUpError past the follow timeout)."""
    assert now is not None, "a followed dataset's snapshot is an increment"
    deadline = None if follow.timeout is None else time.monotonic() + follow.timeout

    def decide(found: Found) -> None:
        late = deadline is not None and time.monotonic() + follow.poll_interval > deadline
        if found is None and late:
            raise CaughtUpError(f"no increment after {now.index} within {follow.timeout} s")

    while True:
        found = _agreed(source, now, decide, request)
        if found is not None:
            logger.info(
                "increment %d: %d files, %d rows appended",
                now.index + 1,
                len(found[1].files),
                found[1].num_rows,
            )
            return found
        time.sleep(follow.poll_interval)

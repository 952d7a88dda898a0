"""Follow mode's side of a dataset: its first increment, and waiting for the next one.

A dataset with ``follow=`` is the chain of its increments (:mod:`lakeloader.lake.increments`),
epoch ``k`` running on increment ``k``; the next link is made when an epoch past the last one
is asked for, by polling the source every ``poll_interval`` seconds. Under
``torch.distributed``, rank 0 looks at the lake and decides (an increment's mark, nothing
yet, or caught up), and every rank takes the same increment: all ranks ask at the same step
(the end of an increment), so the broadcast is a collective they all reach.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Final

import fsspec
import torch.distributed as dist

from lakeloader.follow import Follow
from lakeloader.lake.increments import Increment, IncrementRequest, Mark
from lakeloader.lake.snapshot import Snapshot
from lakeloader.lake.source import Growing, Source

if TYPE_CHECKING:
    from lakeloader.dataset import LakeDataset

logger = logging.getLogger(__name__)

#: Rank 0's word that the wait is over (no increment within the timeout).
_STOP: Final = "caught up"

Found = tuple[fsspec.AbstractFileSystem, Snapshot] | None


class CaughtUpError(Exception):
    """No new increment within the follow timeout: every appended row was delivered."""


def growing(source: Source) -> Growing:
    """``source`` as a source of increments.

    Raises:
        TypeError: If it cannot be followed (naming it).
    """
    if not isinstance(source, Growing):
        raise TypeError(
            f"follow=True needs a folder or a Delta table; {source!r} cannot be followed"
        )
    return source


def _ranks() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agreed(source: Source, after: Increment | None, decide: Any, **kwargs: Any) -> Found:
    """The increment after ``after`` as rank 0 finds it (``decide(found)`` may stop the wait).

    Raises:
        CaughtUpError: When rank 0 says so.
    """
    rank, world = _ranks()
    request = IncrementRequest(**kwargs)
    if world == 1:
        found = growing(source).increment(after, request)
        decide(found)
        return found
    word: list[Mark | str | None] = [None]
    found = None
    if rank == 0:
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
    if rank == 0 or word[0] is None:
        return found
    assert isinstance(word[0], Mark)
    return growing(source).increment(after, dataclasses.replace(request, upto=word[0]))


def first_increment(
    source: Source, follow: Follow, storage_options: dict[str, Any], **kwargs: Any
) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
    """Increment 0: the lake as it is now (as rank 0 sees it).

    Raises:
        LakeNotFoundError: If it holds no data file.
    """
    found = _agreed(
        source,
        None,
        lambda _: None,
        storage_options=storage_options,
        on_rewrite=follow.on_rewrite,
        **kwargs,
    )
    assert found is not None, "the first increment of a lake holds its files"
    return found


def next_increment(dataset: LakeDataset) -> LakeDataset:
    """The dataset of the increment after ``dataset``'s, waiting for one to be appended.

    Raises:
        CaughtUpError: If none comes within the follow timeout.
    """
    follow, now = dataset.follow, dataset.snapshot.increment
    assert follow is not None and now is not None
    deadline = None if follow.timeout is None else time.monotonic() + follow.timeout

    def decide(found: Found) -> None:
        late = deadline is not None and time.monotonic() + follow.poll_interval > deadline
        if found is None and late:
            raise CaughtUpError(f"no increment after {now.index} within {follow.timeout} s")

    while True:
        found = _agreed(
            dataset.source,
            now,
            decide,
            storage_options=dataset.storage_options,
            columns=list(dataset.config.columns),
            progress=False,
            retry=dataset.retry,
            skip_unreadable=dataset.on_error == "skip",
            on_rewrite=follow.on_rewrite,
        )
        if found is not None:
            fs, snapshot = found
            logger.info(
                "increment %d: %d files, %d rows appended",
                now.index + 1,
                len(snapshot.files),
                snapshot.num_rows,
            )
            return grown(dataset, fs, snapshot)
        time.sleep(follow.poll_interval)


def grown(dataset: LakeDataset, fs: fsspec.AbstractFileSystem, snapshot: Snapshot) -> LakeDataset:
    """A twin of ``dataset`` on a new increment (the filter applied to it)."""
    twin = copy.copy(dataset)
    twin.fs = fs
    twin._pin(twin._filtered(snapshot, progress=False))
    twin._successor, twin.lost = None, ()
    return twin

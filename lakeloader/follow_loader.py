"""``FollowLoader``: the loader of a dataset with ``follow=``, endless over its increments.

``for batch in loader`` runs through increment after increment (each one epoch of the
ordinary loader: the same order, exactness and resume), waiting for the next one to be
appended once it has caught up; it ends when none comes within ``Follow.timeout``, and a new
``iter(loader)`` then goes on from there. It never moves to the next epoch before that
increment exists, so a state taken while it waits is the end of the last increment.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from lakeloader.lake.following import CaughtUpError
from lakeloader.loader import LOADER_FOR, DataLoader

logger = logging.getLogger(__name__)


class FollowLoader(DataLoader):
    """A ``DataLoader`` of a growing lake (made by ``DataLoader(dataset)`` when it follows)."""

    def __len__(self) -> int:
        raise TypeError("a followed lake is endless: it has no len(); see loader.dataset's")

    def __iter__(self) -> Iterator[Any]:
        return self._increments()

    def _increments(self) -> Iterator[Any]:
        while True:
            if self.tracker.epoch_over(len(self.dataset)):
                try:  # make sure the next increment exists before the epoch moves on
                    self._base.for_epoch(self.tracker.epoch + 1)
                except CaughtUpError as caught:
                    logger.info("caught up with the lake: %s", caught)
                    return
            yield from super().__iter__()


LOADER_FOR["follow"] = FollowLoader

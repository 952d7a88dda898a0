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

from lakeloader.lake.following import CaughtUpError, increment_at
from lakeloader.lake.increments import Increment
from lakeloader.loader import LOADER_FOR, DataLoader
from lakeloader.recovery.coordinator import Resumption
from lakeloader.state.loader_state import LoaderState

logger = logging.getLogger(__name__)

#: The state key of the increment a followed lake's position is in.
INCREMENT_KEY = "follow_increment"


class FollowLoader(DataLoader):
    """A ``DataLoader`` of a growing lake (made by ``DataLoader(dataset)`` when it follows)."""

    def state_dict(self) -> dict[str, Any]:
        """The position, with the increment it stands in (its marks: a few numbers).

        With them, :meth:`load_state_dict` finds the increment's files again on a dataset
        made anew, without a checkpoint's manifest.
        """
        state = super().state_dict()
        increment = self.dataset.snapshot.increment
        state[INCREMENT_KEY] = None if increment is None else increment.to_list()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state of a followed lake, under any topology.

        Raises:
            StateMismatchError: If the lake no longer holds the state's increment, or the
                state belongs to another lake or configuration.
        """
        saved = state_dict.get(INCREMENT_KEY)
        if saved is None:
            super().load_state_dict(state_dict)
            return
        state = LoaderState.from_dict(state_dict)
        increment = Increment.from_list(saved)
        base = self._base
        if base.snapshot.increment != increment:
            base = base.on_increment(
                *increment_at(base.source, increment, base.increment_request())
            )
        state.check_matches(base.fingerprint, base.config.to_dict())
        self._resume(Resumption(state, dataset=base))

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

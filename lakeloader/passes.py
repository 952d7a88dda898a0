"""How ``iter(loader)`` maps onto epochs: one pass, a whole pass every time, or no end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class Endless:
    """One iterator over pass after pass: when a pass ends, the next begins.

    Args:
        start_pass: Starts the next pass (the loader's own, which moves to the next epoch
            when the one under way is over).

    Example:
        >>> passes = iter([[1, 2], [3], [4, 5]])
        >>> it = Endless(lambda: iter(next(passes, [])))
        >>> [next(it) for _ in range(5)]
        [1, 2, 3, 4, 5]
        >>> next(it)  # two passes in a row with nothing in them: the source is spent
        Traceback (most recent call last):
        ...
        StopIteration
    """

    def __init__(self, start_pass: Callable[[], Iterator[Any]]) -> None:
        self._start_pass = start_pass
        self._pass = start_pass()

    def __iter__(self) -> Endless:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # an epoch that delivers nothing, then one more try
            try:
                return next(self._pass)
            except StopIteration:
                self._pass = self._start_pass()
        return next(self._pass)  # a third empty pass ends it (an empty lake, a spent stream)


class Deferred:
    """``iter(loader)``: the pass begins at the first ``next()``, not at ``iter()``.

    ``iter()`` costs nothing (frameworks call it to test a loader), and a ``set_epoch`` before
    the first batch moves the pass it will begin. Other attributes (``num_steps``, ...) are
    the pass's, which asking for begins.

    Args:
        begin: Begins the pass (the loader's).

    Example:
        >>> begun = []
        >>> it = Deferred(lambda: begun.append("pass") or iter([7, 8]))
        >>> begun
        []
        >>> next(it), begun, list(it)
        (7, ['pass'], [8])
    """

    def __init__(self, begin: Callable[[], Iterator[Any]]) -> None:
        self._begin: Callable[[], Iterator[Any]] | None = begin
        self._pass: Iterator[Any] | None = None

    def _started(self) -> Iterator[Any]:
        if self._pass is None:
            assert self._begin is not None
            self._pass, self._begin = self._begin(), None
        return self._pass

    def __iter__(self) -> Deferred:
        return self

    def __next__(self) -> Any:
        return next(self._pass if self._pass is not None else self._started())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._started(), name)


class EpochSampler:
    """``loader.sampler``: not a torch ``Sampler``, only where frameworks set the epoch.

    Lightning and Accelerate call ``loader.sampler.set_epoch(epoch)``; this hands it to the
    loader's ``set_epoch``.

    Args:
        set_epoch: The loader's ``set_epoch``; None for a loader whose epochs are not the
            framework's (no ``len()``), which ignores it.
    """

    def __init__(self, set_epoch: Callable[[int], None] | None) -> None:
        self._set_epoch = set_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the loader's next pass run ``epoch`` (see ``DataLoader.set_epoch``)."""
        if self._set_epoch is not None:
            self._set_epoch(epoch)

    def __repr__(self) -> str:
        return "EpochSampler(the loader plans its own order; set_epoch reaches the loader)"

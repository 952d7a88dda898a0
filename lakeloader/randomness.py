"""Reproducible randomness in transforms: draws that belong to the row, not to the worker.

A row's seed is a hash of ``(dataset seed, epoch, slot)``, whatever the topology or resume
(see docs/design.md).

Example:
    >>> with drawing(slot_seeds(0, 1, np.array([5, 9]))):
    ...     a = row_rngs()[1].integers(1000)
    >>> with drawing(slot_seeds(0, 1, np.array([9]))):
    ...     b = row_rngs()[0].integers(1000)
    >>> bool(a == b)
    True
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def _word(value: int) -> np.ndarray:
    return np.array([value % 2**64], dtype=np.uint64)


def slot_seeds(seed: int, epoch: int, slots: np.ndarray) -> np.ndarray:
    """The 64-bit seed of each slot of an epoch: a hash of ``(seed, epoch, slot)``.

    >>> s = slot_seeds(-(2**63), 3, np.array([0, 1, 0]))
    >>> s.dtype, s[0] == s[2], s[0] != s[1]
    (dtype('uint64'), np.True_, np.True_)
    """
    with np.errstate(over="ignore"):
        key = _mix(_mix(_word(seed)) ^ (_word(epoch) + _GOLDEN))
        return _mix(key ^ (np.asarray(slots, dtype=np.int64).astype(np.uint64) * _GOLDEN))


def batch_seed(seeds: np.ndarray) -> int:
    """One seed of a whole batch, from its rows' seeds in order (63 bits, fits torch).

    >>> batch_seed(np.array([1, 2], np.uint64)) != batch_seed(np.array([2, 1], np.uint64))
    True
    """
    with np.errstate(over="ignore"):
        at = np.arange(1, len(seeds) + 1, dtype=np.uint64) * _GOLDEN
        folded = np.bitwise_xor.reduce(_mix(seeds.astype(np.uint64) ^ at)) if len(seeds) else 0
    return int(_mix(np.array([folded], np.uint64))[0]) >> 1


def seed_globals(seed: int) -> None:
    """Seed ``torch``'s, ``random``'s and numpy's global generators from one 63-bit seed."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)


class _Draws:
    """The seeds of what is being transformed: one row (``row`` set) or a batch."""

    def __init__(self, seeds: np.ndarray) -> None:
        self.seeds = seeds
        #: The row being transformed (a row transform sets it per row), or None: the batch.
        self.row: int | None = None
        self._rng: np.random.Generator | None = None
        self._rng_of: int | None = None  # the row ``_rng`` was made for
        self._rngs: list[np.random.Generator] | None = None

    def rng(self) -> np.random.Generator:
        if self._rng is None or self._rng_of != self.row:
            seed = batch_seed(self.seeds) if self.row is None else int(self.seeds[self.row])
            self._rng, self._rng_of = np.random.Generator(np.random.PCG64(seed)), self.row
        return self._rng

    def rngs(self) -> list[np.random.Generator]:
        if self._rngs is None:
            self._rngs = [np.random.Generator(np.random.PCG64(int(s))) for s in self.seeds]
        return self._rngs


_local = threading.local()


@contextmanager
def drawing(seeds: np.ndarray) -> Iterator[_Draws]:
    """Make ``seeds`` (one per row, in batch order) what :func:`rng` and friends draw from."""
    before = getattr(_local, "draws", None)
    _local.draws = draws = _Draws(seeds)
    try:
        yield draws
    finally:
        _local.draws = before


def _current(name: str) -> _Draws:
    draws: _Draws | None = getattr(_local, "draws", None)
    if draws is None:
        raise RuntimeError(
            f"lakeloader.{name}() draws for the row or batch being transformed: call it inside "
            "the dataset's transform or batch_transform, while lakeloader runs them"
        )
    return draws


def rng() -> np.random.Generator:
    """A generator of the row being transformed (in ``transform``) or of the batch.

    Raises:
        RuntimeError: Outside a transform or batch_transform that lakeloader is running.
    """
    return _current("rng").rng()


def row_seeds() -> np.ndarray:
    """The 64-bit seeds of the rows being transformed, in batch order (uint64).

    Raises:
        RuntimeError: Outside a transform or batch_transform that lakeloader is running.
    """
    draws = _current("row_seeds")
    return draws.seeds if draws.row is None else draws.seeds[draws.row : draws.row + 1]


def row_rngs() -> list[np.random.Generator]:
    """One generator per row being transformed, in batch order (made on first use).

    Raises:
        RuntimeError: Outside a transform or batch_transform that lakeloader is running.
    """
    draws = _current("row_rngs")
    return draws.rngs() if draws.row is None else [draws.rng()]

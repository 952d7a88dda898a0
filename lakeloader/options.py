"""The loader's options as one frozen value: torch's DataLoader arguments and lakeloader's own."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from lakeloader.pipeline.collate import Collate


def cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: Default byte budget of the decoded-unit cache of one rank.
DEFAULT_CACHE_BYTES: Final = 2 << 30
#: Default number of threads decoding units in the loader's process.
DEFAULT_IO_THREADS: Final = 4
#: Work handed to each worker ahead when ``prefetch_factor`` is not given (as in torch).
DEFAULT_PREFETCH_FACTOR: Final = 2


@dataclass(frozen=True)
class LoaderOptions:
    """How a :class:`~lakeloader.DataLoader` delivers batches: its arguments of the same names.

    See the DataLoader's docstring for each; a ``prefetch_factor`` of 0 counts as 1.

    Example:
        >>> LoaderOptions(batch_size=0)
        Traceback (most recent call last):
        ...
        ValueError: batch_size must be a positive integer, got 0
    """

    batch_size: int = 1
    num_workers: int = 0
    collate_fn: Collate | None = None
    pin_memory: bool = False
    drop_last: bool = False
    timeout: float = 0
    worker_init_fn: Callable[[int], None] | None = None
    multiprocessing_context: Any = None
    prefetch_factor: int = DEFAULT_PREFETCH_FACTOR
    persistent_workers: bool = False
    pin_memory_device: str = ""
    cache_dir: str | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    io_threads: int = DEFAULT_IO_THREADS
    restart_on_iter: bool = False
    endless: bool = False

    def __post_init__(self) -> None:
        size = self.batch_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.num_workers < 0 or self.timeout < 0:
            raise ValueError(
                f"num_workers ({self.num_workers}) and timeout ({self.timeout}) must be >= 0"
            )
        if self.prefetch_factor < 0:
            raise ValueError(f"prefetch_factor must be >= 0, got {self.prefetch_factor}")
        if self.restart_on_iter and self.endless:
            raise ValueError(
                "restart_on_iter=True (every iter() one whole pass) and endless=True (one "
                "iter() for every epoch) exclude each other: choose one"
            )
        for name in ("collate_fn", "worker_init_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} must be callable or None, got {getattr(self, name)!r}")
        context = self.multiprocessing_context
        if isinstance(context, str) and context not in mp.get_all_start_methods():
            raise ValueError(  # as torch's DataLoader says at once
                f"multiprocessing_context {context!r} is not a start method here: use one of "
                f"{mp.get_all_start_methods()}, a multiprocessing context, or None"
            )
        if self.io_threads < 1 or self.cache_bytes < 1:
            raise ValueError(
                f"io_threads ({self.io_threads}) and cache_bytes ({self.cache_bytes}) must be >= 1"
            )

    @property
    def prefetch(self) -> int:
        """Work handed to each worker ahead: ``prefetch_factor``, 0 counting as 1."""
        return max(1, self.prefetch_factor)

    @property
    def wait_timeout(self) -> float | None:
        """``timeout`` as waits take it: None (wait for ever) for 0."""
        return self.timeout or None

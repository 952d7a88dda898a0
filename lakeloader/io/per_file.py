"""Work on every file of a lake, in threads sized for where the lake lies.

A store's files are read on :data:`REMOTE_THREADS` threads, a file a task; a local lake's (CPU
bound) on a thread a core, :data:`LOCAL_PER_TASK` files a task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import fsspec

from lakeloader.io.fetch import is_local
from lakeloader.options import cores
from lakeloader.signals import main_thread_only

T = TypeVar("T")
R = TypeVar("R")

#: Files of a store read at once (I/O bound, so more than the core count).
REMOTE_THREADS = 32
#: Files of a local lake a thread works on before it hands their results over.
LOCAL_PER_TASK = 64


def per_file(
    fs: fsspec.AbstractFileSystem,
    work: Callable[[T], R],
    items: Sequence[T],
    done: Callable[[int], object] | None = None,
) -> list[R]:
    """``work`` of each item (a file), in order; ``done`` is told how many finished, as they do.

    >>> import fsspec
    >>> per_file(fsspec.filesystem("file"), len, ["a", "bb", "ccc"])
    [1, 2, 3]
    """
    threads, size = max(1, min(REMOTE_THREADS, len(items))), 1
    if is_local(fs):
        threads = max(1, min(cores(), len(items)))
        size = max(1, min(LOCAL_PER_TASK, len(items) // threads))
    tasks = [items[i : i + size] for i in range(0, len(items), size)]
    out: list[R] = []
    with ThreadPoolExecutor(max_workers=threads, initializer=main_thread_only) as pool:
        for results in pool.map(lambda task: [work(item) for item in task], tasks):
            out += results
            if done is not None:
                done(len(results))
    return out

"""Work on every file of a lake, in threads sized for where the lake lies.

A store's files are read on :data:`REMOTE_THREADS` threads, a file a task; a local lake's (CPU
bound) on a thread a core, :data:`LOCAL_PER_TASK` files a task. The work may show a progress bar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import fsspec
from tqdm.auto import tqdm

from lakeloader.io.fetch import is_local
from lakeloader.options import cores
from lakeloader.signals import main_thread_only

T = TypeVar("T")
R = TypeVar("R")

#: Files of a store read at once (I/O bound, so more than the core count).
REMOTE_THREADS = 32
#: Files of a local lake a thread works on before it hands their results over.
LOCAL_PER_TASK = 64
#: From this many items on, a progress bar shows unless told (on stderr, terminal or not).
PROGRESS_MIN_FILES = 64


def per_file(
    fs: fsspec.AbstractFileSystem,
    work: Callable[[T], R],
    items: Sequence[T],
    desc: str | None = None,
    progress: bool | None = None,
    *,
    unit: str = "file",
    threads: int | None = None,
) -> list[R]:
    """``work`` of each item (a file), in order, under a progress bar ``desc`` if one is given.

    The bar counts ``unit`` and shows as ``progress`` says (None: from ``PROGRESS_MIN_FILES``
    items on); ``threads``, an item a task, replaces the sizing for where ``fs`` lies.

    >>> import fsspec
    >>> per_file(fsspec.filesystem("file"), len, ["a", "bb", "ccc"])
    [1, 2, 3]
    """
    local = threads is None and is_local(fs)
    if threads is None:
        threads = cores() if local else REMOTE_THREADS
    threads = max(1, min(threads, len(items)))
    size = max(1, min(LOCAL_PER_TASK, len(items) // threads)) if local else 1
    tasks = [items[i : i + size] for i in range(0, len(items), size)]
    show = len(items) >= PROGRESS_MIN_FILES if progress is None else progress
    out: list[R] = []
    with (
        tqdm(total=len(items), desc=desc, unit=unit, disable=desc is None or not show) as bar,
        ThreadPoolExecutor(max_workers=threads, initializer=main_thread_only) as pool,
    ):
        for results in pool.map(lambda task: [work(item) for item in task], tasks):
            out += results
            bar.update(len(results))
    return out

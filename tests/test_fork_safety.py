"""Workers are forked while other threads of the loader's process run: a lock one of them
holds at that moment must not be inherited held by a worker (which would then wait on it for
ever, and the loader with it)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest

import lakeloader as ll
from lakeloader.io import fetch
from lakeloader.workers.pool import WorkerPool

pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.errors.CpuContentionWarning")


@contextmanager
def held_by_another_thread(lock: Any) -> Iterator[None]:
    """``lock`` held by a thread of this process for the duration of the block."""
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            done.wait()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    taken.wait()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_workers_forked_while_a_thread_reads_a_footer_decode(dataset: ll.LakeDataset) -> None:
    """Another thread is inside the process's footer cache when the workers fork (another
    loader's decoding thread, say): the workers still read footers. Before, each worker
    inherited the cache's lock held, and its first decode waited for ever."""
    start = WorkerPool.__init__

    def forked_while_held(pool: WorkerPool, *args: Any, **kwargs: Any) -> None:
        with held_by_another_thread(fetch._FOOTERS._lock):
            start(pool, *args, **kwargs)

    reference = [b["id"].tolist() for b in ll.DataLoader(dataset, batch_size=24)]
    # timeout: a worker that hangs fails the test instead of hanging it
    with (
        mock.patch.object(WorkerPool, "__init__", forked_while_held),
        ll.DataLoader(dataset, batch_size=24, num_workers=2, timeout=30) as loader,
    ):
        got = [b["id"].tolist() for b in loader]
    assert got == reference

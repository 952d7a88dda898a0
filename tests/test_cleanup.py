"""Finalisers of collected loaders never wait on a lock that the collecting thread holds."""

from __future__ import annotations

import gc
import threading
import weakref

from lakeloader.pipeline.cleanup import close_safely, prepare


class _Cycle:
    """Garbage only the cyclic collector frees (as a dropped pass is)."""

    def __init__(self) -> None:
        self.me = self


def test_a_finaliser_the_collector_runs_under_a_held_lock_closes_elsewhere() -> None:
    # The deadlock this guards against: the collector ran a pass's finaliser in a thread that
    # held (indirectly) what the close waited for. Closing in place here waits forever.
    lock = threading.Lock()
    closed = threading.Event()

    def close() -> None:
        with lock:
            closed.set()

    def collect_holding_the_lock() -> None:
        garbage = _Cycle()
        weakref.finalize(garbage, close_safely, close)
        del garbage
        with lock:
            gc.collect()
            assert not closed.is_set()

    prepare()
    thread = threading.Thread(target=collect_holding_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the collecting thread waited for its own lock"
    assert closed.wait(10), "the close never ran"


def test_a_close_on_the_main_thread_outside_a_collection_runs_at_once() -> None:
    prepare()
    done: list[int] = []
    close_safely(done.append, 1)
    assert done == [1]

"""Finalisers that never deadlock: a loader collected by the garbage collector closes elsewhere.

See docs/design.md (Release) for why a close is queued for one daemon thread of the process.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_Close = tuple[Callable[..., None], tuple[Any, ...]]


@dataclass
class _State:
    """The process's closing thread and its queue, and whether a collection is under way."""

    queue: queue.SimpleQueue[_Close] = field(default_factory=queue.SimpleQueue)  # reentrant put
    thread: threading.Thread | None = None
    collecting: bool = False


_state = _State()


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    _state.collecting = phase == "start"


def _run(close: _Close) -> None:
    try:
        close[0](*close[1])
    except Exception:
        logger.debug("error while closing what a collected loader held", exc_info=True)


def _serve(jobs: queue.SimpleQueue[_Close]) -> None:
    while True:
        _run(jobs.get())


def _drain() -> None:
    """Close in place whatever is still queued (at interpreter exit)."""
    while True:
        try:
            close = _state.queue.get_nowait()
        except queue.Empty:
            return
        _run(close)


def _after_fork_in_child() -> None:
    global _state
    _state = _State()


def prepare() -> None:
    """Start the closing thread if it is not running (never from a finaliser: it starts one)."""
    if _state.thread is None or not _state.thread.is_alive():
        _state.thread = threading.Thread(
            target=_serve, args=(_state.queue,), name="lakeloader-close", daemon=True
        )
        _state.thread.start()


def close_safely(close: Callable[..., None], *args: Any) -> None:
    """Run ``close(*args)`` in place when that cannot deadlock, else on the closing thread.

    In place: on the main thread outside a garbage collection, or when the closing thread is
    not running (interpreter exit). Errors are logged at debug level: a finaliser has nobody
    to raise them to.
    """
    thread = _state.thread
    on_main = threading.current_thread() is threading.main_thread()
    if thread is None or not thread.is_alive() or (on_main and not _state.collecting):
        _run((close, args))
    else:
        _state.queue.put((close, args))


gc.callbacks.append(_on_gc)
atexit.register(_drain)
os.register_at_fork(after_in_child=_after_fork_in_child)

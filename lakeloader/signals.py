"""Signals go to the training loop's thread, not to the loader's own threads.

Python runs a handler only once the main thread wakes up, so a signal the kernel hands to a
loader thread would wait: every long-lived thread lakeloader starts blocks SIGINT and SIGTERM
(:func:`main_thread_only`).
"""

from __future__ import annotations

import signal
from typing import Final

#: Signals that only the main thread should receive.
MAIN_THREAD_SIGNALS: Final = frozenset({signal.SIGINT, signal.SIGTERM})


def main_thread_only() -> None:
    """Block :data:`MAIN_THREAD_SIGNALS` in the calling thread (a thread's first call)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)


def process_receives() -> None:
    """Unblock :data:`MAIN_THREAD_SIGNALS` in the calling thread.

    A worker forked from one of lakeloader's threads inherits its mask, and would never receive
    ``SIGTERM``: a worker calls this first.
    """
    signal.pthread_sigmask(signal.SIG_UNBLOCK, MAIN_THREAD_SIGNALS)

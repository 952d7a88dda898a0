"""Signals go to the training loop's thread, not to the loader's own threads.

The kernel hands a signal sent to a process to any thread that does not block it. Python runs
the handler in the main thread, but only once that thread wakes up: if ``SIGINT`` (Ctrl-C) or
``SIGTERM`` lands on one of the loader's threads while the main thread sleeps or waits, the
handler waits with it (a training step of a minute ignores Ctrl-C for a minute). So every
long-lived thread that lakeloader starts blocks them (:func:`main_thread_only`), and threads
those threads start (pyarrow's) inherit the mask. Threads that other libraries start from
the main thread do not, so a main thread blocked in one long system call (a single
``time.sleep(60)``) may still learn of a signal only when the call returns; a training loop
that computes notices it at once.
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

    A process forked from one of lakeloader's threads (a worker that replaces a dead one is
    started by the dispatcher's receiving thread) inherits that thread's mask: it would never
    receive ``SIGTERM``, and ``multiprocessing``'s exit handler, which terminates daemon
    children and then joins them, would wait for it forever. A worker calls this first.
    """
    signal.pthread_sigmask(signal.SIG_UNBLOCK, MAIN_THREAD_SIGNALS)

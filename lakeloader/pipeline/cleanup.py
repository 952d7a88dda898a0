"""Finalisers that never deadlock: what a collected loader held is closed on a thread of its own.

Python's cyclic garbage collector runs in whichever thread happens to allocate, and runs the
``weakref.finalize`` callbacks of what it collects right there. That thread may be one of the
loader's own (the dispatcher's receiving thread, a decoding thread) holding a lock that the
close needs: the dispatcher's lock, the unit store's. ``threading.Lock`` is not reentrant, so
closing there would wait for itself forever (seen once: a test held 300 s until pytest-timeout
fired inside the finaliser). So a finaliser that runs on any thread but the main one only
starts a daemon thread that does the closing. On the main thread (where the finalisers run at
interpreter exit, when a thread started then might not finish before the process ends) it
closes in place: the main thread holds those locks only inside the methods of a pass still
referenced from its own stack, which therefore is not being collected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def close_off_thread(close: Callable[..., None], *args: Any) -> None:
    """Run ``close(*args)`` in place on the main thread, else on a daemon thread of its own.

    >>> done = threading.Event()
    >>> worker = threading.Thread(target=close_off_thread, args=(done.set,)); worker.start()
    >>> done.wait(5)
    True
    """
    if threading.current_thread() is threading.main_thread():
        close(*args)
        return
    try:
        threading.Thread(target=close, args=args, name="lakeloader-close", daemon=True).start()
    except RuntimeError:  # no new thread at interpreter shutdown
        close(*args)

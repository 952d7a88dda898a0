"""What a loader holds outside Python's memory, and its release on every exit but SIGKILL."""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import threading
import weakref
from types import FrameType
from typing import Any, Final

from lakeloader.cache.shm import default_cache_dir, make_unit_dir
from lakeloader.pipeline.backfill import Backfill
from lakeloader.pipeline.cleanup import close_safely, prepare
from lakeloader.pipeline.iterator import PassIterator
from lakeloader.pipeline.stores import Stores
from lakeloader.workers.pool import WorkerPool

logger = logging.getLogger(__name__)

#: Exit status of a process ended by ``SIGTERM`` (128 + 15), as the shell reports it.
SIGTERM_STATUS: Final = 128 + signal.SIGTERM

#: A pass under way (an ``EpochIterator``, a ``MixtureIterator``, a ``PackedIterator``, or
#: an epoch's pass backfilled).
Pass = PassIterator | Backfill


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Turn ``SIGTERM`` into ``SystemExit``, so that exit handlers release what loaders hold."""
    raise SystemExit(SIGTERM_STATUS)


class LoaderResources:
    """The pass, the worker pool and the unit folder of one loader, and what a pass left.

    All are released when ``owner`` (the loader) is collected, or the interpreter exits.
    """

    def __init__(self, owner: Any) -> None:
        # Weak: the pass's iterator keeps its loader alive (as torch's does).
        self._iterator: weakref.ref[Pass] | None = None
        self.pool: WorkerPool | None = None
        self.unit_dir: str | None = None
        self.worker_restarts = 0
        #: What a pass that ended left for the next one (a mixture's open sources).
        self._carried: Stores | None = None
        prepare()
        self._finalizer = weakref.finalize(owner, close_safely, self.release)

    @property
    def iterator(self) -> Pass | None:
        """The pass under way, if any."""
        return self._iterator() if self._iterator is not None else None

    @iterator.setter
    def iterator(self, it: Pass | None) -> None:
        self._iterator = weakref.ref(it) if it is not None else None

    def close_iterator(self, wait: bool = True, ended_by: str | None = None) -> None:
        """End the pass under way, if any (``ended_by``: see ``EpochIterator.close``)."""
        it = self.iterator
        if it is not None:
            it.close(wait, ended_by)
        self._iterator = None

    def carry(self, kept: Stores) -> None:
        """Keep what a pass left for the next one (released with the loader if never taken)."""
        self.drop_carried()
        self._carried = kept

    def take_carried(self) -> Stores | None:
        """What the last pass left, if anything (the caller owns it from now on)."""
        kept, self._carried = self._carried, None
        return kept

    def drop_carried(self, wait: bool = True) -> None:
        """Release what the last pass left, if anything."""
        kept = self.take_carried()
        if kept is not None:
            kept.close(wait)

    def carried_bytes(self) -> int:
        """Bytes of decoded units that what the last pass left holds (0: nothing left)."""
        return self._carried.held_bytes() if self._carried is not None else 0

    def unit_folder(self, cache_dir: str | None, cache_bytes: int) -> str:
        """The loader's folder for decoded units, made on first use.

        In ``/dev/shm`` when it has ``cache_bytes`` free, unless ``cache_dir`` says where;
        from then on SIGTERM exits cleanly (releasing it), unless another handler is set.
        """
        if self.unit_dir is None:
            self.unit_dir = make_unit_dir(cache_dir or default_cache_dir(cache_bytes))
            on_main = threading.current_thread() is threading.main_thread()
            if on_main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self.unit_dir

    def shutdown_workers(self, graceful: bool = True) -> None:
        """Stop the workers, release what a pass left, and delete the unit folder."""
        self.drop_carried(wait=graceful)  # it lives in the unit folder
        if self.pool is not None:
            self.worker_restarts += self.pool.restarts
            self.pool.shutdown(graceful)
            self.pool = None
        if self.unit_dir is not None:
            shutil.rmtree(self.unit_dir, ignore_errors=True)
            self.unit_dir = None

    def pass_ended(self, persistent_workers: bool) -> None:
        """A pass ended: stop the workers unless they persist between epochs."""
        if not persistent_workers:
            self.shutdown_workers()

    def release(self) -> None:
        """Release everything without waiting for the loader's own threads (the finaliser's).

        At interpreter exit, workers are terminated rather than asked.
        """
        try:
            self.close_iterator(wait=False)
            self.drop_carried(wait=False)
            self.shutdown_workers(graceful=not sys.is_finalizing())
        except Exception:
            logger.debug("error while releasing a DataLoader's resources", exc_info=True)

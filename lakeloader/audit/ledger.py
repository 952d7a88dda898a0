"""The audit ledger: every delivered step and every committed checkpoint, append-only."""

from __future__ import annotations

import datetime as dt
import os
import posixpath
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

from lakeloader.audit.records import (
    Entry,
    SaveEntry,
    Stands,
    StartEntry,
    StepEntry,
    dump_entry,
    parse_entry,
)
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.io.fetch import url_of
from lakeloader.signals import main_thread_only
from lakeloader.state.journal import Runs

LEDGER_DIR: Final = "ledger"


class Ledger:
    """The entries of one attempt, written in immutable segments.

    Args:
        root: The checkpoint root (a path of ``store``'s filesystem).
        flush_seconds: Longest time delivered steps wait in memory (0: a segment per step).
        attempt: The attempt's id (default: a new one, its start time in UTC so that ids
            sort by time, and 8 random hex digits).
    """

    def __init__(
        self,
        store: CheckpointStore,
        root: str,
        *,
        flush_seconds: float = 10.0,
        attempt: str | None = None,
    ) -> None:
        if flush_seconds < 0:
            raise ValueError(f"ledger_flush_seconds must be >= 0, got {flush_seconds}")
        self.store = store
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        self.attempt = attempt or f"{now}-{uuid.uuid4().hex[:8]}"
        self.folder = posixpath.join(root, LEDGER_DIR, self.attempt)
        self.flush_seconds = flush_seconds
        self.seq = 0
        self._resumed = (-1, "")
        self._started = False
        self._starts = 0  # start entries written: the index of the next one
        self._closed = False
        self._buffer: list[Entry] = []
        self._stands: Stands = {}  # where each stream stands after the steps recorded
        self._marks: dict[tuple[int, int], Stands] = {}  # each pending save's streams
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._writer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lakeloader-ledger", initializer=main_thread_only
        )
        self._pending: list[Future[None]] = []

    def resumed(self, step: int, attempt: str) -> None:
        """The attempt resumes from the checkpoint of ``step``, saved by ``attempt``."""
        self._resumed = (step, attempt)
        self._started = False  # a load starts the attempt's history again from there
        self._stands = {}

    def _start(self, epoch: int, position: int, world_size: int, streams: Stands) -> None:
        if self._started:
            return
        self._started = True
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        resumed = (*self._resumed, epoch, position, self.seq, self._starts, streams)
        self._buffer.append(StartEntry(self.attempt, time.time(), world_size, restart, *resumed))
        self._starts += 1

    def step(self, runs: Runs, *, committed: bool = True) -> None:
        """Record delivered steps (the tracker's observer; nothing once closed).

        Args:
            runs: The runs of one step, one per stream it moved, or of consecutive steps the
                loader delivered before the ledger was attached to it (one step number for
                them all). A run that covers no position (of a stream the step did not
                move, beside others) is not written; it tells where its stream stands.
            committed: False for steps that were discarded.
        """
        if self._closed or not runs:
            return
        t = runs[0].topology
        with self._lock:
            first: Stands = {}
            for r in runs:
                first.setdefault(r.stream, (r.epoch, r.start))
            self._start(runs[0].epoch, runs[0].start, t.world_size, _named(first))
            self.seq += 1
            for r in runs:
                self._stands[r.stream] = (r.epoch, r.stop)
                if r.stop == r.start and len(runs) > 1:
                    continue
                span = (r.epoch, r.start, r.stop, r.num_rows, t.world_size, t.batch_size)
                run = (*span, committed, r.steps, r.stream, r.skipped)
                self._buffer.append(StepEntry(self.attempt, self.seq, *run))
        if time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def mark(self, epoch: int, position: int, world_size: int) -> tuple[int, int]:
        """Where a checkpoint taken now stands: (steps delivered, index of the attempt's start).

        ``epoch``, ``position`` and ``world_size`` are the loader's; each stream stands where
        the steps recorded since the attempt began or resumed left it (a single lake: at
        ``epoch`` and ``position``).
        """
        with self._lock:
            stands = _named(self._stands)
            self._start(epoch, position, world_size, stands)
            mark = (self.seq, self._starts - 1)
            self._marks[mark] = stands
            return mark

    def saved(self, step: int, mark: tuple[int, int], epoch: int, position: int) -> None:
        """Record a checkpoint and write the segment at once (before its ``COMMIT``)."""
        if self._closed:
            return
        seq, start = mark
        with self._lock:
            streams = self._marks.pop(mark, {})
            entry = SaveEntry(self.attempt, step, seq, epoch, position, start, streams)
            self._buffer.append(entry)
        self.flush(wait=True)

    def flush(self, *, wait: bool = False) -> None:
        """Write the buffered entries as a new segment (in the background unless ``wait``)."""
        with self._lock:
            entries, self._buffer = self._buffer, []
            self._last_flush = time.monotonic()
        if entries:  # the first step number it records sorts the attempt's segments
            first = next((e.seq for e in entries if isinstance(e, StepEntry | SaveEntry)), 0)
            name = f"{first:012d}-{uuid.uuid4().hex[:6]}.jsonl"
            data = "".join(dump_entry(e) + "\n" for e in entries).encode()
            path = posixpath.join(self.folder, name)
            with self._lock:
                self._pending.append(self._writer.submit(self._put, path, data))
        if wait:
            self.wait()

    def _put(self, path: str, data: bytes) -> None:
        self.store.makedirs(self.folder)
        self.store.put(path, data)

    def wait(self) -> None:
        """Wait for the segments being written; raise the first failure."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Write what is buffered and stop the writer thread."""
        try:
            self.flush(wait=True)
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)


def _named(stands: Stands) -> Stands:
    """``stands`` if they name a stream, else none: a single lake's entry takes the loader's."""
    return dict(stands) if any(stands) else {}


def read_entries(store: CheckpointStore, root: str) -> tuple[list[Entry], list[str]]:
    """Every entry of every attempt's segments under a checkpoint root.

    Returns:
        The entries, and one line per segment cut short by a crash (its last line incomplete;
        the entries before the cut are kept).

    Raises:
        CheckpointError: If an entry is malformed anywhere but at a segment's end.
    """
    folder = posixpath.join(root, LEDGER_DIR)
    entries: list[Entry] = []
    torn: list[str] = []
    for path in sorted(store.sizes(folder)):
        if not path.endswith(".jsonl"):
            continue
        lines = store.cat(path).decode("utf-8", errors="replace").split("\n")
        if lines[-1]:  # no newline at the end: the write was cut short
            torn.append(
                f"{url_of(store.fs, path)}: its last line is incomplete (cut short by a crash)"
            )
            lines = lines[:-1]
        entries += [parse_entry(line, path) for line in lines if line]
    return entries, torn

"""The decoded-unit cache of one rank: fetched ahead in plan order, evicted once used.

Units are decoded by a small thread pool in the process that owns the loader, screened
(quarantine), and packed (:mod:`lakeloader.packed`). With worker processes a decoded unit is
written into a cache folder (in shared memory, ``/dev/shm``, when there is one) as a ``.npy``
file of packed row bytes plus an Arrow IPC file of its other columns, which every worker of
the rank memory-maps, so a unit is fetched and decoded once per rank per epoch however many
workers build batches from it. Without workers units simply stay in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import pyarrow as pa

from lakeloader.errors import LakeDataError
from lakeloader.fetch import url_of
from lakeloader.packed import Packed, RowLayout, compact, pack
from lakeloader.plan import EpochPlan, release_slots
from lakeloader.quarantine import OnError, QuarantineEntry, Validate, verdict
from lakeloader.reader import UnitReader
from lakeloader.retry import describe

logger = logging.getLogger(__name__)

#: Where unit files go by default when there are worker processes.
SHM_DIR = "/dev/shm"
#: Seconds between checks of a decode waiting for the byte gate.
GATE_POLL_SECONDS = 0.5
#: Row groups from this size on are followed by returning freed memory to the system.
RELEASE_BYTES = 64 << 20
#: Name prefix of the per-process unit folders.
UNIT_DIR_PREFIX = "lakeloader"


@dataclass(frozen=True)
class UnitFiles:
    """A decoded unit in the cache folder, as worker processes receive it.

    Attributes:
        rows: The ``.npy`` file of its packed row bytes, or None.
        table: The Arrow IPC file of its other columns.
        packed: Names of the packed columns.
    """

    rows: str | None
    table: str
    packed: tuple[str, ...]

    def paths(self) -> list[str]:
        """Every file of the unit."""
        return [p for p in (self.rows, self.table) if p is not None]


#: A decoded unit as a batch builder gets it: in memory, or as files in the cache folder.
UnitRef: TypeAlias = "Packed | UnitFiles"
#: What the store holds for a unit: the decoded unit, or why it is quarantined.
Held: TypeAlias = "UnitRef | QuarantineEntry"


@dataclass(frozen=True)
class Screening:
    """What to do with units that fail to decode or that the user's validator rejects.

    Attributes:
        on_error: ``"raise"`` a :class:`LakeDataError`, or ``"skip"`` (quarantine) the unit.
        validate: The user's check of each decoded unit, or None.
        known: Units already quarantined (from the loaded state): skipped without reading.
    """

    on_error: OnError = "raise"
    validate: Validate | None = None
    known: tuple[QuarantineEntry, ...] = ()


def default_cache_dir() -> str | None:
    """Shared memory when the machine has it, else None (the system's temporary folder)."""
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else None


def make_unit_dir(root: str | None) -> str:
    """Create this process's unit folder, first removing folders left by dead processes.

    A loader whose process was killed cannot delete its decoded units; since they live in
    shared memory, they would hold RAM until reboot. Folder names carry the owner's pid.
    """
    base = root if root is not None else tempfile.gettempdir()
    for name in os.listdir(base):
        prefix, _, rest = name.partition("-")
        pid = rest.split("-")[0]
        if prefix == UNIT_DIR_PREFIX and pid.isdigit() and not _alive(int(pid)):
            logger.info("removing %s, left by dead process %s", name, pid)
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{UNIT_DIR_PREFIX}-{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_unit(ref: UnitRef) -> Packed:
    """Open a decoded unit: zero-copy memory maps of its files, or the unit itself."""
    if isinstance(ref, Packed):
        return ref
    rows = np.load(ref.rows, mmap_mode="r") if ref.rows is not None else None
    with pa.memory_map(ref.table, "r") as source:
        table = pa.ipc.open_file(source).read_all()
    return Packed(rows, ref.packed, table)


class UnitOpener:
    """Opens units for a worker, keeping the maps of the previous batch's units.

    Consecutive batches share most of their units (they draw from the same windows), and
    mapping a file costs more than the rows a batch takes from it. Maps older than the
    previous batch are dropped, so that the memory of units the loader has evicted is freed.
    """

    def __init__(self) -> None:
        self._open: dict[UnitFiles, Packed] = {}

    def open(self, refs: Sequence[UnitRef]) -> list[Packed]:
        """The units of one batch."""
        now: dict[UnitFiles, Packed] = {}
        out = []
        for ref in refs:
            if isinstance(ref, Packed):
                out.append(ref)
                continue
            unit = now.get(ref) or self._open.get(ref) or load_unit(ref)
            now[ref] = unit
            out.append(unit)
        self._open = now
        return out


class _ByteGate:
    """Admits decodes while the row groups being decoded fit a byte limit.

    Decoding a unit materialises its whole row group first (a 256 MB row group split into
    units is decoded whole for each), so on lakes of large row groups the decodes under way,
    not the cache, decide peak memory. One decode is always admitted, however large.
    """

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._used = 0
        self._cond = threading.Condition()
        self._closed = False

    @contextlib.contextmanager
    def admit(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` (capped at the limit) of the budget for the ``with`` block."""
        n = min(max(0, nbytes), self._limit)
        with self._cond:
            while self._used and self._used + n > self._limit and not self._closed:
                self._cond.wait(GATE_POLL_SECONDS)
            self._used += n
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()

    def close(self) -> None:
        """Let every waiting decode through (the store is closing; its results are dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass
class _Entry:
    future: Future[Held]
    release: int
    nbytes: int


class UnitStore:
    """Decoded units of one epoch for one rank.

    Args:
        reader: Reads units from the lake.
        plan: The epoch's plan.
        directory: Folder for IPC unit files (worker processes), or None to keep tables in
            memory (no workers).
        threads: Units decoded at once.
        screening: What to do with units that cannot be decoded or are rejected.
        layout: How to pack tensor-typed columns (None: keep units as Arrow tables, for
            transforms and collate functions that want rows with their Arrow types).
        decode_bytes: Uncompressed row-group bytes decoded at once at most (one decode is
            always allowed).
    """

    def __init__(
        self,
        reader: UnitReader,
        plan: EpochPlan,
        directory: str | None,
        threads: int,
        screening: Screening,
        layout: RowLayout | None,
        decode_bytes: int,
    ) -> None:
        self._reader = reader
        self._layout = layout
        self._screening = screening
        self._plan = plan
        self._dir = directory
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lakeloader-io")
        self._gate = _ByteGate(decode_bytes)
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self.peak_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held or being decoded (estimates until a unit is decoded)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def _locate(self, position: int) -> tuple[int, int, int, int]:
        """(file index, row group, first row in the row group, rows) of a piece."""
        plan = self._plan
        unit = int(plan.piece_unit[position])
        rows = int(plan.offsets[position + 1] - plan.offsets[position])
        start = int(plan.units.row_start[unit]) + int(plan.piece_start[position])
        return int(plan.units.file_index[unit]), int(plan.units.row_group[unit]), start, rows

    def _estimate(self, position: int) -> int:
        file_index, rg, _, rows = self._locate(position)
        info = self._reader.snapshot.files[file_index]
        return int(info.row_group_bytes[rg] * rows / max(1, info.row_group_rows[rg]))

    def _screen(
        self, file_index: int, rg: int, start: int, rows: int
    ) -> pa.Table | QuarantineEntry:
        """Read a unit, or say why it is quarantined."""
        path = self._reader.snapshot.files[file_index].path
        rules = self._screening
        for known in rules.known:
            if known.covers(path, rg, start, rows):
                return QuarantineEntry(path, rg, start, rows, known.reason)
        try:
            table = self._reader.read(file_index, rg, start, rows)
        except LakeDataError as exc:
            if rules.on_error != "skip":
                raise
            reason = describe(exc.__cause__ or exc)
        else:
            rejected = None if rules.validate is None else verdict(rules.validate, table)
            if rejected is None:
                return table
            if rules.on_error != "skip":
                raise LakeDataError(
                    f"{url_of(self._reader.fs, path)}, row group {rg}, rows [{start}, "
                    f"{start + rows}): rejected by validate: {rejected}. Fix the data, or pass "
                    "on_error='skip' to quarantine such units"
                )
            reason = f"rejected by validate: {rejected}"
        logger.warning(
            "quarantined %s, row group %d, rows [%d, %d): %s", path, rg, start, start + rows, reason
        )
        return QuarantineEntry(path, rg, start, rows, reason)

    def _decode(self, position: int) -> Held:
        where = self._locate(position)
        file_index, rg = where[0], where[1]
        rg_bytes = self._reader.snapshot.files[file_index].row_group_bytes[rg]
        with self._gate.admit(rg_bytes):
            held = self._decode_admitted(position, where)
        if rg_bytes >= RELEASE_BYTES:  # hand a big row group's memory back to the system
            pa.default_memory_pool().release_unused()
        return held

    def _decode_admitted(self, position: int, where: tuple[int, int, int, int]) -> Held:
        table = self._screen(*where)
        ref: Held
        if isinstance(table, QuarantineEntry):
            size, ref = 0, table
        elif self._dir is None:
            unit = self._pack(table, None)
            size, ref = unit.table.nbytes + (unit.rows.nbytes if unit.rows is not None else 0), unit
        else:
            ref = self._write(position, table)
            size = sum(os.path.getsize(p) for p in ref.paths())
        with self._lock:
            entry = self._entries.get(position)
            if entry is not None:
                entry.nbytes = size
            self.peak_bytes = max(self.peak_bytes, sum(e.nbytes for e in self._entries.values()))
        return ref

    def _pack(self, table: pa.Table, out: np.ndarray | None) -> Packed:
        if self._layout is None or not self._layout.names:
            return Packed(None, (), compact(table))
        return pack(table, self._layout, out)

    def _write(self, position: int, table: pa.Table) -> UnitFiles:
        """Pack a unit straight into the cache folder (temporary names, then renamed)."""
        base = os.path.join(self._dir or "", f"e{self._plan.epoch}-p{position}")
        rows_path, out = base + ".rows.npy", None
        if self._layout is not None and self._layout.names:
            shape = (table.num_rows, self._layout.row_bytes)
            out = np.lib.format.open_memmap(rows_path + ".tmp", "w+", np.uint8, shape)
        unit = self._pack(table, out)
        if out is not None:
            out.flush()
            del out
            if unit.rows is None:  # nothing could be packed after all
                os.unlink(rows_path + ".tmp")
            else:
                os.replace(rows_path + ".tmp", rows_path)
        table_path = base + ".arrow"
        with (
            pa.OSFile(table_path + ".tmp", "wb") as sink,
            pa.ipc.new_file(sink, unit.table.schema) as writer,
        ):
            writer.write_table(unit.table)
        os.replace(table_path + ".tmp", table_path)
        return UnitFiles(rows_path if unit.rows is not None else None, table_path, unit.packed)

    def request(self, positions: np.ndarray, on_ready: Callable[[], None] | None = None) -> None:
        """Start decoding the units at these positions unless already held or underway.

        Args:
            positions: Virtual-sequence positions of the units.
            on_ready: Called (from a decoding thread) when each newly started unit is done.
        """
        with self._lock:
            missing = [int(p) for p in positions if int(p) not in self._entries]
        if not missing:
            return
        releases = release_slots(self._plan, np.asarray(missing, dtype=np.int64))
        for pos, rel in zip(missing, releases.tolist(), strict=True):
            entry = _Entry(self._pool.submit(self._decode, pos), rel, self._estimate(pos))
            with self._lock:
                self._entries[pos] = entry
            if on_ready is not None:
                entry.future.add_done_callback(lambda _f: on_ready())

    def ready(self, positions: np.ndarray) -> bool:
        """Whether every unit at these positions is decoded (or failed)."""
        with self._lock:
            return all(self._entries[int(p)].future.done() for p in positions)

    def failed(self, positions: np.ndarray) -> bool:
        """Whether reading any unit at these positions failed (``get`` would raise)."""
        with self._lock:
            futures = [self._entries[int(p)].future for p in positions]
        return any(f.done() and not f.cancelled() and f.exception() for f in futures)

    def get(self, positions: np.ndarray) -> list[Held]:
        """Wait for the units at these positions (requesting them if needed).

        Returns:
            Each unit, or its quarantine entry when it is skipped.

        Raises:
            LakeDataError: If a unit cannot be read (and ``on_error`` is ``"raise"``).
            StoreUnavailableError: If the store stays down past the retry deadline.
        """
        self.request(positions)
        with self._lock:
            futures = [self._entries[int(p)].future for p in positions]
        return [f.result() for f in futures]

    def describe(self, positions: np.ndarray) -> list[str]:
        """Name the units at these positions as ``file, row group, rows [a, b)``."""
        out = []
        for p in positions:
            file_index, rg, start, rows = self._locate(int(p))
            path = self._reader.snapshot.files[file_index].path
            out.append(f"{path}, row group {rg}, rows [{start}, {start + rows})")
        return out

    def release(self, delivered: int) -> None:
        """Evict every unit whose last use lies before global slot ``delivered``."""
        with self._lock:
            done = [p for p, e in self._entries.items() if e.release <= delivered]
            entries = [self._entries.pop(p) for p in done]
        for entry in entries:
            self._discard(entry)

    def _discard(self, entry: _Entry) -> None:
        if not entry.future.done():
            entry.future.cancel()
            return
        if entry.future.cancelled() or entry.future.exception() is not None:
            return
        ref = entry.future.result()
        if isinstance(ref, UnitFiles):  # units in memory and quarantine entries leave none
            for path in ref.paths():
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    logger.debug("unit file %s was already gone", path)

    def close(self, wait: bool = True) -> None:
        """Stop decoding and drop every unit (deleting unit files).

        Args:
            wait: Wait for decodes underway. A finaliser passes False: it may run on one of
                this store's own threads, which must not wait for itself.
        """
        self._gate.close()
        self._pool.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            self._discard(entry)

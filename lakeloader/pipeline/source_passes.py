"""The open sources of a mixture: each source epoch's pass, and what they share.

A mixture's pass over its sources (:mod:`lakeloader.pipeline.mixing`) reads each epoch of each
source through a :class:`SourcePass` (a unit store and a builder over that epoch's order). All
of them pack rows into one arena and decode in the DataLoader's workers (one dispatcher for
all) or on one pool of threads; :class:`SourcePasses` owns these and the passes. A mixture's
passes are cuts of ``epoch_rows`` rows through streams that go on, so a pass that ends leaves
its sources mid-epoch, with row groups half delivered and others decoded ahead: the loader
keeps the :class:`SourcePasses` for the next pass, which continues where this one stopped
instead of decoding them again (:attr:`SourcePasses.at`).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor

from lakeloader.cache.arena import Arena
from lakeloader.cache.packed import RowLayout
from lakeloader.cache.store import Screening
from lakeloader.io.reader import UnitReader
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions
from lakeloader.order.mixture import MixCursor
from lakeloader.pipeline.builders import LocalBuilder
from lakeloader.pipeline.cleanup import close_safely
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.workspace import (
    ARENA_START_ROWS,
    PassSpec,
    PassWorkspace,
    WorkerDecodes,
)
from lakeloader.signals import main_thread_only
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool


class SourcePass:
    """One epoch of one source in a mixture: its unit store and a builder of its slot ranges.

    Its units are decoded in the workers, or in this process's threads.

    Args:
        mixture: The mixture.
        source: The source's index.
        epoch: The source's epoch.
        reader: Reads the source's units.
        options: The loader's options (the byte budget is shared among sources).
        unit_dir: The loader's folder for decoded units.
        arena: The arena every source's units are packed into.
        layout: How the sources' rows are packed (the same for all: they read the same columns).
        decode_pool: The decoding threads, shared by the sources.
        workers: The workers' decodes, shared by the sources, or None (the threads decode).
    """

    def __init__(
        self,
        mixture: Mixture,
        source: int,
        epoch: int,
        reader: UnitReader,
        options: LoaderOptions,
        unit_dir: str,
        arena: Arena | None,
        layout: RowLayout,
        decode_pool: ThreadPoolExecutor,
        workers: WorkerDecodes | None,
    ) -> None:
        ds = mixture.sources[mixture.names[source]]
        self.epoch = epoch
        self.rows = len(ds)
        budget = max(options.cache_bytes // len(mixture.names), 1)
        self.spec = PassSpec(
            plan=ds.plan(epoch),
            start=0,
            options=dataclasses.replace(options, cache_bytes=budget),
            topology=Topology(1, 0, 0, options.batch_size),
            screening=Screening(ds.on_error, ds.validate, ds.lost),
            layout=layout,
            recipe=BatchRecipe(lists=ds.list_format),
        )
        channel = workers.channel(source) if workers is not None else None
        self.space = PassWorkspace(self.spec, reader, None, unit_dir, arena, decode_pool, channel)
        #: Screens its parts of a step and gathers the columns not in the arena.
        self.builder = LocalBuilder(self.spec, self.space, reader.schema)

    def close(self, wait: bool = False) -> None:
        """Stop decoding; delete the pass's units."""
        self.space.close(wait)


class SourcePasses:
    """A mixture's open source epochs, their arena, decoding threads and folder.

    Made by the loader for a pass, and kept for the next when that pass ended at its last
    step; closed when the loader closes, or when it is collected.

    Args:
        mixture: The mixture.
        options: The loader's options.
        readers: One reader per source, in the order of the mixture's names.
        unit_dir: The loader's folder for decoded units.
        pool: The DataLoader's workers, which decode every source's units; None: the
            loader's ``io_threads`` do.

    Attributes:
        passes: ``{(source, epoch): pass}`` of the epochs open.
        schema: The columns read (the same for every source).
        layout: How every source's rows are packed into the arena.
        arena: The arena (None when no column is packed).
        at: Where the mixture stands when a pass ended at its last step with these open: the
            next pass may continue with them from there (None while a pass is under way).
    """

    def __init__(
        self,
        mixture: Mixture,
        options: LoaderOptions,
        readers: list[UnitReader],
        unit_dir: str,
        pool: WorkerPool | None,
    ) -> None:
        self._mixture, self._options, self._readers = mixture, options, readers
        self._unit_dir = unit_dir
        self._rows = mixture.rows()
        self.passes: dict[tuple[int, int], SourcePass] = {}
        self.schema = readers[0].schema
        self.layout = RowLayout.of(self.schema)
        self.at: MixCursor | None = None
        self._dir = tempfile.mkdtemp(prefix="mixture-", dir=unit_dir)
        self.arena: Arena | None = None
        if self.layout.names:  # every source's packed rows in one arena: one gather a step
            budget = max(options.cache_bytes // self.layout.row_bytes, 1)
            self.arena = Arena(self._dir, self.layout.record, min(budget, ARENA_START_ROWS), budget)
        #: The sources' decoding threads: ``io_threads`` in all.
        self._decode_pool = ThreadPoolExecutor(
            max_workers=options.io_threads,
            thread_name_prefix="lakeloader-io",
            initializer=main_thread_only,
        )
        self._workers = WorkerDecodes(pool, options) if pool is not None else None
        self._closed = False
        self._finalizer = weakref.finalize(
            self,
            close_safely,
            _close_passes,
            self.passes,
            self.arena,
            self._dir,
            self._decode_pool,
            self._workers,
        )

    def get(self, key: tuple[int, int]) -> SourcePass:
        """The pass of ``(source, epoch)``, opened on first use."""
        if key not in self.passes:
            source, epoch = key
            self.passes[key] = SourcePass(
                self._mixture,
                source,
                epoch,
                self._readers[source],
                self._options,
                self._unit_dir,
                self.arena,
                self.layout,
                self._decode_pool,
                self._workers,
            )
        return self.passes[key]

    def held_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return sum(p.space.store.nbytes for p in self.passes.values())

    def peak_bytes(self) -> int:
        """Most bytes held at once by a source's pass open."""
        return max((p.space.store.peak_bytes for p in self.passes.values()), default=0)

    def release(self, cursor: MixCursor) -> None:
        """Evict what ``cursor`` is past; close the epochs it is done with."""
        names, rows = self._mixture.names, self._rows
        for key in list(self.passes):
            source, epoch = key
            count = cursor.counts.get(names[source], 0)
            consumed = min(max(count - epoch * rows[source], 0), rows[source])
            if consumed >= rows[source]:
                self.passes.pop(key).close()
            else:
                self.passes[key].space.store.release(consumed)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def close(self, wait: bool = True) -> None:
        """Stop decoding; drop every source's units; delete the folder (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _close_passes(self.passes, self.arena, self._dir, self._decode_pool, self._workers, wait)


def _close_passes(
    passes: dict[tuple[int, int], SourcePass],
    arena: Arena | None,
    folder: str,
    pool: ThreadPoolExecutor,
    workers: WorkerDecodes | None,
    wait: bool = False,
) -> None:
    """Close every source's pass, their decodes and arena; delete the mixture's folder."""
    for source_pass in passes.values():
        source_pass.close(wait)
    passes.clear()
    if workers is not None:
        workers.close(wait)
    pool.shutdown(wait=wait, cancel_futures=True)
    if arena is not None:
        arena.close()
    shutil.rmtree(folder, ignore_errors=True)

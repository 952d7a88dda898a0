"""The unit stores of one pass: one per epoch of each lake it reads, and what they share.

A pass reads epochs of one or more lakes (its *leaves*); each epoch of a leaf is a
:class:`Store`, opened on first use. The stores of a pass share one folder, one arena, one
pool of decoding threads and, with workers, one dispatcher of decode tasks; the byte budget
is split among the leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pyarrow as pa

from lakeloader.cache.arena import Arena
from lakeloader.cache.decode import Decodes, LocalDecodes, UnitDecoder
from lakeloader.cache.packed import RowLayout
from lakeloader.cache.store import Screening, UnitStore
from lakeloader.dataset import LakeDataset
from lakeloader.io.fetch import is_local
from lakeloader.io.prefetch import Prefetcher
from lakeloader.io.reader import UnitReader
from lakeloader.options import LoaderOptions
from lakeloader.pipeline.builders import LocalBuilder, arena_rows
from lakeloader.pipeline.cleanup import close_safely
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.workspace import ARENA_START_ROWS, PassSpec, StoreDecodes, WorkerDecodes
from lakeloader.signals import main_thread_only
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool

logger = logging.getLogger(__name__)


class Leaf(NamedTuple):
    """A lake a pass reads, its reader (whose counters are the loader's) and its recipe.

    A followed lake's ``dataset`` is the first increment the pass reads (a later epoch is read
    from its successor, ``dataset.for_epoch(epoch)``); ``known``: units already quarantined
    (from the loaded state), skipped without reading.
    """

    dataset: LakeDataset
    reader: UnitReader
    known: tuple[QuarantineEntry, ...] = ()
    recipe: BatchRecipe = BatchRecipe()


class Store:
    """One epoch of one leaf: its unit store, and a builder of its slot ranges.

    It makes its own folder inside the pass's ``folder``; ``shares_tables``: whether another
    process reads the columns that are not packed.
    """

    def __init__(
        self,
        spec: PassSpec,
        reader: UnitReader,
        folder: str,
        arena: Arena | None,
        decodes: Decodes,
        shares_tables: bool,
    ) -> None:
        self.spec, self.schema = spec, reader.schema
        self.dir = tempfile.mkdtemp(prefix="epoch-", dir=folder)
        self.arena = arena
        remote = isinstance(decodes, StoreDecodes)  # else the loader's threads decode
        #: Fetches units ahead of their decode (None: a local lake, which pyarrow reads).
        self.prefetcher: Prefetcher | None = None
        if not is_local(reader.fs):
            self.prefetcher = Prefetcher(reader, self.dir if remote else None)
        self.store = UnitStore(
            reader,
            spec.plan,
            spec.layout,
            arena,
            self.dir if shares_tables else None,
            spec.screening.known,
            decodes,
            self.prefetcher,
        )
        if isinstance(decodes, StoreDecodes):
            decodes.bind(self.store, reader.counters, arena)
        #: Screens its slot ranges and gathers the columns not in the arena.
        self.builder = LocalBuilder(spec, self, reader.schema)

    def close(self, wait: bool = True) -> None:
        """Stop fetching and decoding, drop every unit and delete the store's folder."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.store.close(wait)
        shutil.rmtree(self.dir, ignore_errors=True)


class Stores:
    """The stores of one pass (closed with the pass, the loader, or when collected).

    Args:
        topology: The topology the stores' steps are cut for (a mixture's or a packed
            stream's stores read slot ranges: one rank of one).
        layout: How rows are packed into the arena (the same for every leaf), or None: rows
            go to the user's code and nothing is packed.
        workers_decode: Whether the workers decode (else, with a pool, they build batches).
        increments_by_task: Whether a followed lake's increments go to the workers with each
            task's decoder (a mixture's and a packed stream's: their workers are set up once,
            not per increment as a lake's).
    """

    def __init__(
        self,
        leaves: list[Leaf],
        options: LoaderOptions,
        topology: Topology,
        unit_dir: str,
        pool: WorkerPool | None,
        layout: RowLayout | None,
        workers_decode: bool,
        increments_by_task: bool = False,
    ) -> None:
        self.leaves, self.layout, self._by_task = leaves, layout, increments_by_task
        self._options, self._topology = options, topology
        self.dir = tempfile.mkdtemp(prefix="pass-", dir=unit_dir)
        self.arena: Arena | None = None
        if layout is not None and layout.names:  # every leaf's packed rows in one arena
            budget = max(options.cache_bytes // layout.row_bytes, 1)
            self.arena = Arena(self.dir, layout.record, min(budget, ARENA_START_ROWS), budget)
        self.workers: WorkerDecodes | None = None
        #: The pass's generation of the pool (answers of other passes are dropped).
        self.generation = pool.new_generation() if pool is not None else 0
        if pool is not None and workers_decode:
            self.workers = WorkerDecodes(pool, options, self.generation)
        self._shares_tables = pool is not None
        self._threads = ThreadPoolExecutor(
            max_workers=options.io_threads,
            thread_name_prefix="lakeloader-io",
            initializer=main_thread_only,
        )
        self.open: dict[tuple[int, int], Store] = {}
        #: Where a mixture stands when a pass ended at its last step with these stores: the
        #: next pass may continue with them from there (None while a pass is under way).
        self.at: Any = None
        self._closed = False
        self._finalizer = weakref.finalize(
            self, close_safely, _close, self.open, self.arena, self.dir, self._threads, self.workers
        )

    @property
    def schema(self) -> pa.Schema:
        """The columns read (the same for every leaf)."""
        return self.leaves[0].reader.schema

    def learn(self, entries: Sequence[QuarantineEntry], leaf: int | None = None) -> None:
        """Units found quarantined: every epoch opened from now on skips them without reading.

        ``leaf``: the one lake they are of (None: every leaf is told).
        """
        for i in range(len(self.leaves)) if leaf is None else (leaf,):
            known = self.leaves[i].known
            new = tuple(e for e in entries if not any(k.covers(*e.key) for k in known))
            if new:
                self.leaves[i] = self.leaves[i]._replace(known=known + new)

    def get(self, leaf: int, epoch: int) -> Store:
        """The store of ``epoch`` of ``leaf``, opened on first use."""
        key = (leaf, epoch)
        if key not in self.open:
            first, reader, known, recipe = self.leaves[leaf]
            ds = first.for_epoch(epoch)  # a followed lake's increment
            if ds is not first:  # its own files; its reads count as the leaf's
                reader, counters = ds.reader(), reader.counters
                reader.count_into(counters)
            opts = self._options
            budget = max(opts.cache_bytes // len(self.leaves), 1)
            spec = PassSpec(
                plan=ds.plan(epoch),
                start=0,
                options=dataclasses.replace(opts, cache_bytes=budget),
                topology=self._topology,
                screening=Screening(ds.on_error, ds.validate, known + ds.lost),
                layout=self.layout,
                recipe=recipe,
            )
            decoder = UnitDecoder(reader, self.layout, ds.on_error, ds.validate)
            decodes: Decodes
            by_task = self._by_task and ds.follow is not None
            plain = ds is first and first.grows_at is None
            if self.workers is not None and by_task and _pickles(decoder, ds):
                decodes = StoreDecodes(self.workers, decoder)  # the increment's, with each task
            elif self.workers is not None and not by_task and plain:
                decodes = StoreDecodes(self.workers, leaf)  # the snapshot they were set up with
            else:  # a lake that grew (its pinned epoch's rest, then the lake of now), or no pickle
                # bound to the arena, not to self: what the finaliser holds must not keep self alive
                records = functools.partial(arena_rows, self.arena)
                decodes = LocalDecodes(decoder, budget, records, self._threads)
            self.open[key] = Store(spec, reader, self.dir, self.arena, decodes, self._shares_tables)
        return self.open[key]

    def release(self, leaf: int, epoch: int, delivered: int) -> None:
        """Evict what slot ``delivered`` of that epoch is past; close it once past its end."""
        store = self.open.get((leaf, epoch))
        if store is None:
            return
        if delivered >= store.spec.plan.num_rows:
            self.drop(leaf, epoch)
        else:
            store.store.release(delivered)

    def drop(self, leaf: int, epoch: int) -> None:
        """Close the store of ``epoch`` of ``leaf`` (every partition of this rank is past it)."""
        store = self.open.pop((leaf, epoch), None)
        if store is not None:
            store.close(wait=False)

    def held_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return sum(s.store.nbytes for s in self.open.values())

    def peak_bytes(self) -> int:
        """Most bytes held at once by one of the stores open."""
        return max((s.store.peak_bytes for s in self.open.values()), default=0)

    def close(self, wait: bool = True) -> None:
        """Stop decoding; drop every store's units; delete the folder (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _close(self.open, self.arena, self.dir, self._threads, self.workers, wait)


def _close(
    stores: dict[tuple[int, int], Store],
    arena: Arena | None,
    folder: str,
    threads: ThreadPoolExecutor,
    workers: WorkerDecodes | None,
    wait: bool = False,
) -> None:
    """Close every store, the decodes, threads and arena; delete the pass's folder."""
    for store in stores.values():
        store.close(wait)
    stores.clear()
    if workers is not None:
        workers.dispatcher.close(wait)  # stop sending; cancel queued decodes
    threads.shutdown(wait=wait, cancel_futures=True)
    if arena is not None:
        arena.close()
    shutil.rmtree(folder, ignore_errors=True)


def _pickles(decoder: UnitDecoder, dataset: LakeDataset) -> bool:
    """Whether a decoder can go to the workers with a task (a ``validate`` may not pickle)."""
    try:
        pickle.dumps(decoder)
    except Exception as exc:
        logger.info("the loader's threads decode %r: its decoder does not pickle: %s", dataset, exc)
        return False
    return True

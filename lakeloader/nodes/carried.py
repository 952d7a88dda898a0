"""A followed lake's carried step: an increment's short tail opens the next increment.

With ``drop_last=True`` the rows of an increment that do not fill a last global batch are
carried into the next one, whose first rows fill the batch. The step is read and built in this
process, whatever ``num_workers`` is: every rank reads the whole step and keeps its share; each
row's seed is its slot's in its increment. The tracker records it as one step: the end of one
increment and the start of the next.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from lakeloader.cache.decode import DecodeJob, Held, UnitDecoder
from lakeloader.cache.packed import Packed
from lakeloader.cache.screening import screen
from lakeloader.cache.store import UnitOpener
from lakeloader.dataset import LakeDataset
from lakeloader.nodes.base import Host
from lakeloader.order.batches import range_specs
from lakeloader.order.plan import EpochPlan, batch_slots, piece_span, rank_bounds
from lakeloader.pipeline.collate import pin
from lakeloader.pipeline.recipe import BatchRecipe, build_payload, finish_payload
from lakeloader.randomness import slot_seeds
from lakeloader.signals import main_thread_only
from lakeloader.state.journal import DeliveredRun
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import Delivery, ReaderStateTracker

logger = logging.getLogger(__name__)


class Following(Protocol):
    """What the carried step uses of a followed lake's node."""

    host: Host
    dataset: LakeDataset
    _base: LakeDataset
    tracker: ReaderStateTracker

    def recipe(self) -> BatchRecipe:
        """How rows become batches."""

    def follow_dataset(self, epoch: int) -> None:
        """Switch to the dataset that ``epoch`` runs on."""


class _Part(NamedTuple):
    """A slot range ``[start, stop)`` of one increment's order, in a carried step."""

    dataset: LakeDataset
    epoch: int
    start: int
    stop: int


class _Read(NamedTuple):
    """A part read: its units, and its rows that are not quarantined, in their order.

    Attributes:
        units: Its pieces that were read.
        take: Its rows, as indices into the concatenation of ``units``.
        kept: Where each of them stands in the part (its rows partition-major).
        seeds: Each one's seed (its slot's in its increment).
        skipped: Its pieces quarantined.
    """

    units: list[Packed]
    take: np.ndarray
    kept: np.ndarray
    seeds: np.ndarray
    skipped: tuple[QuarantineEntry, ...]


def _decode(
    decoder: UnitDecoder, plan: EpochPlan, position: int, known: Sequence[QuarantineEntry]
) -> Held:
    """A piece of ``plan`` read and screened, or quarantined already (``known``)."""
    file_index, rg, row_start, rows = piece_span(plan, position)
    path = decoder.reader.snapshot.files[file_index].path
    for entry in known:
        if entry.covers(path, rg, row_start, rows):
            return QuarantineEntry(path, rg, row_start, rows, entry.reason)
    return decoder.decode(DecodeJob(position, file_index, rg, row_start, rows, -1, None), None)


def carried_step(node: Following) -> Any:
    """The step that opens the next increment with this one's tail (None: no tail).

    Raises:
        CaughtUpError: If too few rows come within the follow timeout (nothing moves).
    """
    start, rows, batch = node.tracker.position, len(node.dataset), node.host.topology.global_batch
    if not node.host.options.drop_last or not 0 < rows - start < batch:
        return None
    parts = [_Part(node.dataset, node.tracker.epoch, start, rows)]
    need = batch - (rows - start)
    logger.info(
        "increment %d leaves %d rows, fewer than a global batch of %d: they open the next",
        node.tracker.epoch,
        rows - start,
        batch,
    )
    while need:
        epoch = parts[-1].epoch + 1
        ds = node._base.for_epoch(epoch)  # waits for it
        parts.append(_Part(ds, epoch, 0, min(need, len(ds))))
        need -= parts[-1].stop
    reads = [_read(node, part) for part in parts]
    topo = node.host.topology
    lo, hi = rank_bounds(topo.global_batch, topo.world_size, topo.rank)
    firsts = np.cumsum([0, *(p.stop - p.start for p in parts[:-1])])  # the parts end to end
    places = [read.kept + int(first) for read, first in zip(reads, firsts, strict=True)]
    mine = [(place >= lo) & (place < hi) for place in places]
    out = _assemble(node, reads, mine, parts[-1].dataset.reader().schema)
    _advance(node, parts, reads, mine, (lo, hi))
    return out


def _read(node: Following, part: _Part) -> _Read:
    """Read a part's pieces (in threads) and screen them as a pass does."""
    ds, plan = part.dataset, part.dataset.plan(part.epoch)
    if part.stop == part.start:  # an increment without rows
        empty = np.zeros(0, dtype=np.int64)
        return _Read([], empty, empty, empty.astype(np.uint64), ())
    (spec,) = range_specs(
        plan, np.zeros(1, np.int64), np.array([part.start]), np.array([part.stop])
    )
    decoder = UnitDecoder(ds.reader(), None, ds.on_error, ds.validate)
    known = (*node.tracker.quarantine, *ds.lost)
    threads = max(1, min(node.host.options.io_threads, len(spec.positions)))
    with ThreadPoolExecutor(threads, initializer=main_thread_only) as pool:
        held = list(pool.map(lambda p: _decode(decoder, plan, int(p), known), spec.positions))
    screened = screen(spec, held, plan, None, len(decoder.reader.schema))
    keep = screened.kept
    kept = np.arange(part.stop - part.start) if keep is None else np.flatnonzero(keep)
    slots = batch_slots(part.start, part.stop, plan.num_partitions)[kept]
    units = UnitOpener().open(screened.refs, None)  # decoded here: no arena, no IPC file
    seeds = slot_seeds(plan.seed, plan.epoch, slots)
    return _Read(units, screened.take, kept, seeds, screened.skipped)


def _assemble(
    node: Following, reads: Sequence[_Read], mine: Sequence[np.ndarray], schema: pa.Schema
) -> Any:
    """This rank's share of the carried step (``mine``: each part's rows in it), built."""
    units: list[Packed] = []
    takes, seeds = [], []
    for read, rows in zip(reads, mine, strict=True):
        takes.append(read.take[rows] + sum(u.num_rows for u in units))
        seeds.append(read.seeds[rows])
        for u in read.units:  # an earlier increment's in the later one's (widened) types
            same = u.table.schema.equals(schema)
            units.append(u if same else Packed(None, (), u.table.cast(schema), u.where))
    recipe = node.recipe()
    take, seed = np.concatenate(takes), np.concatenate(seeds)
    batch = finish_payload(build_payload(units, take, schema, recipe, {}, seed), recipe)
    return pin(batch) if node.host.options.pin_memory else batch


def _advance(
    node: Following,
    parts: Sequence[_Part],
    reads: Sequence[_Read],
    mine: Sequence[np.ndarray],
    bounds: tuple[int, int],
) -> None:
    """Record the carried step, one step: the end of one increment, the start of the next."""
    (lo, hi), tracker, at, runs = bounds, node.tracker, 0, []
    before = (tracker.epoch, tracker.position, tracker.rows_dropped)
    for i, (part, read, rows_mine) in enumerate(zip(parts, reads, mine, strict=True)):
        rows, size = len(part.dataset), part.stop - part.start
        if i:
            tracker.set_epoch(part.epoch, restart=True)
            tracker.settle_tail(rows)
        share = max(0, min(hi, at + size) - max(lo, at))
        kept = int(rows_mine.sum())
        if size:
            done = Delivery(part.stop, kept, part.stop == rows, read.skipped, share - kept)
            start = tracker.moved(done, rows)
            runs.append(DeliveredRun(part.epoch, start, part.stop, rows, tracker.topology))
        at += size
    tracker.stepped(before, runs)
    node.follow_dataset(parts[-1].epoch)

"""``FollowLoader``: the loader of a dataset with ``follow=``, endless over its increments.

``for batch in loader`` runs through increment after increment (each one epoch of the
ordinary loader: the same order, exactness and resume), waiting for the next one to be
appended once it has caught up; it ends when none comes within ``Follow.timeout``, and a new
``iter(loader)`` then goes on from there. It never moves to the next epoch before that
increment exists, so a state taken while it waits is the end of the last increment.

A followed lake is one stream of rows: its increments' orders end to end, each a pure
function of its increment, cut into global batches. With ``drop_last=False`` an increment
ends with a short batch, as an epoch does. With ``drop_last=True`` no row is dropped: the
rows of an increment that do not fill a last global batch (its *tail*, fewer than a global
batch) are carried into the next one, whose first rows fill the batch they open (the next
increments' first rows, when they are smaller than that). Every batch is then full and every
appended row comes once; the rows of the tail when the run stops are still to come, not
dropped: the state stands before them (``position`` inside the increment, ``rows_dropped``
0), so a resume under any world size or batch size goes on from there, and cuts the stream
into its own global batches.

That carried step is read and built here, in this process, whatever ``num_workers`` is: each
part (the tail, then the next increments' first rows) is a slot range of its increment's
order (:func:`~lakeloader.order.batches.range_specs`), read and screened like any unit
(quarantine, ``validate``); every rank reads the whole step and keeps its share of it, in the
stream's order, so the batches are those of one rank with the global batch, whatever the
topology. Its rows' seeds are their own slots' in their increments. The tracker records it as
the end of one increment and the start of the next (two steps for the audit ledger).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from lakeloader.cache.decode import DecodeJob, Held, UnitDecoder, UnitRef
from lakeloader.cache.packed import Packed
from lakeloader.dataset import LakeDataset
from lakeloader.lake.following import CaughtUpError, increment_at
from lakeloader.lake.increments import Increment
from lakeloader.loader import LOADER_FOR, DataLoader
from lakeloader.mixture import Mixture
from lakeloader.order.batches import range_specs
from lakeloader.order.plan import EpochPlan, batch_slots, piece_span, rank_bounds
from lakeloader.pipeline.collate import pin
from lakeloader.pipeline.recipe import build_payload, finish_payload
from lakeloader.randomness import slot_seeds
from lakeloader.recovery.coordinator import Resumption
from lakeloader.signals import main_thread_only
from lakeloader.state.loader_state import LoaderState
from lakeloader.state.quarantine import QuarantineEntry, drop_pieces
from lakeloader.state.tracker import Delivery

logger = logging.getLogger(__name__)

#: The state key of the increment a followed lake's position is in.
INCREMENT_KEY = "follow_increment"


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


class FollowLoader(DataLoader):
    """A ``DataLoader`` of a growing lake (made by ``DataLoader(dataset)`` when it follows).

    With ``drop_last=True`` an increment's short tail is carried into the next increment
    instead of dropped (see the module docstring).
    """

    def _init_dataset(self, dataset: LakeDataset | Mixture) -> None:
        super()._init_dataset(dataset)
        self.tracker.drop_last = False  # a short tail is carried, never counted as dropped

    def state_dict(self, *, fetched_ahead: int = 0) -> dict[str, Any]:
        """The position, with the increment it stands in (its marks: a few numbers).

        With them, :meth:`load_state_dict` finds the increment's files again on a dataset
        made anew, without a checkpoint's manifest. ``fetched_ahead`` is the lake's
        (``DataLoader.state_dict``).
        """
        state = super().state_dict(fetched_ahead=fetched_ahead)
        increment = self.dataset.snapshot.increment
        state[INCREMENT_KEY] = None if increment is None else increment.to_list()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state of a followed lake, under any topology.

        Raises:
            StateMismatchError: If the lake no longer holds the state's increment, or the
                state belongs to another lake or configuration.
        """
        saved = state_dict.get(INCREMENT_KEY)
        if saved is None:
            super().load_state_dict(state_dict)
            return
        state = LoaderState.from_dict(state_dict)
        increment = Increment.from_list(saved)
        base = self._base
        if base.snapshot.increment != increment:
            base = base.on_increment(
                *increment_at(base.source, increment, base.increment_request())
            )
        state.check_matches(base.fingerprint, base.config.to_dict())
        self._resume(Resumption(state, dataset=base))

    def _pass_steps(self) -> int:
        raise TypeError("a followed lake is endless: it has no len(); see loader.dataset's")

    def _pass(self) -> Iterator[Any]:
        return self._increments()

    def _increments(self) -> Iterator[Any]:
        while True:
            try:
                self._follow_dataset(self.tracker.epoch)  # a state at an increment's end: next
                if self.tracker.epoch_over(len(self.dataset)):
                    # make sure the next increment exists before the epoch moves on
                    self._base.for_epoch(self.tracker.epoch + 1)
                    carried = None
                else:
                    carried = self._carried_step()
            except CaughtUpError as caught:
                logger.info("caught up with the lake: %s", caught)
                return
            if carried is None:
                yield from super()._pass()
            else:
                yield carried

    # ------------------------------------------------------------- the carried step
    def _carried_step(self) -> Any:
        """The step that opens the next increment with this one's tail (None: no tail).

        Raises:
            CaughtUpError: If too few rows come within the follow timeout (nothing moves).
        """
        start, rows, batch = self.tracker.position, len(self.dataset), self.global_batch_size
        if not self.drop_last or not 0 < rows - start < batch:
            return None
        parts = [_Part(self.dataset, self.tracker.epoch, start, rows)]
        need = batch - (rows - start)
        logger.info(
            "increment %d leaves %d rows, fewer than a global batch of %d: they open the next",
            self.tracker.epoch,
            rows - start,
            batch,
        )
        while need:
            epoch = parts[-1].epoch + 1
            ds = self._base.for_epoch(epoch)  # waits for it
            parts.append(_Part(ds, epoch, 0, min(need, len(ds))))
            need -= parts[-1].stop
        reads = [self._read(part) for part in parts]
        out = self._assemble(parts, reads, parts[-1].dataset.reader().schema)
        self._advance(parts, reads)
        return out

    def _read(self, part: _Part) -> _Read:
        """Read a part's pieces (in threads) and screen them as a pass does."""
        ds, plan = part.dataset, part.dataset.plan(part.epoch)
        if part.stop == part.start:  # an increment without rows
            empty = np.zeros(0, dtype=np.int64)
            return _Read([], empty, empty, empty.astype(np.uint64), ())
        (spec,) = range_specs(
            plan, np.zeros(1, np.int64), np.array([part.start]), np.array([part.stop])
        )
        decoder = UnitDecoder(ds.reader(), None, ds.on_error, ds.validate)
        known = (*self.tracker.quarantine, *ds.lost)
        threads = max(1, min(self.options.io_threads, len(spec.positions)))
        with ThreadPoolExecutor(threads, initializer=main_thread_only) as pool:
            held = list(pool.map(lambda p: _decode(decoder, plan, int(p), known), spec.positions))
        bad = [isinstance(h, QuarantineEntry) for h in held]
        take = drop_pieces(spec.take, plan.piece_rows(spec.positions).tolist(), bad)
        kept = np.flatnonzero(~np.asarray(bad, dtype=bool)[spec.inverse])
        slots = batch_slots(part.start, part.stop, plan.num_partitions)[kept]
        units = [_packed(h) for h in held if isinstance(h, UnitRef)]
        skipped = tuple(h for h in held if isinstance(h, QuarantineEntry))
        return _Read(units, take, kept, slot_seeds(plan.seed, plan.epoch, slots), skipped)

    def _assemble(self, parts: Sequence[_Part], reads: Sequence[_Read], schema: pa.Schema) -> Any:
        """This rank's share of the carried step, built by the loader's recipe."""
        lo, hi = rank_bounds(self.global_batch_size, self.world_size, self.rank)
        units: list[Packed] = []
        takes, seeds = [], []
        for read, place in zip(reads, _places(parts, reads), strict=True):
            mine = (place >= lo) & (place < hi)
            takes.append(read.take[mine] + sum(u.num_rows for u in units))
            seeds.append(read.seeds[mine])
            units += [u if u.table.schema.equals(schema) else _cast(u, schema) for u in read.units]
        recipe = self._recipe()
        take, seed = np.concatenate(takes), np.concatenate(seeds)
        batch = finish_payload(build_payload(units, take, schema, recipe, {}, seed), recipe)
        return pin(batch) if self.options.pin_memory else batch

    def _advance(self, parts: Sequence[_Part], reads: Sequence[_Read]) -> None:
        """Record the carried step: the end of one increment, the start of the next ones."""
        lo, hi = rank_bounds(self.global_batch_size, self.world_size, self.rank)
        at = 0
        places = _places(parts, reads)
        for i, (part, read, place) in enumerate(zip(parts, reads, places, strict=True)):
            rows, size = len(part.dataset), part.stop - part.start
            if i:
                self.tracker.set_epoch(part.epoch, restart=True)
                self.tracker.settle_tail(rows)
            share = max(0, min(hi, at + size) - max(lo, at))
            mine = int(((place >= lo) & (place < hi)).sum())
            if size:
                done = Delivery(part.stop, mine, part.stop == rows, read.skipped, share - mine)
                self.tracker.delivered(done, rows)
            at += size
        self._follow_dataset(parts[-1].epoch)


def _places(parts: Sequence[_Part], reads: Sequence[_Read]) -> list[np.ndarray]:
    """Where each part's rows stand in the carried step (the parts end to end)."""
    sizes = [p.stop - p.start for p in parts]
    firsts = np.cumsum([0, *sizes[:-1]])
    return [read.kept + int(first) for read, first in zip(reads, firsts, strict=True)]


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


def _packed(ref: UnitRef) -> Packed:
    """A unit decoded without an arena, as a batch is built from it."""
    assert isinstance(ref.table, pa.Table), "decoded in this process, without an IPC file"
    return Packed(None, (), ref.table, ref.where)


def _cast(unit: Packed, schema: pa.Schema) -> Packed:
    """A unit of an earlier increment in the later one's (widened) types."""
    return Packed(None, (), unit.table.cast(schema), unit.where)


LOADER_FOR["follow"] = FollowLoader

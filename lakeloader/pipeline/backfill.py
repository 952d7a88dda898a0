"""Fixed-size steps under quarantine (``LakeDataset(on_error="skip", backfill=True)``).

Each rank cuts its share of a one-rank pass over the whole global steps (see docs/design.md);
batches are cut and joined column by column (tensors, nested tensors, padded lists, lists).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from lakeloader.lake.snapshot import Snapshot
from lakeloader.order.plan import (
    EpochPlan,
    batch_slots,
    expand_runs,
    rank_bounds,
    slots_to_virtual,
    virtual_to_piece,
)
from lakeloader.pipeline.collate import BatchTransform, ListFormat, pin
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import Delivery, ReaderStateTracker, ReaderView
from lakeloader.state.view import piece_skipped, rank_shares
from lakeloader.topology import Topology

#: A columnar batch: column name to tensor, nested tensor or list.
Columns = dict[str, Any]


class Screen:
    """Which slots of a one-rank step its batch holds: the store's rule, indexed once a pass.

    A slot is left out when one quarantine entry covers its whole piece.
    """

    def __init__(self, plan: EpochPlan, snapshot: Snapshot) -> None:
        self._plan, self._snapshot = plan, snapshot
        self._index = {f.path: i for i, f in enumerate(snapshot.files)}
        self._entries: tuple[QuarantineEntry, ...] = ()
        self._by_group: dict[tuple[int, int], list[QuarantineEntry]] = {}

    def good_slots(self, start: int, stop: int, skipped: tuple[QuarantineEntry, ...]) -> np.ndarray:
        """The slots of step ``[start, stop)`` that its batch holds, in its row order."""
        if skipped != self._entries:
            self._entries, self._by_group = skipped, {}
            for q in skipped:
                if q.path in self._index:
                    self._by_group.setdefault((self._index[q.path], q.row_group), []).append(q)
        plan = self._plan
        slots = batch_slots(start, stop, plan.num_partitions)
        if not self._by_group:
            return slots
        pos, _ = virtual_to_piece(plan, slots_to_virtual(plan, slots))
        pieces = np.unique(pos)
        units = plan.piece_unit[pieces]
        files, groups = plan.units.file_index[units].tolist(), plan.units.row_group[units].tolist()
        bad = [
            piece
            for piece, f, g in zip(pieces.tolist(), files, groups, strict=True)
            if piece_skipped(plan, self._snapshot, piece, self._by_group.get((f, g), ()))
        ]
        return slots[~np.isin(pos, bad)] if bad else slots


def take(batch: Columns, rows: np.ndarray, list_format: ListFormat) -> Columns:
    """The rows ``rows`` of a columnar batch, in that order."""
    out: Columns = {}
    index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            out[name] = _take_nested(value, rows)
        elif isinstance(value, torch.Tensor):
            out[name] = value.index_select(0, index)
        elif isinstance(value, list):
            out[name] = [value[i] for i in rows.tolist()]
        else:
            raise TypeError(
                f"backfill=True cuts batches column by column, and column {name!r} is a "
                f"{type(value).__name__}: it takes tensors, nested tensors and lists"
            )
    return _trim_padded(out, list_format)


def num_rows(batch: Any) -> int:
    """Rows in a columnar batch.

    Raises:
        TypeError: If the batch is not a dict of columns (a transform's rows must be dicts).
    """
    if not isinstance(batch, dict) or not batch:
        raise TypeError(
            f"backfill=True cuts the default batch, a dict of columns, and got a "
            f"{type(batch).__name__}: a transform must return each row as a dict"
        )
    first = next(iter(batch.values()))
    return int(first.size(0)) if isinstance(first, torch.Tensor) else len(first)


def join(batches: Sequence[Columns], list_format: ListFormat) -> Columns:
    """Columnar batches one after the other (padded lists padded to the longest)."""
    if len(batches) == 1:
        return batches[0]
    out: Columns = {}
    for name, first in batches[0].items():
        values = [b[name] for b in batches]
        if isinstance(first, torch.Tensor) and first.is_nested:
            out[name] = _join_nested(values)
        elif isinstance(first, torch.Tensor):
            width = max(v.shape[1:] for v in values) if first.dim() > 1 else ()
            out[name] = torch.cat([_pad_to(v, width, list_format.pad_value) for v in values])
        else:
            out[name] = [x for v in values for x in v]
    return out


def _take_nested(value: Any, rows: np.ndarray) -> torch.Tensor:
    """Rows of a jagged nested tensor, from its values and offsets (no row by row work)."""
    offsets = value.offsets().numpy()
    starts, lengths = offsets[rows], np.diff(offsets)[rows]
    values = value.values()[torch.from_numpy(expand_runs(starts, lengths, 1))]
    edges = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return torch.nested.nested_tensor_from_jagged(values, edges)


def _join_nested(parts: Sequence[Any]) -> torch.Tensor:
    """Jagged nested tensors one after the other."""
    shift = np.cumsum([0] + [int(p.offsets()[-1]) for p in parts])
    edges = [p.offsets()[int(k > 0) :] + int(shift[k]) for k, p in enumerate(parts)]
    values = torch.cat([p.values() for p in parts])
    return torch.nested.nested_tensor_from_jagged(values, torch.cat(edges))


def _pad_to(value: torch.Tensor, shape: Any, pad: float) -> torch.Tensor:
    """A padded list column's tensor padded on its second dimension to ``shape``."""
    if value.dim() < 2 or value.shape[1:] == shape:
        return value
    widths = (0, 0) * (value.dim() - 2) + (0, shape[0] - value.shape[1])
    return torch.nn.functional.pad(value, widths, value=pad)


def _trim_padded(batch: Columns, list_format: ListFormat) -> Columns:
    """Padded list columns as wide as their longest row (as a batch built whole is)."""
    if not list_format.padded:
        return batch
    for name, value in list(batch.items()):
        lengths = batch.get(list_format.lengths_of(name))
        if isinstance(value, torch.Tensor) and isinstance(lengths, torch.Tensor):
            batch[name] = value[:, : int(lengths.max()) if len(lengths) else 0]
    return batch


def backfill_tracker(tracker: ReaderStateTracker, whole: Topology) -> ReaderStateTracker:
    """The one-rank pass's tracker, standing where the loader's stands."""
    inner = ReaderStateTracker(whole, drop_last=False, workers_build=tracker.workers_build)
    inner.epoch, inner.position = tracker.epoch, tracker.position
    inner.quarantine, inner.lost = tracker.quarantine, tracker.lost
    return inner


def finisher(batch_transform: BatchTransform | None, pin_memory: bool) -> Callable[[Columns], Any]:
    """What a batch as cut goes through: the dataset's batch_transform, then pinning."""

    def finish(batch: Columns) -> Any:
        out = batch if batch_transform is None else batch_transform(batch)
        return pin(out) if pin_memory else out

    return finish


def backfill_view(
    tracker: ReaderStateTracker, plan: EpochPlan, snapshot: Snapshot, topology: Topology
) -> ReaderView:
    """Where a backfilled position leaves every rank and worker, as far as it is known.

    Each rank's share of the next step is cut from the rows the quarantine known so far
    leaves; every rank's workers read the whole step's units.
    """
    whole = Topology(1, 0, topology.num_workers, topology.global_batch)
    one = backfill_tracker(tracker, whole).view(plan, snapshot)
    screen = Screen(plan, snapshot)
    stop = min(plan.num_rows, tracker.position + 2 * whole.global_batch)
    known = (*tracker.quarantine, *tracker.lost)
    slots = np.sort(screen.good_slots(tracker.position, stop, known))[: whole.global_batch]
    if not one.steps_remaining:
        slots = slots[:0]
    ranks = rank_shares(plan, snapshot, slots, topology.world_size)
    workers = [
        dataclasses.replace(w, rank=r) for r in range(topology.world_size) for w in one.workers
    ]
    return dataclasses.replace(one, ranks=tuple(ranks), workers=tuple(workers))


class Backfill:
    """A pass of fixed-size steps cut from a one-rank pass over the whole global batches.

    Args:
        inner: The one-rank pass (``G`` slots a step, quarantined rows left out).
        inner_tracker: Its tracker (its position is the end of the steps it gave).
        tracker: The loader's tracker, moved by this pass's steps.
        topology: The loader's topology (its share of each step).
        drop_last: Whether a short last step is left out (its rows counted dropped).
        list_format: How list columns are laid out.
        finish: Run on each batch as cut (:func:`finisher`).
    """

    def __init__(
        self,
        inner: Iterator[Any],
        inner_tracker: ReaderStateTracker,
        tracker: ReaderStateTracker,
        plan: EpochPlan,
        snapshot: Snapshot,
        topology: Topology,
        drop_last: bool,
        list_format: ListFormat,
        finish: Callable[[Columns], Any],
    ) -> None:
        self._inner, self._inner_tracker, self._tracker = inner, inner_tracker, tracker
        self._plan, self._screen, self._topology = plan, Screen(plan, snapshot), topology
        self._drop_last, self._lists = drop_last, list_format
        self._finish = finish
        self._rows: Columns | None = None  # rows read, not delivered, in slot order
        self._slots = np.zeros(0, dtype=np.int64)
        self._done = self._closed = False
        #: Steps left are not known ahead: quarantine shortens the pass.
        self.num_steps = None

    def __iter__(self) -> Backfill:
        return self

    def _fill(self, size: int) -> None:
        """Read one-rank steps until ``size`` rows are held or the pass is over."""
        while len(self._slots) < size and not self._done:
            inner = self._inner_tracker
            start, before = inner.position, inner.quarantine
            try:
                batch = next(self._inner)
            except StopIteration:
                self._done = True
                return
            found = (*inner.quarantine, *inner.lost)
            slots = self._screen.good_slots(start, inner.position, found)
            if inner.quarantine != before:
                self._tracker.merge_quarantine(inner.quarantine)
            if len(slots) != num_rows(batch):
                raise RuntimeError(
                    f"backfill: a step of slots [{start}, {inner.position}) holds "
                    f"{num_rows(batch)} rows where its pieces hold {len(slots)}: please report it"
                )
            held = [] if self._rows is None else [self._rows]
            rows = join([*held, batch], self._lists)
            slots = np.concatenate([self._slots, slots])
            order = np.argsort(slots, kind="stable")
            self._rows, self._slots = take(rows, order, self._lists), slots[order]

    def __next__(self) -> Any:
        if self._closed:  # its one-rank pass says why (ended, or over)
            next(self._inner)
            raise StopIteration
        size, tracker = self._topology.global_batch, self._tracker
        self._fill(size + 1)  # one row more: whether the pass ends with this step is known
        n = min(size, len(self._slots))
        total, start = self._plan.num_rows, tracker.position
        if n == 0 or (n < size and self._drop_last):  # the rows left counted dropped
            tracker.rows_dropped = total - start
            raise StopIteration
        assert self._rows is not None
        last = self._done and n == len(self._slots)
        stop = total if last else int(self._slots[n - 1]) + 1
        world, rank = self._topology.world_size, self._topology.rank
        lo, hi = rank_bounds(n, world, rank)
        mine = take(self._rows, np.arange(lo, hi), self._lists)
        rest = np.arange(n, len(self._slots))
        self._rows = take(self._rows, rest, self._lists) if len(rest) else None
        self._slots = self._slots[n:]
        out_lo, out_hi = rank_bounds(stop - start - n, world, rank)  # this rank's part of
        tracker.delivered(Delivery(stop, hi - lo, last, (), out_hi - out_lo), total)  # the skipped
        return self._finish(mine)

    def close(self, wait: bool = True, ended_by: str | None = None) -> None:
        """End the one-rank pass."""
        self._closed = True
        close = getattr(self._inner, "close", None)
        if close is not None:
            close(wait, ended_by)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

"""One epoch of a packed source, read unit by unit: each unit's tokens and positions.

A unit's rows' tokens are laid end to end, a separator after each row
(:func:`~lakeloader.order.packing.separated`), from the packing column or from the rows the
source's ``transform`` made; a skipped unit gives padding in the place of its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from multiprocessing.pool import AsyncResult, ThreadPool
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from lakeloader.cache.arrays import one_array
from lakeloader.cache.screening import Screened
from lakeloader.order.batches import BatchSpec, range_specs
from lakeloader.order.packing import TokenStream, separated
from lakeloader.packing import Packing
from lakeloader.pipeline.collate import Transform
from lakeloader.pipeline.recipe import COLUMNS
from lakeloader.pipeline.rows import row_lists, transform_rows
from lakeloader.pipeline.stores import Store
from lakeloader.pipeline.workspace import WorkerDecodes
from lakeloader.randomness import slot_seeds
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.workers.process import TokensTask
from lakeloader.workers.shipping import built


class UnitTokens(NamedTuple):
    """A unit's tokens (separators in), and each one's position in its document.

    ``padding``: the unit was skipped, its tokens are padding.
    """

    tokens: np.ndarray
    positions: np.ndarray
    padding: bool


class EpochTokens:
    """One epoch of one packed source, read unit by unit.

    Args:
        store: The epoch's unit store (a packed source's plan: one partition, one piece per
            unit, rows in file order).
        stream: Where the epoch's units' tokens lie.
        check: Called with each unit read: (unit, tokens got, tokens counted, epoch).
        threads: Where a unit requested is made into tokens once it is decoded (without a
            row ``transform``, which runs in the caller's thread, unless ``workers`` run it).
        workers: The DataLoader's workers that decode the units, or None; they run the row
            ``transform`` too (:class:`~lakeloader.workers.process.TokensTask`: theirs of
            ``source``, the source's index in the pass).
    """

    def __init__(
        self,
        store: Store,
        stream: TokenStream,
        packing: Packing,
        transform: Transform | None,
        check: Any,
        threads: ThreadPool,
        workers: WorkerDecodes | None = None,
        source: int = 0,
    ) -> None:
        self._store, self.stream, self._packing = store, stream, packing
        self._transform, self._check, self._threads = transform, check, threads
        self._workers, self._source = workers, source
        self.plan = store.spec.plan
        self._specs: dict[int, BatchSpec] = {}
        self._units: dict[int, UnitTokens] = {}
        self._made: dict[int, AsyncResult[tuple[UnitTokens, tuple[QuarantineEntry, ...]]]] = {}
        #: Units found skipped since the caller last took them.
        self.skipped: list[QuarantineEntry] = []

    def request(self, pos: int) -> None:
        """Start decoding the unit at ``pos`` of the epoch (if not yet)."""
        if pos in self._specs:
            return
        at = np.array([pos])  # the spec's step: one screening each
        (spec,) = range_specs(self.plan, at, self.plan.offsets[at], self.plan.offsets[at + 1])
        self._store.store.request(spec.positions)
        self._specs[pos] = spec
        if self._transform is None or self._workers is not None:
            self._made[pos] = self._threads.apply_async(self._read, (spec, pos))

    def unit(self, pos: int) -> UnitTokens:
        """The tokens of the unit at ``pos`` (requested first if it was not)."""
        held = self._units.get(pos)
        if held is None:
            self.request(pos)
            made = self._made.pop(pos, None)
            held, skipped = made.get() if made else self._read(self._specs[pos], pos)
            self._units[pos] = held
            self.skipped += skipped
        return held

    def ready(self, pos: int) -> bool:
        """Whether the unit at ``pos`` is made into tokens (or failed), so ``unit`` won't wait."""
        made = self._made.get(pos)
        return pos in self._units or (made is not None and made.ready())

    def drop(self, positions: Iterable[int]) -> None:
        """Let go of the units at these positions (decoded again if requested again)."""
        gone = [p for p in positions if p in self._specs]
        for pos in gone:
            self._units.pop(pos, None)
            made = self._made.pop(pos, None)
            if made is not None:
                made.wait()  # its unit must stay in the store until it is made (or failed)
        self._store.store.drop(
            np.concatenate([self._specs.pop(p).positions for p in gone] or [np.zeros(0, np.int64)])
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the units' tokens and positions held."""
        return sum(u.tokens.nbytes + u.positions.nbytes for u in list(self._units.values()))

    @property
    def held(self) -> list[int]:
        """The positions requested and not dropped."""
        return list(self._specs)

    def _read(self, spec: BatchSpec, pos: int) -> tuple[UnitTokens, tuple[QuarantineEntry, ...]]:
        """A unit's tokens, and the units found skipped (it, or none)."""
        builder, packing = self._store.builder, self._packing
        ends = self.stream.ends
        expected = int(ends[pos] - (ends[pos - 1] if pos else 0))
        remote = self._transform is not None and self._workers is not None
        # the workers open the unit's files: no views into this process's buffers
        screened = builder.screened(spec, views=not remote, whole=remote)
        if screened.skipped:
            pads = np.full(expected, packing.pad_id, dtype=np.int64)
            return UnitTokens(pads, np.zeros(expected, dtype=np.int64), True), screened.skipped
        made: tuple[np.ndarray, np.ndarray] | None = None
        if self._transform is not None:
            slots = spec.slot_start + np.arange(spec.num_rows, dtype=np.int64)
            seeds = slot_seeds(self.plan.seed, self.plan.epoch, slots)
            if remote:
                made = self._made_by_workers(spec, screened, seeds)
            else:
                rows = transform_rows(builder.rows(screened), self._transform, seeds)
                values, offsets = row_lists(rows, packing.column)
        elif (units := builder.units(screened)) and packing.column in units[0].table.column_names:
            # the unit's rows in file order: its Arrow column as it is
            values, offsets = arrow_lists(units[0].table[packing.column], packing.column)
        else:  # a fixed-size list packed into the arena (a list column never is)
            kind, columns = builder.build(spec)
            assert kind == COLUMNS
            value = columns[packing.column]
            if not isinstance(value, np.ndarray) or value.ndim != 2:
                raise TypeError(
                    f"packing needs a list column of integers; {packing.column!r} is "
                    f"{type(value).__name__} in the batch"
                )
            values = value.reshape(-1)
            offsets = np.arange(len(value) + 1, dtype=np.int64) * value.shape[1]
            builder.skipped.pop(spec.step)
        tokens, positions = made or separated(values, offsets, packing.eos_id)
        self._check(int(self.plan.order[pos]), len(tokens), expected, self.plan.epoch)
        self._store.store.drop(spec.positions)  # its tokens are all it is needed for now
        return UnitTokens(tokens, positions, False), ()

    def _made_by_workers(
        self, spec: BatchSpec, screened: Screened, seeds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """A unit's tokens and positions, made by a worker (the row ``transform`` runs there)."""
        assert self._workers is not None
        workers, store, spec_of = self._workers, self._store, self._store.spec
        arena, what = store.arena, "the tokens of " + store.store.describe(spec.positions)[0]

        def make(key: int) -> TokensTask:
            handle = arena.handle if arena is not None and screened.rows is not None else None
            return TokensTask(
                workers.generation,
                key,
                screened.refs,
                screened.take,
                seeds,
                store.dir,
                arena=handle,
                schema=store.schema,
                source=self._source,
                column=self._packing.column,
                eos_id=self._packing.eos_id,
                layout=spec_of.layout,
            )

        timeout = spec_of.options.timeout
        deadline = time.monotonic() + timeout if timeout else None
        _, (tokens, positions) = built(workers.run(what, make), deadline, timeout, what)
        return tokens, positions


def arrow_lists(col: pa.ChunkedArray, column: str) -> tuple[np.ndarray, np.ndarray]:
    """A unit's list column of integers, without a copy: values end to end, and offsets."""
    arr = one_array(col)
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        if arr.null_count:  # a null row holds no token (its slots are not the row's)
            sizes = np.where(arr.is_valid().to_numpy(zero_copy_only=False), width, 0)
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            return arr.flatten().to_numpy(zero_copy_only=False), offsets
        values = arr.values.to_numpy(zero_copy_only=False)[arr.offset * width :]
        return values, np.arange(len(arr) + 1, dtype=np.int64) * width
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise TypeError(f"packing needs a list column of integers; {column!r} is {arr.type}")
    return arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy()

"""The mixture's slot-to-source rule: pure, split-independent, evenly spread, resumable."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lakeloader.order.mixture import (
    MixCursor,
    MixDraw,
    MixWeights,
    PartTable,
    _epoch_of,
    draw_parts,
    epoch_first,
    slot_sources,
)
from tests.conftest import FAST
from tests.oracles import part_table, rank_parts, rank_parts_many

weight_maps = st.dictionaries(
    st.sampled_from(["web", "code", "books", "math", "chat", "wiki"]),
    st.floats(min_value=0.01, max_value=100),
    min_size=1,
    max_size=6,
)


@FAST
@given(
    weights=weight_maps,
    seed=st.integers(0, 2**32),
    first=st.integers(0, 2**40),
    cuts=st.lists(st.integers(0, 300), max_size=6),
)
def test_any_split_of_the_slots_draws_the_same_sources(
    weights: dict[str, float], seed: int, first: int, cuts: list[int]
) -> None:
    w = MixWeights.of(weights)
    whole = slot_sources(w, seed, first, sum(cuts))
    parts, at = [], first
    for n in cuts:
        parts.append(slot_sources(w, seed, at, n))
        at += n
    assert np.array_equal(np.concatenate([whole[:0], *parts]), whole)


@FAST
@given(
    weights=weight_maps,
    seed=st.integers(0, 2**32),
    first=st.integers(0, 2**40),
    batch=st.sampled_from([1, 7, 64, 1024]),
)
def test_every_thousand_global_batches_hold_each_source_within_one_percent(
    weights: dict[str, float], seed: int, first: int, batch: int
) -> None:
    w = MixWeights.of(weights)
    sources = slot_sources(w, seed, first, 1000 * batch)
    shares = np.bincount(sources, minlength=len(w.names)) / len(sources)
    assert np.abs(shares - np.asarray(w.shares)).max() <= 0.01, (shares, w.shares)


def test_shares_are_tighter_than_dice() -> None:
    # Independent draws would miss by about sqrt(n) slots; the sequence by a few.
    w = MixWeights.of({"a": 0.5, "b": 0.3, "c": 0.2})
    n = 100_000
    counts = np.bincount(slot_sources(w, 3, 12345, n), minlength=3)
    assert np.abs(counts - n * np.asarray(w.shares)).max() <= 20, counts


@FAST
@given(
    weights=weight_maps,
    seed=st.integers(0, 2**16),
    takes=st.lists(st.integers(0, 500), min_size=1, max_size=8),
)
def test_each_source_stream_is_drawn_once_in_order_however_the_draws_are_cut(
    weights: dict[str, float], seed: int, takes: list[int]
) -> None:
    w = MixWeights.of(weights)
    cursor = MixCursor(0, {})
    offsets: dict[str, list[int]] = {n: [] for n in w.names}
    for n in takes:
        draw, cursor = cursor.take(w, seed, n)
        for source, offset in zip(draw.sources.tolist(), draw.offsets.tolist(), strict=True):
            offsets[w.names[source]].append(offset)
    assert cursor.slot == sum(takes)
    for name, seen in offsets.items():
        assert seen == list(range(len(seen))), name  # exactly once, in order, none skipped
        assert cursor.counts.get(name, 0) == len(seen)
    assert cursor == MixCursor(0, {}).take(w, seed, sum(takes))[1]  # one draw of them all


def test_a_weight_change_continues_every_source_from_its_own_count() -> None:
    before = MixWeights.of({"a": 0.5, "b": 0.3, "c": 0.2})
    after = MixWeights.of({"a": 0.2, "b": 0.2, "c": 0.2, "d": 0.4})  # d added at the resume
    _, cursor = MixCursor(0, {}).take(before, 0, 4096)
    draw, _ = cursor.take(after, 0, 50_000)
    for k, name in enumerate(after.names):
        mine = draw.offsets[draw.sources == k]
        start = cursor.counts.get(name, 0)
        assert mine.tolist() == list(range(start, start + len(mine))), name
        assert abs(len(mine) / 50_000 - after.shares[k]) <= 0.01


def test_a_small_source_runs_through_its_epochs_one_after_the_other() -> None:
    w = MixWeights.of({"big": 0.9, "small": 0.1})
    draw, _ = MixCursor(0, {}).take(w, 0, 10_000)
    epochs = _epoch_of([100_000, 30], draw.sources, draw.offsets)
    rows = draw.offsets - epoch_first([100_000, 30], draw.sources, epochs)
    small = draw.sources == w.names.index("small")
    e, r = epochs[small], rows[small]
    assert e.max() >= 3  # upsampled through several epochs
    for epoch in range(int(e.max())):  # every finished epoch: each row exactly once
        assert sorted(r[e == epoch].tolist()) == list(range(30))
    assert (np.diff(e) >= 0).all(), "no row of an epoch after one of the next"


@pytest.mark.parametrize(
    ("weights", "message"),
    [({}, "at least one source"), ({"a": 0}, "finite positive"), ({"a": float("nan")}, "finite")],
)
def test_bad_weights_say_which(weights: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixWeights.of(weights)


@dataclass(frozen=True)
class Chunk:
    """Consecutive global batches of a mixture, drawn from a cursor, for a world of ranks."""

    weights: MixWeights
    seed: int
    cursor: MixCursor
    steps: int
    world: int
    per_rank: int
    rows: list[int]

    @property
    def size(self) -> int:
        return self.world * self.per_rank


chunks = st.builds(
    lambda weights, seed, start, steps, world, per_rank, rows: Chunk(
        MixWeights.of(weights),
        seed,
        MixCursor(start, {name: start % 97 for name in weights}),
        steps,
        world,
        per_rank,
        rows,
    ),
    weight_maps,
    st.integers(0, 2**32),
    st.integers(0, 10_000),
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(1, 40),
    st.lists(st.integers(1, 60), min_size=6, max_size=6),
)


@FAST
@given(chunks)
def test_a_rank_s_parts_cover_its_share_exactly_in_chunks_as_one_by_one(c: Chunk) -> None:
    """Planning many steps at once gives each step's parts as planning it alone; the parts of
    a rank's share are its slots' rows, each once, and the ranks' shares are the batch."""
    w, seed, steps, world, per_rank, rows, size = (
        c.weights, c.seed, c.steps, c.world, c.per_rank, c.rows, c.size,
    )  # fmt: skip
    draw, _ = c.cursor.take(w, seed, steps * size)
    for rank in range(world):
        chunked = rank_parts_many(draw, rows, steps, world, rank)
        for k, (sources, parts) in enumerate(chunked):
            one = MixDraw(
                draw.sources[k * size : (k + 1) * size], draw.offsets[k * size : (k + 1) * size]
            )
            alone_sources, alone = rank_parts(one, rows, world, rank)
            assert sources.tolist() == alone_sources.tolist()
            assert [(p.source, p.epoch, p.start, p.stop, p.at.tolist()) for p in parts] == [
                (p.source, p.epoch, p.start, p.stop, p.at.tolist()) for p in alone
            ]
            got = sorted(
                (int(at), p.source, p.epoch * rows[p.source] + p.start + i)
                for p in parts
                for i, at in enumerate(p.at.tolist())
            )
            assert all(p.stop - p.start == len(p.at) for p in parts)
            share = range(rank * per_rank, (rank + 1) * per_rank)
            want = [(j - rank * per_rank, int(one.sources[j]), int(one.offsets[j])) for j in share]
            assert got == want


@FAST
@given(chunks)
def test_drawing_and_cutting_at_once_equals_taking_then_cutting(c: Chunk) -> None:
    w, seed, steps, world, rows, size = c.weights, c.seed, c.steps, c.world, c.rows, c.size
    draw, after = c.cursor.take(w, seed, steps * size)
    for rank in range(world):
        want = part_table(draw, rows, steps, world, rank)
        got, got_after, totals = draw_parts(c.cursor, w, seed, steps, size, rows, world, rank)
        for field in ("shares", "step", "source", "epoch", "start", "stop"):
            assert getattr(got, field).tolist() == getattr(want, field).tolist(), field
        # the rows of each part: the oracle lays them out part after part, draw_parts by source
        lengths = (got.stop - got.start).tolist()
        assert _part_rows(got) == _part_rows(want)
        spans = zip(got.at_start.tolist(), lengths, strict=True)
        used = sorted(i for a, n in spans for i in range(a, a + n))
        assert used == list(range(len(got.at)))  # each entry of ``at`` in one part, once
        assert got_after == after
        assert totals[-1].tolist() == [after.counts[n] for n in w.names]


def _part_rows(table: PartTable) -> list[list[int]]:
    """Where each part's rows stand in its share, part by part (whatever ``at``'s layout)."""
    spans = zip(table.at_start.tolist(), (table.stop - table.start).tolist(), strict=True)
    return [table.at[a : a + n].tolist() for a, n in spans]

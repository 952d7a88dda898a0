"""Quarantine entries: merge, covers and drop_pieces against obvious set-based oracles."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.state.quarantine import QuarantineEntry, drop_pieces, merge

FAST = settings(max_examples=200, deadline=None)

entries = st.builds(
    QuarantineEntry,
    path=st.sampled_from(["a.parquet", "b.parquet", "dir/c.parquet"]),
    row_group=st.integers(0, 3),
    row_start=st.integers(0, 40),
    num_rows=st.integers(1, 40),
    reason=st.sampled_from(["bad page", "all NaN", "rejected by validate"]),
)
groups = st.lists(st.lists(entries, max_size=8), max_size=4)


@FAST
@given(groups=groups)
def test_merge_is_the_sorted_union_one_entry_per_unit(
    groups: list[list[QuarantineEntry]],
) -> None:
    merged = merge(*groups)
    keys = [e.key for e in merged]
    unique = sorted({e.key for g in groups for e in g})
    # One entry per unit: an entry within another's rows (a piece of a unit) is left out.
    within = {k for k in unique for o in unique if o != k and QuarantineEntry(*o, "").covers(*k)}
    assert keys == [k for k in unique if k not in within]
    # For a unit listed more than once, the last occurrence (in argument order) is kept.
    last = {e.key: e for g in groups for e in g}
    assert merged == [last[k] for k in keys]
    # Merging again, in any grouping, changes nothing: every rank gets the same list.
    assert merge(merged) == merged
    assert merge(merged, *groups) == merged
    assert merge([e for g in groups for e in g]) == merged


@FAST
@given(
    entry=entries,
    path=st.sampled_from(["a.parquet", "b.parquet"]),
    row_group=st.integers(0, 3),
    row_start=st.integers(0, 90),
    num_rows=st.integers(1, 90),
)
def test_covers_means_the_unit_lies_inside_the_entry(
    entry: QuarantineEntry, path: str, row_group: int, row_start: int, num_rows: int
) -> None:
    inside = set(range(row_start, row_start + num_rows)) <= set(
        range(entry.row_start, entry.row_start + entry.num_rows)
    )
    want = path == entry.path and row_group == entry.row_group and inside
    assert entry.covers(path, row_group, row_start, num_rows) == want


@FAST
@given(entry=entries)
def test_an_entry_covers_itself_and_survives_the_state_dict(entry: QuarantineEntry) -> None:
    assert entry.covers(entry.path, entry.row_group, entry.row_start, entry.num_rows)
    assert not entry.covers(entry.path, entry.row_group, entry.row_start, entry.num_rows + 1)
    trip = msgpack.unpackb(msgpack.packb(entry.to_dict()), raw=False)
    assert QuarantineEntry.from_dict(trip) == entry


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, list[int], list[bool]]:
    """Piece sizes, which pieces are bad, and row indices into their concatenation."""
    sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=8))
    bad = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    take = draw(st.lists(st.integers(0, sum(sizes) - 1), max_size=60))
    return np.array(take, dtype=np.int64), sizes, bad


@FAST
@given(batch=batches())
def test_drop_pieces_renumbers_the_rows_of_the_good_pieces(
    batch: tuple[np.ndarray, list[int], list[bool]],
) -> None:
    take, sizes, bad = batch
    # Label every row of the concatenation (piece, row); keep the good pieces' labels.
    labels = [(p, r) for p, n in enumerate(sizes) for r in range(n)]
    kept = [label for label in labels if not bad[label[0]]]
    want = [kept.index(labels[t]) for t in take.tolist() if not bad[labels[t][0]]]
    got = drop_pieces(take, sizes, bad)
    assert got.dtype == np.int64
    assert got.tolist() == want


def test_drop_pieces_without_bad_pieces_changes_nothing() -> None:
    take = np.array([5, 0, 3, 3, 1], dtype=np.int64)
    assert drop_pieces(take, [2, 4], [False, False]).tolist() == take.tolist()
    assert drop_pieces(take, [2, 4], [True, True]).tolist() == []

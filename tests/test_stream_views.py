"""The reader-state tracker and ``loader.view()`` of a mixture and of a packed stream (issue 30).

``loader.tracker`` is a :class:`~lakeloader.ReaderStateTracker` for every kind of source; the
view says where each rank's share of the next step begins and where each source stands, as
files, row groups and row offsets. Each is checked against what the loaders then deliver: a
unique id per row says where it lives (per token, packed: a token names its row), so the
location the view gives must be the row the next batch (or the source's next row) starts with.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.state.view import Location

ROWS_PER_GROUP = 10
#: Where each row lives: its id -> (file, row group, row offset).
Places = dict[int, tuple[str, int, int]]


def write_lake(root: Path, first: int, places: Places, files: int = 3, groups: int = 4) -> None:
    root.mkdir(parents=True)
    schema = pa.schema([("id", pa.int64()), ("tok", pa.list_(pa.int64()))])
    for f in range(files):
        path = root / f"part-{f}.parquet"
        with pq.ParquetWriter(path, schema) as writer:
            for g in range(groups):
                ids = np.arange(first, first + ROWS_PER_GROUP)
                writer.write_table(pa.table({"id": ids, "tok": [tokens(i) for i in ids]}))
                places.update((int(i), (str(path), g, k)) for k, i in enumerate(ids))
                first += ROWS_PER_GROUP


def tokens(i: int) -> list[int]:
    """Row ``i``'s tokens: 1 to 5 of its own, ``(token - 1) // 8 == i``."""
    return [i * 8 + j + 1 for j in range(1 + i % 5)]


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Places]:
    root, places = tmp_path_factory.mktemp("views"), {}
    write_lake(root / "a", 0, places)
    write_lake(root / "b", 1000, places, files=2)
    return {"a": root / "a", "b": root / "b"}, places


def source(kind: str, roots: dict[str, Path]) -> Any:
    packing = ll.Packing("tok", seq_len=8) if kind.startswith("packed") else None
    a = ll.LakeDataset(
        str(roots["a"]), max_unit_rows=ROWS_PER_GROUP, packing=packing if kind == "packed" else None
    )
    if kind == "packed":
        return a
    b = ll.LakeDataset(str(roots["b"]), max_unit_rows=ROWS_PER_GROUP)
    return ll.Mixture({"a": a, "b": b}, weights={"a": 2, "b": 1}, seed=3, packing=packing)


def first_row(kind: str, batch: dict[str, Any]) -> int:
    """The row the batch starts with (a packed batch: the row of its first token)."""
    if kind.startswith("packed"):
        return (int(batch["input_ids"][0, 0]) - 1) // 8
    return int(batch["id"][0])


def rows_of(kind: str, batch: dict[str, Any]) -> list[int]:
    """The rows of a batch in order, a packed batch's sample by sample (their first tokens)."""
    if kind.startswith("packed"):
        return [(int(t) - 1) // 8 for t in batch["input_ids"][:, 0]]
    return batch["id"].tolist()


def where(at: Location | None) -> tuple[str, int, int] | None:
    """A location as (file, row group, row offset)."""
    return None if at is None else (at.file, at.row_group, at.row_offset)


def expected(kind: str, row: int, places: Places) -> tuple[str, int, int]:
    """Where the view must say ``row`` is: the row, or (packed) its unit's first row."""
    file, group, offset = places[row]
    return (file, group, 0) if kind.startswith("packed") else (file, group, offset)


def lockstep(loaders: list[ll.DataLoader]) -> Iterator[list[dict[str, Any]]]:
    its = [iter(loader) for loader in loaders]
    while True:
        yield [next(it) for it in its]


@pytest.mark.parametrize("kind", ["mixture", "packed", "packed-mixture"])
def test_each_rank_s_next_share_begins_where_the_view_says(
    kind: str, lakes: tuple[dict[str, Path], Places]
) -> None:
    roots, places = lakes
    loaders = [
        ll.DataLoader(source(kind, roots), batch_size=3, rank=r, world_size=2) for r in range(2)
    ]
    steps = lockstep(loaders)
    for step in range(12):
        views = [loader.view() for loader in loaders]
        assert views[0] == views[1]  # every rank sees every rank
        view = views[0]
        for loader in loaders:
            tracker = loader.tracker
            assert isinstance(tracker, ll.ReaderStateTracker)
            assert tracker.position == view.position
            assert tracker.rows_delivered == 3 * step
        assert [r.rows for r in view.ranks] == [3, 3]
        batches = next(steps)
        for rank, batch in enumerate(batches):
            at = where(view.ranks[rank].at)
            assert at == expected(kind, first_row(kind, batch), places), (step, rank)
        assert len(loaders[0].tracker.record.last) >= 1  # the step's runs, for the audit
    for loader in loaders:
        loader.close()


@pytest.mark.parametrize("kind", ["mixture", "packed", "packed-mixture"])
def test_each_source_s_next_row_is_where_the_view_says(
    kind: str, lakes: tuple[dict[str, Path], Places]
) -> None:
    """One sample (row) a step: each source's next one is the next the run draws from it."""
    roots, places = lakes
    with ll.DataLoader(source(kind, roots), batch_size=1) as loader:
        it = iter(loader)
        drawn = [rows_of(kind, next(it))[0] for _ in range(40)]
    with ll.DataLoader(source(kind, roots), batch_size=1) as loader:
        it = iter(loader)
        for step in range(25):
            view = loader.view()
            names = [s.source for s in view.sources]
            assert names == (["lake"] if kind == "packed" else ["a", "b"])
            for s in view.sources:
                later = [
                    r for r in drawn[step:] if kind == "packed" or (r >= 1000) == (s.source == "b")
                ]
                assert where(s.at) == expected(kind, later[0], places), (step, s)
            next(it)
        assert view.position == 24


@pytest.mark.parametrize("kind", ["mixture", "packed", "packed-mixture"])
def test_a_restored_loader_s_view_is_the_uninterrupted_one_s(
    kind: str, lakes: tuple[dict[str, Path], Places]
) -> None:
    """Under another world size and batch: the state says where everyone stands."""
    roots, _ = lakes
    for steps in (7, 60):  # within the first epoch of every source, and past it
        with ll.DataLoader(source(kind, roots), batch_size=4, world_size=1) as run:
            it = iter(run)
            for _ in range(steps):
                try:
                    next(it)
                except StopIteration:  # a mixture's pass is over: the next one
                    it = iter(run)
                    next(it)
            state, ran = run.state_dict(), run.view()
        with ll.DataLoader(source(kind, roots), batch_size=2, world_size=2, rank=1) as resumed:
            resumed.load_state_dict(state)
            view = resumed.view()
        fields = ("epoch", "position", "num_rows", "steps_remaining", "sources")
        assert [getattr(view, f) for f in fields] == [getattr(ran, f) for f in fields]
        assert [r.rows for r in view.ranks] == [2, 2]
        assert (max(s.epoch for s in view.sources) > 0) == (steps == 60)
        if kind.startswith("packed"):
            assert view.position == 4 * steps
        if kind == "packed":
            assert view.epoch == run.epoch == view.sources[0].epoch

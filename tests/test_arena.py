"""The arena: its allocator over a real shared file, and a worker's map of it."""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.cache.arena import Arena, FileMap
from lakeloader.cache.packed import RowLayout, gather_packed, pack
from lakeloader.cache.shm import SHM_DIR, default_cache_dir

LAYOUT = RowLayout.of(pa.schema([("id", pa.int64()), ("x", pa.float32())]))


def _arena(tmp_path: os.PathLike[str], capacity: int = 16, keep: int = 0) -> Arena:
    return Arena(str(tmp_path), LAYOUT.record, capacity, keep)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), min_size=1, max_size=40))
def test_extents_never_overlap_and_keep_their_rows(tmp_path_factory, ops) -> None:
    """Allocations are disjoint, inside the file, survive growth, and all freed rows coalesce."""
    arena = _arena(tmp_path_factory.mktemp("arena"), keep=1_000)
    live: dict[int, int] = {}
    try:
        for i, (alloc, rows) in enumerate(ops):
            if alloc or not live:
                start = arena.alloc(rows)
                assert start >= 0 and start + rows <= arena.capacity
                for s, n in live.items():
                    assert start + rows <= s or s + n <= start, "extents overlap"
                arena.records["id"][start : start + rows] = i
                live[start] = rows
            else:
                start = sorted(live)[rows % len(live)]
                arena.free(start, live.pop(start))
            # every live extent still holds what was written into it, growth or not
            for s, n in live.items():
                ids = arena.records["id"][s : s + n]
                assert (ids == ids[0]).all()
        # No row leaks: once every extent is freed, the whole file is one free extent again.
        for s, n in live.items():
            arena.free(s, n)
        capacity = arena.capacity
        assert arena.alloc(capacity) == 0
        assert arena.capacity == capacity
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


def test_freed_space_is_reused_first_fit(tmp_path) -> None:
    arena = _arena(tmp_path, capacity=100)
    a, b = arena.alloc(10), arena.alloc(20)
    assert (a, b) == (0, 10)
    arena.free(a, 10)
    assert arena.alloc(5) == 0  # the hole at the start, not the end
    assert arena.alloc(5) == 5
    assert arena.alloc(1) == 30
    arena.close()


def test_growth_keeps_old_views_valid(tmp_path) -> None:
    arena = _arena(tmp_path)
    first = arena.alloc(arena.capacity)
    view = arena.records[first : first + 3]
    view["id"] = [7, 8, 9]
    capacity = arena.capacity
    arena.alloc(5)  # no room left: the file grows
    assert arena.capacity >= capacity + 5
    assert view["id"].tolist() == [7, 8, 9]
    assert arena.records["id"][:3].tolist() == [7, 8, 9]
    arena.close()


def test_memory_above_the_kept_mark_is_returned(tmp_path) -> None:
    """Freed pages above keep_rows leave the file (a hole); those below stay for reuse."""
    rows = (1 << 22) // LAYOUT.row_bytes  # 4 MiB
    arena = Arena(str(tmp_path), LAYOUT.record, 2 * rows, rows)
    low, high = arena.alloc(rows), arena.alloc(rows)
    arena.records["id"][:] = 1  # touch every page
    full = os.stat(arena.path).st_blocks * 512
    arena.free(high, rows)
    after_high = os.stat(arena.path).st_blocks * 512
    arena.free(low, rows)
    after_low = os.stat(arena.path).st_blocks * 512
    arena.close()
    assert full >= 2 * rows * LAYOUT.row_bytes - 8192
    assert after_high <= full - rows * LAYOUT.row_bytes + 8192  # returned
    assert after_low == after_high  # kept for the next units


def test_a_worker_map_sees_the_loader_rows(tmp_path) -> None:
    arena = _arena(tmp_path)
    table = pa.table({"id": np.arange(10, dtype=np.int64), "x": np.arange(10, dtype=np.float32)})
    start = arena.alloc(10)
    pack(table, LAYOUT, arena.records[start : start + 10])
    handle = arena.handle
    records = FileMap(writable=False).bytes(handle.path, handle.capacity * LAYOUT.row_bytes)
    rows = np.array([start + 9, start, start + 4])
    out = gather_packed(records.view(LAYOUT.record), rows, LAYOUT, LAYOUT.names)
    assert out["id"].tolist() == [9, 0, 4]
    assert out["x"].tolist() == [9.0, 0.0, 4.0]
    arena.close()


def test_units_leave_shared_memory_that_has_no_room(
    dataset: ll.LakeDataset, caplog: pytest.LogCaptureFixture
) -> None:
    """A full /dev/shm would be a SIGBUS: the loader goes to the temporary folder, and says so."""
    assert default_cache_dir(1) == SHM_DIR
    huge = 1 << 60  # more than any /dev/shm holds
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        assert default_cache_dir(huge) is None
        loader = ll.DataLoader(dataset, batch_size=48, num_workers=1, cache_bytes=huge)
        batches = [b["id"].tolist() for b in loader]
    assert "--shm-size" in caplog.text and "less than cache_bytes" in caplog.text
    assert batches == [b["id"].tolist() for b in ll.DataLoader(dataset, batch_size=48)]
    loader.close()

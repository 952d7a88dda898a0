"""String and binary columns as Arrow binary views in the arena (lakeloader.cache.views).

The views are checked value by value against pyarrow's own reading, for short (inline) and
long values, nulls, empty values, non-ASCII text and bytes, at 0 and 2 workers; and the
loader must keep using the Arrow path, exactly, for units whose views cannot be written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader as ll
import lakeloader.cache.views
import lakeloader.pipeline.builders
from lakeloader.cache.views import (
    EMPTY_BUFFER,
    VIEW_DTYPE,
    ViewBuffers,
    views_array,
    write_views,
)

TYPES = [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()]


def _values(typ: pa.DataType) -> st.SearchStrategy[list[Any]]:
    """Optional values of every length around the 12 bytes that fit inside a view."""
    text = st.text(alphabet="aé€z\u0000", min_size=0, max_size=20)
    raw = st.binary(min_size=0, max_size=30)
    one = text if typ in (pa.string(), pa.large_string()) else raw
    return st.lists(st.none() | one, min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    typ=st.sampled_from(TYPES),
    index=st.integers(min_value=0, max_value=5),
)
def test_views_give_back_every_value(data: st.DataObject, typ: pa.DataType, index: int) -> None:
    values = data.draw(_values(typ))
    start = data.draw(st.integers(min_value=0, max_value=len(values) - 1))
    col = pa.array(values, typ).slice(start)  # a slice: views count from the parent's data
    out = np.zeros(len(col), dtype=VIEW_DTYPE)
    buffer = write_views(col, out, index)
    assert buffer is not None
    buffers = [EMPTY_BUFFER] * index + [buffer]
    taken = np.random.default_rng(index).permutation(len(col))
    got = views_array(out[taken].copy(), typ, buffers).to_pylist()
    assert got == [col.to_pylist()[i] for i in taken]


def test_a_view_that_points_nowhere_raises_instead_of_reading_stray_memory() -> None:
    col = pa.array(["a value longer than twelve bytes"])
    out = np.zeros(1, dtype=VIEW_DTYPE)
    write_views(col, out, buffer_index=3)
    with pytest.raises(pa.ArrowException, match="buffer"):
        views_array(out.copy(), pa.string(), [EMPTY_BUFFER])


def test_data_too_large_for_views_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lakeloader.cache.views, "VIEW_MAX_BUFFER", 10)
    out = np.zeros(1, dtype=VIEW_DTYPE)
    assert write_views(pa.array(["a value longer than ten bytes"]), out, 0) is None
    assert not out.view(np.int32).any(), "nothing written"


def test_buffer_indices_are_reused_and_snapshots_never_change() -> None:
    bufs = ViewBuffers()
    a, b = bufs.reserve(), bufs.reserve()
    bufs.put(a, pa.py_buffer(b"aaaa"))
    before = bufs.snapshot
    bufs.free([a])
    assert bufs.reserve() == a, "a freed index is handed out again"
    assert before[a].to_pybytes() == b"aaaa", "a snapshot a batch holds stays as it was"
    assert bufs.snapshot[a].size == 0 and len(bufs.snapshot) == 2 and b == 1


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per batch column that the loader's process built from views."""
    seen: list[int] = []
    real = lakeloader.pipeline.builders.views_array

    def counting(*args: Any) -> pa.Array:
        seen.append(1)
        return real(*args)

    monkeypatch.setattr(lakeloader.pipeline.builders, "views_array", counting)
    return seen


def _text_lake(root: Path) -> dict[int, tuple[str | None, bytes | None]]:
    """Three files of strings and bytes of every kind, with a unique id; returns the truth."""
    rng = np.random.default_rng(5)
    truth: dict[int, tuple[str | None, bytes | None]] = {}
    next_id = 0
    for f in range(3):
        rows = [300, 0, 457][f]
        ids = np.arange(next_id, next_id + rows)
        text = [
            None if i % 11 == 0 else "" if i % 7 == 0 else "é" * int(rng.integers(0, 30)) + str(i)
            for i in ids
        ]
        blob = [None if i % 13 == 0 else bytes(rng.integers(0, 256, i % 40)) for i in ids]
        truth.update(zip(ids.tolist(), zip(text, blob, strict=True), strict=True))
        table = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "text": pa.array(text, pa.large_string() if f == 2 else pa.string()),
                "blob": pa.array(blob, pa.binary()),
            }
        )
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=100)
        next_id += rows
    return truth


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_delivers_strings_and_bytes_through_views_exactly(
    tmp_path: Path, num_workers: int, calls: list[int]
) -> None:
    truth = _text_lake(tmp_path)
    ds = ll.LakeDataset(tmp_path, seed=3, num_partitions=4, window=64, max_unit_rows=64)
    loader = ll.DataLoader(ds, batch_size=32, num_workers=num_workers)
    seen = []
    for batch in loader:
        assert isinstance(batch["text"], list) and isinstance(batch["blob"], list)
        for i, text, blob in zip(batch["id"].tolist(), batch["text"], batch["blob"], strict=True):
            assert (text, blob) == truth[i], i
            seen.append(i)
    assert sorted(seen) == sorted(truth), "every row exactly once"
    assert calls, "the batches came through the views"
    reference = [b["id"].tolist() for b in ll.DataLoader(ds, batch_size=32)]
    assert [seen[k : k + 32] for k in range(0, len(seen), 32)] == reference


def test_units_without_views_take_the_arrow_path_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calls: list[int]
) -> None:
    """Units whose data is too large for views mix with units that have them."""
    truth = _text_lake(tmp_path)
    ds = ll.LakeDataset(tmp_path, seed=3, num_partitions=4, window=64, max_unit_rows=64)
    reference = [(b["id"].tolist(), b["text"], b["blob"]) for b in ll.DataLoader(ds, batch_size=32)]
    # Units of 64 rows hold 1-4 KB of each column: with 3,000 bytes at most, some have views
    # and some do not, and a step whose units do not all have them takes the Arrow path.
    monkeypatch.setattr(lakeloader.cache.views, "VIEW_MAX_BUFFER", 3000)
    calls.clear()  # count the mixed run only
    mixed = [(b["id"].tolist(), b["text"], b["blob"]) for b in ll.DataLoader(ds, batch_size=32)]
    assert mixed == reference
    assert 0 < len(calls) < 2 * len(mixed), "some columns of some steps came through views"
    for ids, texts, blobs in mixed:
        assert [truth[i] for i in ids] == list(zip(texts, blobs, strict=True))

"""Packed token streams without shape rules: every token of every row exactly once per epoch,
padding counted; the same global batches under any world size (3, 5 and 8 too) at a global
batch that ``C`` does not divide; exact resume (mid-document too) from rank 0's state alone,
under other world sizes and global batches."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.order.packing import TokenStream
from lakeloader.pipeline.token_counts import token_counts

ROWS, L, EOS = 1200, 16, 999_999
#: (world size, batch per rank): global batches of 24, 10 and 40, none a multiple of C=16.
SHAPES = [(1, 24), (3, 8), (8, 3), (2, 12), (1, 10), (2, 5), (5, 2), (5, 8), (8, 5), (2, 20)]


def tokens_of(i: int) -> list[int]:
    """Row ``i``'s tokens: unique across the lake (0 to 24 of them; some rows are empty)."""
    return [i * 100 + j for j in range((i * 7919) % 25)]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packing")
    for f in range(3):
        ids = list(range(f * ROWS // 3, (f + 1) * ROWS // 3))
        table = pa.table({"id": ids, "tokens": [tokens_of(i) for i in ids]})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=30 + 10 * f)
    return root


def dataset(lake: Path, eos: int | None = EOS, **kw: Any) -> ll.LakeDataset:
    packing = ll.Packing("tokens", L, eos_id=eos, pad_id=0)
    return ll.LakeDataset(lake, seed=3, packing=packing, **kw)


@cache
def oracle_epoch(
    lake: Path, epoch: int, eos: int | None = EOS
) -> list[tuple[int, int, np.ndarray]]:
    """An epoch's samples as the design says, from the files: ``(stream, index, sample)`` in
    the epoch's order, each sample ``[3, L]`` (tokens, positions, pad mask)."""
    ds = dataset(lake, eos)
    units, files = ds.units, ds.snapshot.files
    tokens: list[int] = []
    positions: list[int] = []
    for u in ds.plan(epoch).order.tolist():  # units in the epoch's order, rows in file order
        path = files[int(units.file_index[u])].path
        ids = pq.ParquetFile(path).read_row_group(int(units.row_group[u]), columns=["id"])
        start = int(units.row_start[u])
        for i in ids["id"].to_pylist()[start : start + int(units.num_rows[u])]:
            doc = tokens_of(i) + ([] if eos is None else [eos])
            tokens += doc
            positions += range(len(doc))
    C, T = ds.config.num_partitions, len(tokens)
    streams = []
    for c in range(C):
        a, b = c * T // C, (c + 1) * T // C
        pad = -(b - a) % L
        rows = np.array(
            [tokens[a:b] + [0] * pad, positions[a:b] + [0] * pad, [0] * (b - a) + [1] * pad]
        )
        streams.append(rows.reshape(3, -1, L).transpose(1, 0, 2))
    out = []
    for k in range(max(len(s) for s in streams)):  # round robin over the streams
        out += [(c, k, s[k]) for c, s in enumerate(streams) if k < len(s)]
    return out


def oracle_steps(
    lake: Path, first: int, batch: int, steps: int, eos: int | None = EOS
) -> np.ndarray:
    """Global steps from sample ``first`` on: each step's samples sorted by (epoch, stream,
    index), stacked: ``[steps * batch, 3, L]``."""
    per_epoch = len(oracle_epoch(lake, 0, eos))
    out = []
    for t in range(steps):
        keyed = []
        for g in range(first + t * batch, first + (t + 1) * batch):
            c, k, sample = oracle_epoch(lake, g // per_epoch, eos)[g % per_epoch]
            keyed.append(((g // per_epoch, c, k), sample))
        out += [s for _, s in sorted(keyed, key=lambda x: x[0])]
    return np.stack(out)


def run(
    lake: Path,
    world: int,
    batch: int,
    steps: int,
    state: dict[str, Any] | None = None,
    workers: int = 0,
    eos: int | None = EOS,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Every rank in lockstep: the global steps' samples ``[steps * world * batch, 3, L]``
    (ranks in order), and each rank's state after."""
    loaders = [
        ll.DataLoader(
            dataset(lake, eos), batch_size=batch, rank=r, world_size=world, num_workers=workers
        )
        for r in range(world)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        for it in iters:
            b = next(it)
            out.append(np.stack([b["input_ids"], b["position_ids"], b["pad_mask"]], axis=1))
    states = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    return np.concatenate(out), states


def test_every_token_once_per_epoch_padding_counted(lake: Path) -> None:
    per_epoch = len(oracle_epoch(lake, 0))
    steps = per_epoch * 5 // 2 // 24  # two and a half epochs
    got, states = run(lake, 1, 24, steps)
    assert (got == oracle_steps(lake, 0, 24, steps)).all()
    assert states[0]["samples"] == steps * 24
    want = sorted(t for i in range(ROWS) for t in tokens_of(i))
    for epoch in range(2):
        samples = np.stack([s for _, _, s in oracle_epoch(lake, epoch)])
        tokens = samples[:, 0][samples[:, 2] == 0]
        assert sorted(tokens[tokens != EOS].tolist()) == want, f"epoch {epoch}"
        assert (tokens == EOS).sum() == ROWS
        assert samples[:, 2].sum() < 16 * L, "at most one padded sample per stream"
    loader = ll.DataLoader(dataset(lake), batch_size=24)
    it = iter(loader)
    batches = [next(it) for _ in range(steps)]
    stats = loader.stats()
    assert stats["padding"] == sum(int(b["pad_mask"].sum()) for b in batches)
    assert stats["tokens"] + stats["padding"] == steps * 24 * L
    loader.close()


@pytest.mark.parametrize(("world", "batch"), SHAPES[1:])
def test_the_same_global_batches_under_any_world_size(lake: Path, world: int, batch: int) -> None:
    steps = 700 // (world * batch)
    got, states = run(lake, world, batch, steps)
    assert (got == oracle_steps(lake, 0, world * batch, steps)).all()
    assert all(s == states[0] for s in states), "the same state on every rank"
    assert len(json.dumps(states[0])) < 300


def test_workers_give_the_same_batches(lake: Path) -> None:
    got, _ = run(lake, 3, 8, 40, workers=2)
    assert (got == oracle_steps(lake, 0, 24, 40)).all()


def test_resume_from_rank_0_state_at_20_random_points_under_other_shapes(lake: Path) -> None:
    rng = random.Random(11)
    per_epoch = len(oracle_epoch(lake, 0))
    mid_document = 0
    for _ in range(20):
        (w1, b1), (w2, b2) = rng.sample(SHAPES, 2)
        steps = rng.randrange(1, 2 * per_epoch // (w1 * b1))
        before, states = run(lake, w1, b1, steps)
        first = steps * w1 * b1
        assert states[0]["samples"] == first
        g = first % per_epoch
        mid_document += oracle_epoch(lake, first // per_epoch)[g][2][1, 0] > 0
        more = 3
        after, _ = run(lake, w2, b2, more, state=states[0])
        assert (before == oracle_steps(lake, 0, w1 * b1, steps)).all()
        assert (after == oracle_steps(lake, first, w2 * b2, more)).all(), (w1, b1, steps, w2, b2)
    assert mid_document >= 10, "resumes in the middle of a document"


def test_without_a_separator_documents_run_end_to_end(lake: Path) -> None:
    got, _ = run(lake, 2, 5, 30, eos=None)
    assert (got == oracle_steps(lake, 0, 10, 30, eos=None)).all()


def test_bad_states_are_refused(lake: Path, tmp_path: Path) -> None:
    loader = ll.DataLoader(dataset(lake), batch_size=4, rank=0, world_size=3)
    with pytest.raises(ll.StateFormatError, match="not a packed state"):
        loader.load_state_dict(ll.DataLoader(ll.LakeDataset(lake), batch_size=4).state_dict())
    other = tmp_path / "other"
    other.mkdir()
    pq.write_table(pa.table({"tokens": [[1, 2, 3]] * 10}), other / "a.parquet")
    theirs = ll.DataLoader(dataset(other), batch_size=2)
    next(iter(theirs))
    with pytest.raises(ll.StateMismatchError, match="the packed state is of snapshot"):
        loader.load_state_dict(theirs.state_dict())
    with pytest.raises(TypeError, match="is endless"):
        len(loader)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        ll.Packing("tokens", 0)
    theirs.close()
    loader.close()


def test_counts_from_footers_equal_counts_read_and_a_filter_counts_by_reading(lake: Path) -> None:
    ds = dataset(lake)
    truth = []
    for u in range(len(ds.units)):
        path = ds.snapshot.files[int(ds.units.file_index[u])].path
        ids = pq.ParquetFile(path).read_row_group(int(ds.units.row_group[u]))["id"].to_pylist()
        truth.append(sum(len(tokens_of(i)) + 1 for i in ids))
    assert token_counts(ds).tolist() == truth
    kept = dataset(lake, filter=pads.field("id") < 500)  # counted by reading: 500 rows
    loader = ll.DataLoader(kept, batch_size=5)
    it = iter(loader)
    got = [next(it) for _ in range(200)]
    loader.close()
    tokens = np.concatenate([b["input_ids"][~b["pad_mask"]].numpy() for b in got])
    want = sorted(t for i in range(500) for t in tokens_of(i))
    per_epoch = sum(len(tokens_of(i)) + 1 for i in range(500))
    assert len(tokens) > per_epoch, "more than an epoch"
    first = tokens[:per_epoch]
    assert sorted(first[first != EOS].tolist()) == want


@given(
    st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=40),
    st.integers(min_value=1, max_value=20),
    st.integers(min_value=1, max_value=17),
)
def test_samples_tile_each_epochs_tokens_exactly_once(
    counts: list[int], streams: int, seq_len: int
) -> None:
    """Every token of an epoch lies in exactly one sample; samples of a stream are contiguous
    and only its last one is short; streams differ by at most one sample."""
    s = TokenStream.of(np.array(counts), streams, seq_len)
    total = sum(counts)
    stream, index = s.locate(np.arange(s.num_samples))
    assert sorted(zip(stream.tolist(), index.tolist(), strict=True)) == [
        (c, k) for c in range(streams) for k in range(int(s.sizes[c]))
    ]
    start, stop = s.spans(stream, index)
    covered = np.zeros(total, dtype=int)
    for a, b in zip(start.tolist(), stop.tolist(), strict=True):
        assert 0 < b - a <= seq_len
        covered[a:b] += 1
    assert (covered == 1).all()
    assert s.sizes.max() - s.sizes.min() <= 1
    for a, b in zip(start.tolist(), stop.tolist(), strict=True):
        units = s.units(a, b)
        assert s.ends[units[0]] > a and (units[-1] == 0 or s.ends[units[-1] - 1] < b)


def test_units_are_let_go_once_every_stream_has_passed_them(lake: Path) -> None:
    """Units that straddle two streams are let go too: no epoch's unit is held past it."""
    ds = dataset(lake)
    per_epoch = TokenStream.of(token_counts(ds), 16, L).num_samples
    loader = ll.DataLoader(ds, batch_size=8, rank=0, world_size=3)
    oldest = []  # after each epoch's steps, the oldest epoch of a unit still held
    with loader:
        batches = iter(loader)
        for _ in range(8):
            for _ in range(per_epoch // 24):
                next(batches)
            assert loader.stats()["cache_bytes"] > 0
            # The pass's units, held by (source, epoch, position) until their streams pass
            # them (what is held in bytes moves with how far decoding ran ahead: not a measure).
            oldest.append(min(epoch for _, epoch, _ in loader._res.iterator._last_use))
    # The steps of an epoch (rounded down) end in it or the one before: nothing older is held.
    assert all(old >= e - 1 for e, old in enumerate(oldest)), oldest


def test_a_lake_whose_every_unit_is_quarantined_is_an_error_not_endless_padding(
    lake: Path,
) -> None:
    ds = dataset(lake, on_error="skip", validate=lambda table: "every unit is bad")
    loader = ll.DataLoader(ds, batch_size=8)
    with loader, pytest.raises(ll.LakeDataError, match=r"every unit of .* is quarantined") as err:
        batches = iter(loader)
        for _ in range(10_000):
            next(batches)
    assert "every unit is bad" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_null_row_of_a_fixed_size_list_column_is_an_empty_document(
    tmp_path: Path, workers: int
) -> None:
    """Its slots are not the row's tokens: every other token once an epoch, the counts agree."""
    rows = [None if i % 5 == 3 else [i * 4 + j + 1 for j in range(4)] for i in range(60)]
    column = pa.array(rows, pa.list_(pa.int32(), 4))
    pq.write_table(pa.table({"tokens": column}), tmp_path / "a.parquet", row_group_size=9)
    ds = ll.LakeDataset(tmp_path, seed=2, packing=ll.Packing("tokens", 8, eos_id=0))
    per_epoch = TokenStream.of(token_counts(ds), 16, 8).num_samples
    with ll.DataLoader(ds, batch_size=per_epoch, num_workers=workers) as loader:
        epoch = next(iter(loader))["input_ids"].flatten().tolist()
    assert sorted(t for t in epoch if t) == sorted(t for row in rows if row for t in row)
    assert epoch.count(0) >= 60, "a separator after each document, the null ones too"

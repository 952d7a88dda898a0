"""Packed token streams: every token of every row exactly once per epoch, in each partition's
order, the same under any world size that divides C, exact resume (mid-document too) under
other world sizes and batch sizes, padding counted."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lakeloader as ll

ROWS, C, L, EOS = 1200, 4, 16, 999_999


def tokens_of(i: int) -> list[int]:
    """Row ``i``'s tokens: unique across the lake (0 to 24 of them; some rows are empty)."""
    return [i * 100 + j for j in range((i * 7919) % 25)]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packing")
    for f in range(3):
        ids = list(range(f * ROWS // 3, (f + 1) * ROWS // 3))
        table = pa.table({"id": ids, "tokens": [tokens_of(i) for i in ids]})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=100)
    return root


def dataset(lake: Path, eos: int | None = EOS) -> ll.LakeDataset:
    packing = ll.Packing("tokens", L, eos_id=eos, pad_id=0)
    return ll.LakeDataset(lake, seed=3, num_partitions=C, window=64, packing=packing)


def run(
    lake: Path,
    world: int,
    batch: int,
    steps: int,
    states: list[dict[str, Any]] | None = None,
    workers: int = 0,
    eos: int | None = EOS,
) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """Every rank in lockstep for ``steps`` steps: each partition's samples (tokens,
    positions, pad mask stacked on axis 1), and the ranks' states after."""
    loaders = [
        ll.DataLoader(
            dataset(lake, eos), batch_size=batch, rank=r, world_size=world, num_workers=workers
        )
        for r in range(world)
    ]
    if states is not None:
        for loader in loaders:
            loader.load_state_dict(states)
    iters = [iter(loader) for loader in loaders]
    k = world * batch // C
    per_part: list[list[np.ndarray]] = [[] for _ in range(C)]
    for _ in range(steps):
        batches = [next(it) for it in iters]
        both = [
            np.stack([b["input_ids"], b["position_ids"], b["pad_mask"]], axis=1) for b in batches
        ]
        whole = np.concatenate(both)  # partition-major: k samples of each partition
        assert whole.shape == (world * batch, 3, L)
        for p in range(C):
            per_part[p].append(whole[p * k : (p + 1) * k])
    states_after = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    return [np.concatenate(x) for x in per_part], states_after


def expected_stream(lake: Path, partition: int, epochs: int, eos: int | None = EOS) -> np.ndarray:
    """A partition's samples as the unpacked loader's row order says they must be."""
    out = []
    for epoch in range(epochs):
        plain = ll.LakeDataset(lake, seed=3, num_partitions=C, window=64, columns=["id"])
        loader = ll.DataLoader(plain, batch_size=ROWS)
        loader.set_epoch(epoch)
        # One batch of every slot comes partition-major: each partition's rows in its order.
        ids = next(iter(loader))["id"].numpy().reshape(C, ROWS // C)
        tokens, positions = [], []
        for i in ids[partition].tolist():
            doc = tokens_of(i) + ([] if eos is None else [eos])
            tokens += doc
            positions += list(range(len(doc)))
        pad = -len(tokens) % L
        mask = [False] * len(tokens) + [True] * pad
        tokens, positions = tokens + [0] * pad, positions + [0] * pad
        out.append(np.stack([tokens, positions, mask]).reshape(3, -1, L).transpose(1, 0, 2))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def reference(lake: Path) -> list[np.ndarray]:
    streams, _ = run(lake, 1, 8, 260)  # k = 2: two and a half epochs of every partition
    return streams


def test_each_partition_is_its_rows_tokens_once_per_epoch_padding_counted(
    lake: Path, reference: list[np.ndarray]
) -> None:
    for p in range(C):
        want = expected_stream(lake, p, 3)
        got = reference[p]
        assert len(want) > len(got) > len(want) * 2 // 3, "two epochs and more were read"
        assert (got == want[: len(got)]).all(), f"partition {p}"
    _, states = run(lake, 1, 8, 260)
    for p, (epoch, row, offset, tokens, padding) in states[0]["partitions"].items():
        stream = reference[int(p)]
        assert padding == int(stream[:, 2].sum()) and tokens + padding == stream[:, 0].size
        assert epoch == 2 and 0 <= row <= ROWS // C and offset >= 0


@pytest.mark.parametrize(("world", "workers"), [(2, 0), (4, 2)])
def test_the_same_streams_under_any_world_size_dividing_c(
    lake: Path, reference: list[np.ndarray], world: int, workers: int
) -> None:
    streams, _ = run(lake, world, 8 // world, 260, workers=workers)
    for p in range(C):
        assert (streams[p] == reference[p]).all()


def test_resume_at_20_random_points_mid_document_and_under_other_shapes(
    lake: Path, reference: list[np.ndarray]
) -> None:
    rng = random.Random(11)
    shapes = [(1, 8), (2, 4), (4, 2), (1, 16), (2, 8), (4, 4), (4, 1)]  # (world, batch)
    mid_document = 0
    for _ in range(20):
        (w1, b1), (w2, b2) = rng.sample(shapes, 2)
        k1, k2 = w1 * b1 // C, w2 * b2 // C
        steps = rng.randrange(1, 400 // k1)
        before, states = run(lake, w1, b1, steps)
        mid_document += any(x[2] > 0 for s in states for x in s["partitions"].values())
        after, _ = run(
            lake, w2, b2, (520 - steps * k1) // k2, states=rng.sample(states, len(states))
        )
        for p in range(C):
            got = np.concatenate([before[p], after[p]])
            assert (got == reference[p][: len(got)]).all(), (w1, b1, steps, w2, b2, p)
    assert mid_document >= 10, "resumes in the middle of a document"


def test_without_a_separator_documents_run_end_to_end(lake: Path) -> None:
    streams, _ = run(lake, 2, 4, 60, eos=None)
    for p in range(C):
        assert (streams[p] == expected_stream(lake, p, 1, eos=None)[: len(streams[p])]).all()


def test_bad_shapes_and_states_are_refused(lake: Path) -> None:
    with pytest.raises(ValueError, match=r"world size 3 must divide num_partitions=4"):
        ll.DataLoader(dataset(lake), batch_size=4, rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"global batch of 6 samples must be a multiple of 4"):
        ll.DataLoader(dataset(lake), batch_size=3, rank=0, world_size=2)
    _, states = run(lake, 2, 4, 3)
    loader = ll.DataLoader(dataset(lake), batch_size=2, rank=0, world_size=4)
    loader.load_state_dict(states[0])  # rank 0 of 4 owns partition 0: rank 0 of 2 had it
    other = ll.DataLoader(dataset(lake), batch_size=2, rank=3, world_size=4)
    with pytest.raises(ll.StateMismatchError, match=r"no position for partition\(s\) \[3\]"):
        other.load_state_dict([states[0]])
    with pytest.raises(ll.StateFormatError, match="not a packed state"):
        other.load_state_dict(ll.DataLoader(ll.LakeDataset(lake), batch_size=4).state_dict())
    with pytest.raises(TypeError, match="is endless"):
        len(other)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        ll.Packing("tokens", 0)


def test_checkpoints_and_inspect_of_a_packed_loader(
    lake: Path, reference: list[np.ndarray], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CheckpointManager saves every partition's position (here one rank holds them all) and a
    run of two ranks continues from it; inspect shows each partition's tokens and offset."""
    from lakeloader.cli.main import main

    before, states = run(lake, 1, 8, 37)
    loader = ll.DataLoader(dataset(lake), batch_size=8)
    loader.load_state_dict(states)
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(37, loader, extra={"step": 37})
    fresh = [ll.DataLoader(dataset(lake), batch_size=4, rank=r, world_size=2) for r in range(2)]
    for r in fresh:
        assert manager.load(r) == {"step": 37}
    after, _ = run(lake, 2, 4, 100, states=[r.state_dict() for r in fresh])
    for p in range(C):
        got = np.concatenate([before[p], after[p]])
        assert (got == reference[p][: len(got)]).all()
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "packed" and info["samples_per_partition"] == 37 * 2
    saved = states[0]["partitions"]
    for x in info["partitions"]:
        assert [x["epoch"], x["row"], x["token_offset"], x["tokens"], x["padding"]] == saved[
            str(x["partition"])
        ]
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "token offset" in capsys.readouterr().out
    with pytest.raises(
        ll.StateFormatError, match=r"'packed' state, which this DataLoader over a lake does"
    ):
        manager.load(ll.DataLoader(ll.LakeDataset(lake), batch_size=4))


@given(
    st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=30),
    st.integers(min_value=0, max_value=20),
    st.integers(min_value=1, max_value=50),
    st.integers(min_value=1, max_value=8),
    st.booleans(),
)
def test_a_block_hands_out_what_cutting_take_by_take_gives(
    lengths: list[int], offset: int, count: int, most: int, eos: bool
) -> None:
    """Takes from one Block equal cut_tokens take after take: tokens, positions, and the
    (rows finished, offset) each take leaves; rows of length 0 (skipped rows, which get no
    separator) among them."""
    from lakeloader.order.packing import Block, cut_tokens, separated

    raw = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ended = np.array([n % 3 != 0 for n in lengths])  # a row of 0, 3, ... tokens is skipped
    values, offsets = separated(
        np.arange(1, int(raw[-1]) + 1, dtype=np.int64), raw, 0 if eos else None, ended
    )
    sizes = np.diff(offsets)
    assert sizes.tolist() == [n + (eos and e) for n, e in zip(lengths, ended, strict=True)]
    total = int(offsets[-1])
    offset = min(offset, max(int(sizes[0]) - 1, 0))
    block = Block.cut(values, offsets, offset, count, most)
    if total - offset < count:
        assert block is None
        return
    assert block is not None
    takes = len(block.tokens) // count
    assert takes == min((total - offset) // count, most) and len(block.tokens) == takes * count
    rows, at = 0, offset
    for k in range(takes):
        cut = cut_tokens(values[offsets[rows] :], offsets[rows:] - offsets[rows], at, count)
        got = slice(k * count, (k + 1) * count)
        assert block.tokens[got].tolist() == cut.tokens.tolist()
        assert block.positions[got].tolist() == cut.positions.tolist()
        rows, at = rows + cut.rows, cut.offset
        assert block.after((k + 1) * count) == (rows, at)

"""Packing over a mixture: each sample's source drawn by weight, each source packing its own
epochs (sources of different ``C``); the same global batches under world sizes 1, 2, 3 and 5
(none dividing every source's ``C``); exact resume from rank 0's state alone under other world
sizes and global batches, with new weights and a source added; every token of every row once
per epoch of each source; checkpoints and inspect. Checked against an oracle built from the
files (:func:`tests.oracles.packed_epoch`)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.order.mixture import MixWeights, slot_sources
from tests.oracles import PackedSample, packed_epoch, packed_steps

L, EOS, SEED, MIX_SEED = 16, 1, 5, 21
ROWS = {"web": 800, "code": 600, "math": 200, "books": 400}
#: Each source's streams: no world size below divides them all.
C = {"web": 4, "code": 3, "math": 5, "books": 2}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
#: The weights of a resume: books joins.
NEW = {"web": 0.25, "code": 0.25, "math": 0.2, "books": 0.3}
BASE = {name: (k + 1) * 10_000_000 for k, name in enumerate(ROWS)}
#: The reference: one rank, global batches of 24, 150 steps (every source through 2 epochs).
BATCH, STEPS = 24, 150


def tokens_of(name: str, i: int) -> list[int]:
    """Row ``i`` of a source: 0 to 19 tokens, unique across the lakes."""
    return [BASE[name] + i * 100 + j for j in range((i * 31) % 20)]


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packed-mixture")
    for name, rows in ROWS.items():
        (root / name).mkdir()
        for f in range(2):
            ids = range(f * rows // 2, (f + 1) * rows // 2)
            table = pa.table({"tokens": [tokens_of(name, i) for i in ids], "id": list(ids)})
            pq.write_table(table, root / name / f"part-{f}.parquet", row_group_size=100)
    return root


def source(lakes: Path, name: str) -> ll.LakeDataset:
    return ll.LakeDataset(
        lakes / name, columns=["tokens"], seed=SEED, num_partitions=C[name], window=64
    )


def mixture(lakes: Path, weights: dict[str, float] = WEIGHTS) -> ll.Mixture:
    packing = ll.Packing("tokens", L, eos_id=EOS)
    sources = {n: source(lakes, n) for n in weights}
    return ll.Mixture(sources, weights, seed=MIX_SEED, packing=packing)


@dataclass
class Got:
    """Global batches laid end to end: each sample's source name, and ``[N, 3, L]``."""

    names: list[str]
    samples: np.ndarray


def run(
    lakes: Path,
    world: int,
    batch: int,
    steps: int,
    weights: dict[str, float] = WEIGHTS,
    state: dict[str, Any] | None = None,
) -> tuple[Got, list[dict[str, Any]]]:
    """Every rank in lockstep for ``steps`` steps (ranks in order in each), each rank's state
    after."""
    loaders = [
        ll.DataLoader(mixture(lakes, weights), batch_size=batch, rank=r, world_size=world)
        for r in range(world)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    names = sorted(weights)
    iters = [iter(loader) for loader in loaders]
    got, samples = [], []
    for _ in range(steps):
        for it in iters:
            b = next(it)
            got += [names[i] for i in b["source"].tolist()]
            samples.append(np.stack([b["input_ids"], b["position_ids"], b["pad_mask"]], axis=1))
    states = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    return Got(got, np.concatenate(samples).astype(np.int64)), states


class Oracle:
    """Each source's epochs from its files: units in the epoch's order, rows in file order."""

    def __init__(self, lakes: Path) -> None:
        self.sources = mixture(lakes, NEW).sources  # packed as the loader packs them
        self._epochs: dict[tuple[str, int], list[PackedSample]] = {}

    def epoch(self, name: str, e: int) -> list[PackedSample]:
        if (name, e) not in self._epochs:
            ds = self.sources[name]
            units, files = ds.units, ds.snapshot.files
            out = []
            for u in ds.plan(e).order.tolist():
                path = files[int(units.file_index[u])].path
                group = pq.ParquetFile(path).read_row_group(int(units.row_group[u]), ["tokens"])
                start = int(units.row_start[u])
                out.append(group["tokens"].to_pylist()[start : start + int(units.num_rows[u])])
            self._epochs[name, e] = packed_epoch(out, C[name], L, EOS)
        return self._epochs[name, e]

    def steps(
        self,
        weights: dict[str, float],
        batch: int,
        steps: int,
        slot: int = 0,
        counts: dict[str, int] | None = None,
    ) -> Got:
        """Global steps from ``slot`` on (the sources at ``counts``), under ``weights``."""
        w = MixWeights.of(weights)
        drawn = [w.names[k] for k in slot_sources(w, MIX_SEED, slot, batch * steps).tolist()]
        out = [x for step in packed_steps(self.epoch, drawn, counts or {}, batch) for x in step]
        return Got([n for n, _, _ in out], np.stack([s for _, _, s in out]))


@pytest.fixture(scope="module")
def oracle(lakes: Path) -> Oracle:
    return Oracle(lakes)


@pytest.fixture(scope="module")
def reference(lakes: Path) -> tuple[Got, dict[str, Any]]:
    got, states = run(lakes, 1, BATCH, STEPS)
    return got, states[0]


def cursor(state: dict[str, Any]) -> dict[str, Any]:
    """A packed mixture's state but the topology it records (the saving rank's)."""
    return {**state["mixture"], "topology": None}


def same(got: Got, want: Got) -> bool:
    return got.names == want.names and np.array_equal(got.samples, want.samples)


def test_samples_follow_the_weights_and_each_source_packs_its_own_epochs(
    reference: tuple[Got, dict[str, Any]], oracle: Oracle
) -> None:
    got, state = reference
    assert same(got, oracle.steps(WEIGHTS, BATCH, STEPS))
    counts = {n: got.names.count(n) for n in WEIGHTS}
    assert state["mixture"]["slot"] == BATCH * STEPS
    assert state["mixture"]["counts"] == counts, "the state counts each source's samples"
    assert all(abs(counts[n] / (BATCH * STEPS) - w) < 0.01 for n, w in WEIGHTS.items()), counts
    # Each source's samples, in the order delivered, are its epochs one after the other: every
    # token of every row once per epoch, one separator a row, padding only at streams' ends.
    for name in WEIGHTS:
        mine = got.samples[np.array(got.names) == name]
        per_epoch = len(oracle.epoch(name, 0))
        assert state["mixture"]["sources"][name]["rows"] == per_epoch
        assert len(mine) >= 2 * per_epoch, name
        want = sorted(t for i in range(ROWS[name]) for t in tokens_of(name, i))
        for e in range(len(mine) // per_epoch):
            epoch = mine[e * per_epoch : (e + 1) * per_epoch]
            tokens, pads = epoch[:, 0], epoch[:, 2].astype(bool)
            real = tokens[~pads]
            assert sorted(real[real != EOS].tolist()) == want, (name, e)
            assert (real == EOS).sum() == ROWS[name]
            assert 0 < pads.sum() < C[name] * L and (tokens[pads] == 0).all()


@pytest.mark.parametrize(("world", "batch"), [(2, 12), (3, 8), (5, 5)])
def test_the_same_global_batches_under_other_world_sizes(
    lakes: Path, reference: tuple[Got, dict[str, Any]], oracle: Oracle, world: int, batch: int
) -> None:
    steps = 60
    got, states = run(lakes, world, batch, steps)
    if world * batch == BATCH:
        n = steps * BATCH
        assert same(got, Got(reference[0].names[:n], reference[0].samples[:n]))
    else:
        assert same(got, oracle.steps(WEIGHTS, world * batch, steps))
    assert all(cursor(s) == cursor(states[0]) for s in states), "the same state on every rank"


def test_resume_under_other_shapes_with_new_weights_and_a_source_added(
    lakes: Path, oracle: Oracle
) -> None:
    rng = random.Random(3)
    shapes = [(1, 24), (2, 12), (3, 8), (5, 5), (3, 3), (2, 7)]
    for _ in range(6):
        (w1, b1), (w2, b2) = rng.sample(shapes, 2)
        steps = rng.randrange(1, 120)
        before, states = run(lakes, w1, b1, steps)
        assert same(before, oracle.steps(WEIGHTS, w1 * b1, steps)), (w1, b1, steps)
        saved = states[0]["mixture"]
        slot = steps * w1 * b1
        assert saved["slot"] == slot
        assert saved["counts"] == {n: before.names.count(n) for n in WEIGHTS}
        after, later = run(lakes, w2, b2, 30, weights=NEW, state=states[0])
        want = oracle.steps(NEW, w2 * b2, 30, slot, saved["counts"])
        assert same(after, want), (w1, b1, steps, w2, b2)
        mixed = later[0]["mixture"]
        assert [c["start"] for c in mixed["history"]] == [0, slot]
        assert mixed["counts"] == {n: saved["counts"].get(n, 0) + after.names.count(n) for n in NEW}


def test_checkpoints_and_inspect(
    lakes: Path,
    reference: tuple[Got, dict[str, Any]],
    oracle: Oracle,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lakeloader.cli.main import main

    _, states = run(lakes, 3, 8, 30)
    with ll.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        with ll.DataLoader(mixture(lakes), batch_size=BATCH) as saver:
            saver.load_state_dict(states[1])  # any rank's state
            manager.save(30, saver)
        fresh = [
            ll.DataLoader(mixture(lakes), batch_size=12, rank=r, world_size=2) for r in range(2)
        ]
        for loader in fresh:
            manager.load(loader)
        loaded = [loader.state_dict() for loader in fresh]
        for loader in fresh:
            loader.close()
    assert cursor(loaded[0]) == cursor(loaded[1]) == cursor(states[1]) == cursor(states[0])
    after, _ = run(lakes, 2, 12, 20, state=loaded[0])
    n, m = 30 * BATCH, 50 * BATCH
    assert same(after, Got(reference[0].names[n:m], reference[0].samples[n:m]))
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "packed-mixture" and info["slot"] == n
    assert {s["source"]: s["drawn"] for s in info["sources"]} == states[0]["mixture"]["counts"]
    for s in info["sources"]:
        assert s["samples_per_epoch"] == len(oracle.epoch(s["source"], 0))
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "samples drawn" in capsys.readouterr().out


def test_refusals(lakes: Path) -> None:
    with pytest.raises(ll.errors.ColumnNotFoundError, match="Packing column 'text'"):
        ll.Mixture({"web": source(lakes, "web")}, {"web": 1}, packing=ll.Packing("text", L))
    own = ll.LakeDataset(lakes / "web", columns=["tokens"], packing=ll.Packing("tokens", L))
    with pytest.raises(ValueError, match="give packing= to the Mixture"):
        ll.Mixture({"web": own}, {"web": 1})

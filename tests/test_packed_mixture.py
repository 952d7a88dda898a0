"""Packing over a mixture: each source packed on its own, drawn in rounds (one sample from
every partition of a source) in the weights' proportions; exact under other world sizes,
batch sizes, new weights and an added source; checkpoints and inspect."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.order.mixture import MixWeights, slot_sources

C, L, EOS, SEED = 4, 16, 0, 21
ROWS = {"web": 800, "code": 600, "math": 200, "books": 400}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
BASE = {name: (k + 1) * 10_000_000 for k, name in enumerate(ROWS)}


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packed-mixture")
    for name, rows in ROWS.items():
        (root / name).mkdir()
        for f in range(2):
            ids = range(f * rows // 2, (f + 1) * rows // 2)
            tokens = [[BASE[name] + i * 100 + j for j in range((i * 31) % 20)] for i in ids]
            table = pa.table({"tokens": tokens, "other": [float(i) for i in ids]})
            pq.write_table(table, root / name / f"part-{f}.parquet", row_group_size=100)
    return root


def source(lakes: Path, name: str) -> ll.LakeDataset:
    return ll.LakeDataset(lakes / name, columns=["tokens"], seed=5, num_partitions=C, window=64)


def mixture(lakes: Path, weights: dict[str, float] = WEIGHTS) -> ll.Mixture:
    packing = ll.Packing("tokens", L, eos_id=EOS)
    sources = {n: source(lakes, n) for n in weights}
    return ll.Mixture(sources, weights, seed=SEED, packing=packing)


def run(
    lakes: Path,
    world: int,
    batch: int,
    steps: int,
    weights: dict[str, float] = WEIGHTS,
    states: list[dict[str, Any]] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """Every rank in lockstep: the global batches (tokens and each sample's source name index
    in sorted order of all names), and the ranks' states after."""
    loaders = [
        ll.DataLoader(mixture(lakes, weights), batch_size=batch, rank=r, world_size=world)
        for r in range(world)
    ]
    if states is not None:
        for loader in loaders:
            loader.load_state_dict(states)
    names = sorted(weights)
    iters = [iter(loader) for loader in loaders]
    tokens, sources = [], []
    for _ in range(steps):
        batches = [next(it) for it in iters]
        tokens.append(np.concatenate([b["input_ids"].numpy() for b in batches]))
        sources.append(np.concatenate([[names[i] for i in b["source"].tolist()] for b in batches]))
    out = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    return np.stack(tokens), np.stack(sources), out


def per_source(tokens: np.ndarray, sources: np.ndarray) -> dict[str, list[list[list[int]]]]:
    """Each source's samples by partition: the global batch is partition-major (C blocks)."""
    steps, size, _ = tokens.shape
    k = size // C
    out: dict[str, list[list[list[int]]]] = {n: [[] for _ in range(C)] for n in ROWS}
    for t in range(steps):
        for p in range(C):
            for j in range(p * k, (p + 1) * k):
                out[str(sources[t, j])][p].append(tokens[t, j].tolist())
    return out


def alone(lakes: Path, name: str, samples: int) -> list[list[list[int]]]:
    """A source's partition streams, packed by itself."""
    packing = ll.Packing("tokens", L, eos_id=EOS)
    ds = ll.LakeDataset(
        lakes / name, columns=["tokens"], seed=5, num_partitions=C, window=64, packing=packing
    )
    loader = ll.DataLoader(ds, batch_size=C)
    it = iter(loader)
    out: list[list[list[int]]] = [[] for _ in range(C)]
    for _ in range(samples):
        batch = next(it)["input_ids"].tolist()
        for p in range(C):
            out[p].append(batch[p])
    loader.close()
    return out


def check_streams(lakes: Path, tokens: np.ndarray, sources: np.ndarray) -> None:
    for name, parts in per_source(tokens, sources).items():
        counts = {len(p) for p in parts}
        assert len(counts) == 1, "every partition of a source gives one sample a round"
        n = counts.pop()
        if n:
            assert parts == alone(lakes, name, n), f"{name}: each partition's own stream"


@pytest.fixture(scope="module")
def reference(lakes: Path) -> tuple[np.ndarray, np.ndarray]:
    tokens, sources, _ = run(lakes, 1, 8, 150)  # 2 rounds a step
    return tokens, sources


def test_rounds_follow_the_weights_and_each_source_its_own_streams(
    lakes: Path, reference: tuple[np.ndarray, np.ndarray]
) -> None:
    tokens, sources = reference
    check_streams(lakes, tokens, sources)
    first_block = sources[:, : 8 // C]  # partition 0's samples: one per round, in round order
    names = sorted(WEIGHTS)
    want = slot_sources(MixWeights.of(WEIGHTS), SEED, 0, 150 * 2)
    assert [names.index(n) for n in first_block.reshape(-1)] == want.tolist()
    shares = {n: float(np.mean(first_block == n)) for n in WEIGHTS}
    assert all(abs(shares[n] - w) < 0.02 for n, w in WEIGHTS.items()), shares


@pytest.mark.parametrize("world", [2, 4])
def test_the_same_global_batches_under_other_world_sizes(
    lakes: Path, reference: tuple[np.ndarray, np.ndarray], world: int
) -> None:
    tokens, sources, _ = run(lakes, world, 8 // world, 150)
    assert (tokens == reference[0]).all() and (sources == reference[1]).all()


def test_resume_under_other_shapes_with_new_weights_and_a_source_added(lakes: Path) -> None:
    rng = random.Random(3)
    shapes = [(1, 8), (2, 4), (4, 2), (2, 8), (4, 1)]
    new = {"web": 0.25, "code": 0.25, "math": 0.2, "books": 0.3}
    for _ in range(6):
        (w1, b1), (w2, b2) = rng.sample(shapes, 2)
        steps = rng.randrange(1, 60)
        t1, s1, states = run(lakes, w1, b1, steps)
        t2, s2, after = run(lakes, w2, b2, 40, weights=new, states=states)
        # Each source goes on from its own partitions' positions: its streams stay its own.
        for name, parts in per_source(t1, s1).items():
            later = per_source(t2, s2)[name]
            n = len(parts[0]) + len(later[0])
            whole = [parts[p] + later[p] for p in range(C)]
            assert whole == alone(lakes, name, n), (name, w1, b1, steps, w2, b2)
        assert [c["start"] for c in after[0]["mixture"]["history"]] == [0, steps * w1 * b1 // C]


def test_checkpoints_and_inspect(
    lakes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lakeloader.cli.main import main

    t1, s1, states = run(lakes, 1, 8, 30)
    loader = ll.DataLoader(mixture(lakes), batch_size=8)
    loader.load_state_dict(states)
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(30, loader)
    fresh = [ll.DataLoader(mixture(lakes), batch_size=4, rank=r, world_size=2) for r in range(2)]
    for r in fresh:
        manager.load(r)
    t2, s2, _ = run(lakes, 2, 4, 20, states=[r.state_dict() for r in fresh])
    ref_t, ref_s, _ = run(lakes, 1, 8, 50)
    assert (np.concatenate([t1, t2]) == ref_t).all() and (np.concatenate([s1, s2]) == ref_s).all()
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "packed-mixture" and info["slot"] == 60
    for name, packed in info["packed"].items():
        saved = states[0]["sources"][name]["partitions"]
        assert {
            str(x["partition"]): [
                x["epoch"],
                x["row"],
                x["token_offset"],
                x["tokens"],
                x["padding"],
            ]
            for x in packed["partitions"]
        } == saved
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "drawn counts rounds" in capsys.readouterr().out


def test_refusals(lakes: Path) -> None:
    packing = ll.Packing("tokens", L)
    other_c = {
        "web": source(lakes, "web"),
        "code": ll.LakeDataset(lakes / "code", columns=["tokens"], num_partitions=8),
    }
    with pytest.raises(ValueError, match=r"same num_partitions, got \{'code': 8, 'web': 4\}"):
        ll.Mixture(other_c, {"web": 1, "code": 1}, packing=packing)
    with pytest.raises(KeyError, match="Packing column 'text'"):
        ll.Mixture({"web": source(lakes, "web")}, {"web": 1}, packing=ll.Packing("text", L))
    own = ll.LakeDataset(lakes / "web", columns=["tokens"], packing=packing)
    with pytest.raises(ValueError, match="give packing= to the Mixture"):
        ll.Mixture({"web": own}, {"web": 1})

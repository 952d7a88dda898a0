"""``lakeloader audit`` of a run whose lake grew between a checkpoint and its resume.

The ledger is attached from the first step. The resumed attempt finishes the saved epoch on
the snapshot the checkpoint pinned and the later epochs on the lake of now (more rows): the
audit proves each epoch of each position stream exactly once, with its own number of rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main as cli
from tests.conftest import make_loaders

WEB, CODE = list(range(200)), list(range(1_000_000, 1_000_150))
ADDED = list(range(100_000, 100_060))


def _write(root: Path, name: str, ids: list[int]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids}), root / f"{name}.parquet", row_group_size=7)


def _mixture(root: Path) -> ll.Mixture:
    sources = {n: ll.LakeDataset(root / n, seed=4, num_partitions=2) for n in ("web", "code")}
    return ll.Mixture(sources, {"web": 0.5, "code": 0.5}, seed=3, epoch_rows=600)


def _audit(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, tuple[int, int, bool]]:
    """``lakeloader audit --json``: ``{"stream/epoch": (trained, rows, complete)}``."""
    assert cli(["audit", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"], info
    return {
        f"{e['stream']}/{e['epoch']}": (e["trained"], e["num_rows"], e["complete"])
        for e in info["epochs"]
    }


def _first_attempt(ckpt: Path, source: ll.LakeDataset | ll.Mixture, batch: int, steps: int) -> None:
    """One rank with a ledger from its first step, a checkpoint at ``steps``, then it stops."""
    with ll.CheckpointManager(str(ckpt), ledger_flush_seconds=0) as manager:
        loader = ll.DataLoader(source, batch_size=batch)
        manager.attach(loader)
        for step, _ in enumerate(loader, 1):
            if step == steps:
                manager.save(step, loader)
                break
        loader.close()


def test_a_mixture_run_whose_source_grew_is_proven_per_source_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, ckpt = tmp_path / "lakes", tmp_path / "ckpt"
    _write(root / "web", "part-0", WEB)
    _write(root / "code", "part-0", CODE)
    _first_attempt(ckpt, _mixture(root), 8, 17)  # web's epoch 0 under way
    _write(root / "web", "part-1", ADDED)
    # attempt 2: two ranks of 6 on the grown lake, two passes, a checkpoint after each
    ranks = make_loaders(_mixture(root), 2, batch_size=6)
    with ll.CheckpointManager(str(ckpt), ledger_flush_seconds=0) as manager:
        for loader in ranks:
            manager.load(loader)
        step, ids = 17, []
        for _ in range(2):
            for shares in zip(*ranks, strict=True):
                step += 1
                ids += [i for s in shares for i in s["id"].tolist()]
            manager.save(step, ranks[0])
    for loader in ranks:
        loader.close()
    web_rows = sum(1 for i in ids if i < 1_000_000)
    assert web_rows > len(WEB) + len(ADDED), "the run reached web's epoch 2"
    epochs = _audit(ckpt, capsys)
    assert epochs["web/0"] == (len(WEB), len(WEB), True), "the saved epoch: the pinned files"
    assert epochs["web/1"] == (len(WEB) + len(ADDED),) * 2 + (True,), "the lake of now"
    assert epochs["web/2"][1:] == (len(WEB) + len(ADDED), False)
    assert epochs["code/0"] == (len(CODE), len(CODE), True)


def _tokens_of(i: int) -> list[int]:
    return [i * 32 + j + 1 for j in range((i * 7) % 13)]


def _packed(root: Path, mixed: bool) -> ll.LakeDataset | ll.Mixture:
    def lake(name: str, packed: bool) -> ll.LakeDataset:
        packing = ll.Packing("tokens", 8, eos_id=0) if packed else None
        return ll.LakeDataset(root / name, seed=4, num_partitions=3, packing=packing)

    if not mixed:
        return lake("a", True)
    sources = {n: lake(n, False) for n in ("a", "b")}
    return ll.Mixture(sources, {"a": 0.5, "b": 0.5}, seed=3, packing=ll.Packing("tokens", 8, 0))


@pytest.mark.parametrize("mixed", [False, True], ids=["packed-lake", "packed-mixture"])
def test_a_packed_run_whose_lake_grew_is_proven_per_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mixed: bool
) -> None:
    root, ckpt = tmp_path / "lakes", tmp_path / "ckpt"
    for name, ids in (("a", range(60)), ("b", range(5000, 5040))):
        (root / name).mkdir(parents=True)
        table = pa.table({"tokens": [_tokens_of(i) for i in ids]})
        pq.write_table(table, root / name / "part-0.parquet", row_group_size=9)
    _first_attempt(ckpt, _packed(root, mixed), 4, 7)
    table = pa.table({"tokens": [_tokens_of(i) for i in range(1000, 1030)]})
    pq.write_table(table, root / "a" / "part-1.parquet", row_group_size=9)
    ranks = make_loaders(_packed(root, mixed), 2, batch_size=3)
    with ll.CheckpointManager(str(ckpt), ledger_flush_seconds=0) as manager:
        for loader in ranks:
            manager.load(loader)
        step = 7
        for _ in range(3):
            for _ in zip(range(40 if mixed else 20), *ranks, strict=False):
                step += 1
            manager.save(step, ranks[0])
    for loader in ranks:
        loader.close()
    epochs = _audit(ckpt, capsys)
    stream = "a" if mixed else "lake"
    grown = [epochs.get(f"{stream}/{k}") for k in range(3)]
    assert all(e is not None and e[2] and e[0] == e[1] for e in grown[:2]), epochs
    assert grown[0] is not None and grown[1] is not None and grown[0][1] < grown[1][1], (
        "epoch 0 on the pinned files, epoch 1 on the lake of now: more samples"
    )
    assert all(trained == rows for trained, rows, done in epochs.values() if done)

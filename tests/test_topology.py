"""Topology independence: the global batch sequence does not depend on ranks or workers."""

from __future__ import annotations

from pathlib import Path

import pytest

import lakeloader as ll
from tests.conftest import GLOBAL_BATCH, LAYOUT_ROWS, run_epoch


def test_reference_epoch_is_a_permutation_of_all_rows(reference: list[list[int]]) -> None:
    ids = [i for batch in reference for i in batch]
    assert sorted(ids) == list(range(LAYOUT_ROWS))
    assert ids != sorted(ids), "shuffle=True must not give path order"
    assert all(len(b) == GLOBAL_BATCH for b in reference[:-1])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_same_global_batches_for_every_world_size(
    dataset: ll.LakeDataset, reference: list[list[int]], world_size: int
) -> None:
    assert run_epoch(dataset, world_size, batch_size=GLOBAL_BATCH // world_size) == reference


@pytest.mark.parametrize("num_workers", [0, 1, 2, 4])
def test_same_global_batches_for_every_worker_count(
    dataset: ll.LakeDataset, reference: list[list[int]], num_workers: int
) -> None:
    assert run_epoch(dataset, 1, batch_size=GLOBAL_BATCH, num_workers=num_workers) == reference


def test_workers_and_ranks_together(dataset: ll.LakeDataset, reference: list[list[int]]) -> None:
    assert run_epoch(dataset, 3, batch_size=GLOBAL_BATCH // 3, num_workers=2) == reference


def test_epochs_differ_and_each_is_complete(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=GLOBAL_BATCH)
    epochs = [[i for b in loader for i in b["id"].tolist()] for _ in range(3)]
    assert loader.epoch == 2
    for ids in epochs:
        assert sorted(ids) == list(range(LAYOUT_ROWS))
    assert epochs[0] != epochs[1] != epochs[2]


def test_seed_changes_order(lake: Path) -> None:
    a = ll.LakeDataset(lake, seed=1)
    b = ll.LakeDataset(lake, seed=2)
    assert run_epoch(a, 1, batch_size=64) != run_epoch(b, 1, batch_size=64)


def test_short_last_batch_split_evenly(dataset: ll.LakeDataset) -> None:
    # 1500 rows, global batch 8 x 7 = 56: 26 full batches and a last one of 44 rows.
    loaders = [ll.DataLoader(dataset, batch_size=7, rank=r, world_size=8) for r in range(8)]
    last = [list(loader)[-1]["id"].numel() for loader in loaders]
    assert sum(last) == LAYOUT_ROWS % 56
    assert max(last) - min(last) <= 1

"""What frameworks need of the loader itself (issue: exactly once inside the frameworks).

Rank and world size resolved when a pass starts (a loader made before the process group, as
Lightning's ``ddp`` and ``ddp_spawn`` do), ``loader.sampler.set_epoch``, ``restart_on_iter``
for evaluation, ``endless`` for step-based trainers, and a state that stands before batches
a framework fetched ahead of its step.
"""

from __future__ import annotations

import itertools
import multiprocessing
import socket
from pathlib import Path
from typing import Any

import pytest

import lakeloader as ll
from tests.conftest import LAYOUT_ROWS

BATCH = 32


def _ids(batches: Any) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def _epoch(ds: ll.LakeDataset, epoch: int, **kwargs: Any) -> list[list[int]]:
    loader = ll.DataLoader(ds, batch_size=BATCH, **kwargs)
    loader.set_epoch(epoch)
    return _ids(loader)


# ------------------------------------------------------------------------------ the topology


def test_rank_and_world_size_are_taken_when_a_pass_starts(
    dataset: ll.LakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    loader = ll.DataLoader(dataset, batch_size=BATCH)  # made before the launcher's variables
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (loader.rank, loader.world_size) == (1, 2)
    got = _ids(loader)
    assert got == _ids(ll.DataLoader(dataset, batch_size=BATCH, rank=1, world_size=2))
    assert len(loader) == len(got)
    assert loader.state_dict()["topology"]["world_size"] == 2


def test_a_rank_nothing_tells_is_an_error_at_iteration_naming_the_variables(
    dataset: ll.LakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")  # what Lightning's ddp launcher gives a child
    loader = ll.DataLoader(dataset, batch_size=BATCH)  # making it is fine
    it = iter(loader)  # Lightning tests iterability before it starts the process group
    with pytest.raises(ll.TopologyError) as err:
        next(it)
    message = str(err.value)
    assert "\n" not in message
    for name in ("WORLD_SIZE=2", "RANK is not set", "LOCAL_RANK=1", "rank=", "initialised"):
        assert name in message
    assert _ids(ll.DataLoader(dataset, batch_size=BATCH, rank=1))  # explicit: no error


def _rank_process(rank: int, loader: ll.DataLoader, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out.put((rank, _ids(loader), loader.rank, loader.world_size))
    finally:
        dist.destroy_process_group()


def test_a_loader_made_before_the_process_group_takes_its_rank_in_each_process(
    dataset: ll.LakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ddp_spawn: the parent makes the loader (one process, no group) and pickles it into two
    # spawned processes, which then start a gloo group
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    loader = ll.DataLoader(dataset, batch_size=BATCH, num_workers=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank_process, args=(r, loader, port, out)) for r in range(2)]
    for p in ranks:
        p.start()
    got = dict(
        (r, (ids, rank, world)) for r, ids, rank, world in (out.get(timeout=240) for _ in ranks)
    )
    for p in ranks:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert {r: got[r][1:] for r in got} == {0: (0, 2), 1: (1, 2)}
    every = sorted(i for r in got for batch in got[r][0] for i in batch)
    assert every == list(range(LAYOUT_ROWS)), "each row once across the two processes"
    for r in range(2):
        assert got[r][0] == _ids(ll.DataLoader(dataset, batch_size=BATCH, rank=r, world_size=2))


# ---------------------------------------------------------------------------------- epochs


def test_sampler_set_epoch_reaches_the_loader(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    assert loader.batch_sampler is None
    loader.sampler.set_epoch(3)  # where Lightning and Accelerate set it
    assert loader.epoch == 3
    assert _ids(loader) == _epoch(dataset, 3)
    # the epoch under way keeps its position, as the loader's own set_epoch
    it = iter(loader)
    loader.sampler.set_epoch(4)
    first = next(iter(loader))["id"].tolist()
    loader.sampler.set_epoch(4)
    assert [first, *_ids(loader)] == _epoch(dataset, 4)
    del it


def test_a_loader_without_len_keeps_its_own_epochs(dataset: ll.LakeDataset) -> None:
    # Lightning counts epochs by len(); without one its count stays 0, and it calls
    # loader.sampler.set_epoch(0) at every start: an endless loader must not go back
    loader = ll.DataLoader(dataset, batch_size=BATCH, endless=True)
    steps = len(ll.DataLoader(dataset, batch_size=BATCH))
    it = iter(loader)
    list(itertools.islice(it, 2 * steps + 3))
    state = loader.state_dict()
    loader.sampler.set_epoch(0)
    assert loader.state_dict() == state
    resumed = ll.DataLoader(dataset, batch_size=BATCH, endless=True)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(0)
    assert _ids(itertools.islice(iter(resumed), 2)) == _ids(itertools.islice(it, 2))
    loader.close()


def test_restart_on_iter_makes_every_iter_a_whole_pass(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH, restart_on_iter=True)
    whole = _epoch(dataset, 0)
    assert len(list(itertools.islice(iter(loader), 2))) == 2  # a sanity check stops early
    assert _ids(loader) == whole, "the next validation sees every row"
    assert _ids(itertools.islice(iter(loader), 5)) == whole[:5]  # limit_val_batches
    assert _ids(loader) == whole
    loader.set_epoch(2)
    assert _ids(loader) == _epoch(dataset, 2)


def test_restart_on_iter_and_endless_are_refused_where_they_cannot_work(
    dataset: ll.LakeDataset,
) -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        ll.DataLoader(dataset, batch_size=BATCH, restart_on_iter=True, endless=True)
    mixture = ll.Mixture({"a": dataset, "b": dataset}, weights={"a": 1, "b": 1}, seed=0)
    with pytest.raises(ValueError, match="restart_on_iter=True needs a LakeDataset"):
        ll.DataLoader(mixture, batch_size=BATCH, restart_on_iter=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_endless_runs_epoch_after_epoch_and_resumes_exactly(
    dataset: ll.LakeDataset, num_workers: int
) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH, endless=True, num_workers=num_workers)
    with pytest.raises(TypeError, match="endless"):
        len(loader)
    steps = len(ll.DataLoader(dataset, batch_size=BATCH))
    it = iter(loader)
    got = _ids(itertools.islice(it, steps * 2 + 5))
    expected = _epoch(dataset, 0) + _epoch(dataset, 1) + _epoch(dataset, 2)[:5]
    assert got == expected
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (2, 5 * BATCH)
    later = _ids(itertools.islice(it, 3))
    resumed = ll.DataLoader(dataset, batch_size=BATCH, endless=True)
    resumed.load_state_dict(state)
    assert _ids(itertools.islice(iter(resumed), 3)) == later
    loader.close()


# ------------------------------------------------------------------------- fetched ahead


def test_a_state_stands_before_batches_fetched_ahead(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH, endless=True)
    it = iter(loader)
    steps = len(ll.DataLoader(dataset, batch_size=BATCH))
    trained = _ids(itertools.islice(it, steps + 1))  # into epoch 1
    ahead = next(it)["id"].tolist()  # a framework's prefetch: not trained yet
    state = loader.state_dict(fetched_ahead=1)
    assert (state["epoch"], state["position"]) == (1, BATCH)
    resumed = ll.DataLoader(dataset, batch_size=BATCH)
    resumed.load_state_dict(state)
    assert next(iter(resumed))["id"].tolist() == ahead, "the prefetched batch comes again"
    # across the epoch's boundary: three back stands before epoch 0's last step
    back = loader.state_dict(fetched_ahead=3)
    assert (back["epoch"], back["position"]) == (0, LAYOUT_ROWS - len(trained[-2]))
    again = ll.DataLoader(dataset, batch_size=BATCH, endless=True)
    again.load_state_dict(back)
    assert _ids(itertools.islice(iter(again), 3)) == [trained[-2], trained[-1], ahead]
    with pytest.raises(ValueError, match="cannot stand 9 steps back"):
        loader.state_dict(fetched_ahead=9)


def test_a_stream_that_cannot_stand_back_says_so(tmp_path: Path, dataset: ll.LakeDataset) -> None:
    mixture = ll.Mixture({"a": dataset, "b": dataset}, weights={"a": 1, "b": 1}, seed=0)
    loader = ll.DataLoader(mixture, batch_size=BATCH)
    next(iter(loader))
    assert loader.state_dict(fetched_ahead=0)
    with pytest.raises(ValueError, match=r"fetched_ahead=1\) of a mixture"):
        loader.state_dict(fetched_ahead=1)


def test_steps_left_count_in_the_topology_of_now(
    dataset: ll.LakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ll.DataLoader(dataset, batch_size=BATCH)
    list(itertools.islice(iter(first), 5))
    state = first.state_dict()
    assert first.steps_left() == len(first) - 5
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    resumed = ll.DataLoader(dataset, batch_size=BATCH)  # made before the process group
    resumed.load_state_dict(state)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # now 64 rows a step
    assert resumed.steps_left() == -(-(LAYOUT_ROWS - 5 * BATCH) // (2 * BATCH))
    assert len(resumed) - resumed.steps_left() == 2 + 1, "160 rows done: 2.5 steps of 64"
    mixture = ll.Mixture({"a": dataset, "b": dataset}, weights={"a": 1, "b": 1}, seed=0)
    mixed = ll.DataLoader(mixture, batch_size=BATCH, rank=0, world_size=1)
    list(itertools.islice(iter(mixed), 3))
    assert mixed.steps_left() == len(mixed) - 3
    with pytest.raises(TypeError, match="endless"):
        ll.DataLoader(dataset, batch_size=BATCH, endless=True).steps_left()

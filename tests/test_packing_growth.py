"""Packed token streams over a lake that grew between a checkpoint and its resume.

A packed lake, and a packed Mixture's source, finish the saved epoch's samples on the snapshot
the checkpoint pinned (every token of the old rows once, padding counted) and cut their later
epochs from the lake of now (the added rows' tokens too, each once an epoch). A checkpoint
taken after that resume, on the pinned files or on the lake of now, continues with the same
samples on another world size and batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll

EOS, L = 0, 8
OLD, ADDED = range(60), range(1000, 1030)


def tokens_of(i: int) -> list[int]:
    """Row ``i``'s tokens: unique, 0 to 12 of them."""
    return [i * 32 + j + 1 for j in range((i * 7) % 13)]


def _write(root: Path, name: str, ids: range) -> None:
    root.mkdir(parents=True, exist_ok=True)
    table = pa.table({"tokens": [tokens_of(i) for i in ids]})
    pq.write_table(table, root / f"{name}.parquet", row_group_size=9)


def _dataset(root: Path, packed: bool = True) -> ll.LakeDataset:
    packing = ll.Packing("tokens", L, eos_id=EOS) if packed else None
    return ll.LakeDataset(root, seed=4, num_partitions=3, packing=packing)


def _source(root: Path, mixed: bool) -> Any:
    if not mixed:
        return _dataset(root / "a")
    sources = {n: _dataset(root / n, packed=False) for n in ("a", "b")}
    return ll.Mixture(sources, {"a": 0.5, "b": 0.5}, seed=3, packing=ll.Packing("tokens", L, EOS))


def _steps(loaders: Sequence[ll.DataLoader], steps: int) -> list[list[int]]:
    """``steps`` global batches: each sample's tokens, in the global order of samples."""
    out: list[list[int]] = []
    for shares in itertools.islice(zip(*(iter(x) for x in loaders), strict=True), steps):
        out += [row for b in shares for row in b["input_ids"].tolist()]
    return out


def _loaded(
    root: Path, ckpt: Path | None, world: int, batch: int, mixed: bool
) -> list[ll.DataLoader]:
    """Loaders of ``world`` ranks, each loading the newest checkpoint under ``ckpt`` (if any)."""
    source = _source(root, mixed)
    loaders = [
        ll.DataLoader(source, batch_size=batch, rank=r, world_size=world) for r in range(world)
    ]
    for loader in loaders:
        if ckpt is not None:
            ll.CheckpointManager(str(ckpt)).load(loader)
    return loaders


def _close(loaders: Sequence[ll.DataLoader]) -> None:
    for loader in loaders:
        loader.close()


def _grown(tmp_path: Path, mixed: bool) -> tuple[Path, Path, list[list[int]]]:
    """7 steps of 4 samples and a checkpoint, then a file added to source ``a``."""
    root = tmp_path / "lakes"
    _write(root / "a", "part-0", OLD)
    _write(root / "b", "part-0", range(5000, 5040))
    loaders = _loaded(root, None, 1, 4, mixed)
    seen = _steps(loaders, 7)
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(7, loaders[0])
    _close(loaders)
    _write(root / "a", "part-1", ADDED)
    return root, tmp_path / "ckpt", seen


def _tokens(ids: range) -> list[int]:
    return [t for i in ids for t in [*tokens_of(i), EOS]]


@pytest.mark.parametrize("mixed", [False, True], ids=["packed-lake", "packed-mixture"])
def test_the_saved_epoch_finishes_on_the_pinned_rows_then_the_added_ones_join(
    tmp_path: Path, mixed: bool
) -> None:
    root, ckpt, seen = _grown(tmp_path, mixed)
    loaders = _loaded(root, ckpt, 2, 3, mixed)
    samples = seen + _steps(loaders, 20)
    decoded = loaders[0].stats()["units_decoded"]
    samples += _steps(loaders, 100 if mixed else 40)
    assert loaders[0].stats()["units_decoded"] > decoded, "the later epochs' reads count too"
    _close(loaders)
    body = [t for row in samples for t in row if t and t < 5000 * 32]  # source a's tokens
    old = [t for t in _tokens(OLD) if t]
    new = [t for t in _tokens(ADDED) if t]
    assert len(body) > 2 * len(old) + len(new), "the run reached a's epoch 2"
    assert sorted(body[: len(old)]) == sorted(old), "the saved epoch: the pinned rows, once each"
    later = body[len(old) :]
    size = len(old) + len(new)
    for k in range(0, len(later), size):  # the next epochs: the added rows' tokens too
        epoch = later[k : k + size]
        full = sorted(old + new) if len(epoch) == size else sorted(set(epoch))
        assert sorted(epoch) == full, "each token once an epoch"


@pytest.mark.parametrize("mixed", [False, True], ids=["packed-lake", "packed-mixture"])
@pytest.mark.parametrize("steps", [2, 30], ids=["on-pinned-files", "on-the-lake-of-now"])
def test_a_checkpoint_after_the_resume_continues_with_the_same_samples(
    tmp_path: Path, mixed: bool, steps: int
) -> None:
    root, ckpt, _ = _grown(tmp_path, mixed)
    loaders = _loaded(root, ckpt, 2, 3, mixed)
    whole = _steps(loaders, 50)
    _close(loaders)
    loaders = _loaded(root, ckpt, 2, 3, mixed)
    head = _steps(loaders, steps)
    ll.CheckpointManager(str(tmp_path / "again")).save(steps, loaders[0])
    state = loaders[0].state_dict()
    _close(loaders)
    again = _loaded(root, tmp_path / "again", 3, 2, mixed)
    assert head + _steps(again, 50 - steps) == whole
    _close(again)
    if steps == 30 and not mixed:  # a state of the lake of now: load_state_dict alone
        assert state.get("from_epoch", 0) >= 1
        with ll.DataLoader(_source(root, mixed), batch_size=6) as fresh:
            fresh.load_state_dict(state)
            assert head + _steps([fresh], 50 - steps) == whole


@pytest.mark.parametrize("mixed", [False, True], ids=["packed-lake", "packed-mixture"])
def test_a_later_checkpoint_loads_into_the_loader_that_resumed_and_states_say_their_version(
    tmp_path: Path, mixed: bool
) -> None:
    """A later checkpoint of a run that resumed after the growth loads into the loader that
    resumed and into a new one made on its ``loader.dataset``: the lake did not change since.
    Its states name their epoch, in a version an older lakeloader refuses (packed 3, mixture 2)."""
    root, ckpt, _ = _grown(tmp_path, mixed)
    loaders = _loaded(root, ckpt, 1, 6, mixed)
    head = _steps(loaders, 30)
    ll.CheckpointManager(str(tmp_path / "later")).save(30, loaders[0])
    state = loaders[0].state_dict()
    whole = head + _steps(loaders, 10)
    assert state["version"] == (2 if mixed else 3)
    cursor = state["mixture"] if mixed else state
    assert cursor["version"] == (2 if mixed else 3)
    again = ll.DataLoader(loaders[0].dataset, batch_size=6)
    for loader in (loaders[0], again):
        ll.CheckpointManager(str(tmp_path / "later")).load(loader)
        assert head + _steps([loader], 10) == whole
    _close([*loaders, again])


@pytest.mark.parametrize("policy", ["error", "skip", "restart_epoch"])
def test_a_pinned_file_gone_is_refused_whatever_the_policy(tmp_path: Path, policy: str) -> None:
    """A packed stream's saved epoch is cut by its files' token counts: without one of them it
    cannot go on, and the error names the file (no footer of a file gone is read)."""
    root, ckpt, _ = _grown(tmp_path, False)
    (root / "a" / "part-0.parquet").unlink()
    loader = ll.DataLoader(_source(root, False), batch_size=6)
    with pytest.raises(ll.LakeChangedError, match=r"gone: .*part-0\.parquet"):
        ll.CheckpointManager(str(ckpt)).load(loader, on_lake_change=policy)
    loader.close()


def test_fetched_ahead_stands_back_across_the_saved_epochs_end(tmp_path: Path) -> None:
    """``state_dict(fetched_ahead=1)`` (Lightning's, for an endless loader) taken at each step
    around the end of the saved epoch is the state before the batch fetched: reloaded, that
    batch comes again."""
    root, ckpt, _ = _grown(tmp_path, False)
    [loader] = _loaded(root, ckpt, 1, 6, False)
    batches, versions = iter(loader), set()
    for _ in range(12):  # the saved epoch ends within these steps
        fetched = next(batches)["input_ids"].tolist()
        back = loader.state_dict(fetched_ahead=1)
        versions.add(back["version"])
        loader.load_state_dict(back)
        batches = iter(loader)
        assert next(batches)["input_ids"].tolist() == fetched
    assert versions == {2, 3}, "states on the pinned snapshot, then on the lake of now"
    loader.close()


@pytest.mark.parametrize("mixed", [False, True], ids=["packed-lake", "packed-mixture"])
def test_a_fresh_states_keys_are_a_grown_ones(tmp_path: Path, mixed: bool) -> None:
    """torch.distributed.checkpoint fills only the keys a fresh loader's state has."""
    root, ckpt, _ = _grown(tmp_path, mixed)
    [grown] = _loaded(root, ckpt, 1, 6, mixed)
    _steps([grown], 30)
    fresh = ll.DataLoader(_source(root, mixed), batch_size=6)

    def keys(state: dict[str, Any], at: str = "") -> set[str]:
        return {f"{at}{k}" for k in state} | {
            key for k, v in state.items() if isinstance(v, dict) for key in keys(v, f"{k}.")
        }

    assert keys(fresh.state_dict()) == keys(grown.state_dict())
    _close([grown, fresh])

"""The recovery coordinator at its seams: resumptions as values, one rule for dead workers.

Lakes are real Parquet folders; "the lake changed" is a real file added, removed or rewritten.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.recovery.reassign import MAX_ATTEMPTS, reassign
from tests.conftest import LAYOUT, write_lake

SETTINGS = {"seed": 1, "num_partitions": 2, "window": 32, "max_unit_rows": 128}


@given(
    owed=st.lists(st.integers(0, 50), unique=True, max_size=8),
    pick=st.integers(-1, 7),
    before=st.dictionaries(st.integers(0, 50), st.integers(1, MAX_ATTEMPTS + 1), max_size=5),
)
def test_reassign_blames_only_the_work_under_way(
    owed: list[int], pick: int, before: dict[int, int]
) -> None:
    building = owed[pick] if 0 <= pick < len(owed) else None
    r = reassign(owed, building, before)
    given_up = [k for k, _ in r.given_up]
    assert [k for k in owed if k not in given_up] == list(r.resend), "order kept, nothing lost"
    assert set(given_up) <= {building}
    for key in owed:
        if key == building:
            assert r.attempts[key] == before.get(key, 1) + 1
            assert (key in given_up) == (r.attempts[key] > MAX_ATTEMPTS)
        else:
            assert r.attempts.get(key) == before.get(key), "queued work is not blamed"


def test_a_misspelt_policy_fails_at_the_call(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_lake_change must be one of"):
        ll.RecoveryCoordinator("skipp")  # type: ignore[arg-type]
    loader = ll.DataLoader(dataset, batch_size=16)
    ckpt = ll.CheckpointManager(str(tmp_path))
    next(iter(loader))
    ckpt.save(1, loader)
    with pytest.raises(ValueError, match="got 'skipp'"):  # nothing changed in the lake
        ckpt.load(ll.DataLoader(dataset, batch_size=16), on_lake_change="skipp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 'later'"):
        ckpt.dataset(on_lake_change="later")  # type: ignore[arg-type]
    loader.close()


def _checkpoint_of(lake: Path, tmp_path: Path, steps: int) -> tuple[ll.Checkpoint, int]:
    ds = ll.LakeDataset(lake, **SETTINGS)
    loader = ll.DataLoader(ds, batch_size=16)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(steps, loader)
    loader.close()
    return manager.load_checkpoint(), loader.tracker.position


def test_resumption_is_a_value_and_no_dataset_changes(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    write_lake(lake, LAYOUT)
    ckpt, position = _checkpoint_of(lake, tmp_path, 3)
    same = ll.LakeDataset(lake, **SETTINGS)
    r = ll.RecoveryCoordinator().resume(ckpt, same)
    assert r.dataset is None and r.state == ckpt.state and r.state.position == position

    write_lake(tmp_path / "more", [[10]])  # a file added since the checkpoint
    shutil.copy(tmp_path / "more" / "file-0000.parquet", lake / "file-9999.parquet")
    live = ll.LakeDataset(lake, **SETTINGS)
    r = ll.RecoveryCoordinator().resume(ckpt, live)
    assert r.state == ckpt.state and r.dataset is not None
    assert r.dataset.fingerprint == ckpt.snapshot.fingerprint, "the saved epoch stays pinned"
    assert r.dataset.for_epoch(ckpt.state.epoch + 1) is live, "added files join next epoch"
    assert live.for_epoch(ckpt.state.epoch) is live and live.lost == (), "live is unchanged"


def test_gone_files_go_by_the_policy(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    write_lake(lake, LAYOUT)
    ckpt, _ = _checkpoint_of(lake, tmp_path, 2)
    (lake / "file-0003.parquet").unlink()
    live = ll.LakeDataset(lake, **SETTINGS)
    with pytest.raises(ll.LakeChangedError, match=r"file-0003\.parquet"):
        ll.RecoveryCoordinator("error").resume(ckpt, live)
    skip = ll.RecoveryCoordinator("skip").resume(ckpt, live)
    assert skip.dataset is not None and skip.state == ckpt.state
    assert {q.path for q in skip.dataset.lost} == {str(lake / "file-0003.parquet")}
    assert live.lost == () and skip.dataset.for_epoch(ckpt.state.epoch + 1) is live
    restart = ll.RecoveryCoordinator("restart_epoch").resume(ckpt, live)
    assert restart.state is None and restart.restart_epoch == ckpt.state.epoch


def test_a_state_of_another_lake_is_refused_with_both_values(
    dataset: ll.LakeDataset, tmp_path: Path
) -> None:
    lake = tmp_path / "lake"
    write_lake(lake, [[10, 20]])
    other = ll.LakeDataset(lake, seed=7, num_partitions=4, window=64, max_unit_rows=128)
    state = ll.DataLoader(dataset, batch_size=8).state_dict()
    with pytest.raises(ll.StateMismatchError) as err:
        ll.RecoveryCoordinator().resume_state(state, other)
    assert dataset.fingerprint in str(err.value) and other.fingerprint in str(err.value)


def test_a_checkpoint_is_checked_against_the_dataset_its_epoch_runs_on(tmp_path: Path) -> None:
    lake, later = tmp_path / "lake", tmp_path / "later"
    write_lake(lake, LAYOUT)
    write_lake(later, [[40]])
    pinned, live = ll.LakeDataset(lake, **SETTINGS), ll.LakeDataset(later, **SETTINGS)
    chained = pinned.followed_by(1, live)  # epoch 0 on the lake, 1 on: the other one
    saver = ll.DataLoader(live, batch_size=16)
    next(iter(saver))
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(1, saver)  # epoch 0 of ``live``
    saver.close()
    loader = ll.DataLoader(chained, batch_size=16)
    list(loader)  # epoch 0, on ``pinned``
    next(iter(loader))  # epoch 1: the loader is on ``live`` now
    assert loader.dataset is live
    with pytest.raises(ll.StateMismatchError, match=live.fingerprint):
        manager.load(loader)  # the saved epoch 0 runs on ``pinned`` here, not on ``live``
    loader.close()


def test_an_unknown_lake_change_policy_is_refused_where_it_is_applied() -> None:
    """Set on a coordinator after it was made, a misspelt policy does not restart an epoch."""
    from lakeloader.recovery.lake_changes import LakeDiff, enforce

    with pytest.raises(ValueError, match="on_lake_change must be one of"):
        enforce(LakeDiff(gone=("a.parquet",)), "restart", "ckpt", False)  # type: ignore[arg-type]

"""A lake that changes between a checkpoint and a resume.

- files added: reported, and they join at the next epoch boundary (the saved epoch finishes
  exactly once on its pinned snapshot);
- files removed or rewritten that the rest of the epoch needs: an error listing each with its
  old and new size and version, unless ``on_lake_change="skip"``, which skips their units for
  the rest of the epoch and counts the rows;
- a checkpoint taken at an epoch's end needs no old file at all.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from tests.conftest import LAYOUT, LAYOUT_ROWS, global_batches, layout_dataset, make_loaders

BATCH = 16
NEW_IDS = set(range(100_000, 100_300))


def _add_file(root: Path) -> None:
    ids = np.array(sorted(NEW_IDS), dtype=np.int64)
    table = pa.table(
        {
            "id": ids,
            "x": (ids * 0.5).astype(np.float32),
            "s": [f"row-{i}" for i in ids],
            "label": np.zeros(len(ids), np.int32),
        }
    )
    pq.write_table(table, root / "file-9000.parquet", row_group_size=100)


def _run_some(root: Path, ckpt_dir: Path, steps: int) -> list[int]:
    loader = ll.DataLoader(layout_dataset(root), batch_size=BATCH)
    seen = list(
        itertools.chain.from_iterable(b["id"].tolist() for b in itertools.islice(loader, steps))
    )
    ll.CheckpointManager(str(ckpt_dir)).save(steps, loader)
    loader.close()
    return seen


def test_added_files_join_at_the_next_epoch_boundary(
    own_lake: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen = _run_some(own_lake, tmp_path / "ckpt", 7)
    _add_file(own_lake)
    live = layout_dataset(own_lake)
    assert len(live) == LAYOUT_ROWS + len(NEW_IDS)
    loaders = make_loaders(live, 2, batch_size=BATCH // 2 * 3, num_workers=1)
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        for loader in loaders:
            ll.CheckpointManager(str(tmp_path / "ckpt")).load(loader)
    assert "1 file(s) were added" in caplog.text and "file-9000.parquet" in caplog.text
    rest = list(itertools.chain.from_iterable(global_batches(loaders)))
    epoch0 = seen + rest
    assert sorted(epoch0) == list(range(LAYOUT_ROWS)), "the saved epoch: old files, once each"
    assert {loader.state_dict()["fingerprint"] for loader in loaders} != {live.fingerprint}
    epoch1 = list(itertools.chain.from_iterable(global_batches(loaders)))
    assert sorted(epoch1) == sorted(set(range(LAYOUT_ROWS)) | NEW_IDS), "they joined"
    assert {loader.state_dict()["fingerprint"] for loader in loaders} == {live.fingerprint}
    assert {loader.epoch for loader in loaders} == {1}
    for loader in loaders:
        loader.close()


def test_a_state_of_the_next_epoch_before_its_pass_names_the_lake_of_now(
    own_lake: Path, tmp_path: Path
) -> None:
    """After a checkpoint's epoch on its pinned snapshot, ``set_epoch(e + 1)`` then
    ``state_dict()`` (no pass begun yet) is a state of the lake of now: a loader made on it
    takes the state and runs epoch 1 with the added file."""
    _run_some(own_lake, tmp_path / "ckpt", 3)
    _add_file(own_lake)
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    ll.CheckpointManager(str(tmp_path / "ckpt")).load(loader)
    loader.set_epoch(1)
    state = loader.state_dict()
    loader.close()
    live = layout_dataset(own_lake)
    assert (state["epoch"], state["fingerprint"]) == (1, live.fingerprint)
    with ll.DataLoader(live, batch_size=BATCH) as fresh:
        fresh.load_state_dict(state)
        epoch1 = [i for b in fresh for i in b["id"].tolist()]
    assert sorted(epoch1) == sorted(set(range(LAYOUT_ROWS)) | NEW_IDS)


def _remove_and_rewrite(root: Path) -> tuple[Path, Path]:
    removed = root / "file-0003.parquet"
    removed.unlink()
    rewritten = root / "file-0000.parquet"
    pq.write_table(pq.read_table(rewritten).slice(0, 100), rewritten)
    return removed, rewritten


def test_removed_or_rewritten_files_are_listed_with_old_and_new_size(
    own_lake: Path, tmp_path: Path
) -> None:
    _run_some(own_lake, tmp_path / "ckpt", 3)
    old_size = (own_lake / "file-0000.parquet").stat().st_size
    removed, rewritten = _remove_and_rewrite(own_lake)
    ckpt = ll.CheckpointManager(str(tmp_path / "ckpt"))
    for attempt in (
        lambda: ckpt.dataset(),
        lambda: ckpt.load(ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)),
    ):
        with pytest.raises(ll.LakeChangedError) as err:
            attempt()
        message = str(err.value)
        assert f"gone: {removed}" in message
        assert f"changed: {rewritten} (size {old_size}, mtime:" in message
        assert f"-> size {rewritten.stat().st_size}, mtime:" in message
        assert "on_lake_change='skip'" in message


@pytest.mark.parametrize("how", ["manifest", "live"])
def test_skip_finishes_the_epoch_without_the_lost_files(
    own_lake: Path, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen = _run_some(own_lake, tmp_path / "ckpt", 5)
    _remove_and_rewrite(own_lake)
    lost_ids = set(range(sum(LAYOUT[0]))) | set(
        range(sum(map(sum, LAYOUT[:3])), sum(map(sum, LAYOUT[:4])))
    )
    ckpt = ll.CheckpointManager(str(tmp_path / "ckpt"))
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        ds = ckpt.dataset(on_lake_change="skip") if how == "manifest" else layout_dataset(own_lake)
        loaders = make_loaders(ds, 3, batch_size=8)
        for loader in loaders:
            ckpt.load(loader, on_lake_change="skip")
    assert "skips the units of these files" in caplog.text
    rest = list(itertools.chain.from_iterable(global_batches(loaders)))
    assert len(rest) == len(set(rest)) and not set(rest) & set(seen)
    assert set(seen) | set(rest) == set(range(LAYOUT_ROWS)) - (lost_ids - set(seen))
    skipped = sum(loader.stats()["rows_skipped"] for loader in loaders)
    assert skipped == len(lost_ids - set(seen)), "the rows it cost are counted"
    reasons = {e.reason.split(" (")[0] for loader in loaders for e in loader.quarantine}
    assert reasons == {"file gone since the checkpoint", "file rewritten since the checkpoint"}
    # the next epoch runs on the lake as it is now: the rewritten file's 100 rows are back
    epoch1 = list(itertools.chain.from_iterable(global_batches(loaders)))
    assert len(epoch1) == LAYOUT_ROWS - sum(LAYOUT[0]) - sum(LAYOUT[3]) + 100
    for loader in loaders:
        loader.close()


def test_a_checkpoint_at_an_epoch_end_needs_no_old_file(own_lake: Path, tmp_path: Path) -> None:
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    list(loader)  # the whole epoch
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(1, loader)
    _remove_and_rewrite(own_lake)
    live = layout_dataset(own_lake)
    fresh = ll.DataLoader(live, batch_size=BATCH)
    ll.CheckpointManager(str(tmp_path / "ckpt")).load(fresh)  # default policy: no error
    rows = [i for b in fresh for i in b["id"].tolist()]
    assert fresh.epoch == 1 and len(rows) == len(live) == len(set(rows))

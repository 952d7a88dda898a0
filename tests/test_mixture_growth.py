"""A mixture whose source lake grew between a checkpoint and its resume.

As for one lake (``RecoveryCoordinator.resume``): the source finishes its saved epoch on the
snapshot the checkpoint pinned, every old row once, and its later epochs take the files added,
each row once an epoch; the other sources go on untouched. A checkpoint or a state taken after
that resume continues exactly, whether it was taken while the saved epoch finished on the
pinned snapshot or after the lake of now took over, under other world sizes and batches.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.nodes.streams import SourceStream
from tests.conftest import global_batches, make_loaders

WEB, CODE = list(range(200)), list(range(1_000_000, 1_000_150))
ADDED = list(range(100_000, 100_060))
#: Rows of a pass over the mixture (two passes reach web's epoch 2).
PASS = 600


def _write(root: Path, name: str, ids: list[int]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids}), root / f"{name}.parquet", row_group_size=7)


def _mixture(root: Path) -> ll.Mixture:
    sources = {
        n: ll.LakeDataset(root / n, seed=4, num_partitions=2, window=8) for n in ("web", "code")
    }
    return ll.Mixture(sources, {"web": 0.5, "code": 0.5}, seed=3, epoch_rows=PASS)


def _run(loaders: Sequence[ll.DataLoader], steps: int | None = None) -> list[int]:
    """Row ids of ``steps`` global batches (None: the passes' rest, then one more pass)."""
    if steps is not None:
        return [i for b in itertools.islice(global_batches(loaders), steps) for i in b]
    return [i for _ in range(2) for b in global_batches(loaders) for i in b]


def _loaded(root: Path, ckpt: Path, world: int, batch: int, **kw: Any) -> list[ll.DataLoader]:
    loaders = make_loaders(_mixture(root), world, batch_size=batch, **kw)
    for loader in loaders:
        ll.CheckpointManager(str(ckpt)).load(loader)
    return loaders


def _close(loaders: Sequence[ll.DataLoader]) -> None:
    for loader in loaders:
        loader.close()


@pytest.fixture
def grown(tmp_path: Path) -> tuple[Path, Path, list[int]]:
    """Two lakes, 17 steps of 8 rows and a checkpoint, then a file added to ``web``."""
    root = tmp_path / "lakes"
    _write(root / "web", "part-0", WEB)
    _write(root / "code", "part-0", CODE)
    loaders = make_loaders(_mixture(root), 1, batch_size=8)
    seen = _run(loaders, 17)
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(17, loaders[0])
    _close(loaders)
    _write(root / "web", "part-1", ADDED)
    return root, tmp_path / "ckpt", seen


def _epochs(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """The stream ``ids`` cut into epochs of these sizes (the last may be short)."""
    out, at = [], 0
    for size in sizes:
        out.append(ids[at : at + size])
        at += size
    return out


def test_the_saved_epoch_finishes_on_the_pinned_files_and_later_ones_take_the_new(
    grown: tuple[Path, Path, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    root, ckpt, seen = grown
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        loaders = _loaded(root, ckpt, 2, 6)
    assert "1 file(s) were added" in caplog.text and "part-1.parquet" in caplog.text
    ids, decoded = list(seen), []
    for _ in range(2):  # a pass, then the next: web's reader changes snapshot in between
        ids += [i for b in global_batches(loaders) for i in b]
        decoded.append(loaders[0].stats()["units_decoded"])
    assert 0 < decoded[0] < decoded[1], "the reads of a source's earlier snapshot still count"
    _close(loaders)
    web = [i for i in ids if i < 1_000_000]
    code = [i for i in ids if i >= 1_000_000]
    assert 0 < len([i for i in seen if i < 1_000_000]) < len(WEB), "saved in web's epoch 0"
    epoch0, epoch1, epoch2 = _epochs(web, [len(WEB), len(WEB) + len(ADDED), len(web)])
    assert sorted(epoch0) == WEB, "the saved epoch: the pinned files' rows, once each"
    assert sorted(epoch1) == sorted(WEB + ADDED), "the next epoch takes the added file"
    assert epoch2 and len(set(epoch2)) == len(epoch2) and set(epoch2) <= set(WEB + ADDED)
    for epoch in _epochs(code, [len(CODE)] * (len(code) // len(CODE))):
        assert sorted(epoch) == CODE, "the source that did not grow goes on untouched"


@pytest.mark.parametrize("steps", [5, 30], ids=["on-pinned-files", "on-the-lake-of-now"])
def test_a_checkpoint_after_the_resume_continues_exactly(
    grown: tuple[Path, Path, list[int]], tmp_path: Path, steps: int
) -> None:
    """Saved while web's epoch 0 finishes on the pinned snapshot (5 steps of 12), or once its
    epoch 1 runs on the lake of now (30 steps): resumed on 3 ranks of 4, the same rows."""
    root, ckpt, _ = grown
    loaders = _loaded(root, ckpt, 2, 6)
    whole = _run(loaders)
    _close(loaders)
    loaders = _loaded(root, ckpt, 2, 6)
    head = _run(loaders, steps)
    state = loaders[0].state_dict()
    ll.CheckpointManager(str(tmp_path / "again")).save(steps, loaders[0])
    rest_of_pass = [i for b in global_batches(loaders) for i in b]
    _close(loaders)
    web = state["sources"]["web"]
    assert (web["epoch"], web["fingerprint"] == _mixture(root).sources["web"].fingerprint) == (
        (0, False) if steps == 5 else (1, True)
    )
    again = _loaded(root, tmp_path / "again", 3, 4)
    assert head + _run(again) == whole
    _close(again)
    if steps == 30:  # a state of the lake of now: load_state_dict alone resumes it
        with ll.DataLoader(_mixture(root), batch_size=12) as fresh:
            fresh.load_state_dict(state)
            assert (
                head + [i for b in fresh for i in b["id"].tolist()]
                == whole[: len(head) + len(rest_of_pass)]
            )


def test_a_rollback_to_its_own_state_and_workers_on_either_side_of_the_saved_epochs_end(
    grown: tuple[Path, Path, list[int]],
) -> None:
    """The loader's own state reloads (a FaultTolerantLoader's rollback) while the grown source
    finishes its saved epoch on the pinned snapshot (3 steps in) and after it (30 steps in),
    with 2 worker processes: the same rows as without the rollback."""
    root, ckpt, _ = grown
    [whole_loader] = _loaded(root, ckpt, 1, 12, num_workers=2)
    whole = _run([whole_loader], 38)
    for back in (3, 30):
        [loader] = _loaded(root, ckpt, 1, 12, num_workers=2)
        head = _run([loader], back)
        state = loader.state_dict()
        _run([loader], 5)
        loader.load_state_dict(state)
        assert head + _run([loader], 38 - back) == whole
        loader.close()
    whole_loader.close()


def test_the_units_behind_a_step_of_the_saved_epoch_are_the_pinned_files(
    grown: tuple[Path, Path, list[int]],
) -> None:
    """``quarantine_step`` of the first step after the resume (in web's saved epoch) names the
    same units whether asked at once or once web's later epoch runs on the lake of now."""
    root, ckpt, _ = grown

    def behind(steps: int) -> list[tuple[str, int]]:
        [loader] = _loaded(root, ckpt, 1, 12)
        _run([loader], steps)
        entries = loader.quarantine_step(17)
        loader.close()
        return sorted((Path(e.path).name, e.row_group) for e in entries if "/web/" in e.path)

    at_once = behind(1)
    assert at_once and {name for name, _ in at_once} == {"part-0.parquet"}
    assert behind(30) == at_once


def test_a_record_at_an_epoch_boundary_is_of_the_next_epoch_however_far_it_looked_ahead(
    tmp_path: Path,
) -> None:
    """A stream over a lake that grew records the epoch that holds its count, known or not."""
    _write(tmp_path / "web", "part-0", WEB)
    pinned = ll.LakeDataset(tmp_path / "web", seed=4)
    _write(tmp_path / "web", "part-1", ADDED)
    live = ll.LakeDataset(tmp_path / "web", seed=4)
    chained = pinned.followed_by(1, live)
    looked_ahead = SourceStream(chained)
    looked_ahead.cover(len(WEB) + 5)
    for stream in (SourceStream(chained), looked_ahead):
        record = stream.record(len(WEB))
        assert (record.fingerprint, record.start, record.epoch) == (live.fingerprint, 200, 1)
        assert record.where(len(WEB) + 7) == (1, 7)
        assert stream.dataset(0) is chained and stream.dataset(3) is live

"""CheckpointManager: round-trips, atomic visibility, corrupt checkpoints, ranks, changed lakes."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
import lakeloader.lake.snapshot
from lakeloader.checkpoint.layout import COMMIT_FILE, STATE_FILE, step_dir_name
from tests.conftest import TORCHRUN_ENV, layout_dataset, torchrun_command

BATCH = 48


def _ids(loader: ll.DataLoader, steps: int | None = None) -> list[list[int]]:
    return [b["id"].tolist() for b in itertools.islice(iter(loader), steps)]


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_into_another_topology(
    dataset: ll.LakeDataset, tmp_path: Path, async_save: bool
) -> None:
    full = _ids(ll.DataLoader(dataset, batch_size=BATCH))
    loader = ll.DataLoader(dataset, batch_size=BATCH, num_workers=2)
    it = iter(loader)
    ckpt = ll.CheckpointManager(str(tmp_path / "ckpt"), async_save=async_save)
    for step in range(1, 8):
        next(it)
        ckpt.save(step, loader, extra={"step": step, "blob": b"\x00" * 10})
    ckpt.wait()
    loader.close()
    assert ckpt.steps() == [5, 6, 7] and ckpt.latest() == 7, "keep=3 prunes the oldest"
    fresh = ll.DataLoader(dataset, batch_size=BATCH // 2, rank=1, world_size=2)
    twin = ll.DataLoader(dataset, batch_size=BATCH // 2, rank=0, world_size=2)
    extra = ckpt.load(fresh)
    assert extra == {"step": 7, "blob": b"\x00" * 10}
    ckpt.load(twin)
    rest = [a["id"].tolist() + b["id"].tolist() for a, b in zip(twin, fresh, strict=True)]
    assert rest == full[7:]
    ckpt.close()


def test_a_given_step_and_the_checkpoint_record(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    it = iter(loader)
    ckpt = ll.CheckpointManager(str(tmp_path), keep=5)
    for step in (1, 2):
        next(it)
        ckpt.save(step, loader)
    record = ckpt.read(1)
    assert record.state.position == BATCH
    assert record.context.topology.batch_size == BATCH
    assert record.context.library_version == ll.__version__
    assert record.snapshot.fingerprint == dataset.fingerprint
    fresh = ll.DataLoader(dataset, batch_size=BATCH)
    ckpt.load(fresh, step=1)
    assert fresh.state_dict()["position"] == BATCH


def test_manifest_is_written_once_per_fingerprint(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    ckpt = ll.CheckpointManager(str(tmp_path))
    for step in range(3):
        ckpt.save(step, loader)
    manifests = list((tmp_path / "manifests").iterdir())
    assert [m.name for m in manifests] == [f"{dataset.fingerprint}.msgpack"]
    mtime = manifests[0].stat().st_mtime_ns
    ckpt.save(9, loader)
    assert manifests[0].stat().st_mtime_ns == mtime


def test_extra_that_msgpack_cannot_hold(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    ckpt = ll.CheckpointManager(str(tmp_path))
    with pytest.raises(ll.CheckpointError, match="not msgpack-serialisable"):
        ckpt.save(1, ll.DataLoader(dataset, batch_size=4), extra={"x": object()})
    assert ckpt.steps() == []


def test_a_save_killed_midway_leaves_the_previous_checkpoint(
    own_lake: Path, tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    script = textwrap.dedent(
        f"""
        import os, signal
        import lakeloader as ll
        from lakeloader.checkpoint.manager import CheckpointManager
        from lakeloader.checkpoint.layout import STATE_FILE
        ds = ll.LakeDataset({str(own_lake)!r}, seed=7, num_partitions=4, window=64,
                            max_unit_rows=128)
        loader = ll.DataLoader(ds, batch_size={BATCH})
        it = iter(loader)
        ckpt = CheckpointManager({str(ckpt_dir)!r})
        next(it)
        ckpt.save(1, loader)
        next(it)
        put = ckpt.store.put
        def dying_put(path, data):
            put(path, data)
            if path.endswith(STATE_FILE) and "step-000000000002" in path:
                os.kill(os.getpid(), signal.SIGKILL)  # after the state, before the marker
        ckpt.store.put = dying_put
        ckpt.save(2, loader)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert (ckpt_dir / step_dir_name(2) / STATE_FILE).exists()
    assert not (ckpt_dir / step_dir_name(2) / COMMIT_FILE).exists()
    ckpt = ll.CheckpointManager(str(ckpt_dir))
    assert ckpt.steps() == [1]
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    ckpt.load(loader)
    assert loader.state_dict()["position"] == BATCH
    ckpt.save(3, loader)  # a later save clears the half-written folder
    assert not (ckpt_dir / step_dir_name(2)).exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / STATE_FILE).write_bytes((d / STATE_FILE).read_bytes()[:20]),
        lambda d: (d / STATE_FILE).write_bytes(b"garbage" * 30),
        lambda d: (d / COMMIT_FILE).write_bytes(b"\xff\x00not msgpack"),
        lambda d: (d / STATE_FILE).unlink(),
    ],
    ids=["truncated", "garbage", "bad-commit", "missing-state"],
)
def test_corrupt_newest_falls_back_to_the_previous(
    dataset: ll.LakeDataset, tmp_path: Path, damage: Any, caplog: pytest.LogCaptureFixture
) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    it = iter(loader)
    ckpt = ll.CheckpointManager(str(tmp_path))
    for step in (1, 2):
        next(it)
        ckpt.save(step, loader, extra=step)
    damage(tmp_path / step_dir_name(2))
    fresh = ll.DataLoader(dataset, batch_size=BATCH)
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        assert ckpt.load(fresh) == 1
    assert fresh.state_dict()["position"] == BATCH
    assert any(
        step_dir_name(2) in r.message and "falling back" in r.message for r in caplog.records
    )
    with pytest.raises(ll.CheckpointError, match=step_dir_name(2)):
        ckpt.load(fresh, step=2)


def test_no_usable_checkpoint_is_a_clear_error(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    ckpt = ll.CheckpointManager(str(tmp_path))
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    with pytest.raises(ll.CheckpointError, match="no committed checkpoint"):
        ckpt.load(loader)
    ckpt.save(1, loader)
    manifest = next((tmp_path / "manifests").iterdir())
    manifest.write_bytes(manifest.read_bytes()[:-40])
    with pytest.raises(ll.CheckpointError, match=r"no usable checkpoint(?s:.*)manifest"):
        ckpt.load(loader)


def test_every_damaged_checkpoint_is_reported_once(
    dataset: ll.LakeDataset, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    ckpt = ll.CheckpointManager(str(tmp_path))
    for step in (1, 2):
        ckpt.save(step, loader)
        (tmp_path / step_dir_name(step) / STATE_FILE).write_bytes(b"garbage")
    with (
        caplog.at_level(logging.WARNING, logger="lakeloader"),
        pytest.raises(ll.CheckpointError) as err,
    ):
        ckpt.load(loader)
    assert not caplog.records, "the error says it all: no warning besides it"
    for step in (1, 2):
        assert str(err.value).count(step_dir_name(step)) == 1


def test_file_removed_or_rewritten_since_the_checkpoint(own_lake: Path, tmp_path: Path) -> None:
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    it = iter(loader)
    next(it)
    ckpt = ll.CheckpointManager(str(tmp_path / "ckpt"))
    ckpt.save(1, loader)
    loader.close()
    removed = own_lake / "file-0003.parquet"
    removed.unlink()
    rewritten = own_lake / "file-0000.parquet"
    pq.write_table(pq.read_table(rewritten).slice(0, 100), rewritten)  # same schema, fewer rows
    with pytest.raises(ll.LakeChangedError) as err:
        ckpt.dataset()  # the pinned snapshot, checked file by file
    assert f"gone: {removed}" in str(err.value) and f"changed: {rewritten}" in str(err.value)
    live = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    with pytest.raises(ll.LakeChangedError, match=r"file-0003\.parquet"):
        ckpt.load(live)
    # The documented policy: run the saved epoch again on the lake as it is now.
    ckpt.load(live, on_lake_change="restart_epoch")
    assert (live.state_dict()["epoch"], live.state_dict()["position"]) == (0, 0)
    assert sum(b["id"].numel() for b in live) == len(live.dataset)


def test_recovery_never_lists_the_lake_or_reads_footers(
    own_lake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    it = iter(loader)
    full = [next(it)["id"].tolist() for _ in range(3)]
    ckpt = ll.CheckpointManager(str(tmp_path / "ckpt"))
    ckpt.save(1, loader)
    rest = [b["id"].tolist() for b in it]

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("recovery listed the lake or read a footer")

    monkeypatch.setattr(lakeloader.lake.snapshot, "discover_listed", forbidden)
    monkeypatch.setattr(lakeloader.lake.snapshot, "read_file_info", forbidden)
    ds = ckpt.dataset()
    assert ds.fingerprint == loader.dataset.fingerprint
    fresh = ll.DataLoader(ds, batch_size=BATCH)
    ckpt.load(fresh)
    assert [b["id"].tolist() for b in fresh] == rest
    assert len(full) == 3


RANK_SCRIPT = """
import os, sys
import torch.distributed as dist
import lakeloader as ll
dist.init_process_group("gloo")
ds = ll.LakeDataset(sys.argv[1], seed=7, num_partitions=4, window=64, max_unit_rows=128)
loader = ll.DataLoader(ds, batch_size=8)
it = iter(loader)
for _ in range(2 + (dist.get_rank() == 1)):  # rank 1 is one step ahead
    next(it)
ckpt = ll.CheckpointManager(sys.argv[2])
try:
    ckpt.save(5, loader)
except ll.CheckpointError as exc:
    with open(f"{sys.argv[2]}-refused-{dist.get_rank()}.txt", "w") as out:
        out.write(str(exc))
dist.destroy_process_group()
"""


def test_ranks_that_disagree_are_named(lake: Path, tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, **TORCHRUN_ENV}
    proc = subprocess.run(
        torchrun_command(3, script, str(lake), str(tmp_path / "ckpt")),
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = [(tmp_path / f"ckpt-refused-{r}.txt").read_text() for r in range(3)]
    for message in refused:  # every rank refuses, and says who stands where
        assert "ranks [0, 2] at epoch 0, position 48" in message
        assert "ranks [1] at epoch 0, position 72" in message
    assert not (tmp_path / "ckpt" / step_dir_name(5)).exists()


def test_a_failed_background_save_surfaces(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be")
    ckpt = ll.CheckpointManager(str(blocker), async_save=True)
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    ckpt.save(1, loader)  # returns at once; the write fails in the background
    with pytest.raises(ll.CheckpointError, match="background checkpoint save failed"):
        ckpt.save(2, loader)
    ckpt.save(3, loader)
    with pytest.raises(ll.CheckpointError, match="background checkpoint save failed"):
        ckpt.wait()
    sync = ll.CheckpointManager(str(blocker))
    with pytest.raises(ll.CheckpointError, match="saving step 4"):
        sync.save(4, loader)
    ckpt.close()
    with pytest.raises(ll.CheckpointError, match="is closed"):
        ckpt.save(5, loader)


def test_a_torn_manifest_is_rewritten_and_detected(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    loader = ll.DataLoader(dataset, batch_size=BATCH)
    ll.CheckpointManager(str(tmp_path)).save(1, loader)
    manifest = next((tmp_path / "manifests").iterdir())
    whole = manifest.read_bytes()
    manifest.write_bytes(whole[:100])
    with pytest.raises(ll.CheckpointError, match="torn or overwritten"):
        ll.CheckpointManager(str(tmp_path)).load_checkpoint(1)
    ll.CheckpointManager(str(tmp_path)).save(2, loader)  # a new manager checks and rewrites it
    assert manifest.read_bytes() == whole
    assert ll.CheckpointManager(str(tmp_path)).steps() == [1, 2]


def test_a_mixture_is_saved_as_a_lake_is_and_its_steps_recorded(
    lake: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One record for every loader (a manifest per leaf, COMMIT naming none but a lake's); a
    mixture's steps are in the ledger, source by source, and the audit proves them; a packed
    stream's steps are recorded too (each source's samples), with no warning."""
    from lakeloader.checkpoint.layout import CommitRecord
    from lakeloader.cli.audit import run_audit

    sources = {"a": ll.LakeDataset(lake, seed=1), "b": ll.LakeDataset(lake, seed=2)}
    mixed = ll.DataLoader(ll.Mixture(sources, {"a": 1, "b": 1}, seed=3), batch_size=8)
    it = iter(mixed)
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    with caplog.at_level(logging.WARNING, logger="lakeloader.checkpoint.manager"):
        for step in (1, 2):
            next(it)
            manager.save(step, mixed, extra=step)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "no warning"
    assert manager.attach(mixed) and (tmp_path / "ckpt" / "ledger").exists()
    ckpt = manager.read(2)
    assert sorted(ckpt.manifests) == ["a", "b"] and ckpt.sources == {"a": str(lake), "b": str(lake)}
    assert ckpt.lake is None and ckpt.context.topology == mixed.topology
    with pytest.raises(ll.CheckpointError, match=r"pins no single lake: it holds a 'mixture'"):
        ckpt.snapshot  # noqa: B018
    commit = CommitRecord.from_bytes((Path(ckpt.path) / COMMIT_FILE).read_bytes())
    assert (commit.manifest, commit.manifest_sha256) == ("", "")
    report = run_audit(str(tmp_path / "ckpt"), {})[0]
    assert report.verdict == "exactly once" and {e.stream for e in report.epochs} == {"a", "b"}
    pq.write_table(pa.table({"t": [[1, 2]] * 40}), tmp_path / "tokens.parquet")
    packing = ll.Packing("t", 4, eos_id=0)
    packed = ll.DataLoader(
        ll.LakeDataset(tmp_path / "tokens.parquet", packing=packing), batch_size=16
    )
    with caplog.at_level(logging.WARNING, logger="lakeloader.checkpoint.manager"):
        assert manager.attach(packed) and manager.attach(packed)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "no warning"
    manager.close()

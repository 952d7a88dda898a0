"""``lakeloader inspect``, checked against what the loader itself delivers before and after.

Row ids of the conftest lake are 0..N-1 in path order, so where a row lives (file, row group,
offset) is computed here from ``LAYOUT`` alone, independently of the library's plan.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import lakeloader as ll
from lakeloader.cli.inspect import requested
from lakeloader.cli.main import main
from tests.conftest import LAYOUT, LAYOUT_ROWS, make_loaders
from tests.oracles import first_need_units

pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")

_RG_BASE = {
    (f, g): int(sum(map(sum, LAYOUT[:f])) + sum(rgs[:g]))
    for f, rgs in enumerate(LAYOUT)
    for g in range(len(rgs))
}


def where(row_id: int) -> tuple[int, int, int]:
    """(file index, row group, row offset) of a row id, from the layout alone."""
    for (f, g), base in _RG_BASE.items():
        if base <= row_id < base + LAYOUT[f][g]:
            return f, g, row_id - base
    raise AssertionError(f"no row {row_id}")


def file_index(path: str) -> int:
    return int(Path(path).stem.split("-")[1])


def located(entry: dict[str, Any]) -> tuple[int, int, int] | None:
    if entry["file"] is None:
        return None
    assert file_index(entry["file"]) == entry["file_index"]
    return entry["file_index"], entry["row_group"], entry["row_offset"]


def range_ids(info: dict[str, Any], category: str) -> list[int]:
    ids: list[int] = []
    for rg in info["ranges"]:
        base = _RG_BASE[file_index(rg["file"]), rg["row_group"]]
        for start, end in rg[category]:
            assert 0 <= start < end <= rg["rows"]
            ids.extend(range(base + start, base + end))
    return ids


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["inspect", *args, "--json"]) == 0
    info: dict[str, Any] = json.loads(capsys.readouterr().out)
    return info


class Run:
    """Simulated ranks iterated in lockstep, recording every row id delivered per step."""

    def __init__(self, ds: ll.LakeDataset, world_size: int, **kwargs: Any) -> None:
        self.loaders = make_loaders(ds, world_size, **kwargs)
        self.iters = [iter(loader) for loader in self.loaders]
        self.delivered: list[int] = []

    def step(self) -> list[list[int]] | None:
        """One global step: each rank's ids, or None at the end of the epoch."""
        try:
            shares = [next(it)["id"].tolist() for it in self.iters]
        except StopIteration:
            return None
        self.delivered += itertools.chain.from_iterable(shares)
        return shares

    def rest(self) -> list[list[list[int]]]:
        return list(iter(self.step, None))

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()


def check(info: dict[str, Any], run: Run) -> None:
    """Check inspect's report against the loader's accounting and what it delivers next.

    Runs the loaders to the end of the epoch.
    """
    state, before = run.loaders[0].state_dict(), list(run.delivered)
    upcoming = run.rest()
    assert info["position"] == info["rows_consumed"] == state["position"] == len(before)
    assert info["epoch"] == state["epoch"] and info["rows_dropped"] == state["rows_dropped"]
    assert info["num_rows"] == LAYOUT_ROWS
    assert info["rows_consumed"] + info["rows_remaining"] + info["rows_dropped"] == LAYOUT_ROWS
    consumed = range_ids(info, "consumed")
    assert sorted(consumed) == sorted(before)
    after = [i for shares in upcoming for share in shares for i in share]
    assert sorted(range_ids(info, "remaining")) == sorted(after)
    everything = sorted(consumed + range_ids(info, "remaining") + range_ids(info, "dropped"))
    assert everything == list(range(LAYOUT_ROWS))
    assert len(range_ids(info, "dropped")) == info["rows_dropped"] + info["rows_to_drop"]
    assert info["steps_remaining"] == len(upcoming)
    assert info["finished"] == (not upcoming)
    world_size = info["topology"]["world_size"]
    assert [r["rank"] for r in info["ranks"]] == list(range(world_size))
    expected = [[where(s[0]) if s else None for s in shares] for shares in upcoming]
    first = expected[0] if expected else [None] * world_size
    assert [located(r) for r in info["ranks"]] == first
    first_rows = [len(s) for s in upcoming[0]] if upcoming else [0] * world_size
    assert [r["rows"] for r in info["ranks"]] == first_rows
    workers = info["topology"]["num_workers"]
    assert len(info["workers"]) == world_size * workers
    if info["workers_build"]:  # worker k builds the k-th next step
        for w in info["workers"]:
            k, r = w["worker"], w["rank"]
            assert w["role"] == "build" and w["step_offset"] == k
            assert located(w) == (expected[k][r] if k < len(expected) else None)
            assert w["rows"] == (len(upcoming[k][r]) if k < len(upcoming) else 0)
        return
    # worker k decodes the k-th unit its rank needs, in the order of first need
    loader = run.loaders[0]
    plan = loader.dataset.plan(info["epoch"])
    global_batch = info["topology"]["global_batch"]
    for w in info["workers"]:
        k, r = w["worker"], w["rank"]
        units = first_need_units(plan, info["position"], global_batch, world_size, r, len(upcoming))
        assert w["role"] == "decode"
        if k >= len(units):
            assert located(w) is None
            continue
        f, g, start, rows = units[k]
        assert located(w) == (f, g, start) and w["rows"] == rows
        needed = {i for shares in upcoming for i in shares[r]}
        assert any(_RG_BASE[f, g] + start + i in needed for i in range(rows)), "a unit it needs"


@pytest.mark.parametrize(
    ("world_size", "batch_size", "num_workers", "drop_last", "steps"),
    [(1, 32, 0, False, 7), (2, 16, 0, True, 5), (3, 10, 0, False, 6), (2, 12, 2, False, 4)],
    ids=["one-rank", "drop-last", "c-does-not-divide", "two-workers"],
)
def test_mid_epoch_matches_the_loader(
    dataset: ll.LakeDataset,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    world_size: int,
    batch_size: int,
    num_workers: int,
    drop_last: bool,
    steps: int,
) -> None:
    kwargs = {"batch_size": batch_size, "num_workers": num_workers, "drop_last": drop_last}
    run = Run(dataset, world_size, **kwargs)
    try:
        for _ in range(steps):
            assert run.step() is not None
        ckpt = ll.CheckpointManager(str(tmp_path))
        ckpt.save(steps, run.loaders[0], extra={"lr": 0.5, "commit": "abc"})
        info = inspect(capsys, str(tmp_path), "--ranges")
        assert (
            info["topology_saved"]
            == info["topology"]
            == {
                "world_size": world_size,
                "num_workers": num_workers,
                "batch_size": batch_size,
                "drop_last": drop_last,
                "global_batch": world_size * batch_size,
            }
        )
        assert info["step"] == steps and info["steps_available"] == [steps]
        assert info["extra"] == {"type": "dict", "keys": ["commit", "lr"]}
        assert info["quarantine"] == [] and info["fingerprint"] == dataset.fingerprint
        assert info["config"] == dataset.config.to_dict()
        assert info["config_hash"] == dataset.config_hash
        assert info["state_bytes"] == (Path(info["path"]) / "state.msgpack").stat().st_size
        assert info["created"] and info["library_version"] == ll.__version__
        check(info, run)
        assert info["rows_to_drop"] == (LAYOUT_ROWS % (world_size * batch_size) if drop_last else 0)
    finally:
        run.close()


def test_before_the_first_step(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(dataset, 2, batch_size=20)
    try:
        ll.CheckpointManager(str(tmp_path)).save(0, run.loaders[0])
        info = inspect(capsys, str(tmp_path), "--ranges")
        assert info["position"] == 0 and info["step_in_epoch"] == 0
        assert all(not rg["consumed"] for rg in info["ranges"])
        assert info["extra"] == {"type": "NoneType", "keys": None}
        check(info, run)
    finally:
        run.close()


@pytest.mark.parametrize("drop_last", [False, True])
def test_at_the_end_of_an_epoch(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str], drop_last: bool
) -> None:
    run = Run(dataset, 2, batch_size=16, drop_last=drop_last)
    try:
        run.rest()
        ll.CheckpointManager(str(tmp_path)).save(99, run.loaders[0], extra=[1, 2])
        info = inspect(capsys, str(tmp_path), "--ranges")
        assert info["finished"] and info["rows_remaining"] == 0 and info["steps_remaining"] == 0
        assert info["rows_dropped"] == (LAYOUT_ROWS % 32 if drop_last else 0)
        assert info["extra"] == {"type": "list", "keys": None}
        check(info, run)
        assert main(["inspect", str(tmp_path)]) == 0
        assert "epoch 0 has no step left" in capsys.readouterr().out
    finally:
        run.close()


def test_root_step_folder_and_step(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(dataset, 1, batch_size=50)
    ckpt = ll.CheckpointManager(str(tmp_path), keep=5)
    positions = {}
    try:
        for step in (1, 2, 3):
            run.step()
            ckpt.save(step, run.loaders[0])
            positions[step] = run.loaders[0].state_dict()["position"]
    finally:
        run.close()
    newest = inspect(capsys, str(tmp_path))
    assert newest["step"] == 3 and newest["position"] == positions[3] == 150
    assert newest["steps_available"] == [1, 2, 3]
    by_step = inspect(capsys, str(tmp_path), "--step", "2")
    folder = tmp_path / "step-000000000002"
    by_folder = inspect(capsys, str(folder) + "/")
    assert by_step == by_folder and by_step["position"] == positions[2]
    assert by_step["path"].rstrip("/") == str(folder)
    assert main(["inspect", str(folder), "--step", "3"]) == 2
    assert "is the checkpoint of step 2, not 3" in capsys.readouterr().err


def test_topology_override_matches_a_resumed_loader(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(dataset, 2, batch_size=16, drop_last=True)
    try:
        for _ in range(9):
            run.step()
        ll.CheckpointManager(str(tmp_path)).save(9, run.loaders[0])
    finally:
        run.close()
    args = ["--world-size", "3", "--num-workers", "2", "--batch-size", "8", "--no-drop-last"]
    info = inspect(capsys, str(tmp_path), "--ranges", *args)
    assert info["topology_saved"]["world_size"] == 2
    assert info["topology"] == {
        "world_size": 3,
        "num_workers": 2,
        "batch_size": 8,
        "drop_last": False,
        "global_batch": 24,
    }
    resumed = Run.__new__(Run)
    resumed.loaders = make_loaders(dataset, 3, batch_size=8)
    for loader in resumed.loaders:
        ll.CheckpointManager(str(tmp_path)).load(loader)
    resumed.iters = [iter(loader) for loader in resumed.loaders]
    resumed.delivered = list(run.delivered)
    try:
        check(info, resumed)
        assert info["rows_to_drop"] == 0
    finally:
        resumed.close()


def test_table_output(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(dataset, 2, batch_size=16, num_workers=0)
    try:
        for _ in range(3):
            run.step()
        ll.CheckpointManager(str(tmp_path)).save(3, run.loaders[0], extra={"seed": 1})
        upcoming = run.step()
    finally:
        run.close()
    assert upcoming is not None
    assert main(["inspect", str(tmp_path), "--ranges", "--num-workers", "2"]) == 0
    out = capsys.readouterr().out
    assert f"position (G)     96 of {LAYOUT_ROWS:,} rows" in out
    assert f"rows remaining   {LAYOUT_ROWS - 96:,}" in out
    assert "extras           keys: seed" in out
    assert "quarantine       none" in out
    assert "2 ranks x 16 rows = 32 per step, 2 workers, drop_last=false (override)" in out
    for rank, share in enumerate(upcoming):
        f, g, offset = where(share[0])
        line = next(ln for ln in out.splitlines() if ln.split()[:2] == [str(rank), "16"])
        assert f"file-{f:04d}.parquet" in line and line.split()[-3:-1] == [str(g), str(offset)]
    assert "rank  worker  file" in out and "consumed" in out and "remaining" in out


def test_a_path_without_checkpoint_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lakeloader inspect: error:") and "no such folder" in err
    (tmp_path / "step-000000000007").mkdir()
    assert main(["inspect", str(tmp_path / "step-000000000007")]) == 2
    err = capsys.readouterr().err
    assert "no committed checkpoint of step 7" in err and "steps saved there: none" in err
    assert main(["inspect", str(tmp_path), "--world-size", "0"]) == 2
    assert "argument --world-size: must be >= 1, got 0" in capsys.readouterr().err


def test_ranges_of_a_million_rows() -> None:
    """All slots are mapped at once (no per-row Python): a million rows take a fraction of a s."""
    from lakeloader.cli.inspect import row_ranges
    from lakeloader.lake.files import FileInfo
    from lakeloader.order.plan import make_units, plan_epoch

    rows = [[50_000] * 4 for _ in range(5)]
    files = tuple(
        FileInfo(f"f{i}", 1, "v", tuple(r), tuple(r), (), None) for i, r in enumerate(rows)
    )
    snapshot: Any = SimpleNamespace(files=files)  # row_ranges reads only the files
    plan = plan_epoch(
        make_units(rows, 65_536), seed=1, epoch=2, shuffle=True, num_partitions=16, window=16_384
    )
    out = row_ranges(plan, snapshot, 400_000, 990_000)
    counts = {c: sum(e - s for rg in out for s, e in rg[c]) for c in ("consumed", "remaining")}
    assert counts == {"consumed": 400_000, "remaining": 590_000}
    assert sum(e - s for rg in out for s, e in rg["dropped"]) == 10_000
    assert np.all([rg["rows"] == 50_000 for rg in out]) and len(out) == 20


def test_ranges_of_a_lake_without_rows() -> None:
    """Row groups of no row give no range (the run ends once outnumbered the run starts)."""
    from lakeloader.cli.inspect import row_ranges
    from lakeloader.lake.files import FileInfo
    from lakeloader.order.plan import make_units, plan_epoch

    rows = [[0, 0], [0]]
    files = tuple(
        FileInfo(f"f{i}", 1, "v", tuple(r), tuple(r), (), None) for i, r in enumerate(rows)
    )
    snapshot: Any = SimpleNamespace(files=files)
    plan = plan_epoch(
        make_units(rows, 65_536), seed=1, epoch=0, shuffle=True, num_partitions=16, window=16_384
    )
    assert row_ranges(plan, snapshot, 0, 0) == []


@pytest.mark.parametrize("kind", ["plain", "mixture"])
def test_an_unknown_creation_time_and_version_are_null_in_json_for_every_kind(kind: str) -> None:
    """A checkpoint without them (written before they were recorded) says null, not ""."""
    import dataclasses

    from lakeloader.cli.checkpoints import open_checkpoint
    from lakeloader.cli.inspect import inspect_checkpoint
    from lakeloader.cli.inspect_streams import inspect_kind

    found = open_checkpoint(str(Path(__file__).parent / "fixtures" / "checkpoints" / kind))
    ckpt = found.checkpoint
    context = dataclasses.replace(ckpt.context, created="", library_version="")
    ckpt = dataclasses.replace(ckpt, context=context)
    info = inspect_checkpoint(ckpt) if kind == "plain" else inspect_kind(ckpt, [ckpt.step])
    assert info["created"] is None and info["library_version"] is None


def test_the_requests_read_the_quarantine_of_every_kind_and_version() -> None:
    """A version 1 lake state keeps its quarantine as a list (not a JSON string), a packed
    mixture's is its cursor's: ``quarantine_step``'s units are found in both."""
    step = {"path": "a.parquet", "row_group": 0, "row_start": 0, "num_rows": 3}
    entries = [{**step, "reason": "quarantine_step(4)"}, {**step, "reason": "bad page"}]
    v1 = {"kind": "lakeloader.loader_state", "version": 1, "quarantine": entries}
    packed = {
        "kind": "packed-mixture",
        "version": 2,
        "mixture": {"quarantine": json.dumps(entries)},
    }
    for state in (v1, packed):
        assert requested(state)["quarantined_steps"] == entries[:1]

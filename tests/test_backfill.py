"""Issue 32, item 2: fixed shapes under quarantine (``on_error="skip", backfill=True``).

A lake with a unique id per row and a damaged row group: every global step keeps its size (the
last of the epoch aside), the global steps are the same under every world size, batch size and
worker count with the same global batch, the damaged rows are counted and never delivered,
every other row comes once, and a state taken mid-epoch resumes under another topology with
exactly the steps the uninterrupted run gives next; the audit proves it.
"""

from __future__ import annotations

import io
import itertools
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main as cli
from tests.conftest import damage_row_group

ROWS, GROUPS, FILES = 10, 4, 3
G = 12  # the global batch every topology below shares
#: (world size, batch size, workers) with a global batch of ``G``.
TOPOLOGIES = [(1, 12, 0), (2, 6, 0), (3, 4, 2), (4, 3, 0)]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[int]]:
    """The lake and the ids of its damaged row group."""
    root = tmp_path_factory.mktemp("backfill")
    schema = pa.schema([("id", pa.int64()), ("tok", pa.list_(pa.int64())), ("s", pa.string())])
    first = 0
    for f in range(FILES):
        with pq.ParquetWriter(root / f"part-{f}.parquet", schema) as writer:
            for _ in range(GROUPS):
                ids = np.arange(first, first + ROWS)
                toks = [[int(i)] * (1 + int(i) % 3) for i in ids]
                writer.write_table(pa.table({"id": ids, "tok": toks, "s": [str(i) for i in ids]}))
                first += ROWS
    damage_row_group(root / "part-1.parquet", 2)
    return root, set(range(1 * GROUPS * ROWS + 2 * ROWS, 1 * GROUPS * ROWS + 3 * ROWS))


def dataset(root: Path, **kwargs: Any) -> ll.LakeDataset:
    return ll.LakeDataset(str(root), max_unit_rows=ROWS, on_error="skip", backfill=True, **kwargs)


def check_rows(batch: dict[str, Any]) -> list[int]:
    """The batch's ids, its other columns checked against them."""
    ids = batch["id"].tolist()
    assert [t.tolist() for t in batch["tok"].unbind()] == [[i] * (1 + i % 3) for i in ids]
    assert batch["s"] == [str(i) for i in ids]
    return ids


def global_steps(loaders: list[ll.DataLoader]) -> Iterator[list[int]]:
    """Each global step's ids: the ranks' shares one after the other."""
    its = [iter(loader) for loader in loaders]
    while True:
        try:
            shares = [next(it) for it in its]
        except StopIteration:
            return
        yield [i for share in shares for i in check_rows(share)]


def loaders_of(root: Path, world: int, batch: int, workers: int, **kw: Any) -> list[ll.DataLoader]:
    return [
        ll.DataLoader(dataset(root), batch_size=batch, rank=r, world_size=world,
                      num_workers=workers, **kw)
        for r in range(world)
    ]  # fmt: skip


def test_every_step_keeps_its_size_under_every_topology(lake: tuple[Path, set[int]]) -> None:
    root, bad = lake
    runs = []
    for world, batch, workers in TOPOLOGIES:
        loaders = loaders_of(root, world, batch, workers)
        runs.append(list(global_steps(loaders)))
        assert loaders[0].tracker.position == FILES * GROUPS * ROWS  # the bad rows counted
        assert loaders[0].tracker.quarantine
        for loader in loaders:
            loader.close()
    steps = runs[0]
    assert all(run == steps for run in runs[1:]), "the same global steps under every topology"
    ids = [i for step in steps for i in step]
    assert [len(s) for s in steps[:-1]] == [G] * (len(steps) - 1) and 0 < len(steps[-1]) <= G
    assert len(ids) == len(set(ids)) and set(ids) == set(range(FILES * GROUPS * ROWS)) - bad


def test_without_backfill_a_step_comes_out_short(lake: tuple[Path, set[int]]) -> None:
    root, _ = lake
    ds = ll.LakeDataset(str(root), max_unit_rows=ROWS, on_error="skip")
    with ll.DataLoader(ds, batch_size=G) as loader:
        sizes = [len(b["id"]) for b in loader]
    assert min(sizes[:-1]) < G  # what backfill=True is for


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_state_resumes_under_another_topology(
    lake: tuple[Path, set[int]], drop_last: bool
) -> None:
    root, _ = lake
    loaders = loaders_of(root, 2, 6, 0, drop_last=drop_last)
    whole = list(global_steps(loaders))
    for loader in loaders:
        loader.close()
    assert all(len(s) == G for s in whole) if drop_last else len(whole[-1]) < G
    for at in (1, 3, 5, 7):  # before, across and after the damaged row group's slots
        loaders = loaders_of(root, 2, 6, 0, drop_last=drop_last)
        first = list(itertools.islice(global_steps(loaders), at))
        state = json.loads(json.dumps(loaders[1].state_dict()))
        for loader in loaders:
            loader.close()
        resumed = loaders_of(root, 3, 4, 2, drop_last=drop_last)
        for loader in resumed:
            loader.load_state_dict(state)
        rest = list(global_steps(resumed))
        for loader in resumed:
            loader.close()
        assert first + rest == whole, f"resumed after step {at}"


def test_the_batch_transform_sees_whole_steps_and_the_audit_proves_them(
    lake: tuple[Path, set[int]], tmp_path: Path
) -> None:
    root, bad = lake
    sizes: list[int] = []

    def transform(batch: dict[str, Any]) -> dict[str, Any]:
        sizes.append(len(batch["id"]))
        return batch

    folder = str(tmp_path / "ckpt")
    with ll.CheckpointManager(folder) as manager:
        loader = ll.DataLoader(dataset(root, batch_transform=transform), batch_size=G)
        manager.attach(loader)
        seen = [i for b in itertools.islice(iter(loader), 6) for i in b["id"].tolist()]
        manager.save(6, loader)
        loader.close()
    assert sizes == [G] * 6 and not set(seen) & bad
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["audit", folder, "--json"]) == 0
    assert json.loads(out.getvalue())["verdict"] == "exactly once"


def test_where_backfill_does_not_apply_the_error_says_what_to_do(
    lake: tuple[Path, set[int]],
) -> None:
    root, _ = lake
    with pytest.raises(ValueError, match="on_error='skip'"):
        ll.LakeDataset(str(root), backfill=True)
    with pytest.raises(ValueError, match="packed samples keep their length"):
        dataset(root, packing=ll.Packing("tok", seq_len=8))
    with pytest.raises(ValueError, match="mixture source 'a' has backfill=True"):
        ll.Mixture({"a": dataset(root)}, {"a": 1})
    with pytest.raises(TypeError, match="a collate_fn's batches cannot be cut"):
        ll.DataLoader(dataset(root), batch_size=4, collate_fn=list)


CHILD = """
import json, os, signal, sys
import lakeloader as ll
lake, ckpt = sys.argv[1], sys.argv[2]
ds = ll.LakeDataset(lake, max_unit_rows=10, on_error="skip", backfill=True)
loader = ll.DataLoader(ds, batch_size=12, num_workers=2)
manager = ll.CheckpointManager(ckpt)
it = iter(loader)
got = [next(it)["id"].tolist() for _ in range(5)]
manager.save(5, loader)
manager.wait()
print(json.dumps([got, loader.tracker.position]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_sigkilled_run_resumes_on_three_ranks(
    lake: tuple[Path, set[int]], tmp_path: Path
) -> None:
    """Killed with its workers after a checkpoint past the damaged rows; 3 ranks go on."""
    root, _ = lake
    loaders = loaders_of(root, 1, G, 0)
    whole = list(global_steps(loaders))
    loaders[0].close()
    ckpt = tmp_path / "ckpt"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    got, position = json.loads(child.stdout)
    assert got == whole[:5] and position > 5 * G  # damaged rows were passed over by then
    ranks = loaders_of(root, 3, 4, 0)
    for loader in ranks:
        ll.CheckpointManager(str(ckpt)).load(loader)
    assert list(global_steps(ranks)) == whole[5:]
    for loader in ranks:
        loader.close()


def small_lake(root: Path, damaged: int | None = None) -> Path:
    """One file of 4 row groups of 10 rows (ids 0-39), row group ``damaged`` damaged."""
    root.mkdir()
    with pq.ParquetWriter(root / "a.parquet", pa.schema([("id", pa.int64())])) as writer:
        for g in range(4):
            writer.write_table(pa.table({"id": np.arange(g * 10, g * 10 + 10)}))
    if damaged is not None:
        damage_row_group(root / "a.parquet", damaged)
    return root


def test_an_epoch_whose_last_rows_are_quarantined_ends(tmp_path: Path) -> None:
    root = small_lake(tmp_path / "lake", damaged=3)
    ds = dataset(root, shuffle=False)
    with ll.DataLoader(ds, batch_size=10) as loader:
        for epoch in range(3):
            assert [b["id"].tolist() for b in loader] == [
                list(range(k, k + 10)) for k in (0, 10, 20)
            ]
            assert (loader.epoch, loader.tracker.position) == (epoch, 40)
    with ll.DataLoader(ds, batch_size=10, endless=True) as loader:
        ids = [i for b in itertools.islice(loader, 9) for i in b["id"].tolist()]
    assert ids == list(range(30)) * 3


def test_the_rows_delivered_and_counted_are_those_without_backfill(tmp_path: Path) -> None:
    """Pieces differ by epoch, so entries cover parts of them; rows skipped are counted."""
    root = small_lake(tmp_path / "lake")
    got = {}
    for backfill in (False, True):
        ds = ll.LakeDataset(
            str(root), num_partitions=3, window=4, max_unit_rows=10, on_error="skip", seed=1,
            validate=lambda t: t.num_rows == 10 or "a piece", backfill=backfill,
        )  # fmt: skip
        with ll.DataLoader(ds, batch_size=8) as loader:
            epochs = []
            for epoch in range(3):
                loader.set_epoch(epoch)
                epochs.append([i for b in loader for i in b["id"].tolist()])
            got[backfill] = (epochs, loader.stats()["rows_skipped"])
    (plain, skipped), (filled, skipped_filled) = got[False], got[True]
    assert [sorted(e) for e in filled] == [sorted(e) for e in plain]
    assert all(len(e) == len(set(e)) for e in filled) and skipped_filled == skipped > 0


def test_the_view_places_each_rank_s_next_share(lake: tuple[Path, set[int]]) -> None:
    """From a state whose quarantine holds the damaged unit: each rank's next first row."""
    root, _ = lake
    loaders = loaders_of(root, 1, G, 0)
    steps = global_steps(loaders)
    for _ in range(5):
        next(steps)
    state = loaders[0].state_dict()
    loaders[0].close()
    assert json.loads(state["quarantine"])  # found before the state
    ranks = loaders_of(root, 3, 4, 2)
    for loader in ranks:
        loader.load_state_dict(state)
    its = [iter(loader) for loader in ranks]
    for step in range(4):
        view = ranks[0].view()
        assert [r.rows for r in view.ranks] == [4, 4, 4]
        work = [[(w.worker, w.role, w.at) for w in view.workers if w.rank == r] for r in range(3)]
        assert len(work[0]) == 2 and work[0] == work[1] == work[2]  # every rank: whole steps
        for rank, it in enumerate(its):
            at, first = view.ranks[rank].at, int(next(it)["id"][0])
            assert (
                at is not None
                and int(Path(at.file).stem.split("-")[1]) * GROUPS * ROWS
                + (at.row_group * ROWS + at.row_offset)
                == first
            ), (step, rank)
    for loader in ranks:
        loader.close()


def test_inspect_of_a_backfilled_checkpoint_places_the_ranks_as_the_loaders_do(
    lake: tuple[Path, set[int]], tmp_path: Path
) -> None:
    root, _ = lake
    loaders = loaders_of(root, 3, 4, 0)
    steps = global_steps(loaders)
    for step in range(1, 9):
        next(steps)
        folder = str(tmp_path / f"ckpt-{step}")
        ll.CheckpointManager(folder).save(step, loaders[0])
        out = io.StringIO()
        with redirect_stdout(out):
            assert cli(["inspect", folder, "--json"]) == 0
        ranks = json.loads(out.getvalue())["ranks"]
        got = [(r["rows"], Path(r["file"]).name, r["row_group"], r["row_offset"]) for r in ranks]
        want = [
            (v.rows, Path(v.at.file).name, v.at.row_group, v.at.row_offset)
            for v in loaders[0].view().ranks
            if v.at is not None
        ]
        assert got == want, step
    for loader in loaders:
        loader.close()

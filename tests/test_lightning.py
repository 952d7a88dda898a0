"""PyTorch Lightning over a lake (issue 29): real Lightning, real ranks, a real SIGKILL.

Each setup trains tests/lightning_child.py in real processes: on 2 processes (gloo) until a
checkpoint is written, then SIGKILL to the run's process group mid-epoch; again on 2 processes
from that checkpoint with Lightning's own resume (``fit(ckpt_path=...)``), killed again; and
on 1 process to the end, from the last checkpoint. Every rank logs the row ids of each step
it trains; a run's steps from the global step of the checkpoint the next run resumed from
were trained again and are dropped; every row of every epoch must be left exactly once. The
numbers are printed (``pytest -s``) and in the assertion messages. Then, in this process on
1 device: loaders without ``len()``, end-of-epoch checkpoints; and the example's demo.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import lakeloader as ll
from lakeloader.integrations.lightning import (
    LightningVersionError,
    fetched_ahead,
)
from tests.conftest import LAYOUT, LAYOUT_ROWS, ROOT, TORCHRUN_ENV, write_lake
from tests.lightning_child import dataset, main

pytestmark = pytest.mark.slow

BATCH = 16  # rows per rank and step
VAL_ROWS = 128
VAL_BATCH = 16
STEPS_1 = -(-LAYOUT_ROWS // BATCH)  # steps of an epoch on 1 process
GROWTH = (200, 100)  # rows of the increments appended to the followed lake


# ------------------------------------------------------------------------- running the child


#: Where POSIX named semaphores live (multiprocessing's locks and queues).
SHM = Path("/dev/shm")


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` is still running (zombies are not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _semaphores_in_use() -> set[Path]:
    """The named semaphores that a living process has mapped, whoever it is: another test's,
    run meanwhile by another pytest-xdist worker, must not be unlinked under it. (A mapping
    names the file glibc made the semaphore in before linking it to its name: compared by
    inode.)"""
    inodes: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        inodes |= {line.split()[4] for line in text.splitlines() if " /dev/shm/sem." in line}
    used = set()
    for sem in SHM.glob("sem.mp-*"):
        with contextlib.suppress(OSError):
            if str(sem.stat().st_ino) in inodes:
                used.add(sem)
    return used


def _launch_env() -> dict[str, str]:
    """This environment, with Lightning's rendezvous on a free port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return {**os.environ, **TORCHRUN_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def _train(
    out: Path,
    *,
    hold: int | None = None,
    when_training: Callable[[], None] | None = None,
    **cfg: Any,
) -> Path | None:
    """Run the child with ``cfg``: to its end, or until each rank holds at global step
    ``hold``, then SIGKILL its process group and return a copy of its ``last.ckpt``.

    ``when_training`` is called once the first step is logged.
    """
    cfg = {"out": str(out), "batch": BATCH, "every": 5, "devices": 2, **cfg}
    if hold is not None:
        cfg["hold"] = hold
    tag, ranks = cfg["tag"], cfg["devices"]
    env = _launch_env()
    log = out / f"{tag}.log"
    semaphores = set(SHM.glob("sem.mp-*"))  # the killed group's own are unlinked after it
    with log.open("w") as fh:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.lightning_child", json.dumps(cfg)],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    try:
        while True:
            if when_training is not None and (out / f"{tag}-rank0.jsonl").exists():
                when_training()
                when_training = None
            held = all((out / f"{tag}-held{r}").exists() for r in range(ranks))
            if (hold is not None and held) or child.poll() is not None:
                break
            assert time.monotonic() < deadline, f"run {tag} stalled: {_tail(log)}"
            time.sleep(0.05)
        if hold is None:
            assert child.wait() == 0, f"run {tag} failed: {_tail(log)}"
            return None
        assert child.poll() is None, f"run {tag} ended before step {hold}: {_tail(log)}"
    finally:
        killed = child.poll() is None
        if killed:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        while _group_alive(child.pid):
            time.sleep(0.01)
        if killed:  # the SIGKILL took the spawned ranks' resource tracker: their semaphores stay
            for left in set(SHM.glob("sem.mp-*")) - semaphores - _semaphores_in_use():
                left.unlink(missing_ok=True)
    return Path(shutil.copy(out / "ckpt" / "last.ckpt", out / f"{tag}.ckpt"))


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


def _records(out: Path, tag: str) -> list[dict[str, Any]]:
    """Every rank's log lines of run ``tag``, each with its ``rank``."""
    got = []
    for path in sorted(out.glob(f"{tag}-rank*.jsonl")):
        rank = int(path.stem.rsplit("rank", 1)[1])
        lines = path.read_text().splitlines()
        got += [{**json.loads(line), "rank": rank, "tag": tag} for line in lines]
    return got


def _global_step(ckpt: Path) -> int:
    return int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"])


def _trained(out: Path, chain: Iterable[tuple[str, Path | None]]) -> list[dict[str, Any]]:
    """The steps that count: of each run ``tag``, those before the global step of the
    checkpoint ``resumed`` that the next run started from (None: all)."""
    kept = []
    for tag, resumed in chain:
        cut = _global_step(resumed) if resumed is not None else None
        steps = [r for r in _records(out, tag) if "v" not in r]
        kept += [r for r in steps if cut is None or r["s"] < cut]
    return kept


def _tally(steps: list[dict[str, Any]], epoch_of: Callable[[int], int] | None = None) -> Any:
    """``{epoch: (rows trained, missing, doubled)}``; the epoch is Lightning's, or
    ``epoch_of(id)``."""
    seen: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for r in steps:
        for i in r["ids"]:
            seen[epoch_of(i) if epoch_of else r["e"]][i] += 1
    every = range(LAYOUT_ROWS + sum(GROWTH)) if epoch_of else range(LAYOUT_ROWS)
    return {
        e: (
            sum(c.values()),
            sum(1 for i in every if (epoch_of(i) if epoch_of else e) == e and i not in c),
            sum(n - 1 for n in c.values()),
        )
        for e, c in sorted(seen.items())
    }


def _report(setup: str, when: str, tally: Any) -> str:
    line = "; ".join(
        f"epoch {e}: {t} trained, {m} missing, {d} doubled" for e, (t, m, d) in tally.items()
    )
    print(f"\n[{setup}] {when}: {line}")
    return f"[{setup}] {when}: {line}"


def _exactly_once(
    setup: str, chain: list[tuple[str, Path | None]], out: Path, epochs: int
) -> list[dict[str, Any]]:
    """Check and report the runs on 2 processes, then all of them; the steps that count."""
    if len(chain) > 2:
        tally = _tally(_trained(out, chain[:-1]))
        message = _report(setup, "after the SIGKILL and the resume on 2 processes", tally)
        assert all(d == 0 for _, _, d in tally.values()), message
        assert all(m == 0 for e, (_, m, _) in tally.items() if e < max(tally)), message
    steps = _trained(out, chain)
    tally = _tally(steps)
    message = _report(setup, "after the resume on 1 process", tally)
    assert tally == {e: (LAYOUT_ROWS, 0, 0) for e in range(epochs)}, message
    return steps


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A training lake (``LAYOUT``, 1500 rows) and a validation lake of ``VAL_ROWS`` rows."""
    root = tmp_path_factory.mktemp("lightning")
    write_lake(root / "train", LAYOUT)
    write_lake(root / "val", [[VAL_ROWS // 2, VAL_ROWS // 2]])
    return root / "train", root / "val"


# ------------------------------------------------------------------------------ validation


def _val_share(val: Path, rank: int, world: int, epoch: int) -> list[list[int]]:
    loader = ll.DataLoader(dataset({}, str(val)), batch_size=VAL_BATCH, rank=rank, world_size=world)
    loader.set_epoch(epoch)
    return [b["id"].tolist() for b in loader]


def _check_validations(out: Path, val: Path, runs: dict[str, int], limit: int | None) -> Any:
    """Check that each validation of each run (tag: its process count) saw its rank's whole
    share of the validation epoch (or its first ``limit`` batches, or 2 in the sanity check);
    ``{tag: [(sanity, the loader's epoch) of each validation]}``."""
    seen = {}
    for tag, world in runs.items():
        done: dict[int, list[int]] = collections.defaultdict(list)
        for rank in range(world):
            batches: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
            for r in _records(out, tag):
                if "v" in r and r["rank"] == rank:
                    batches[r["v"]].append(r)
            for v, got in batches.items():
                share = _val_share(val, rank, world, got[0]["le"])
                k = 2 if got[0]["sanity"] else limit or len(share)
                assert [r["ids"] for r in got] == share[:k], f"run {tag} validation {v}"
                if not got[0]["sanity"]:
                    done[v] += [i for r in got for i in r["ids"]]
            seen[tag] = [(got[0]["sanity"], got[0]["le"]) for _, got in sorted(batches.items())]
        if limit is None:
            for v, ids in done.items():
                assert sorted(ids) == list(range(VAL_ROWS)), f"run {tag} validation {v}"
    return seen


# -------------------------------------------------------------------------------- the rows


def test_a_loader_passed_to_fit_under_ddp_resumes_exactly_and_on_one_process(
    tmp_path: Path, lakes: tuple[Path, Path]
) -> None:
    """Rows 1, 5 and 6: the plain loader made at top level and given to ``fit``, a whole
    validation after a sanity check; on 1 process the callback recounts Lightning's steps."""
    lake, val = lakes
    cfg = {"setup": "fit", "strategy": "ddp", "lake": str(lake), "max_epochs": 3, "val": str(val)}
    cfg |= {"val_batch": VAL_BATCH, "sanity": 2}
    a = _train(tmp_path, tag="a", hold=12, **cfg)
    b = _train(tmp_path, tag="b", hold=62, resume=str(a), **cfg)  # 15 steps into epoch 1
    _train(tmp_path, tag="c", resume=str(b), callback=True, **{**cfg, "devices": 1})
    steps = _exactly_once("fit, ddp", [("a", a), ("b", b), ("c", None)], tmp_path, 3)
    assert all(r["le"] == r["e"] for r in steps)
    # on 1 process, Lightning's batch_idx counts this topology's steps: epoch 1 resumes at
    # the 2-process run's 60 - 47 = 13 steps of 32 rows, 26 steps of 16, and ends on 93
    c = [r for r in steps if r["tag"] == "c"]
    firsts = {r["e"]: r["b"] for r in reversed(c)}
    lasts = {r["e"]: r["b"] for r in c}
    assert (firsts, lasts) == ({1: 26, 2: 0}, {1: STEPS_1 - 1, 2: STEPS_1 - 1})
    validations = _check_validations(tmp_path, val, {"a": 2, "b": 2, "c": 1}, None)
    # a sanity check at the start, none on a resume; one at the end of every epoch
    assert validations == {"a": [(True, 0)], "b": [(False, 0)], "c": [(False, 1), (False, 2)]}


def test_a_loader_pickled_into_ddp_spawn_processes_resumes_exactly(
    tmp_path: Path, lakes: tuple[Path, Path]
) -> None:
    """Row 2: the loader made in the launching process and pickled into the spawned ones."""
    cfg = {"setup": "fit", "strategy": "ddp_spawn", "lake": str(lakes[0]), "max_epochs": 2}
    a = _train(tmp_path, tag="a", hold=12, **cfg)
    b = _train(tmp_path, tag="b", hold=52, resume=str(a), **cfg)  # 5 steps into epoch 1
    _train(tmp_path, tag="c", resume=str(b), callback=True, **{**cfg, "devices": 1})
    steps = _exactly_once("fit, ddp_spawn", [("a", a), ("b", b), ("c", None)], tmp_path, 2)
    assert all(r["le"] == r["e"] for r in steps)


def test_a_loader_made_by_train_dataloader_every_epoch_resumes_from_an_epoch_end(
    tmp_path: Path, lakes: tuple[Path, Path]
) -> None:
    """Rows 3 and 5: ``train_dataloader()`` with ``reload_dataloaders_every_n_epochs=1`` and
    ``limit_val_batches=2``; the run on 1 process resumes from an end-of-epoch checkpoint."""
    lake, val = lakes
    cfg = {"setup": "hook", "strategy": "ddp", "lake": str(lake), "max_epochs": 3, "val": str(val)}
    cfg |= {"val_batch": VAL_BATCH, "sanity": 2, "limit_val": 2}
    a = _train(tmp_path, tag="a", hold=12, **cfg)
    _train(tmp_path, tag="b", hold=50, resume=str(a), **cfg)  # 3 steps into epoch 1
    end = tmp_path / "ckpt" / "epochs" / "epoch=0.ckpt"
    _train(tmp_path, tag="c", resume=str(end), callback=True, **{**cfg, "devices": 1})
    chain = [("a", a), ("b", end), ("c", None)]
    steps = _exactly_once("train_dataloader(), reloaded", chain, tmp_path, 3)
    assert all(r["le"] == r["e"] for r in steps), "every epoch runs the loader's epoch"
    validations = _check_validations(tmp_path, val, {"a": 2, "b": 2, "c": 1}, 2)
    assert validations == {
        "a": [(True, 0)],
        "b": [(False, 0)],
        "c": [(True, 1), (False, 1), (False, 2)],
    }


def _append(lake: Path, increment: int) -> None:
    """Increment ``increment`` (1 or 2): ``GROWTH[increment - 1]`` rows with the next ids in
    a new file of the lake's schema (renamed into place whole)."""
    first = LAYOUT_ROWS + sum(GROWTH[: increment - 1])
    ids = np.arange(first, first + GROWTH[increment - 1], dtype=np.int64)
    table = pa.table(
        {
            "id": ids,
            "x": (ids * 0.5).astype(np.float32),
            "s": [f"row-{i}" for i in ids],
            "label": np.zeros(len(ids), np.int32),
        }
    )
    pq.write_table(table, lake / ".appended.tmp")
    os.replace(lake / ".appended.tmp", lake / f"appended-{increment}.parquet")


def _increment(i: int) -> int:
    """The increment of the followed lake that row ``i`` was appended in."""
    return sum(i >= LAYOUT_ROWS + sum(GROWTH[:k]) for k in range(len(GROWTH) + 1))


def test_a_growing_lake_resumes_before_the_batch_lightning_fetched_ahead(tmp_path: Path) -> None:
    """Row 4: ``follow=``, no ``len()``: Lightning prefetches a batch, which the callback's
    state stands before. Increment 1 is appended while the first run trains, and the second
    is killed in it (3 steps in); increment 2 while the run on 1 process trains."""
    lake = tmp_path / "lake"
    write_lake(lake, LAYOUT)
    cfg = {"setup": "fit", "strategy": "ddp", "lake": str(lake), "follow": True, "timeout": 1.5}
    cfg |= {"max_epochs": 1, "callback": True}  # Lightning's epoch ends when it has caught up
    out = tmp_path / "out"
    out.mkdir()
    a = _train(out, tag="a", hold=12, when_training=lambda: _append(lake, 1), **cfg)
    b = _train(out, tag="b", hold=52, resume=str(a), **cfg)  # increment 0 has 47 steps
    _train(out, tag="c", resume=str(b), when_training=lambda: _append(lake, 2), **cfg, devices=1)
    steps = _trained(out, [("a", a), ("b", b), ("c", None)])
    tally = _tally(steps, _increment)
    message = _report(
        "follow=, ddp, callback", "after the resume on 1 process (by increment)", tally
    )
    assert tally == {0: (LAYOUT_ROWS, 0, 0), 1: (GROWTH[0], 0, 0), 2: (GROWTH[1], 0, 0)}, message
    assert _global_step(b) == 50 and max(r["le"] for r in _records(out, "b")) == 1


# ----------------------------------------------------------------- in this process, 1 device


def _fit(out: Path, **cfg: Any) -> Path:
    """Train in this process on 1 device; a copy of the last checkpoint (``{tag}.ckpt``)."""
    main({"out": str(out), "batch": 100, "devices": 1, "strategy": "auto", **cfg})
    return Path(shutil.copy(out / "ckpt" / "last.ckpt", out / f"{cfg['tag']}.ckpt"))


def _endless(lake: Path, steps: int) -> list[list[int]]:
    loader = ll.DataLoader(dataset({}, str(lake)), batch_size=100, endless=True)
    it = iter(loader)
    return [next(it)["id"].tolist() for _ in range(steps)]


@pytest.mark.parametrize("callback", [False, True])
def test_an_endless_loader_resumes_before_the_batch_lightning_fetched_ahead(
    tmp_path: Path, lakes: tuple[Path, Path], callback: bool
) -> None:
    """``endless=True`` has no ``len()``: without the callback, the checkpoint of step 7 stands
    after the 8th batch, which Lightning fetched ahead, and the resume skips it."""
    cfg = {"setup": "fit", "lake": str(lakes[0]), "endless": True, "every": 7, "callback": callback}
    a = _fit(tmp_path, tag="a", max_steps=7, **cfg)
    _fit(tmp_path, tag="b", max_steps=20, resume=str(a), **cfg)  # into the loader's epoch 1
    got = [r["ids"] for r in _trained(tmp_path, [("a", a), ("b", None)])]
    every = _endless(lakes[0], 21)
    assert got == (every[:20] if callback else every[:7] + every[8:21])


@pytest.mark.parametrize("callback", [False, True])
def test_an_end_of_epoch_checkpoint_resumes_with_or_without_the_callback(
    tmp_path: Path, lakes: tuple[Path, Path], callback: bool
) -> None:
    """ModelCheckpoint's default, a checkpoint at an epoch's end: Lightning restores no loader
    state, calls ``iter()`` and then ``set_epoch(1)``; the pass begins at the first batch, in
    epoch 1 (it began at ``iter()``, in epoch 0, and ``set_epoch`` ended it: a crash)."""
    cfg = {"setup": "fit", "lake": str(lakes[0]), "every": 1000, "callback": callback}
    a = _fit(tmp_path, tag="a", max_epochs=1, **cfg)
    end = tmp_path / "ckpt" / "epochs" / "epoch=0.ckpt"
    _fit(tmp_path, tag="b", max_epochs=2, resume=str(end), **cfg)
    steps = _trained(tmp_path, [("a", a), ("b", None)])
    assert _tally(steps) == {0: (LAYOUT_ROWS, 0, 0), 1: (LAYOUT_ROWS, 0, 0)}
    assert all(r["le"] == r["e"] for r in steps)


def test_a_followed_lake_caught_up_at_an_epoch_end_goes_on_with_what_was_appended(
    tmp_path: Path,
) -> None:
    """An end-of-epoch checkpoint of a followed lake (Lightning's epoch ends when the loader
    has caught up): without the callback the resume would read the lake from increment 0."""
    lake = tmp_path / "lake"
    write_lake(lake, LAYOUT)
    cfg = {"setup": "fit", "lake": str(lake), "follow": True, "timeout": 0.3, "every": 1000}
    cfg |= {"callback": True}
    _fit(tmp_path, tag="a", max_epochs=1, **cfg)
    _append(lake, 1)
    end = tmp_path / "ckpt" / "epochs" / "epoch=0.ckpt"
    _fit(tmp_path, tag="b", max_epochs=2, resume=str(end), **cfg)
    tally = _tally(_trained(tmp_path, [("a", None), ("b", None)]), _increment)
    assert tally == {0: (LAYOUT_ROWS, 0, 0), 1: (GROWTH[0], 0, 0)}


def test_loaders_set_up_before_lightning_restores_its_loops_are_restored_by_the_callback(
    tmp_path: Path, lakes: tuple[Path, Path]
) -> None:
    """``estimated_stepping_batches`` in ``configure_optimizers`` sets the loaders up before
    Lightning restores its loops, and it then loads no loader state (Lightning's issue
    20550): without the callback the resume starts the epoch again (700 rows doubled)."""
    cfg = {"setup": "fit", "lake": str(lakes[0]), "every": 7, "callback": True, "estimate": True}
    a = _fit(tmp_path, tag="a", max_steps=7, **cfg)
    _fit(tmp_path, tag="b", max_epochs=1, resume=str(a), **cfg)
    assert _tally(_trained(tmp_path, [("a", a), ("b", None)])) == {0: (LAYOUT_ROWS, 0, 0)}


def test_an_endless_loader_resumes_past_its_first_epoch(
    tmp_path: Path, lakes: tuple[Path, Path]
) -> None:
    """Lightning's ``set_epoch(0)`` at the start of the resumed run leaves the loader in its
    epoch 1, where the checkpoint stands."""
    cfg = {"setup": "fit", "lake": str(lakes[0]), "endless": True, "every": 20, "callback": True}
    a = _fit(tmp_path, tag="a", max_steps=20, **cfg)  # 15 steps an epoch: 5 into epoch 1
    _fit(tmp_path, tag="b", max_steps=25, resume=str(a), **cfg)
    got = [r["ids"] for r in _trained(tmp_path, [("a", a), ("b", None)])]
    assert got == _endless(lakes[0], 25)


def test_a_lightning_that_keeps_its_fetcher_elsewhere_is_named(tmp_path: Path) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    assert fetched_ahead(trainer) == 0
    del trainer.fit_loop._data_fetcher
    with pytest.raises(LightningVersionError) as err:
        fetched_ahead(trainer)
    message = str(err.value)
    for part in ("Trainer.fit_loop._data_fetcher is missing", "tested with 2.6.6"):
        assert part in message


def test_the_example_demo_trains_every_row_once_on_two_processes(tmp_path: Path) -> None:
    """``python examples/train_lightning.py --demo``: its own lake and run, in ``TMPDIR``."""
    run = subprocess.run(
        [sys.executable, "examples/train_lightning.py", "--demo"],
        cwd=ROOT,
        env=_launch_env() | {"TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    (work,) = tmp_path.glob("train_lightning-*")
    assert f"the lake and the run go to {work}" in run.stdout
    assert sorted(p.name for p in (work / "run" / "logs").iterdir()) == [
        "rank0.jsonl",
        "rank1.jsonl",
    ]
    epochs = [{"epoch": e, "rows": 3000, "missing": 0, "doubled": 0} for e in range(2)]
    assert json.loads(run.stdout.splitlines()[-1]) == {"epochs": epochs, "exactly_once": True}

"""Worker processes decode for mixtures and packed streams, as for one lake.

A mixture's sources and a packed stream's epochs are unit stores of one pass that share one
dispatcher of decode tasks (keys name the store and the unit): the batches are the ones that
no worker gives, a worker SIGKILLed mid-pass has its decodes done again by its replacement
(the death is handled by the decode dispatcher, which is what shows the workers decode), and a
row group that cannot be read fails in the loader's process naming its file and row group.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import lakeloader as ll
from tests.conftest import damage_row_group, wait_dead

C, L, EOS = 4, 16, 999_999


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two lakes with disjoint ids; every row has tokens unique across both."""
    root = tmp_path_factory.mktemp("stream-workers")
    for k, name in enumerate(("web", "code")):
        for f in range(3):
            ids = [k * 100_000 + f * 400 + i for i in range(400)]
            tokens = [[i * 100 + j for j in range(i % 23)] for i in ids]
            table = pa.table({"id": ids, "x": [float(i) for i in ids], "tokens": tokens})
            (root / name).mkdir(exist_ok=True)
            pq.write_table(table, root / name / f"part-{f}.parquet", row_group_size=50)
    return root


def mixture(lakes: Path) -> ll.Mixture:
    sources = {
        n: ll.LakeDataset(lakes / n, columns=["id", "x"], seed=3, num_partitions=C, window=64)
        for n in ("web", "code")
    }
    return ll.Mixture(sources, {"web": 0.6, "code": 0.4}, seed=9)


def packed(lakes: Path) -> ll.LakeDataset:
    packing = ll.Packing("tokens", L, eos_id=EOS, pad_id=0)
    return ll.LakeDataset(lakes / "web", seed=3, num_partitions=C, window=64, packing=packing)


def ids_of(batch: dict[str, Any]) -> list[int]:
    return [int(i) for i in batch["id"]] if "id" in batch else batch["input_ids"].ravel().tolist()


def batches(dataset: Any, steps: int | None, kill_after: int | None = None, **kw: Any) -> list:
    """The loader's batches (each as a list of ids or tokens), SIGKILLing a worker if asked."""
    with ll.DataLoader(dataset, batch_size=32, **kw) as loader:
        it = iter(loader)
        out = []
        for step, batch in enumerate(itertools.islice(it, steps)):
            out.append(ids_of(batch))
            if step == kill_after:
                assert loader._pool is not None
                victim = loader._pool.pids()[0]
                assert victim is not None and victim != os.getpid()
                os.kill(victim, signal.SIGKILL)
                wait_dead(victim)
        return out


def killed_decoder(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether the log says a dead worker's decodes were handed to its replacement."""
    return any(
        re.search(r"died with exit code -9; decoding \d+ unit", r.getMessage())
        for r in caplog.records
    )


def test_a_mixture_decodes_in_its_workers_with_the_same_batches(
    lakes: Path, caplog: pytest.LogCaptureFixture
) -> None:
    alone = batches(mixture(lakes), None)
    with pytest.warns(ll.WorkerWarning, match="exit code -9"):
        killed = batches(mixture(lakes), None, kill_after=3, num_workers=2, prefetch_factor=4)
    assert killed == alone
    assert killed_decoder(caplog)


def test_a_packed_stream_decodes_in_its_workers_with_the_same_samples(
    lakes: Path, caplog: pytest.LogCaptureFixture
) -> None:
    alone = batches(packed(lakes), 40)
    assert len(alone) == 40
    with pytest.warns(ll.WorkerWarning, match="exit code -9"):
        killed = batches(packed(lakes), 40, kill_after=5, num_workers=2, prefetch_factor=4)
    assert killed == alone
    assert killed_decoder(caplog)


def test_a_packed_mixture_decodes_every_source_in_the_workers(lakes: Path) -> None:
    def both() -> ll.Mixture:
        sources = {
            n: ll.LakeDataset(lakes / n, columns=["tokens"], seed=3, num_partitions=C, window=64)
            for n in ("web", "code")
        }
        return ll.Mixture(
            sources, {"web": 0.5, "code": 0.5}, seed=9, packing=ll.Packing("tokens", L, EOS)
        )

    alone = batches(both(), 30)
    with ll.DataLoader(both(), batch_size=32, num_workers=2) as loader:
        got = [ids_of(b) for b in itertools.islice(loader, 30)]
        assert loader._pool is not None and all(p is not None for p in loader._pool.pids())
        assert loader.stats()["units_decoded"] > 0
    assert got == alone
    tokens = np.concatenate([np.array(b) for b in got])
    assert {int(t) // 100 // 100_000 for t in tokens if t not in (0, EOS)} == {0, 1}


def test_a_row_group_a_worker_cannot_read_names_its_file(lakes: Path, tmp_path: Path) -> None:
    broken = tmp_path / "code"
    broken.mkdir()
    for f in (lakes / "code").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    damage_row_group(broken / "part-1.parquet", 2)
    sources = {
        "web": ll.LakeDataset(lakes / "web", columns=["id", "x"], seed=3, num_partitions=C),
        "code": ll.LakeDataset(broken, columns=["id", "x"], seed=3, num_partitions=C),
    }
    mix = ll.Mixture(sources, {"web": 0.5, "code": 0.5}, seed=9)
    loader = ll.DataLoader(mix, batch_size=32, num_workers=2)
    with loader, pytest.raises(ll.LakeDataError, match=r"part-1\.parquet.*row group 2"):
        for _ in loader:
            pass


def _pid_row(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "pid": os.getpid(), "twice": row["id"] * 2}


def _summed(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "total": int(batch["x"].sum())}


@pytest.mark.parametrize("transform", [None, _pid_row])
def test_a_mixture_with_user_code_is_built_by_its_workers(lakes: Path, transform: Any) -> None:
    def both() -> ll.Mixture:
        sources = {
            n: ll.LakeDataset(
                lakes / n,
                columns=["id", "x"],
                seed=3,
                num_partitions=C,
                window=64,
                transform=transform,
            )
            for n in ("web", "code")
        }
        return ll.Mixture(sources, {"web": 0.6, "code": 0.4}, seed=9, batch_transform=_summed)

    def run(**kw: Any) -> list[Any]:
        with ll.DataLoader(both(), batch_size=32, **kw) as loader:
            out = []
            for batch in loader:
                out.append(batch)
                if len(out) == 3 and kw:
                    assert loader._pool is not None
                    victim = loader._pool.pids()[1]
                    assert victim is not None
                    os.kill(victim, signal.SIGKILL)
                    wait_dead(victim)
            return out

    alone = run()
    with pytest.warns(ll.WorkerWarning, match="exit code -9"):
        built = run(num_workers=2, prefetch_factor=2)
    assert [b["id"].tolist() for b in built] == [b["id"].tolist() for b in alone]
    assert [b["source"].tolist() for b in built] == [b["source"].tolist() for b in alone]
    assert [b["total"] for b in built] == [b["total"] for b in alone]
    if transform is not None:
        assert [b["twice"].tolist() for b in built] == [b["twice"].tolist() for b in alone]
        pids = {int(p) for b in built for p in b["pid"].tolist()}
        assert os.getpid() not in pids and len(pids) >= 2


def test_passes_of_a_mixture_built_by_workers_go_on_one_after_the_other(lakes: Path) -> None:
    sources = {
        n: ll.LakeDataset(lakes / n, columns=["id", "x"], seed=3, num_partitions=C, window=64)
        for n in ("web", "code")
    }
    mix = ll.Mixture(
        sources, {"web": 1, "code": 1}, seed=9, epoch_rows=200, batch_transform=_summed
    )
    with (
        ll.DataLoader(mix, batch_size=32) as alone,
        ll.DataLoader(mix, batch_size=32, num_workers=2, persistent_workers=True) as built,
    ):
        for _ in range(3):  # three passes, each a new iter() over the stores the last one left
            assert [b["id"].tolist() for b in built] == [b["id"].tolist() for b in alone]


KILL_MARKER = "LAKELOADER_TEST_KILL_MARKER"


def _kill_once_in_a_worker() -> None:
    """With ``KILL_MARKER`` set and absent, the first worker to call it makes the marker and
    SIGKILLs itself (so that the work it was given is done again by its replacement)."""
    marker = os.environ.get(KILL_MARKER)
    if marker and torch.utils.data.get_worker_info() is not None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _pids_stacked(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A collate_fn: the samples stacked, and the process that collated them."""
    out = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    return {**out, "collated_by": os.getpid()}


def _with_pid(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch_transform: the batch, the process that ran it and each sample's seed. The
    first worker to run it with ``KILL_MARKER`` set and absent makes it, then SIGKILLs itself."""
    _kill_once_in_a_worker()
    return {**batch, "pid": os.getpid(), "seeds": ll.row_seeds().tolist()}


@pytest.mark.parametrize("collate", [None, _pids_stacked])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_packed_stream_s_user_code_runs_in_its_workers(
    lakes: Path,
    collate: Any,
    mixed: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The collate_fn and batch_transform of a packed lake or mixture run in the workers (as
    a lake's do), a worker SIGKILLed while it builds has that build done again by its
    replacement, and the batches, seeds included, are those that no worker gives."""

    def stream() -> ll.LakeDataset | ll.Mixture:
        packing = ll.Packing("tokens", L, eos_id=EOS, pad_id=0)
        if not mixed:
            return ll.LakeDataset(
                lakes / "web",
                seed=3,
                num_partitions=C,
                window=64,
                packing=packing,
                batch_transform=_with_pid,
            )
        sources = {
            n: ll.LakeDataset(lakes / n, columns=["tokens"], seed=3, num_partitions=C, window=64)
            for n in ("web", "code")
        }
        return ll.Mixture(
            sources, {"web": 0.5, "code": 0.5}, seed=9, packing=packing, batch_transform=_with_pid
        )

    def run(**kw: Any) -> list[dict[str, Any]]:
        with ll.DataLoader(stream(), batch_size=8, collate_fn=collate, **kw) as loader:
            return list(itertools.islice(loader, 30))

    alone = run()
    monkeypatch.setenv(KILL_MARKER, str(tmp_path / "killed"))
    with pytest.warns(ll.WorkerWarning, match="exit code -9"):
        built = run(num_workers=2, prefetch_factor=2)
    assert len(built) == len(alone) == 30
    for got, want in zip(built, alone, strict=True):
        assert set(got) == set(want)
        for key in ("input_ids", "position_ids", "pad_mask", "source"):
            if key in want:
                assert torch.equal(got[key], want[key]), key
        assert got["seeds"] == want["seeds"]
    assert {b["pid"] for b in alone} == {os.getpid()}
    pids = {b["pid"] for b in built}
    assert os.getpid() not in pids and len(pids) >= 2, "built by the workers"
    if collate is not None:
        assert {b["collated_by"] for b in built} == pids
    assert any(
        re.search(r"died with exit code -9; .* the packed batch of step \d+", r.getMessage())
        for r in caplog.records
    ), "a build the dead worker held was done again"


class LoggedRetokenize:
    """A row transform that keeps a row's tokens and logs the process it runs in (``pid``
    lines); with ``KILL_MARKER`` set and absent, the first worker to run it makes the marker,
    then SIGKILLs itself."""

    def __init__(self, log: Path) -> None:
        self.log = str(log)

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        _kill_once_in_a_worker()
        with open(self.log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return {"tokens": torch.as_tensor(row["tokens"], dtype=torch.int64)}


def test_a_packed_stream_s_row_transform_runs_in_its_workers(
    lakes: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With workers, the row transform that makes a packed lake's tokens runs in them (the
    token counts at the start are the loader's), a worker SIGKILLed while making a unit's
    tokens has that done again, and the samples are those that no worker gives."""

    def run(name: str, **kw: Any) -> tuple[list[list[int]], set[int]]:
        log = tmp_path / f"{name}.log"
        packing = ll.Packing("tokens", L, eos_id=EOS, pad_id=0)
        ds = ll.LakeDataset(
            lakes / "web",
            seed=3,
            num_partitions=C,
            window=64,
            packing=packing,
            transform=LoggedRetokenize(log),
        )
        with ll.DataLoader(ds, batch_size=8, **kw) as loader:
            log.write_text("")  # the token counts read every unit here first
            got = [ids_of(b) for b in itertools.islice(loader, 40)]
        return got, {int(line) for line in log.read_text().split()}

    alone, ran_alone = run("alone")
    assert ran_alone == {os.getpid()}
    monkeypatch.setenv(KILL_MARKER, str(tmp_path / "killed"))
    with pytest.warns(ll.WorkerWarning, match="exit code -9"):
        built, ran = run("workers", num_workers=2, prefetch_factor=2)
    assert built == alone
    assert os.getpid() not in ran and len(ran) >= 2, "the transform ran in the workers"


def _always_killed(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch_transform that SIGKILLs every worker that runs it."""
    if torch.utils.data.get_worker_info() is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return batch


def test_a_packed_build_that_kills_every_worker_is_given_up(lakes: Path) -> None:
    """The first packed step sent to the workers kills each worker that builds it: after
    MAX_ATTEMPTS it is given up with an error naming it, not sent again for ever."""
    packing = ll.Packing("tokens", L, eos_id=EOS, pad_id=0)
    ds = ll.LakeDataset(
        lakes / "web", seed=3, num_partitions=C, packing=packing, batch_transform=_always_killed
    )
    with (
        pytest.warns(ll.WorkerWarning, match="exit code -9"),
        ll.DataLoader(ds, batch_size=8, num_workers=2, timeout=120) as loader,
        pytest.raises(
            ll.WorkerError,
            match="packed batch of step 1 of the pass killed its worker 3 times; giving up",
        ),
    ):
        next(iter(loader))


@pytest.mark.parametrize("kind", ["mixture", "packed", "packed mixture"])
def test_transforms_that_do_not_pickle_run_in_forked_workers(lakes: Path, kind: str) -> None:
    """Each source's row transform reaches the workers with their setup (inherited by a fork),
    not with each task: a lambda works with workers as it does in torch's (it stopped them:
    "the DataLoader's workers stopped answering: PicklingError")."""
    offset = 7

    def make() -> ll.LakeDataset | ll.Mixture:
        def source(name: str, **kw: Any) -> ll.LakeDataset:
            return ll.LakeDataset(lakes / name, seed=3, num_partitions=C, window=64, **kw)

        if kind == "mixture":
            shifted = lambda row: {**row, "id": row["id"] + offset}  # noqa: E731
            parts = {n: source(n, columns=["id"], transform=shifted) for n in ("web", "code")}
            return ll.Mixture(parts, {"web": 0.6, "code": 0.4}, seed=9)
        tokens = lambda row: {"tokens": torch.as_tensor(row["tokens"]) + offset}  # noqa: E731
        packing = ll.Packing("tokens", L, eos_id=EOS, pad_id=0)
        if kind == "packed":
            return source("web", transform=tokens, packing=packing)
        parts = {n: source(n, columns=["tokens"], transform=tokens) for n in ("web", "code")}
        return ll.Mixture(parts, {"web": 0.5, "code": 0.5}, seed=9, packing=packing)

    alone = batches(make(), 20)
    assert batches(make(), 20, num_workers=2, multiprocessing_context="fork") == alone


def _fails_on_row_1034(row: dict[str, Any]) -> dict[str, Any]:
    """Fails on web's id 1034: its file 2, row 234, in row group 4."""
    if row["id"] == 1034:
        raise ValueError("the user's transform failed on row 1034")
    return row


@pytest.mark.parametrize("mixed", [False, True])
def test_a_transform_failing_in_a_worker_names_the_units_of_its_step(
    lakes: Path, mixed: bool
) -> None:
    """The worker's error names the step's units (file, row group, rows), a lake's as a
    mixture's, with the user's traceback (a mixture's named the step only)."""

    def source(name: str) -> ll.LakeDataset:
        return ll.LakeDataset(
            lakes / name, columns=["id"], seed=3, num_partitions=C, transform=_fails_on_row_1034
        )

    ds: Any = source("web")
    if mixed:
        ds = ll.Mixture({n: source(n) for n in ("web", "code")}, {"web": 0.5, "code": 0.5}, seed=9)
    with (
        ll.DataLoader(ds, batch_size=32, num_workers=2) as loader,
        pytest.raises(ll.WorkerError) as info,
    ):
        for _ in loader:
            pass
    message = str(info.value)
    assert "failed on row 1034" in message and "(its units: " in message
    assert "web/part-2.parquet, row group 4, rows [" in message, message[:600]

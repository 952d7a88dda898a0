"""Smoke test of the benchmarks: each script runs on a tiny lake and writes a complete JSON.

The peer libraries are not needed: the peers benchmark runs with this interpreter for every
loader, so peers that do not import here are skipped (which only ``--smoke`` allows, and says).
lakeloader and pyarrow always run.

The smoke runs are started together when the first of them is needed, two at a time (most of
their time is starting Python processes that import torch, one core each), and each test
checks its own run's output.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import ROOT, run_module

pytestmark = pytest.mark.slow  # each benchmark's smoke run: not in the quick tier


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = run_module(*args, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _on_lake(
    script: str, lake_flag: str | None = "--lake", *options: str
) -> Callable[[Path], list[str]]:
    """The smoke command of a benchmark that writes its lake and results in a folder."""

    def argv(folder: Path) -> list[str]:
        lake = [lake_flag, str(folder / "lake")] if lake_flag else []
        return [f"benchmarks.{script}", "--smoke", *lake, "--out", str(folder), *options]

    return argv


#: Each smoke run: its command line for an output folder, and its timeout in seconds.
SMOKES: dict[str, tuple[Callable[[Path], list[str]], float]] = {
    "peers": (
        lambda d: [
            "benchmarks.peers",
            "--smoke",
            "--work",
            str(d / "work"),
            "--out",
            str(d / "out"),
            "--bench-python",
            sys.executable,
            "--mosaic-python",
            sys.executable,
        ],
        300,
    ),
    "scale": (_on_lake("scale", None), 300),
    "scale_ranks": (_on_lake("scale_ranks", None), 300),
    "cpu_split": (_on_lake("cpu_split"), 300),
    **{s: (_on_lake(s), 400) for s in ("transforms", "array_columns", "mixture", "packing")},
    "mixture-text": (_on_lake("mixture", "--lake", "--workload", "text"), 300),
    "packing-zstd": (_on_lake("packing", "--lake", "--compression", "zstd"), 300),
    "memory": (_on_lake("memory"), 300),
    "s3_vs_local": (_on_lake("s3_vs_local", "--lake-dir"), 300),
    "latency": (_on_lake("latency", "--lake-dir"), 400),
    "train_overlap": (_on_lake("train_overlap"), 400),
    "checkpoint_latency": (lambda d: ["benchmarks.checkpoint_latency", "--quick", "--json"], 300),
    "plan_defaults": (
        lambda d: ["benchmarks.plan_defaults", "--quick", "--json", "--jobs", "1"],
        300,
    ),
}


@pytest.fixture(scope="module")
def smoke(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], tuple[subprocess.CompletedProcess[str], Path]]]:
    """``smoke(name)``: that run's result and output folder (all runs start at the first call)."""
    root = tmp_path_factory.mktemp("smokes")
    pool = ThreadPoolExecutor(max_workers=2)
    futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}

    def get(name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        if not futures:
            for key, (argv, timeout) in SMOKES.items():
                (root / key).mkdir()
                futures[key] = pool.submit(_run, *argv(root / key), timeout=timeout)
        return futures[name].result(), root / name

    yield get
    pool.shutdown(wait=True, cancel_futures=True)


def test_reference_lake_is_deterministic_and_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks/ is not a package that is installed
    from benchmarks.reference_lake import (
        ALL_COLUMNS,
        MARKER,
        NUMERIC_COLUMNS,
        write_reference_lake,
    )

    a = write_reference_lake(tmp_path / "a", files=2, row_groups=2, rows_per_group=100, seed=3)
    b = write_reference_lake(tmp_path / "b", files=2, row_groups=2, rows_per_group=100, seed=3)
    first = (a / "part-00001.parquet").read_bytes()
    assert first == (b / "part-00001.parquet").read_bytes()
    mtime = (a / MARKER).stat().st_mtime_ns
    write_reference_lake(a, files=2, row_groups=2, rows_per_group=100, seed=3)
    assert (a / MARKER).stat().st_mtime_ns == mtime  # the same parameters: nothing rewritten
    write_reference_lake(a, files=1, row_groups=2, rows_per_group=100, seed=3)
    assert sorted(p.name for p in a.glob("part-*")) == ["part-00000.parquet"]
    meta = pq.ParquetFile(a / "part-00000.parquet").metadata
    assert meta.num_row_groups == 2
    assert meta.row_group(0).column(0).compression == "ZSTD"
    table = pq.read_table(b)
    assert table.column_names == ALL_COLUMNS
    assert ALL_COLUMNS[:-1] == NUMERIC_COLUMNS
    assert table.column("id").to_pylist() == list(range(400))


def test_peers_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    result, folder = smoke("peers")
    out = folder / "out"
    report = json.loads((out / "peers-smoke.json").read_text())
    assert (out / "peers-smoke.md").read_text().startswith("# Peers")
    for kind in ("numeric", "text"):
        rows = {r["loader"]: r for r in report["runs"][kind]}
        for name in ("pyarrow-dataset", "lakeloader-w0", "lakeloader-w2"):
            assert rows[name]["ok"], rows[name]
            assert rows[name]["rows"] == report["setup"]["lake_info"]["rows"]
            assert rows[name]["peak_rss_tree"] > 0
            assert rows[name]["dtypes"]["label"] == "Tensor torch.int32"
        assert rows["pyarrow-dataset"]["x_reference"] == 1.0
        ran_or_skipped = set(rows) | set(report["skipped"])
        assert {"torch-map", "torchdata", "hf-streaming", "litdata", "mosaic"} <= ran_or_skipped
    assert ("text" in rows["lakeloader-w2"]["dtypes"]) is True
    for name in report["skipped"]:
        assert f"skipped {name}" in result.stdout


def test_scale_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    _, tmp_path = smoke("scale")
    report = json.loads((tmp_path / "scale-smoke.json").read_text())
    assert report["planning"]["units"] == 10_000
    for topo in report["lake"]["topologies"]:
        assert topo["state_bytes"] < 1024
        assert set(topo["recovery"]) == {"state_s", "plan_s", "reassign_s", "total_s"}


def test_scale_ranks_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    _, tmp_path = smoke("scale_ranks")
    report = json.loads((tmp_path / "scale-ranks-smoke.json").read_text())
    assert [r["ranks"] for r in report["gloo"]] == [2, 4]
    assert all(r["barrier_ms"] > 0 and r["state_bytes"] < 4096 for r in report["gloo"])
    assert [r["ranks"] for r in report["threaded"]] == [2, 16]
    restart = report["restart"]
    assert restart["ranks"] == 4 and restart["total_s"] >= restart["restart_s"] > 0
    assert not list(Path("/tmp").glob("lakeloader-bench-ranks-*")), "the work folder is removed"


def test_cpu_split_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    _, tmp_path = smoke("cpu_split")
    report = json.loads((tmp_path / "cpu_split-smoke.json").read_text())
    for name in ("pyarrow-dataset", "lakeloader-w0", "lakeloader-w2"):
        run = report["best"][name]
        assert run["batches"] == 16 and run["wall_s"] > 0 and run["main_thread_cpu_s"] > 0
    assert report["best"]["lakeloader-w2"]["workers_cpu_s"] > 0


@pytest.mark.parametrize(
    ("script", "tables"),
    [
        ("transforms", ("row_ratios", "batch_ratios")),
        ("array_columns", ("ratios",)),
        ("mixture", ("ratios",)),
        ("packing", ("ratios", "workers_ratios")),
        ("packing-zstd", ("ratios", "workers_ratios")),
        ("mixture-text", ("ratios",)),
    ],
)
def test_issue13_benchmarks_smoke(
    smoke: Callable[[str], tuple[Any, Path]], script: str, tables: tuple[str, ...]
) -> None:
    _, tmp_path = smoke(script)
    report = json.loads((tmp_path / f"{script}-smoke.json").read_text())
    for table in tables:  # every loader ran and was measured against the reference
        assert report[table] and all(r["rows_per_s"][0] > 0 for r in report[table].values())
    assert "failed" not in (tmp_path / f"{script}-smoke.md").read_text()


@pytest.mark.parametrize(
    ("script", "table", "w0", "w2"),
    [
        ("mixture-text", "ratios", "mixture-text-w0", "mixture-text-w2"),
        ("packing-zstd", "workers_ratios", "lakeloader-w0", "lakeloader-w2"),
        ("mixture", "ratios", "mixture-w0", "mixture-w2"),
        ("mixture", "ratios", "single-w0", "single-w2"),  # a lake's workers: they run today
    ],
)
def test_workers_row_has_a_rate_only_if_workers_ran(
    smoke: Callable[[str], tuple[Any, Path]], script: str, table: str, w0: str, w2: str
) -> None:
    _, tmp_path = smoke(script)
    report = json.loads((tmp_path / f"{script}-smoke.json").read_text())
    markdown = (tmp_path / f"{script}-smoke.md").read_text()
    zero, two = report["runs"][w0][0], report["runs"][w2][0]
    assert zero["rows_per_s"] > 0 and zero["worker_cpu_s"] == 0
    module = importlib.import_module(f"benchmarks.{script.split('-')[0]}")
    label = module.LOADERS[w2][0]
    row = next(line for line in markdown.splitlines() if line.startswith(f"| {label}"))
    if "not_measured" in two:  # today's text mixture: the reference says how it tokenised
        assert w2 not in report[table] and "not measured: " in row
        assert "training loop" in zero["note"]
    elif two["worker_cpu_s"] == 0:  # asked for workers, and none ran: no rate, and the row says so
        assert w2 not in report[table] and "no workers started" in row
    else:
        assert report[table][w2]["ratio"][0] > 0 and "note" not in zero
        assert "no workers" not in row and "not measured" not in row


def test_steady_ratio_table_credits_workers_only_when_they_ran() -> None:
    from benchmarks._steady import ratio_table

    def run(rate: float, cpu: float, **more: Any) -> list[dict[str, Any]]:
        return [{"rows_per_s": rate, "worker_cpu_s": cpu, "rep": 0, **more}]

    samples = {
        "w0": run(100.0, 0.0, note="in the loop"),
        "w2": run(180.0, 1.5, seconds=2.0, cpu_s=1.0),
        "idle": run(150.0, 0.0),
        "off": [{"not_measured": "no such option", "worker_cpu_s": 0.0, "rep": 0}],
    }
    labels = {"w0": "zero", "w2": "two", "idle": "idle", "off": "off"}
    table, data = ratio_table(samples, "w0", labels, {"w2", "idle", "off"})
    assert set(data) == {"w0", "w2"} and data["w2"]["ratio"] == [1.8]
    lines = table.splitlines()
    assert lines[2].startswith("| zero (in the loop) | 100 | 1 |")
    assert lines[3] == "| two | 180 | 1.8 | 1.80-1.80 | 1.25 |"  # (1.0 + 1.5) CPU s in 2 s
    idle = "no workers started (rep 0: no child process used CPU)"
    assert lines[4] == f"| idle | - | - | {idle} | - |"
    assert lines[5] == "| off | - | - | not measured: no such option | - |"


#: Run alone in a process of its own (this one has the smoke runs for children): a child
#: that burns 0.3 s of CPU is counted once exited, and another while it lives.
_COUNT_CHILDREN = """
import subprocess, sys, time
from benchmarks._steady import worker_cpu_seconds
burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"
assert worker_cpu_seconds() == 0
subprocess.run([sys.executable, "-c", burn], check=True)
exited = worker_cpu_seconds()
assert exited >= 0.25, exited
live = subprocess.Popen([sys.executable, "-c", burn + "\\ntime.sleep(30)"])
deadline = time.monotonic() + 30
while worker_cpu_seconds() - exited < 0.25:
    assert time.monotonic() < deadline, "a live child's CPU was not counted"
    time.sleep(0.05)
live.kill()
live.wait()
"""


def test_worker_cpu_seconds_counts_exited_and_live_children() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _COUNT_CHILDREN], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_memory_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    _, tmp_path = smoke("memory")
    report = json.loads((tmp_path / "memory-smoke.json").read_text())
    assert {(r["workers"], r["budget"]) for r in report["runs"]} == {(w, 2**20) for w in (0, 2)}
    assert all(r["rows"] == 80_000 and r["peak_pss_plus_shm"] > 0 for r in report["runs"])


def test_s3_vs_local_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    _, tmp_path = smoke("s3_vs_local")
    report = json.loads((tmp_path / "s3_vs_local_smoke.json").read_text())
    assert set(report["passes"]) >= {"local", "s3", "s3+proxy"}
    assert all(p["rows_per_s"] > 0 for passes in report["passes"].values() for p in passes)


def test_latency_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    _, tmp_path = smoke("latency")
    report = json.loads((tmp_path / "latency-smoke.json").read_text())
    got = {(r["store"], r["delay_ms"], r["workers"]) for r in report["table"]}
    stores = [("local", 0)] + [(s, d) for s in ("s3", "gcs") for d in (0, 20)]
    assert got == {(s, d, w) for s, d in stores for w in (0, 2)}
    for row in report["table"]:
        assert row["rows_per_s"] > 0 and row["units"] == 16
        # One ranged GET per unit in the epoch on a store (footers came with the open).
        assert row["epoch_requests"] == (0 if row["store"] == "local" else 16), row


def test_train_overlap_smoke(smoke: Callable[[str], tuple[Any, Path]]) -> None:
    _, tmp_path = smoke("train_overlap")
    report = json.loads((tmp_path / "train_overlap-smoke.json").read_text())
    for step in ("0.5", "2.0"):
        runs = report[step]["runs"]
        assert set(runs) == {f"sleep-{step}", f"w0-{step}", f"w2-{step}"}
        assert all(r[0]["rows_per_s"] > 0 and r[0]["rows"] == 6_000 for r in runs.values())
        assert all(r[0]["next_us_median"] > 0 for k, r in runs.items() if k != f"sleep-{step}")


@pytest.mark.parametrize("name", ["checkpoint_latency", "plan_defaults"])
def test_checkpoint_and_plan_benchmarks_smoke(
    smoke: Callable[[str], tuple[Any, Path]], name: str
) -> None:
    result, _ = smoke(name)
    assert json.loads(result.stdout)

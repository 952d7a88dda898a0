"""Shared fixtures and helpers: small generated lakes with a unique row id, their reference
epochs, multi-rank collection, random epoch plans (hypothesis), and running a module."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import settings
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.order.plan import EpochPlan, make_units, plan_epoch

ROOT = Path(__file__).resolve().parents[1]

#: What this suite's tools could leave in the temporary folder: weed's glog files, torchrun's
#: log folders, the benchmarks' and the examples' folders. Only such names are compared, so
#: that what other processes make there meanwhile is not taken for the suite's.
TMP_PATTERNS = ("weed.*", "torchelastic_*", "lakeloader-*", "train_ft-*")


#: Long tests (3 s or more each, measured with ``--durations=0`` on 2 busy cores) in modules
#: that are otherwise quick; modules of long tests carry ``pytestmark = pytest.mark.slow``
#: instead. ``pytest -m "not slow"`` is the quick tier (docs/testing.md). An entry names a
#: test function (all its parameters) or one parametrized case.
SLOW_TESTS = frozenset(
    {
        "test_parquet_testing.py::test_file_streams_like_pyarrow[large_string_map.brotli.parquet]",
        "test_checkpoint_store.py::test_checkpoint_save_and_load_ride_out_a_store_restart",
        "test_mixture.py::test_resume_at_20_random_points_under_other_topologies",
        "test_follow.py::test_ranks_under_torchrun_take_the_same_increments",
        "test_follow.py::test_a_sigkill_and_a_resume_on_two_ranks_deliver_every_appended_row_once",
        "test_preemption.py::test_a_loop_that_never_checks_exits_with_the_signal_status_at_the_"
        "deadline",
        "test_preemption.py::test_a_loop_that_checks_stops_at_the_next_step_and_exits_zero",
        "test_faultproxy.py::test_the_restartable_store_keeps_its_objects",
        "test_faultproxy.py::test_a_fraction_of_503s_is_retried_through",
        "test_direct_reads.py::test_pooled_connections_survive_a_store_restart",
        "test_packing.py::test_resume_from_rank_0_state_at_20_random_points_under_other_shapes",
        "test_checkpoint.py::test_ranks_that_disagree_are_named",
        "test_loader_api.py::test_timeout",
        "test_transforms.py::test_tokens_and_embeddings_example_runs",
        "test_packed_mixture.py::test_resume_under_other_shapes_with_new_weights_and_a_source_"
        "added",
        "test_ft.py::test_a_group_killed_and_one_joining_leave_every_row_exactly_once",
        "test_demo.py::test_the_demo_passes_its_own_audit",
        "test_usability.py::test_a_spawned_process_continues_a_loader_where_it_stood",
        "test_cli_usage.py::test_a_store_that_does_not_answer_is_given_up_after_retry_seconds",
        "test_cli_usage.py::test_each_damaged_checkpoint_is_named_once",
        "test_audit_unattached.py::test_a_loop_that_really_doubles_or_loses_rows_fails_the_audit",
        "test_audit_unattached.py::test_a_history_the_ledger_did_not_see_is_unverified",
        "test_audit_unattached.py::test_a_readme_loop_without_attach_passes_after_a_crash_and_a_"
        "resize",
        "test_warnings.py::test_warnings_reach_stderr_without_any_logging_set_up",
        "test_loader_in_frameworks.py::test_a_loader_made_before_the_process_group_takes_its_"
        "rank_in_each_process",
        "test_streaming_read.py::test_any_row_range_streams_like_the_row_group_read_whole",
        "test_worker_kills.py::test_a_replacement_worker_ends_on_sigterm",
        "test_packing_user_code.py::test_exact_resume_from_rank_0_state_under_other_shapes",
        "test_mixture.py::test_the_same_global_sequence_under_any_topology",
        "test_quality.py::test_mypy_strict_finds_nothing",
        # about 2 s each: out of the quick tier to keep it under 3 minutes with room
        "test_follow_drop_last.py::test_the_batches_of_a_growing_lake_are_the_same_on_every_"
        "world_size",
        "test_warnings.py::test_a_lake_warning_in_a_worker_process_is_issued_in_the_loaders",
        "test_transforms.py::test_same_order_and_exact_resume_through_transforms",
        "test_backfill.py::test_a_state_resumes_under_another_topology",
        "test_packing_growth.py::test_a_checkpoint_after_the_resume_continues_with_the_same_"
        "samples",
        "test_mixture_growth.py::test_a_rollback_to_its_own_state_and_workers_on_either_side_"
        "of_the_saved_epochs_end",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``SLOW_TESTS`` slow; warn about entries that name no test of a module collected."""
    matched = set()
    for item in items:
        function = getattr(item, "originalname", item.name)
        for key in (f"{item.path.name}::{item.name}", f"{item.path.name}::{function}"):
            if key in SLOW_TESTS:
                item.add_marker(pytest.mark.slow)
                matched.add(key)
    if any("::" in arg for arg in config.args):
        return  # tests picked by name: the others' entries match nothing, as they should
    modules = {item.path.name for item in items}
    stale = sorted(e for e in SLOW_TESTS - matched if e.split("::")[0] in modules)
    if stale:
        warnings.warn(
            pytest.PytestWarning(
                f"tests/conftest.py SLOW_TESTS names tests that do not exist (renamed or "
                f"removed?): {', '.join(stale)}; the quick tier now runs what they became"
            ),
            stacklevel=1,
        )


def left_in(folders: Sequence[Path]) -> set[str]:
    """Paths of entries of ``folders`` whose names match ``TMP_PATTERNS``.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     for name in ("weed.INFO", "torchelastic_x1", "lakeloader-b", "pytest-of-me", "x"):
    ...         Path(d, name).mkdir()
    ...     sorted(Path(p).name for p in left_in([Path(d)]))
    ['lakeloader-b', 'torchelastic_x1', 'weed.INFO']
    """
    return {str(p) for folder in folders for pattern in TMP_PATTERNS for p in folder.glob(pattern)}


def _ours_in_tmp(names: bool = True) -> set[str]:
    """What ``left_in`` finds in /tmp and the temporary folder (``names``), and the gRPC
    sockets that the weed servers of this process left in /tmp."""
    found = left_in(sorted({Path("/tmp"), Path(tempfile.gettempdir())})) if names else set()
    stores = sys.modules.get("tests.stores")
    if stores is not None:
        found |= {str(sock) for sock in stores.weed_sockets(stores.WEED_PORTS)}
    return found


def _in_xdist(config: pytest.Config) -> bool:
    """Whether pytest-xdist runs the tests in worker processes (``-n``)."""
    return hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None) not in (
        None,
        0,
    )


def _left(before: set[str], after: set[str]) -> str | None:
    """What a session left in the temporary folder, said, or None."""
    left = sorted(after - before)
    if not left:
        return None
    return (
        f"the test session left in the temporary folder: {', '.join(left)}; whatever makes "
        "them should write under tmp_path (if other test sessions ran meanwhile, some may be "
        "theirs)"
    )


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_in_tmp(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the session if it leaves in /tmp what its servers, torchrun runs, examples or
    benchmarks make (pytest's own ``tmp_path`` folders, which it cleans, are not looked at).

    Under pytest-xdist a worker checks only its own servers' sockets (the other workers'
    tests are under way meanwhile): the names are compared once all workers are done, by
    :func:`pytest_sessionfinish` in the controlling process.
    """
    names = not _in_xdist(request.config)
    before = _ours_in_tmp(names)
    yield
    left = _left(before, _ours_in_tmp(names))
    if left:
        pytest.fail(left, pytrace=False)


_BEFORE = pytest.StashKey[set[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist, note what the temporary folder holds before any worker starts."""
    if _in_xdist(session.config) and not hasattr(session.config, "workerinput"):
        session.config.stash[_BEFORE] = left_in([Path("/tmp"), Path(tempfile.gettempdir())])


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, fail the run if the workers left in the temporary folder what
    ``TMP_PATTERNS`` names (the workers are done by now)."""
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    left = _left(before, left_in([Path("/tmp"), Path(tempfile.gettempdir())]))
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write(f"\nFAILED {left}\n", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def write_lake(
    root: Path,
    layout: Sequence[Sequence[int]],
    *,
    hive: bool = False,
    seed: int = 0,
) -> int:
    """Write one file per entry of ``layout``, each with row groups of the given sizes.

    Every row gets a unique ``id`` (0..N-1 in path order), a float ``x`` derived from it, a
    string ``s`` and an int32 ``label``. Returns N.
    """
    rng = np.random.default_rng(seed)
    next_id = 0
    for i, row_groups in enumerate(layout):
        folder = root / (f"part={i % 3}" if hive else "")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"file-{i:04d}.parquet"
        schema = pa.schema(
            [("id", pa.int64()), ("x", pa.float32()), ("s", pa.string()), ("label", pa.int32())]
        )
        with pq.ParquetWriter(path, schema) as writer:
            for n in row_groups:
                ids = np.arange(next_id, next_id + n, dtype=np.int64)
                writer.write_table(
                    pa.table(
                        {
                            "id": ids,
                            "x": (ids * 0.5).astype(np.float32),
                            "s": [f"row-{j}" for j in ids],
                            "label": rng.integers(0, 10, n).astype(np.int32),
                        },
                        schema=schema,
                    ),
                    row_group_size=max(1, n),
                )
                next_id += n
    return next_id


def damage_row_group(path: Path, rg: int) -> None:
    """Overwrite the middle of every column chunk of one row group (the footer stays intact).

    The damage only shows when that row group is read: the file still opens and lists.
    """
    meta = pq.read_metadata(path)
    data = bytearray(path.read_bytes())
    group = meta.row_group(rg)
    for i in range(group.num_columns):
        col = group.column(i)
        start = col.dictionary_page_offset or col.data_page_offset
        lo = start + 8
        hi = start + col.total_compressed_size - 2
        data[lo:hi] = b"\xff" * (hi - lo)
    path.write_bytes(bytes(data))


#: A layout with uneven files, an empty file (no row groups) and an empty row group.
LAYOUT = [[300, 200], [], [50, 0, 250], [400], [123, 77, 100]]
LAYOUT_ROWS = sum(sum(f) for f in LAYOUT)


@pytest.fixture(scope="session")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lake")
    write_lake(root, LAYOUT)
    return root


def layout_dataset(root: Path, **kwargs: Any) -> ll.LakeDataset:
    """The dataset of a ``LAYOUT`` lake, with the order settings every test shares."""
    return ll.LakeDataset(root, seed=7, num_partitions=4, window=64, max_unit_rows=128, **kwargs)


@pytest.fixture(scope="session")
def dataset(lake: Path) -> ll.LakeDataset:
    return layout_dataset(lake)


@pytest.fixture
def own_lake(tmp_path: Path) -> Path:
    """A ``LAYOUT`` lake of the test's own, which it may change."""
    root = tmp_path / "lake"
    write_lake(root, LAYOUT)
    return root


#: Rows of a global batch in the reference epoch of ``dataset``.
GLOBAL_BATCH = 48


@pytest.fixture(scope="session")
def reference(dataset: ll.LakeDataset) -> list[list[int]]:
    """The global batches of epoch 0 of ``dataset`` (one rank, ``GLOBAL_BATCH`` rows each)."""
    return run_epoch(dataset, 1, batch_size=GLOBAL_BATCH)


@pytest.fixture(scope="session")
def slot_order(dataset: ll.LakeDataset) -> list[int]:
    """Row id at each global slot of epoch 0 of ``dataset`` (batches of one row are slots)."""
    return [i for b in run_epoch(dataset, 1, batch_size=1) for i in b]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """A state after a msgpack trip, as a checkpoint would give it back."""
    out: dict[str, Any] = msgpack.unpackb(msgpack.packb(state), raw=False)
    return out


def make_loaders(ds: ll.LakeDataset, world_size: int, **kwargs: Any) -> list[ll.DataLoader]:
    return [ll.DataLoader(ds, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


def global_batches(loaders: Sequence[ll.DataLoader]) -> Iterator[list[int]]:
    """Iterate all ranks in lockstep; yield each global batch as row ids in rank order."""
    for shares in zip(*(iter(loader) for loader in loaders), strict=True):
        yield list(itertools.chain.from_iterable(s["id"].tolist() for s in shares))


def run_epoch(ds: ll.LakeDataset, world_size: int, **kwargs: Any) -> list[list[int]]:
    loaders = make_loaders(ds, world_size, **kwargs)
    try:
        return list(global_batches(loaders))
    finally:
        for loader in loaders:
            loader.close()


def checkpointed(ds: Any, world_size: int, batch_size: int, steps: int, folder: Path) -> list[int]:
    """Run ``steps`` global batches on ``world_size`` ranks, save a checkpoint to ``folder``,
    close the loaders; the row ids delivered."""
    loaders = make_loaders(ds, world_size, batch_size=batch_size)
    seen = [i for b in itertools.islice(global_batches(loaders), steps) for i in b]
    ll.CheckpointManager(str(folder)).save(steps, loaders[0])
    for loader in loaders:
        loader.close()
    return seen


def torchrun_command(
    nproc: int, script: Path, *args: str, max_restarts: int = 0, log_dir: str = os.devnull
) -> list[str]:
    """``torchrun`` of ``script`` on ``nproc`` local ranks, rendezvous on loopback only.

    ``log_dir`` is torchrun's folder for the ranks' error files; left out, torchrun makes a
    ``torchelastic_*`` folder in /tmp at every launch and leaves it there, so by default it
    keeps none (the ranks' output goes to the caller's pipes either way).
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--local-addr=127.0.0.1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        f"--log-dir={log_dir}",
        str(script),
        *args,
    ]


#: The environment of every torchrun launch: one intra-op thread, gloo on loopback.
TORCHRUN_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def wait_dead(pid: int, sent: str = "SIGKILL") -> None:
    """Wait until a process sent ``sent`` is dead and its parent can reap it.

    The main thread turns zombie first; the process is only dead, and its pipes closed, once
    its other threads (pyarrow's, torch's) have exited too, and it becomes waitable a moment
    after its last thread leaves ``/proc/PID/task``. For a child of this process, ``waitid``
    with ``WNOWAIT`` says exactly when it is waitable, without reaping it (the pool's own
    ``waitpid`` must do that); for others, ``/proc`` is the best signal.
    """
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
            time.sleep(0.001)
            continue
        except ChildProcessError:  # not a child of this process, or reaped already
            pass
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            threads = len(os.listdir(f"/proc/{pid}/task"))
        except (FileNotFoundError, ProcessLookupError):  # reaped already
            return
        if state in ("Z", "X") and threads <= 1:
            return
        time.sleep(0.001)
    raise AssertionError(f"worker {pid} survived {sent} for 10 s")


def run_module(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m *args`` from the repository's root with this interpreter, output captured."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ----------------------------------------------------------------- random epoch plans

FAST = settings(max_examples=80, deadline=None)
SLOW = settings(max_examples=50, deadline=None)

# Row counts are biased towards 0 and small values so that empty row groups, row groups smaller
# than a unit and row groups cut into several units all show up often.
row_counts = st.one_of(st.just(0), st.integers(1, 8), st.integers(0, 60))
layouts = st.lists(st.lists(row_counts, max_size=5), max_size=6)  # N <= 6 * 5 * 60 = 1800
small_layouts = st.lists(st.lists(row_counts, max_size=4), max_size=4)  # N <= 960
seeds = st.integers(-(2**63), 2**64 - 1)
epochs = st.integers(0, 1000)


@st.composite
def plans(draw: st.DrawFn, layout: st.SearchStrategy[list[list[int]]] = layouts) -> EpochPlan:
    """A random epoch plan over a random layout (C may exceed N, windows may be tiny)."""
    units = make_units(draw(layout), draw(st.integers(1, 40)))
    return plan_epoch(
        units,
        seed=draw(seeds),
        epoch=draw(epochs),
        shuffle=draw(st.booleans()),
        num_partitions=draw(st.integers(1, 20)),
        window=draw(st.integers(1, 50)),
    )


def running(pid: int) -> bool:
    """Whether a process exists and is not a zombie (an exited child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or between open and read
        return False


def double_a_step(root: Path, epoch: int) -> tuple[int, int]:
    """Make a run's ledger say that the head attempt trained on a step of ``epoch`` twice.

    The head attempt's last step of ``epoch`` is appended once more (a new segment), and the
    head checkpoint's save entry is moved after it, as a loader that re-delivered it would
    have written. Returns the doubled positions ``[start, stop)``.
    """
    from lakeloader.audit.ledger import LEDGER_DIR
    from lakeloader.audit.records import SaveEntry, StepEntry, dump_entry

    segments = sorted((root / LEDGER_DIR).glob("*/*.jsonl"))
    lines = [json.loads(x) for p in segments for x in p.read_text().splitlines()]
    save = max((x for x in lines if x["type"] == "save"), key=lambda x: (x["attempt"], x["seq"]))
    attempt = save["attempt"]
    steps = [x for x in lines if x["type"] == "step" and x["attempt"] == attempt]
    victim = max((x for x in steps if x["epoch"] == epoch), key=lambda x: x["seq"])
    seq = max(x["seq"] for x in steps) + 1
    again = StepEntry(
        attempt,
        seq,
        epoch,
        victim["start"],
        victim["stop"],
        victim["num_rows"],
        victim["world_size"],
        victim["batch_size"],
    )
    moved = SaveEntry(attempt, save["step"], seq, save["epoch"], save["position"], save["start"])
    (root / LEDGER_DIR / attempt / "999999999999-doubled.jsonl").write_text(
        dump_entry(again) + "\n" + dump_entry(moved) + "\n"
    )
    return victim["start"], victim["stop"]

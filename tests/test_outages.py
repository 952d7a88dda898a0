"""Bad minutes of an object store: outages, flaky answers, a store that stays down, and what
each read costs in requests.

The store is a real SeaweedFS on loopback; faults come from tests/faultproxy.py (a loopback
proxy between s3fs and the store) or from stopping the server itself. Every run is compared
with the same lake read from a local folder: the same global sequence, every row once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from tests.conftest import global_batches, make_loaders, roundtrip, write_lake
from tests.faultproxy import FaultProxy, Faults
from tests.stores import ObjectStore, RestartableStore

pytest_plugins = ["tests.stores", "tests.faultproxy"]

#: 12 files x 4 row groups x 250 rows: enough units that an epoch keeps fetching throughout.
LAYOUT = [[250] * 4] * 12
ROWS = 12_000
ORDER: dict[str, Any] = {"seed": 11, "num_partitions": 4, "window": 500}
#: Small enough that units are fetched as the epoch goes, not all at its start.
SMALL_CACHE = {"cache_bytes": 40_000, "io_threads": 2}
#: That budget is below what some steps hold, on purpose: the loader says so, as it should.
pytestmark = [
    pytest.mark.slow,  # store outages: not in the quick tier
    pytest.mark.filterwarnings("ignore::lakeloader.CacheBudgetWarning"),
]


@pytest.fixture(scope="module")
def local_lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("outage-lake")
    write_lake(root, LAYOUT)
    return root


def _upload(store: ObjectStore, lake: Path) -> str:
    return store.upload(lake, "outage")[1]


def _reference(lake: Path, world_size: int, batch_size: int) -> list[int]:
    loaders = make_loaders(ll.LakeDataset(lake, **ORDER), world_size, batch_size=batch_size)
    rows = list(itertools.chain.from_iterable(global_batches(loaders)))
    for loader in loaders:
        loader.close()
    return rows


@contextlib.contextmanager
def _report(timeline: list[tuple[str, float]], failures: list[BaseException]) -> Iterator[None]:
    """Add the outage's timeline and the restarter's failures to any error."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"outage timeline (s): {timeline}; restarter failures: {failures!r}")
        raise


def test_the_store_down_for_ten_seconds_mid_epoch(
    restartable_s3_store: RestartableStore,
    local_lake: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = restartable_s3_store
    url = _upload(store, local_lake)
    retry = ll.RetryPolicy(deadline=90)
    ds = ll.LakeDataset(url, storage_options=store.storage_options, retry=retry, **ORDER)
    loaders = make_loaders(ds, 2, batch_size=50, num_workers=1, **SMALL_CACHE)
    timeline: list[tuple[str, float]] = []
    began = time.monotonic()

    def mark(event: str) -> None:
        timeline.append((event, round(time.monotonic() - began, 2)))

    failures: list[BaseException] = []
    done = threading.Event()

    def outage() -> None:
        try:
            mark("server stopping")
            mark(f"server stopped (took {store.stop():.1f} s)")
            time.sleep(10)
            mark(f"server started (ready in {store.start():.1f} s)")
        except BaseException as exc:  # surfaced by the test thread
            failures.append(exc)
            raise
        finally:
            # The server dies with the thread that started it (PR_SET_PDEATHSIG follows the
            # forking thread), so this thread lives until the epoch is over.
            done.wait()

    rows: list[int] = []
    restarter: threading.Thread | None = None
    last_batch_before = first_batch_after = -1.0
    with caplog.at_level(logging.WARNING, logger="lakeloader"), _report(timeline, failures):
        for step, batch in enumerate(global_batches(loaders)):
            rows += batch
            if step == 15:
                restarter = threading.Thread(target=outage)
                restarter.start()
                while not timeline:
                    time.sleep(0.01)
                last_batch_before = time.monotonic() - began
            elif restarter is not None and first_batch_after < 0 and len(timeline) == 3:
                first_batch_after = time.monotonic() - began
                mark(f"first batch after the restart (step {step})")
    assert restarter is not None
    done.set()
    restarter.join()
    assert not failures, failures
    for loader in loaders:
        loader.close()
    retries = [r for r in caplog.records if "transient storage error" in r.getMessage()]
    mark(f"epoch done; {len(retries)} retries logged")
    with capsys.disabled():
        print(f"\noutage timeline (s): {timeline}; last batch before {last_batch_before:.2f}")
    assert rows == _reference(local_lake, 2, 50), "the same sequence: every row once"
    assert retries, "the retries are logged"
    assert all(url.split("://")[1].split("/")[0] in r.getMessage() for r in retries)
    assert "testsecret" not in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_a_flaky_store_loses_and_doubles_nothing(
    s3_store: ObjectStore, s3_proxy: FaultProxy, local_lake: Path, workers: int
) -> None:
    url = _upload(s3_store, local_lake)
    s3_proxy.seed(workers)
    with s3_proxy.faults(Faults(error_rate=0.15, drop_rate=0.08, truncate_rate=0.08)):
        ds = ll.LakeDataset(url, storage_options=s3_proxy.storage_options, **ORDER)
        loaders = make_loaders(ds, 3, batch_size=40, num_workers=workers, **SMALL_CACHE)
        rows = list(itertools.chain.from_iterable(global_batches(loaders)))
        for loader in loaders:
            loader.close()
        injected = s3_proxy.faults_injected()
    assert rows == _reference(local_lake, 3, 40)
    assert {"error", "drop", "truncate"} <= set(injected), injected
    assert all(not loader.quarantine for loader in loaders), "never quarantined"


def test_a_store_that_stays_down_fails_clearly_and_the_state_resumes(
    s3_store: ObjectStore, s3_proxy: FaultProxy, local_lake: Path
) -> None:
    url = _upload(s3_store, local_lake)
    ds = ll.LakeDataset(
        url,
        storage_options=s3_proxy.storage_options,
        retry=ll.RetryPolicy(deadline=4, initial_delay=0.2),
        **ORDER,
    )
    loader = ll.DataLoader(ds, batch_size=60, **SMALL_CACHE)
    seen: list[int] = []
    it = iter(loader)
    for batch in itertools.islice(it, 10):
        seen += batch["id"].tolist()
    state = roundtrip(loader.state_dict())
    s3_proxy.down("refuse")
    began = time.monotonic()
    with pytest.raises(ll.StoreUnavailableError) as err:
        for batch in it:
            seen += batch["id"].tolist()
    waited = time.monotonic() - began
    message = str(err.value)
    assert message.startswith(url.rstrip("/").rsplit("/", 1)[0]), message
    assert "retry deadline 4 s" in message and "last cause:" in message
    assert "testsecret" not in message
    assert waited < 30
    delivered = loader.state_dict()["position"]
    assert delivered == len(seen), "the position counts what was delivered, no more"
    loader.close()
    s3_proxy.up()
    # the state taken before the outage resumes, under another topology, exactly once
    again = make_loaders(
        ll.LakeDataset(url, storage_options=s3_proxy.storage_options, **ORDER), 2, batch_size=30
    )
    for resumed in again:
        resumed.load_state_dict(state)
    rest = list(itertools.chain.from_iterable(global_batches(again)))
    for resumed in again:
        resumed.close()
    before = seen[: state["position"]]
    assert sorted(before + rest) == list(range(ROWS))


def test_one_get_per_footer_and_each_unit_fetched_once(
    s3_store: ObjectStore, s3_proxy: FaultProxy, local_lake: Path
) -> None:
    url = _upload(s3_store, local_lake)
    s3_proxy.reset()
    ds = ll.LakeDataset(url, storage_options=s3_proxy.storage_options, columns=["id", "x"], **ORDER)
    listing = s3_proxy.reset()
    files = sorted(p.name for p in local_lake.glob("*.parquet"))
    gets = Counter(e.path.rsplit("/", 1)[-1] for e in listing if e.method == "GET" and e.range)
    assert gets == dict.fromkeys(files, 1), "one ranged GET per footer"
    heads = [e for e in listing if e.method == "HEAD" and e.path.endswith(".parquet")]
    assert not heads, "sizes and versions come from the listing"

    loader = ll.DataLoader(ds, batch_size=60, **SMALL_CACHE)
    assert sum(b["id"].numel() for b in loader) == ROWS
    reads = [e for e in s3_proxy.reset() if e.method == "GET" and e.range]
    plan = ds.plan(0)
    pieces = Counter(
        (files[int(plan.units.file_index[u])], int(plan.units.row_group[u]))
        for u in plan.piece_unit.tolist()
    )
    fetched = Counter()
    for e in reads:
        name = e.path.rsplit("/", 1)[-1]
        first, _ = e.byte_range or (0, -1)
        meta = pq.read_metadata(local_lake / name)
        for rg in range(meta.num_row_groups):
            cols = [meta.row_group(rg).column(i) for i in range(meta.num_columns)]
            starts = [c.dictionary_page_offset or c.data_page_offset for c in cols]
            ends = [s + c.total_compressed_size for s, c in zip(starts, cols, strict=True)]
            if min(starts) <= first < max(ends):
                fetched[(name, rg)] += 1
    assert len(reads) == sum(pieces.values()), "no footer fetched again, one GET per unit"
    assert fetched == pieces, "each unit of the plan fetched once"
    selected = sum(
        c.total_compressed_size
        for name in files
        for rg_meta in [pq.read_metadata(local_lake / name)]
        for rg in range(rg_meta.num_row_groups)
        for c in [rg_meta.row_group(rg).column(i) for i in range(rg_meta.num_columns)]
        if c.path_in_schema in ("id", "x")
    )
    sent = sum(e.body_bytes for e in reads)
    assert selected <= sent <= selected + 64 * 1024 * len(reads), (sent, selected)

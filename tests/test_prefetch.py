"""Fetching ahead of decoding: the sizing rule, and fetches in flight on a slow real S3 store.

The store is SeaweedFS behind the counting proxy of tests/faultproxy.py, which holds every
request 50 ms (a store far away): the units' fetches must overlap (many in flight at once,
whatever the number of workers), each unit must cost exactly one ranged GET in the epoch (its
footer was read when the dataset was built, and workers get it with the task), and the rows
must be those of the local lake, in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.io.prefetch import CEILING, FLOOR, START, InFlight
from tests.conftest import write_lake
from tests.faultproxy import Faults

if TYPE_CHECKING:
    from tests.faultproxy import FaultProxy
    from tests.stores import ObjectStore

pytest_plugins = ["tests.stores", "tests.faultproxy"]


def _sized(rate: float, latency: float) -> int:
    sizer = InFlight()
    for i in range(32):
        sizer.taken(now=i / rate)
    sizer.fetched(latency)
    return sizer.limit()


def test_the_limit_starts_at_start_until_measured() -> None:
    sizer = InFlight()
    assert sizer.limit() == START
    sizer.fetched(0.08)
    assert sizer.limit() == START, "no demand measured yet"


@given(
    rate=st.floats(min_value=0.01, max_value=1e5),
    latency=st.floats(min_value=1e-4, max_value=10.0),
)
def test_the_limit_covers_demand_times_latency_within_bounds(rate: float, latency: float) -> None:
    limit = _sized(rate, latency)
    assert FLOOR <= limit <= CEILING
    assert limit >= min(CEILING, 2 * rate * latency), "in flight covers twice demand x latency"
    assert _sized(rate, latency * 2) >= limit, "more latency never means fewer in flight"


def test_a_starved_decoder_doubles_the_limit() -> None:
    # Decoders taking pieces only as fast as 8 fetches of 100 ms deliver them: 80/s.
    assert _sized(80.0, 0.1) == 17


@pytest.mark.parametrize("workers", [0, 2])
def test_units_are_fetched_ahead_concurrently_once_each(
    s3_store: ObjectStore, s3_proxy: FaultProxy, tmp_path: Path, workers: int
) -> None:
    local = tmp_path / "lake"
    rows = write_lake(local, [[200] * 4] * 6)  # 24 row groups of 200 rows
    bucket, url = s3_store.upload(local, "prefetch")
    config = {"seed": 1, "num_partitions": 2, "window": 64}
    remote = ll.LakeDataset(url, storage_options=s3_proxy.storage_options, **config)
    s3_proxy.reset()
    s3_proxy.set_faults(Faults(delay=0.05))
    loader = ll.DataLoader(remote, batch_size=64, num_workers=workers)
    try:
        got = [i for b in loader for i in b["id"].tolist()]
    finally:
        loader.close()
    gets = s3_proxy.gets_for(f"{bucket}/lake/file-")
    local_loader = ll.DataLoader(ll.LakeDataset(local, **config), batch_size=64)
    try:
        expected = [i for b in local_loader for i in b["id"].tolist()]
    finally:
        local_loader.close()
    assert got == expected and sorted(got) == list(range(rows))
    assert len(gets) == 24, "one ranged GET per unit in the epoch, no footer"
    assert s3_proxy.peak_in_flight() >= 4, "fetches overlap, however many workers decode"

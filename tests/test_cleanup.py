"""Finalisers of collected loaders never wait on a lock that the collecting thread holds."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.pipeline.cleanup import close_safely, prepare


class _Cycle:
    """Garbage only the cyclic collector frees (as a dropped pass is)."""

    def __init__(self) -> None:
        self.me = self


def test_a_finaliser_the_collector_runs_under_a_held_lock_closes_elsewhere() -> None:
    # The deadlock this guards against: the collector ran a pass's finaliser in a thread that
    # held (indirectly) what the close waited for. Closing in place here waits forever.
    lock = threading.Lock()
    closed = threading.Event()

    def close() -> None:
        with lock:
            closed.set()

    def collect_holding_the_lock() -> None:
        garbage = _Cycle()
        weakref.finalize(garbage, close_safely, close)
        del garbage
        with lock:
            gc.collect()
            assert not closed.is_set()

    prepare()
    thread = threading.Thread(target=collect_holding_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the collecting thread waited for its own lock"
    assert closed.wait(10), "the close never ran"


def test_a_close_on_the_main_thread_outside_a_collection_runs_at_once() -> None:
    prepare()
    done: list[int] = []
    close_safely(done.append, 1)
    assert done == [1]


def _sources(root: Path, kind: str) -> Any:
    for name in ("a", "b"):
        (root / name).mkdir()
        rows = [[i * 10 + j + 1 for j in range(i % 13)] for i in range(300)]
        pq.write_table(pa.table({"tokens": rows}), root / name / "x.parquet", row_group_size=20)
    packing = ll.Packing("tokens", 8, eos_id=0) if kind.startswith("packed") else None
    if kind.endswith("mixture"):
        sources = {n: ll.LakeDataset(root / n) for n in ("a", "b")}
        return ll.Mixture(sources, {"a": 1.0, "b": 1.0}, packing=packing)
    return ll.LakeDataset(root / "a", packing=packing)


@pytest.mark.parametrize("kind", ["lake", "mixture", "packed", "packed-mixture"])
def test_passes_left_by_a_break_stop_their_threads_and_free_their_folders(
    tmp_path: Path, kind: str
) -> None:
    """A pass dropped without close() (a ``break``): once collected, no decoding thread of it
    runs on and its unit folder is gone, while the loader lives on (it leaked 4 threads a pass
    for a mixture, and 1 for a packed stream)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    before = set(threading.enumerate())  # other tests' loaders may hold threads of their own
    loader = ll.DataLoader(_sources(tmp_path, kind), batch_size=4, cache_dir=str(cache))
    for _ in range(5):
        for step, _ in enumerate(loader):
            if step == 2:
                break
    for attempt in range(200):  # the collector queues the closes for the closing thread
        if attempt % 50 == 0:
            gc.collect()
        io = [t for t in threading.enumerate() if t.name.startswith("lakeloader-io")]
        io = [t for t in io if t not in before]
        passes = list(cache.glob("*/*"))  # in the loader's folder: each pass's
        if not io and not passes:
            break
        time.sleep(0.05)
    assert not io and not passes, (io, passes)
    loader.close()


def test_stores_dropped_unclosed_are_collected_and_their_folder_removed(tmp_path: Path) -> None:
    """A pass's stores left unclosed (no pass finaliser) go with the garbage collector."""
    from lakeloader.options import LoaderOptions
    from lakeloader.pipeline.recipe import BatchRecipe
    from lakeloader.pipeline.stores import Leaf, Stores
    from lakeloader.topology import Topology

    lake = tmp_path / "lake"
    lake.mkdir()
    pq.write_table(pa.table({"id": list(range(100))}), lake / "a.parquet", row_group_size=25)
    ds = ll.LakeDataset(lake)
    leaf = Leaf(ds, ds.reader(), (), BatchRecipe())
    units = tmp_path / "units"
    units.mkdir()
    stores = Stores(
        [leaf], LoaderOptions(batch_size=4), Topology(1, 0, 0, 4), str(units), None, None, False
    )
    stores.get(0, 0)  # a store decoding in this process (it held the stores before)
    folder, collected = Path(stores.dir), weakref.ref(stores)
    del stores
    gc.collect()
    assert collected() is None and not folder.exists()

"""The library's use without surprises: columns, errors, pickling, ``with``, views, globs."""

from __future__ import annotations

import copy
import itertools
import multiprocessing
import pickle
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from tests.conftest import LAYOUT_ROWS, write_lake

# ------------------------------------------------------------------------------------ columns


def test_a_single_column_name_is_one_column(lake: Path) -> None:
    ds = ll.LakeDataset(lake, columns="id", shuffle=False)
    assert ds.config.columns == ("id",)
    batch = next(iter(ll.DataLoader(ds, batch_size=4)))
    assert set(batch) == {"id"} and batch["id"].tolist() == [0, 1, 2, 3]


def test_a_wrong_column_is_a_lake_error_in_one_line_with_the_closest_first(lake: Path) -> None:
    with pytest.raises(ll.ColumnNotFoundError) as err:
        ll.LakeDataset(lake, columns=["id", "lable"])
    assert isinstance(err.value, ll.LakeError) and isinstance(err.value, KeyError)
    message = str(err.value)
    assert message == err.value.args[0], "no quoted repr, as a bare KeyError gives"
    assert "\n" not in message
    assert message.startswith(f"column 'lable' is not in the lake {lake} (did you mean 'label'?)")
    assert "its columns, closest first: 'label', " in message
    assert all(repr(c) in message for c in ("id", "x", "s", "label"))
    assert "Pass columns=" in message


def test_several_wrong_columns_are_named_together(tmp_path: Path) -> None:
    write_lake(tmp_path, [[3]], hive=True)
    with pytest.raises(KeyError, match=r"columns 'nope', 'prat' are not in the lake") as err:
        ll.LakeDataset(tmp_path, columns=["nope", "prat"])
    assert "did you mean 'part'?" in str(err.value)


# ----------------------------------------------------------------------- pickle and deepcopy


def _ids(batches: Iterable[dict[str, Any]], key: str = "id") -> list[list[int]]:
    return [b[key].flatten().tolist() for b in batches]


def _pickled(loader: ll.DataLoader) -> ll.DataLoader:
    copied: ll.DataLoader = pickle.loads(pickle.dumps(loader))
    return copied


COPIES = [pytest.param(_pickled, id="pickle"), pytest.param(copy.deepcopy, id="deepcopy")]


def _check_copy(loader: ll.DataLoader, twin: ll.DataLoader) -> None:
    """Same class, options, topology and position; an equal dataset; nothing running."""
    assert type(twin) is type(loader)
    assert twin.options == loader.options and twin.topology == loader.topology
    assert twin.state_dict() == loader.state_dict()
    assert twin.dataset is not loader.dataset
    assert repr(twin.dataset) == repr(loader.dataset)
    assert twin._pool is None and twin._res.unit_dir is None and twin._res.iterator is None


@pytest.mark.parametrize("copier", COPIES)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_copies_as_configuration_and_position(
    dataset: ll.LakeDataset, copier: Callable[[ll.DataLoader], ll.DataLoader], workers: int
) -> None:
    loader = ll.DataLoader(dataset, batch_size=40, num_workers=workers, drop_last=True)
    it = iter(loader)
    head = _ids(itertools.islice(it, 7))  # a pass under way, with work prefetched
    twin = copier(loader)
    _check_copy(loader, twin)
    assert twin.dataset.snapshot == dataset.snapshot
    rest = _ids(twin)
    assert rest == _ids(it), "the copy delivers what the original would have"
    rows = list(itertools.chain.from_iterable(head + rest))
    assert len(rows) == len(set(rows)) == LAYOUT_ROWS // 40 * 40
    loader.close()
    twin.close()


def test_a_loader_copies_at_an_epoch_end_and_before_any_iteration(
    dataset: ll.LakeDataset,
) -> None:
    loader = ll.DataLoader(dataset, batch_size=100)
    _check_copy(loader, _pickled(loader))
    first = _ids(loader)
    twin = _pickled(loader)
    _check_copy(loader, twin)
    assert twin.state_dict()["position"] == LAYOUT_ROWS
    assert _ids(twin) == _ids(loader) != first, "both run epoch 1"


def test_a_dataset_pickles_without_listing_the_lake_again(own_lake: Path) -> None:
    ds = ll.LakeDataset(own_lake, seed=3)
    write_lake(own_lake / "later", [[10]])  # a file the copy must not see
    twin = pickle.loads(pickle.dumps(ds))
    assert twin.fingerprint == ds.fingerprint and len(twin) == len(ds)
    assert twin.config == ds.config and twin.plan(2).num_rows == ds.plan(2).num_rows
    assert len(ll.LakeDataset(own_lake, seed=3)) == len(ds) + 10


def _copied_midway(
    loader: ll.DataLoader, copier: Callable[[Any], Any]
) -> tuple[Iterator[Any], Any]:
    """The loader's pass after a few batches, and a copy taken then (checked)."""
    it = iter(loader)
    list(itertools.islice(it, 4))
    twin = copier(loader)
    assert type(twin) is ll.DataLoader and type(twin.root) is type(loader.root)
    assert twin.root.host is twin and twin.state_dict() == loader.state_dict()
    assert twin._res.iterator is None
    return it, twin


@pytest.mark.parametrize("copier", COPIES)
def test_a_mixture_loader_copies(lake: Path, copier: Callable[[Any], Any]) -> None:
    sources = {n: ll.LakeDataset(lake, seed=s, num_partitions=2) for n, s in (("a", 1), ("b", 2))}
    mixture = ll.Mixture(sources, {"a": 3, "b": 1}, seed=5)
    loader = ll.DataLoader(mixture, batch_size=32)
    it, twin = _copied_midway(loader, copier)
    assert twin.dataset.names == mixture.names
    mine = [(b["id"].tolist(), b["source"].tolist()) for b in twin]
    assert mine == [(b["id"].tolist(), b["source"].tolist()) for b in it]
    twin.close()
    loader.close()


@pytest.mark.parametrize("copier", COPIES)
def test_a_packed_loader_copies(tmp_path: Path, copier: Callable[[Any], Any]) -> None:
    ids = list(range(300))
    tokens = [[i] * (i % 7) for i in ids]
    pq.write_table(pa.table({"id": ids, "tokens": tokens}), tmp_path / "a.parquet")
    ds = ll.LakeDataset(tmp_path, packing=ll.Packing("tokens", 16, eos_id=0), num_partitions=4)
    loader = ll.DataLoader(ds, batch_size=4)
    it, twin = _copied_midway(loader, copier)
    ahead = itertools.islice(iter(twin), 20)
    assert _ids(ahead, "input_ids") == _ids(itertools.islice(it, 20), "input_ids")
    twin.close()
    loader.close()


def _continue_in_child(loader: ll.DataLoader, out: Any) -> None:
    """What a spawned process does with a loader it received: deliver the rest of the epoch."""
    out.put(_ids(loader))
    loader.close()


def test_a_spawned_process_continues_a_loader_where_it_stood(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=32, num_workers=2)
    it = iter(loader)
    list(itertools.islice(it, 6))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_continue_in_child, args=(loader, out))
    child.start()
    got = out.get(timeout=240)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == _ids(it) and len(got) == -(-LAYOUT_ROWS // 32) - 6
    loader.close()


# --------------------------------------------------------------------------------- with block


def test_a_with_block_stops_the_workers_and_removes_the_cache_folder(
    dataset: ll.LakeDataset,
) -> None:
    with ll.DataLoader(dataset, batch_size=16, num_workers=2, persistent_workers=True) as loader:
        first = next(iter(loader))["id"].tolist()
        pids = loader._pool.pids()  # type: ignore[union-attr]
        folder = loader._res.unit_dir
        assert folder is not None and Path(folder).is_dir()
        assert all(pid is not None and Path(f"/proc/{pid}").exists() for pid in pids)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "workers reaped"
    assert not Path(folder).exists()
    assert loader._pool is None
    again = next(iter(loader))["id"].tolist()  # a closed loader goes on from its position
    assert again != first and loader.state_dict()["position"] == 32
    loader.close()


def test_a_with_block_closes_on_an_exception(dataset: ll.LakeDataset) -> None:
    with (
        pytest.raises(RuntimeError, match="the training step failed"),
        ll.DataLoader(dataset, batch_size=16, num_workers=1) as loader,
    ):
        next(iter(loader))
        folder = loader._res.unit_dir
        raise RuntimeError("the training step failed")
    assert loader._pool is None and folder is not None and not Path(folder).exists()


# ---------------------------------------------------------------------------------- view()


def test_view_needs_no_internal_object(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=24, world_size=2, rank=1, num_workers=3)
    assert loader.view() == loader.tracker.view(dataset.plan(0), dataset.snapshot)
    assert loader.view().position == 0 and loader._pool is None, "nothing started"
    state = {**loader.state_dict(), "position": 96}
    loader.load_state_dict(state)
    view = loader.view()
    assert (view.epoch, view.position) == (0, 96) and len(view.ranks) == 2
    assert len(view.workers) == 2 * 3 and {w.rank for w in view.workers} == {0, 1}
    loader.load_state_dict({**state, "position": LAYOUT_ROWS})  # the epoch is over
    assert (loader.view().epoch, loader.view().position) == (1, 0)
    assert loader.view() == loader.tracker.view(dataset.plan(1), dataset.snapshot)


def test_view_of_a_fresh_mixture_names_each_source_s_first_row(lake: Path) -> None:
    mixture = ll.Mixture({"a": ll.LakeDataset(lake, shuffle=False)}, {"a": 1})
    with ll.DataLoader(mixture, batch_size=4) as loader:
        view = loader.view()
        (a,) = view.sources
        assert (a.source, a.epoch, a.position) == ("a", 0, 0)
        assert a.at is not None and (a.at.row_group, a.at.row_offset) == (0, 0)
        assert view.ranks[0].at == a.at and loader.tracker.position == 0


# ------------------------------------------------------------------- a stray file in a lake


def test_a_stray_file_is_named_with_a_glob_that_reads_the_lake(own_lake: Path) -> None:
    (own_lake / "part=1").mkdir()
    (own_lake / "README.md").write_text("# the lake of the tests\n")
    (own_lake / "part=1" / "notes.txt").write_text("written by hand\n")
    with pytest.raises(ll.LakeDataError) as err:
        ll.LakeDataset(own_lake)
    message = str(err.value)
    assert message.startswith(f"{own_lake}/README.md: cannot read the Parquet footer")
    assert "not named as Parquet (README.md, part=1/notes.txt)" in message
    suggested = re.search(r"LakeDataset\('([^']+)'\)", message)
    assert suggested is not None and suggested.group(1) == f"{own_lake}/**/*.parquet"
    ds = ll.LakeDataset(suggested.group(1), seed=7)
    assert len(ds) == LAYOUT_ROWS and len(ds.snapshot.files) == 5
    assert ds.config.columns == ("id", "x", "s", "label")


def test_a_hive_partitioned_lake_keeps_its_partitions_through_the_glob(tmp_path: Path) -> None:
    write_lake(tmp_path, [[3], [4], [5]], hive=True)
    (tmp_path / "part=0" / "SCHEMA.json").write_text("{}")
    with pytest.raises(ll.LakeDataError, match=r"part=0/SCHEMA\.json") as err:
        ll.LakeDataset(tmp_path)
    glob = re.search(r"LakeDataset\('([^']+)'\)", str(err.value))
    assert glob is not None
    ds = ll.LakeDataset(glob.group(1), shuffle=False)
    batch = next(iter(ll.DataLoader(ds, batch_size=12)))
    assert sorted(batch["id"].tolist()) == list(range(12)) and "part" in batch


@pytest.mark.parametrize("how", ["glob", "no parquet names"])
def test_no_glob_is_suggested_where_names_do_not_tell(tmp_path: Path, how: str) -> None:
    pq.write_table(pa.table({"id": [1]}), tmp_path / "000000_0")  # as Hive names its files
    (tmp_path / "000001_0").write_text("not parquet")
    source = str(tmp_path / "*") if how == "glob" else str(tmp_path)
    with pytest.raises(ll.LakeDataError, match="000001_0: cannot read") as err:
        ll.LakeDataset(source)
    assert "LakeDataset(" not in str(err.value)

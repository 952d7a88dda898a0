"""Bad input: corrupt files fail clearly, quarantine skips them alike everywhere, nothing is lost.

Broken files are made here from good ones: truncated at several offsets, a garbage footer,
bytes overwritten inside one row group's data pages (the footer stays fine, so the damage only
shows when that unit is read).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main
from lakeloader.state.quarantine import QuarantineEntry, merge
from tests.conftest import damage_row_group, global_batches, make_loaders, roundtrip, write_lake

LAYOUT = [[200, 150], [300], [100, 100, 100], [250, 50]]
ROWS = sum(map(sum, LAYOUT))
#: The damaged unit: file 2, row group 1 (rows 100..199 of that file).
BAD_FILE, BAD_RG = "file-0002.parquet", 1


def _write(root: Path, compression: str = "zstd") -> None:
    write_lake(root, LAYOUT)
    for path in sorted(root.glob("*.parquet")):  # rewrite compressed, row groups kept
        f = pq.ParquetFile(path)
        tables = [f.read_row_group(i) for i in range(f.num_row_groups)]
        with pq.ParquetWriter(path, f.schema_arrow, compression=compression) as w:
            for t in tables:
                w.write_table(t)


def _bad_ids() -> set[int]:
    """Ids of the damaged row group (write_lake numbers rows in path order)."""
    file_index = int(BAD_FILE[5:9])
    start = sum(map(sum, LAYOUT[:file_index])) + sum(LAYOUT[file_index][:BAD_RG])
    return set(range(start, start + LAYOUT[file_index][BAD_RG]))


@pytest.fixture(scope="module")
def good_lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good")
    _write(root)
    return root


@pytest.fixture(scope="module")
def bad_page_lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("badpage")
    _write(root)
    damage_row_group(root / BAD_FILE, BAD_RG)
    return root


def _open(root: Path, **kwargs: Any) -> ll.LakeDataset:
    return ll.LakeDataset(root, seed=3, num_partitions=4, window=32, **kwargs)


# ---------------------------------------------------------------- broken footers


@pytest.mark.parametrize("cut", ["minus 1", "minus 8", "half", "first 4", "first 12"])
def test_a_truncated_file_is_a_lake_data_error_naming_it(
    good_lake: Path, tmp_path: Path, cut: str
) -> None:
    (tmp_path / "lake").mkdir()
    for p in good_lake.glob("*.parquet"):
        (tmp_path / "lake" / p.name).write_bytes(p.read_bytes())
    victim = tmp_path / "lake" / "file-0001.parquet"
    data = victim.read_bytes()
    keep = {
        "minus 1": len(data) - 1,
        "minus 8": len(data) - 8,
        "half": len(data) // 2,
        "first 4": 4,
        "first 12": 12,
    }[cut]
    victim.write_bytes(data[:keep])
    with pytest.raises(ll.LakeDataError, match=r"file-0001\.parquet") as exc:
        _open(tmp_path / "lake")
    assert "repair or remove" in str(exc.value)


def test_a_garbage_footer_is_a_lake_data_error(good_lake: Path, tmp_path: Path) -> None:
    data = bytearray((good_lake / "file-0000.parquet").read_bytes())
    length = int.from_bytes(data[-8:-4], "little")
    data[-8 - length : -8] = b"\x13" * length
    (tmp_path / "file-0000.parquet").write_bytes(bytes(data))
    with pytest.raises(ll.LakeDataError, match=r"file-0000\.parquet.*footer") as exc:
        _open(tmp_path)
    assert exc.value.__cause__ is not None  # pyarrow's own error is chained


# ----------------------------------------------------- a bad page behind a good footer


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_page_fails_when_its_unit_is_read_naming_file_and_row_group(
    bad_page_lake: Path, workers: int
) -> None:
    ds = ll.LakeDataset(bad_page_lake, shuffle=False)  # the footer is fine: it builds
    loader = ll.DataLoader(ds, batch_size=16, num_workers=workers)
    seen: list[int] = []
    state = loader.state_dict()
    with pytest.raises(ll.LakeDataError) as exc:
        for batch in loader:
            seen += batch["id"].tolist()
            state = loader.state_dict()
    message = str(exc.value)
    assert BAD_FILE in message and f"row group {BAD_RG}" in message
    assert "on_error='skip'" in message
    assert exc.value.__cause__ is not None
    assert not set(seen) & _bad_ids()
    # the position is that of the last batch delivered: nothing counted that was not seen
    assert state["position"] == len(seen) >= min(_bad_ids()) - 16
    loader.close()


def _skip_run(root: Path, world_size: int, **kwargs: Any) -> tuple[list[int], list[Any]]:
    ds = _open(root, on_error="skip")
    loaders = make_loaders(ds, world_size, **kwargs)
    rows = list(itertools.chain.from_iterable(global_batches(loaders)))
    quarantines = [loader.quarantine for loader in loaders]
    for loader in loaders:
        loader.close()
    return rows, quarantines


def test_quarantine_skips_the_bad_unit_alike_under_every_topology(bad_page_lake: Path) -> None:
    bad_ids = _bad_ids()
    reference, (ref_quarantine,) = _skip_run(bad_page_lake, 1, batch_size=24)
    assert sorted(reference) == sorted(set(range(ROWS)) - bad_ids), "every other row once"
    assert {(e.path.endswith(BAD_FILE), e.row_group) for e in ref_quarantine} == {(True, BAD_RG)}
    assert sum(e.num_rows for e in ref_quarantine) == len(bad_ids)
    for world_size, workers in [(3, 0), (2, 2), (4, 1)]:
        rows, quarantines = _skip_run(
            bad_page_lake, world_size, batch_size=24 // world_size, num_workers=workers
        )
        # the same global batch: the same sequence of the remaining rows
        assert rows == reference, (world_size, workers)
        assert merge(*quarantines) == ref_quarantine


def test_quarantine_counts_skipped_rows_and_is_in_the_state(bad_page_lake: Path) -> None:
    ds = _open(bad_page_lake, on_error="skip")
    loader = ll.DataLoader(ds, batch_size=32)
    delivered = sum(b["id"].numel() for b in loader)
    stats = loader.stats()
    assert stats["rows_skipped"] == 100 and delivered == ROWS - 100
    assert stats["rows_delivered"] == delivered
    entries = json.loads(roundtrip(loader.state_dict())["quarantine"])  # one per piece cut
    assert all(e["path"].endswith(BAD_FILE) and e["row_group"] == BAD_RG for e in entries)
    assert all("Deserializing page header failed" in e["reason"] for e in entries)
    assert sum(e["num_rows"] for e in entries) == 100


def _nan_lake(root: Path) -> set[int]:
    """A lake where one row group's feature is all NaN; returns that row group's ids."""
    write_lake(root, LAYOUT)
    path = root / "file-0003.parquet"
    f = pq.ParquetFile(path)
    groups = [f.read_row_group(i) for i in range(f.num_row_groups)]
    nan = groups[0].set_column(1, "x", pa.array(np.full(groups[0].num_rows, np.nan, np.float32)))
    with pq.ParquetWriter(path, f.schema_arrow) as w:
        w.write_table(nan)
        w.write_table(groups[1])
    return set(nan["id"].to_pylist())


def _no_nan(table: pa.Table) -> bool | str:
    x = table.column("x").to_numpy()
    return "all NaN" if len(x) and np.isnan(x).all() else True


@pytest.mark.parametrize(
    ("before", "after", "cut"),
    [((1, 48, 0), (3, 8, 2), 5), ((2, 16, 2), (1, 40, 0), 11), ((4, 8, 1), (2, 8, 0), 1)],
)
def test_validate_quarantine_is_exactly_once_across_a_resize(
    tmp_path: Path, before: tuple[int, int, int], after: tuple[int, int, int], cut: int
) -> None:
    nan_ids = _nan_lake(tmp_path)
    ds = _open(tmp_path, on_error="skip", validate=_no_nan)
    ws, bs, nw = before
    first = make_loaders(ds, ws, batch_size=bs, num_workers=nw)
    seen: list[int] = []
    for batch in itertools.islice(global_batches(first), cut):
        seen += batch
    states = [roundtrip(loader.state_dict()) for loader in first]
    for loader in first:
        loader.close()
    assert len({s["position"] for s in states}) == 1
    merged = merge(
        *([QuarantineEntry.from_dict(q) for q in json.loads(s["quarantine"])] for s in states)
    )
    ws, bs, nw = after
    second = make_loaders(ds, ws, batch_size=bs, num_workers=nw)
    for loader, state in zip(second, itertools.cycle(states), strict=False):
        state = dict(state, quarantine=json.dumps([e.to_dict() for e in merged]))
        loader.load_state_dict(state)
    for batch in global_batches(second):
        seen += batch
    quarantined = merge(merged, *(loader.quarantine for loader in second))
    for loader in second:
        loader.close()
    assert sorted(seen) == sorted(set(range(ROWS)) - nan_ids), "every valid row exactly once"
    assert len(seen) == len(set(seen))
    assert {e.reason for e in quarantined} == {"rejected by validate: all NaN"}
    assert sum(e.num_rows for e in quarantined) == len(nan_ids)


def test_a_resumed_loader_skips_known_quarantine_without_reading(tmp_path: Path) -> None:
    nan_ids = _nan_lake(tmp_path)
    calls: list[int] = []

    def counting(table: pa.Table) -> bool | str:
        calls.append(table.num_rows)
        return _no_nan(table)

    ds = ll.LakeDataset(tmp_path, on_error="skip", validate=counting, shuffle=False)
    loader = ll.DataLoader(ds, batch_size=ROWS)
    assert len(next(iter(loader))["id"]) == ROWS - len(nan_ids)
    state = loader.state_dict()
    loader.load_state_dict(dict(state, position=0))
    calls.clear()
    again = next(iter(loader))["id"].tolist()
    assert not set(again) & nan_ids
    assert sum(calls) == ROWS - len(nan_ids), "the quarantined unit was not read again"


def test_validate_rejection_raises_by_default(tmp_path: Path) -> None:
    _nan_lake(tmp_path)
    loader = ll.DataLoader(_open(tmp_path, validate=_no_nan), batch_size=64)
    with pytest.raises(ll.LakeDataError, match=r"file-0003\.parquet, row group 0.*all NaN"):
        list(loader)


def test_on_error_must_be_a_known_choice(good_lake: Path) -> None:
    with pytest.raises(ValueError, match=r"on_error must be one of \('raise', 'skip'\)"):
        _open(good_lake, on_error="ignore")  # type: ignore[arg-type]


def test_inspect_shows_the_quarantine(
    bad_page_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loader = ll.DataLoader(_open(bad_page_lake, on_error="skip"), batch_size=32)
    list(loader)
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(1, loader)
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quarantine"] == json.loads(loader.state_dict()["quarantine"]) != []
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert f"{len(info['quarantine'])} units, 100 rows skipped" in text
    for entry in info["quarantine"]:
        line = next(x for x in text.splitlines() if f"[{entry['row_start']}, " in x)
        assert BAD_FILE in line and "Deserializing page header failed" in line


def test_skip_leaves_a_file_with_an_unreadable_footer_out(
    good_lake: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    real = Path(__file__).resolve().parents[2] / "shared/parquet-testing/data"
    broken = real / "incorrect_map_schema.parquet"  # a real writer's bad map schema
    if not broken.exists():
        pytest.fail(f"{broken} is missing: ../shared/parquet-testing must be beside the repo")
    sources = [str(good_lake / "file-0000.parquet"), str(broken)]
    with pytest.raises(ll.LakeDataError, match=r"incorrect_map_schema\.parquet"):
        ll.LakeDataset(sources)
    ds = ll.LakeDataset(sources, on_error="skip", shuffle=False)
    assert [Path(f.path).name for f in ds.snapshot.files] == ["file-0000.parquet"]
    assert "left out of the snapshot" in caplog.text and "Map keys" in caplog.text


@pytest.mark.parametrize(("data", "why"), [(b"PAR1", "shorter than"), (b"x" * 40, "it ends with")])
def test_a_remote_file_too_short_or_not_parquet_says_which(data: bytes, why: str) -> None:
    """A store's file is read by ranges: the refusal names the file and what is wrong with it."""
    import fsspec

    from lakeloader.io.fetch import read_footer

    fs = fsspec.filesystem("memory")
    fs.pipe("/bad-input/f.parquet", data)
    with pytest.raises(ll.LakeDataError, match=rf"f\.parquet: not a Parquet file: {why}"):
        read_footer(fs, "/bad-input/f.parquet", len(data), ll.RetryPolicy())
    fs.rm("/bad-input", recursive=True)


def test_a_mixture_s_later_epochs_skip_a_quarantined_unit_without_reading(tmp_path: Path) -> None:
    """A unit found bad in one epoch of a source is not read again in its later epochs."""
    _nan_lake(tmp_path / "bad")
    write_lake(tmp_path / "good", [[ROWS]])
    bad_reads: list[int] = []

    def counting(table: pa.Table) -> bool | str:
        verdict = _no_nan(table)
        if verdict is not True:
            bad_reads.append(table.num_rows)
        return verdict

    def source(name: str) -> ll.LakeDataset:
        folder = tmp_path / name
        return ll.LakeDataset(folder, on_error="skip", validate=counting, num_partitions=1)

    mixture = ll.Mixture({"bad": source("bad"), "good": source("good")}, {"bad": 3, "good": 1})
    with ll.DataLoader(mixture, batch_size=100) as loader:  # about 6 epochs of "bad" a pass
        for _ in range(4):
            list(loader)
        epochs = loader.state_dict()["sources"]["bad"]["epoch"]
    # read where it was found, and in an epoch planned before (units are requested ahead)
    assert epochs >= 5 and len(bad_reads) <= 2, f"read {len(bad_reads)} times in {epochs} epochs"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_whose_sources_pack_other_columns_delivers_up_to_the_null(
    tmp_path: Path, workers: int
) -> None:
    """A source whose int column holds a null keeps its units out of the arena, the other
    source's units are packed: each mixed step still gets every row (it crashed on the first
    step), up to the step holding the null, whose error names its file and row group."""

    def lakes(last: int | None) -> ll.Mixture:
        root = tmp_path / f"last-{last}"
        for name, ids in (("web", list(range(100))), ("code", [*range(1000, 1099), last])):
            (root / name).mkdir(parents=True)
            table = pa.table({"id": pa.array(ids, pa.int64())})
            pq.write_table(table, root / name / "a.parquet", row_group_size=50)
        sources = {n: ll.LakeDataset(root / n, shuffle=False) for n in ("web", "code")}
        return ll.Mixture(sources, {"web": 0.5, "code": 0.5})

    def batches(mix: ll.Mixture) -> tuple[list[list[int]], str]:
        out: list[list[int]] = []
        with ll.DataLoader(mix, batch_size=4, num_workers=workers) as loader:
            try:
                for batch in loader:
                    out.append(batch["id"].tolist())
            except ll.NullValuesError as exc:
                return out, str(exc)
        return out, ""

    got, error = batches(lakes(None))
    want, none = batches(lakes(1099))
    assert none == "" and len(want) == 50
    assert got == want[: len(got)] and len(got) == 49, "every step up to the null's"
    assert "last-None/code/a.parquet, row group 1" in error and "null" in error

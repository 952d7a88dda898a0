"""Mixtures of lakes through the loader: exactly once per source epoch, topology independent,
exact resume under other world sizes, batch sizes and workers, weights changed and sources
added at a resume, a small source upsampled."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader import Mixture
from lakeloader.order.mixture import MixWeights, slot_sources

#: Rows of each lake; ids of lake k are k * 1_000_000 + row.
SIZES = {"web": 1200, "code": 900, "math": 300}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
BASE = {name: k * 1_000_000 for k, name in enumerate(("web", "code", "math", "books"))}


def write_source(root: Path, name: str, rows: int) -> None:
    folder = root / name
    folder.mkdir()
    per_file = -(-rows // 3)
    for f in range(3):
        ids = list(range(BASE[name] + f * per_file, BASE[name] + min(rows, (f + 1) * per_file)))
        tokens = [[i % 97, i % 89, i % 83][: 1 + i % 3] for i in ids]
        table = pa.table({"id": ids, "tokens": tokens, "text": [f"row {i}" for i in ids]})
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=100)


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    for name, rows in {**SIZES, "books": 500}.items():
        write_source(root, name, rows)
    return root


def make(
    lakes: Path,
    weights: Mapping[str, float] = WEIGHTS,
    epoch_rows: int | None = None,
    columns: list[str] | None = None,
    partitions: int = 4,
) -> Mixture:
    sources = {
        n: ll.LakeDataset(lakes / n, seed=7, num_partitions=partitions, window=64, columns=columns)
        for n in weights
    }
    return Mixture(sources, weights, seed=11, epoch_rows=epoch_rows)


def stream(
    mixture: Mixture,
    world: int,
    batch: int,
    slots: int,
    *,
    workers: int = 0,
    state: dict[str, Any] | None = None,
) -> tuple[list[int], list[int], dict[str, Any]]:
    """Run every rank in lockstep for ``slots`` global slots (or more, to the step's end):
    the ids and source names' indices in global slot order, and the state after."""
    loaders = [
        ll.DataLoader(mixture, batch_size=batch, rank=r, world_size=world, num_workers=workers)
        for r in range(world)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    ids: list[int] = []
    sources: list[int] = []
    while len(ids) < slots:
        iters = [iter(loader) for loader in loaders]
        for shares in zip(*iters, strict=True):
            for share in shares:
                assert len(share["id"]) == batch
                if "text" not in share:
                    ids += share["id"].tolist()
                    sources += share["source"].tolist()
                    continue
                assert share["text"] == [f"row {i}" for i in share["id"].tolist()]
                tokens = [t.tolist() for t in share["tokens"].unbind()]
                assert tokens == [
                    [i % 97, i % 89, i % 83][: 1 + i % 3] for i in share["id"].tolist()
                ]
                ids += share["id"].tolist()
                sources += share["source"].tolist()
            if len(ids) >= slots:
                break
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] | {"topology": s["topology"]} for s in states)
    for loader in loaders:
        loader.close()
    return ids, sources, states[0]


def per_source(ids: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {n: [] for n in BASE}
    names = list(BASE)
    for i in ids:
        out[names[i // 1_000_000]].append(i)
    return out


def own_stream(lakes: Path, name: str, rows: int) -> list[int]:
    """A source's stream of rows (its epochs one after the other), drawn alone."""
    return stream(make(lakes, {name: 1.0}), 1, 50, rows)[0][:rows]


def check_streams(lakes: Path, ids: list[int]) -> None:
    """Each source's rows in ``ids`` are its own stream from its first row, in order."""
    for name, drawn in per_source(ids).items():
        if drawn:
            assert drawn == own_stream(lakes, name, len(drawn)), f"{name} lost or repeated rows"


def check_epochs(ids: list[int], sizes: Mapping[str, int] = SIZES) -> None:
    """Every epoch of every source is its rows exactly once, before any row of its next."""
    for name, drawn in per_source(ids).items():
        if name not in sizes:
            assert not drawn
            continue
        n = sizes[name]
        every = set(range(BASE[name], BASE[name] + n))
        for e in range(0, len(drawn), n):
            epoch = drawn[e : e + n]
            assert len(set(epoch)) == len(epoch), f"{name} epoch {e // n} repeats a row"
            assert set(epoch) <= every


@pytest.fixture(scope="module")
def reference(lakes: Path) -> list[int]:
    ids, sources, _ = stream(make(lakes), 1, 48, 4800)
    names = sorted(WEIGHTS)
    assert [names[s] for s in sources] == [list(BASE)[i // 1_000_000] for i in ids]
    return ids[:4800]


def test_every_source_epoch_exactly_once_with_its_share(lakes: Path, reference: list[int]) -> None:
    check_epochs(reference)
    check_streams(lakes, reference)
    drawn = per_source(reference)
    for name, weight in WEIGHTS.items():
        assert abs(len(drawn[name]) / len(reference) - weight) < 0.01
    assert len(drawn["math"]) >= 3 * SIZES["math"], "the small source runs through 3 epochs"
    epochs = [drawn["math"][e * 300 : (e + 1) * 300] for e in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert epochs[0] != epochs[1], "each epoch of a source has its own order"


@pytest.mark.parametrize(("world", "workers"), [(1, 2), (2, 0), (3, 2), (8, 0), (8, 2)])
def test_the_same_global_sequence_under_any_topology(
    lakes: Path, reference: list[int], world: int, workers: int
) -> None:
    batch = {1: 48, 2: 24, 3: 16, 8: 6}[world]
    ids, _, _ = stream(make(lakes), world, batch, 4800, workers=workers)
    assert ids[:4800] == reference


@pytest.mark.parametrize("world", [1, 3])
def test_numeric_columns_take_one_gather_a_step_with_the_same_rows(
    lakes: Path, reference: list[int], world: int
) -> None:
    """Only packed columns: a step is one gather of arena rows planned ahead."""
    mixture = make(lakes, columns=["id"])
    ids, _, state = stream(mixture, world, 48 // world, 2400)
    assert ids[:2400] == reference[:2400]
    after, _, _ = stream(make(lakes, columns=["id"]), 2, 24, 2400, state=state)
    assert (ids + after)[:4800] == reference


def test_resume_at_20_random_points_under_other_topologies(
    lakes: Path, reference: list[int]
) -> None:
    rng = random.Random(5)
    shapes = [(1, 48), (2, 24), (3, 16), (4, 12), (8, 6), (2, 8), (3, 10)]
    for _ in range(20):
        (w1, b1), (w2, b2) = rng.sample(shapes, 2)
        steps = rng.randrange(1, 4800 // (w1 * b1))
        before, _, state = stream(make(lakes), w1, b1, steps * w1 * b1)
        after, _, _ = stream(make(lakes), w2, b2, 4800 - len(before), state=state, workers=2)
        assert (before + after)[:4800] == reference, (w1, b1, steps, w2, b2)


def test_the_next_pass_goes_on_with_the_row_groups_decoded_by_the_last(lakes: Path) -> None:
    """Passes of 700 rows cut through the sources' epochs: the row groups a pass leaves half
    delivered (or decoded ahead) are not decoded again by the next; each (source, epoch, row
    group) is decoded once, and the stream is the one of a single long pass. (3 partitions:
    each source's are whole row groups, so that a row group is one unit of the plan.)"""
    loader = ll.DataLoader(make(lakes, epoch_rows=700, partitions=3), batch_size=35)
    ids: list[int] = []
    for _ in range(6):
        ids += [i for batch in loader for i in batch["id"].tolist()]
    folder = Path(loader._res.unit_dir or "")
    assert list(folder.glob("pass-*")), "the open sources are kept between passes"
    assert loader.stats()["cache_bytes"] > 0, "and what they hold is counted"
    touched = set()
    for name, drawn in per_source(ids).items():
        for k, i in enumerate(drawn):
            touched.add((name, k // SIZES[name], (i - BASE[name]) // 100))  # 100-row groups
    assert loader.stats()["units_decoded"] == len(touched)
    assert ids == stream(make(lakes, epoch_rows=4200, partitions=3), 1, 35, 4200)[0]
    loader.close()
    assert not folder.exists()
    assert loader.stats()["cache_bytes"] == 0


def test_a_pass_left_early_or_a_load_starts_the_sources_afresh(lakes: Path) -> None:
    loader = ll.DataLoader(make(lakes, epoch_rows=700), batch_size=35)
    ids = [i for batch in loader for i in batch["id"].tolist()]
    for k, batch in enumerate(loader):  # the second pass, left after 5 steps
        ids += batch["id"].tolist()
        if k == 4:
            break
    state = loader.state_dict()
    ids += [i for batch in loader for i in batch["id"].tolist()]  # the rest of the pass
    loader.load_state_dict(state)
    again = [i for batch in loader for i in batch["id"].tolist()]
    assert again == ids[-len(again) :]
    ids += [i for batch in loader for i in batch["id"].tolist()]
    assert ids == stream(make(lakes, epoch_rows=2100), 1, 35, 2100)[0]
    loader.close()


def test_new_weights_at_a_resume_lose_and_repeat_nothing(lakes: Path) -> None:
    new = {"web": 0.2, "code": 0.2, "math": 0.6}
    before, _, state = stream(make(lakes), 2, 24, 1200)
    after, sources, resumed = stream(make(lakes, new), 3, 16, 3000, state=state)
    ids = before + after
    check_epochs(ids)
    check_streams(lakes, ids)
    expected = slot_sources(MixWeights.of(new), 11, len(before), len(after))
    assert sources == expected.tolist(), "the new shares apply from the next step"
    assert [c["start"] for c in resumed["history"]] == [0, 1200]
    assert resumed["history"][-1]["weights"] == new


def test_a_source_added_at_a_resume_starts_at_its_first_row(lakes: Path) -> None:
    before, _, state = stream(make(lakes), 1, 48, 960)
    more = {**WEIGHTS, "books": 0.25}
    after, _, resumed = stream(make(lakes, more), 2, 24, 2400, state=state)
    check_epochs(before + after, {**SIZES, "books": 500})
    check_streams(lakes, before + after)
    assert per_source(before)["books"] == [] != per_source(after)["books"]
    assert set(resumed["counts"]) == {*SIZES, "books"}


def test_the_state_stays_small_and_round_trips(lakes: Path) -> None:
    _, _, early = stream(make(lakes, epoch_rows=480), 1, 48, 96)
    _, _, late = stream(make(lakes, epoch_rows=480), 1, 48, 4800)
    assert len(repr(late)) <= len(repr(early)) + 64, "O(sources), not O(rows or epochs)"
    assert late["epoch"] == 9 and late["slot"] == 4800


def test_bad_mixtures_and_states_are_refused_with_both_sides(lakes: Path) -> None:
    with pytest.raises(ValueError, match=r"one weight per source.*\['code', 'web'\].*\['web'\]"):
        Mixture({n: ll.LakeDataset(lakes / n) for n in ("web", "code")}, {"web": 1.0})
    other = lakes.parent / "other-schema"
    other.mkdir(exist_ok=True)
    pq.write_table(pa.table({"id": ["x"]}), other / "a.parquet")
    with pytest.raises(ll.SchemaMismatchError, match=r"id: int64.*id: string|id: string.*int64"):
        Mixture(
            {"web": ll.LakeDataset(lakes / "web"), "x": ll.LakeDataset(other)}, {"web": 1, "x": 1}
        )
    single = ll.DataLoader(ll.LakeDataset(lakes / "web"), batch_size=4)
    loader = ll.DataLoader(make(lakes), batch_size=4)
    with pytest.raises(ll.StateFormatError, match="not a mixture state"):
        loader.load_state_dict(single.state_dict())
    state = loader.state_dict()
    reseeded = Mixture(make(lakes).sources, WEIGHTS, seed=12)
    with pytest.raises(ll.StateMismatchError, match="seed is 11, this Mixture's is 12"):
        ll.DataLoader(reseeded, batch_size=4).load_state_dict(state)
    changed = dict(make(lakes).sources)
    changed["web"] = ll.LakeDataset(lakes / "web", seed=8, num_partitions=4, window=64)
    with pytest.raises(ll.StateMismatchError, match="source 'web' is not the one saved"):
        ll.DataLoader(Mixture(changed, WEIGHTS, seed=11), batch_size=4).load_state_dict(state)
    ckpt = ll.CheckpointManager(str(lakes.parent / "mixed-kinds"))
    ckpt.save(1, loader)
    with pytest.raises(
        ll.StateFormatError,
        match=r"holds a 'mixture' state, which this DataLoader over a lake does not",
    ):
        ckpt.load(single)
    ckpt.save(2, single)
    with pytest.raises(
        ll.StateFormatError,
        match=r"'lakeloader.loader_state' state, which this DataLoader over a mixture",
    ):
        ckpt.load(loader)
    with pytest.raises(ll.CheckpointError, match=r"holds a 'mixture' state over the lakes"):
        ckpt.dataset(step=1)


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoints_resume_a_mixture_under_another_topology(
    lakes: Path, reference: list[int], tmp_path: Path, async_save: bool
) -> None:
    """CheckpointManager saves a mixture's state with its sources' manifests; a loader of
    another world size and batch size continues from it, after a weight change too."""
    before, _, state = stream(make(lakes), 2, 24, 1440)
    loader = ll.DataLoader(make(lakes), batch_size=24, rank=0, world_size=2)
    loader.load_state_dict(state)
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"), async_save=async_save)
    manager.save(30, loader, extra={"lr": 0.5})
    manager.close()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "manifests").iterdir()) == sorted(
        f"{ds.fingerprint}.msgpack" for ds in make(lakes).sources.values()
    )
    resumed = [ll.DataLoader(make(lakes), batch_size=16, rank=r, world_size=3) for r in range(3)]
    for r in resumed:
        assert ll.CheckpointManager(str(tmp_path / "ckpt")).load(r) == {"lr": 0.5}
    after, _, _ = stream(make(lakes), 3, 16, 4800 - 1440, state=resumed[0].state_dict())
    assert (before + after)[:4800] == reference


def test_inspect_shows_each_source_of_a_mixture_checkpoint(
    lakes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lakeloader.cli.main import main

    _, _, state = stream(make(lakes), 1, 48, 2400)
    new = {"web": 0.25, "code": 0.25, "math": 0.5}
    loader = ll.DataLoader(make(lakes, new), batch_size=48)
    loader.load_state_dict(state)
    ckpt = ll.CheckpointManager(str(tmp_path / "ckpt"))
    ckpt.save(50, loader)
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "mixture" and info["slot"] == 2400 and info["step"] == 50
    assert [c["start"] for c in info["history"]] == [0, 2400]
    by_name = {s["source"]: s for s in info["sources"]}
    for name, rows in SIZES.items():
        got = by_name[name]
        drawn = state["counts"][name]
        assert (got["epoch"], got["rows_consumed"]) == divmod(drawn, rows)
        assert got["rows_consumed"] + got["rows_remaining"] == rows
        assert got["realised_share"] == pytest.approx(drawn / 2400)
        assert abs(got["realised_share"] - WEIGHTS[name]) < 0.01
        assert got["weight"] == pytest.approx(new[name])
    assert by_name["math"]["epoch"] >= 1, "the small source is in a later epoch"
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in SIZES) and "remaining" in text


def _double(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "twice": batch["id"] * 2}


def test_user_code_over_a_mixture_its_sources_own_rows_and_the_mixture_owns_batches(
    lakes: Path,
) -> None:
    def tagged(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "tag": f"{row['source']}:{row['id']}"}

    sources = {
        n: ll.LakeDataset(
            lakes / n, seed=7, num_partitions=4, window=64, columns=["id"], transform=tagged
        )
        for n in WEIGHTS
    }
    mixture = Mixture(sources, WEIGHTS, seed=11, batch_transform=_double)
    plain = make(lakes)
    with (
        ll.DataLoader(mixture, batch_size=16) as loader,
        ll.DataLoader(plain, batch_size=16) as ref,
    ):
        for batch, want in itertools.islice(zip(loader, ref, strict=True), 30):
            assert batch["id"].tolist() == want["id"].tolist()
            assert batch["twice"].tolist() == [2 * i for i in want["id"].tolist()]
            names = [plain.names[s] for s in want["source"].tolist()]
            index = [plain.names.index(n) for n in names]
            assert batch["tag"] == [
                f"{s}:{i}" for s, i in zip(index, want["id"].tolist(), strict=True)
            ]
    same = {n: ll.LakeDataset(lakes / n, batch_transform=_double) for n in ("code", "web")}
    assert Mixture(same, {"web": 1, "code": 1}).batch_transform is _double
    apart = {"web": same["web"], "code": ll.LakeDataset(lakes / "code")}
    with pytest.raises(ValueError, match=r"\['web'\] have their own batch_transform.*Mixture\("):
        Mixture(apart, {"web": 1, "code": 1})

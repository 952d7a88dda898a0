"""Packed streams with the user's code and quarantine: a row transform that makes the tokens
(from a text column, with a token drawn from the row's seed), a batch_transform and a
collate_fn (each sample's seed: ``slot_seeds(seed, crc32(name), n)``), ``on_error="skip"`` over
a damaged row group and a ``validate`` that rejects one; on a packed lake and on a packed
mixture. The batches are an oracle's, built from the files (a skipped unit's counted tokens are
padding, every other token comes once per epoch); a resume from rank 0's state alone (or every
rank's) under another world size and batch, with workers too, continues them exactly, the
skipped units in the state's quarantine and not read again."""

from __future__ import annotations

import random
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import lakeloader as ll
from lakeloader.order.mixture import MixWeights, slot_sources
from lakeloader.randomness import slot_seeds
from lakeloader.state.formats import PACKED, PACKED_MIXTURE, read
from lakeloader.state.packed_state import PackedState
from lakeloader.state.quarantine import QuarantineEntry
from tests.conftest import damage_row_group
from tests.oracles import PackedSample, packed_epoch, packed_steps

L, EOS, SEED, MIX_SEED = 16, 99_000_000, 7, 13
#: Each source's streams.
C = {"web": 4, "code": 3}
#: Files of each lake, row groups per file, rows per row group; the first id of each lake.
LAKES = {"web": (3, 2, 60), "code": (2, 2, 50)}
FIRST = {"web": 0, "code": 100_000}
WEIGHTS = {"web": 0.6, "code": 0.4}
#: The transform appends one token drawn from the row's seed, from ``DRAWN`` up.
DRAWN = 90_000_000
#: Rejected by ``validate``: row group 1 of each lake's file 1.
REJECT_GROUP = ("part-1.parquet", 1)
#: Damaged in each lake's damaged twin: row group 0 of file 1.
DAMAGED_GROUP = ("part-1.parquet", 0)

pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.errors.CpuContentionWarning")


def tokens_of(i: int) -> list[int]:
    """Row ``i``'s own tokens: 0 to 11 ids of its own (a row of none is an empty document)."""
    return [i * 16 + j + 1 for j in range((i * 7) % 12)]


@dataclass(frozen=True)
class Lakes:
    """The lakes: where, the ids of each (file, row group), and the damaged twins."""

    root: Path
    groups: dict[str, dict[tuple[str, int], list[int]]]

    def uri(self, name: str, damaged: bool = False) -> Path:
        return self.root / (f"{name}-damaged" if damaged else name)


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Lakes:
    root = tmp_path_factory.mktemp("packing-user-code")
    groups: dict[str, dict[tuple[str, int], list[int]]] = {}
    for name, (files, per_file, rows) in LAKES.items():
        (root / name).mkdir()
        groups[name] = {}
        first = FIRST[name]
        for f in range(files):
            path = root / name / f"part-{f}.parquet"
            with pq.ParquetWriter(path, _schema()) as writer:
                for g in range(per_file):
                    ids = list(range(first, first + rows))
                    writer.write_table(_rows(ids), row_group_size=rows)
                    groups[name][path.name, g] = ids
                    first += rows
        shutil.copytree(root / name, root / f"{name}-damaged")
        damage_row_group(root / f"{name}-damaged" / DAMAGED_GROUP[0], DAMAGED_GROUP[1])
    return Lakes(root, groups)


def _schema() -> pa.Schema:
    return pa.schema([("id", pa.int64()), ("text", pa.string()), ("tokens", pa.list_(pa.int64()))])


def _rows(ids: list[int]) -> pa.Table:
    texts = [" ".join(map(str, tokens_of(i))) for i in ids]
    return pa.table({"id": ids, "text": texts, "tokens": [tokens_of(i) for i in ids]}, _schema())


# ------------------------------------------------------------------ the user's code (picklable)


def tokenize(row: dict[str, Any]) -> dict[str, Any]:
    """Text to token ids, and one more token drawn from the row's seed."""
    drawn = DRAWN + int(ll.rng().integers(1000))
    return {"tokens": torch.tensor([*map(int, row["text"].split()), drawn], dtype=torch.int64)}


def add_fields(batch: dict[str, Any]) -> dict[str, Any]:
    """``b = 3 input_ids``, each sample's seed (as int64), and the id of the DataLoader worker
    that ran it (-1: the training process)."""
    seeds = torch.from_numpy(ll.row_seeds().view(np.int64).copy())
    info = torch.utils.data.get_worker_info()
    worker = torch.full_like(seeds, -1 if info is None else info.id)
    return {**batch, "b": batch["input_ids"] * 3, "seed": seeds, "worker": worker}


def stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each field stacked, plus ``c = 5 input_ids`` and how many samples came."""
    assert all(s["input_ids"].shape == (L,) for s in samples)
    out = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    return {**out, "c": out["input_ids"] * 5, "n": torch.full((len(samples),), len(samples))}


@dataclass(frozen=True)
class Reject:
    """Rejects a unit holding a row of row group 1 of file 1 (logs each rejection)."""

    ids: frozenset[int]
    log: str

    def __call__(self, table: pa.Table) -> bool | str:
        if pc.any(pc.is_in(table["id"], pa.array(sorted(self.ids)))).as_py():
            with open(self.log, "a") as fh:
                fh.write("rejected\n")
            return "a row of the rejected row group"
        return True


# ------------------------------------------------------------------ scenarios


@dataclass(frozen=True)
class Scenario:
    """What a run reads: a packed lake or mixture, its user code and screening."""

    mixture: bool
    transform: bool = False
    batch_code: bool = False  # a batch_transform and a collate_fn
    skip: bool = False  # on_error="skip" over the damaged twins
    validate: bool = False

    def names(self) -> tuple[str, ...]:
        """The sources, sorted (their index in a batch), or the one lake's ``"lake"``."""
        return ("code", "web") if self.mixture else ("lake",)

    def bad(self) -> set[tuple[str, int]]:
        """The (file, row group) skipped in each source."""
        return {g for g, on in ((DAMAGED_GROUP, self.skip), (REJECT_GROUP, self.validate)) if on}

    def lakes(self) -> tuple[str, ...]:
        """The folder of each source's lake."""
        names = ("code", "web") if self.mixture else ("web",)
        return tuple(f"{n}-damaged" if self.skip else n for n in names)

    def quarantined(self) -> set[tuple[str, str, int]]:
        """The (lake, file, row group) of every unit skipped."""
        return {(lake, *g) for lake in self.lakes() for g in self.bad()}

    def rejected(self) -> set[tuple[str, str, int]]:
        """The (lake, file, row group) of every unit ``validate`` rejects."""
        return {(lake, *REJECT_GROUP) for lake in self.lakes()} if self.validate else set()


def packing() -> ll.Packing:
    return ll.Packing("tokens", L, eos_id=EOS, pad_id=0)


def source(s: Scenario, lakes: Lakes, name: str, log: str) -> ll.LakeDataset:
    kw: dict[str, Any] = {"seed": SEED, "num_partitions": C[name], "window": 32}
    if s.transform:
        kw["transform"], kw["columns"] = tokenize, ["id", "text"]
    else:
        kw["columns"] = ["id", "tokens"]
    if s.skip or s.validate:
        kw["on_error"] = "skip"
    if s.validate:
        kw["validate"] = Reject(frozenset(lakes.groups[name][REJECT_GROUP]), log)
    if s.batch_code and not s.mixture:
        kw["batch_transform"] = add_fields
    if not s.mixture:
        kw["packing"] = packing()
    return ll.LakeDataset(lakes.uri(name, s.skip), **kw)


def dataset(s: Scenario, lakes: Lakes, log: str) -> ll.LakeDataset | ll.Mixture:
    if not s.mixture:
        return source(s, lakes, "web", log)
    return ll.Mixture(
        {n: source(s, lakes, n, log) for n in WEIGHTS},
        WEIGHTS,
        seed=MIX_SEED,
        packing=packing(),
        batch_transform=add_fields if s.batch_code else None,
    )


@dataclass
class Got:
    """Global batches laid end to end: each sample's source (index), ``[N, 3, L]`` (tokens,
    positions, pad mask) and seed (0 without a batch_transform)."""

    sources: np.ndarray
    samples: np.ndarray
    seeds: np.ndarray

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Got) and all(
            np.array_equal(a, b)
            for a, b in zip(
                (self.sources, self.samples, self.seeds),
                (other.sources, other.samples, other.seeds),
                strict=True,
            )
        )


def run(
    s: Scenario,
    lakes: Lakes,
    log: str,
    world: int,
    batch: int,
    steps: int,
    state: dict[str, Any] | list[dict[str, Any]] | None = None,
    workers: int = 0,
) -> tuple[Got, list[dict[str, Any]]]:
    """Every rank in lockstep for ``steps`` steps (ranks in order in each), and each rank's
    state after. With user code, it ran in the workers if there are any (in each of them),
    else in the training process."""
    kw: dict[str, Any] = {"batch_size": batch, "world_size": world, "num_workers": workers}
    if s.batch_code:
        kw["collate_fn"] = stack
    loaders = [ll.DataLoader(dataset(s, lakes, log), rank=r, **kw) for r in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    its = [iter(x) for x in loaders]
    sources, samples, seeds, ran_in = [], [], [], set()
    for _ in range(steps):
        for it in its:
            share = next(it)
            if s.batch_code:
                assert torch.equal(share["b"], share["input_ids"] * 3)  # the batch_transform's
                assert torch.equal(share["c"], share["input_ids"] * 5)  # the collate_fn's
                assert share["n"].tolist() == [batch] * batch  # one call with the rank's samples
                ran_in |= set(share["worker"].tolist())
            fields = ("input_ids", "position_ids", "pad_mask")
            samples.append(np.stack([share[k] for k in fields], 1).astype(np.int64))
            sources.append(share.get("source", torch.zeros(batch, dtype=torch.int64)).numpy())
            seeds.append(share.get("seed", torch.zeros(batch, dtype=torch.int64)).numpy())
    out = [x.state_dict() for x in loaders]
    for x in loaders:
        x.close()
    if s.batch_code:
        assert ran_in == (set(range(workers)) if steps >= workers and workers else {-1}), ran_in
    return Got(np.concatenate(sources), np.concatenate(samples), np.concatenate(seeds)), out


# ------------------------------------------------------------------ what must come


class Oracle:
    """A scenario's epochs from the files: units in the epoch's order, rows in file order, a
    transform's drawn token from the row's seed (its place in the epoch's rows), a skipped
    unit's counted tokens as padding."""

    def __init__(self, s: Scenario, lakes: Lakes) -> None:
        self.s, self.lakes = s, lakes
        made = dataset(s, lakes, "")  # packed as the loader packs them
        self.sources = made.sources if isinstance(made, ll.Mixture) else {"lake": made}
        self._epochs: dict[tuple[str, int], list[PackedSample]] = {}

    def lake(self, name: str) -> str:
        return "web" if name == "lake" else name

    def epoch(self, name: str, e: int) -> list[PackedSample]:
        if (name, e) in self._epochs:
            return self._epochs[name, e]
        ds, groups = self.sources[name], self.lakes.groups[self.lake(name)]
        units = ds.units
        out: list[list[list[int]] | int] = []
        slot = 0  # the row's place in the epoch's rows: its seed's key
        for u in ds.plan(e).order.tolist():
            group = (
                Path(ds.snapshot.files[int(units.file_index[u])].path).name,
                int(units.row_group[u]),
            )
            ids = groups[group]
            assert (int(units.row_start[u]), int(units.num_rows[u])) == (0, len(ids))
            docs = []
            for j, i in enumerate(ids):
                doc = tokens_of(i)
                if self.s.transform:
                    seed = int(slot_seeds(SEED, e, np.array([slot + j]))[0])
                    doc.append(
                        DRAWN + int(np.random.Generator(np.random.PCG64(seed)).integers(1000))
                    )
                docs.append(doc)
            slot += len(ids)
            out.append(self.padding(group, docs) if group in self.s.bad() else docs)
        self._epochs[name, e] = packed_epoch(out, C[self.lake(name)], L, EOS)
        return self._epochs[name, e]

    def padding(self, group: tuple[str, int], docs: list[list[int]]) -> int:
        """A skipped unit's padding: its counted tokens. Counted from the footers; by reading
        with a transform, where a damaged unit counts none."""
        return 0 if group == DAMAGED_GROUP and self.s.transform else sum(len(d) + 1 for d in docs)

    def steps(self, batch: int, steps: int, state: dict[str, Any] | None = None) -> Got:
        """Global steps from where ``state`` stands (None: the start)."""
        names = self.s.names()
        if not self.s.mixture:
            first = 0 if state is None else int(state["samples"])
            drawn, counts = ["lake"] * (batch * steps), {"lake": first}
        else:
            at = None if state is None else state["mixture"]
            slot, counts = (0, {}) if at is None else (int(at["slot"]), dict(at["counts"]))
            w = MixWeights.of(WEIGHTS)
            drawn = [w.names[k] for k in slot_sources(w, MIX_SEED, slot, batch * steps).tolist()]
        out = [x for step in packed_steps(self.epoch, drawn, counts, batch) for x in step]
        seeds = np.zeros(len(out), dtype=np.int64)
        if self.s.batch_code:
            seeds = np.array(
                [slot_seeds(SEED, zlib.crc32(n.encode()), np.array([k]))[0] for n, k, _ in out]
            ).view(np.int64)
        return Got(
            np.array([names.index(n) for n, _, _ in out]),
            np.stack([x for _, _, x in out]),
            seeds,
        )

    def check_each_token_once(self, got: Got) -> None:
        """Each source's samples as delivered are its epochs one after the other: every token
        of every row not skipped once an epoch (then one drawn token with a transform, and a
        separator), a skipped unit's tokens as padding; at least two epochs through."""
        for k, name in enumerate(self.s.names()):
            mine = got.samples[got.sources == k]
            per_epoch = len(self.epoch(name, 0))
            assert len(mine) >= 2 * per_epoch, name
            groups = self.lakes.groups[self.lake(name)]
            kept = [i for g, ids in groups.items() if g not in self.s.bad() for i in ids]
            lost_tokens = sum(
                self.padding(g, [[0] * (len(tokens_of(i)) + self.s.transform) for i in groups[g]])
                for g in self.s.bad()
            )
            for e in range(len(mine) // per_epoch):
                epoch = mine[e * per_epoch : (e + 1) * per_epoch]
                tokens, pads = epoch[:, 0], epoch[:, 2].astype(bool)
                real = tokens[~pads]
                drawn = (real >= DRAWN) & (real < DRAWN + 1000)
                own = real[(real != EOS) & ~drawn]
                assert sorted(own.tolist()) == sorted(t for i in kept for t in tokens_of(i))
                assert (real == EOS).sum() == len(kept), (name, e)
                assert drawn.sum() == len(kept) * self.s.transform, (name, e)
                assert lost_tokens <= pads.sum() < lost_tokens + C[self.lake(name)] * L
                assert (tokens[pads] == 0).all()


SCENARIOS = {
    "lake-user-code": Scenario(False, transform=True, batch_code=True),
    "lake-skip": Scenario(False, skip=True),
    "lake-validate": Scenario(False, transform=True, validate=True),
    "mixture-user-code": Scenario(True, transform=True, batch_code=True),
    "mixture-skip": Scenario(True, skip=True, batch_code=True),
    "mixture-validate": Scenario(True, transform=True, validate=True),
    # A transform's tokens are counted by reading each unit, and a damaged one counts none:
    # it leaves no padding, and no other token moves.
    "lake-skip-transform": Scenario(False, transform=True, skip=True),
}
#: (world size, batch per rank) before and after a resume.
SHAPES = [(1, 8), (2, 4), (3, 3), (1, 5), (2, 5), (3, 2)]
STEPS = 80  # global batches of 8: every source through two epochs and more


@pytest.fixture(scope="module")
def oracles(lakes: Lakes) -> Callable[[str], Oracle]:
    cache: dict[str, Oracle] = {}

    def get(name: str) -> Oracle:
        if name not in cache:
            cache[name] = Oracle(SCENARIOS[name], lakes)
        return cache[name]

    return get


def quarantine(state: dict[str, Any]) -> set[tuple[str, str, int]]:
    """The (lake, file, row group) of each unit in a state's quarantine."""
    entries: tuple[QuarantineEntry, ...]
    if state["kind"] == "packed":
        entries = read(state, PACKED, per_epoch=1).quarantine
    else:
        entries = read(state, PACKED_MIXTURE).quarantine
    return {(Path(q.path).parent.name, Path(q.path).name, q.row_group) for q in entries}


def rejections(log: str) -> int:
    return Path(log).read_text().count("\n") if Path(log).exists() else 0


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_token_once_per_epoch_padding_counted(
    name: str, lakes: Lakes, oracles: Callable[[str], Oracle], tmp_path: Path
) -> None:
    s, oracle = SCENARIOS[name], oracles(name)
    got, states = run(s, lakes, str(tmp_path / "rejected.log"), 1, 8, STEPS)
    assert got == oracle.steps(8, STEPS)
    oracle.check_each_token_once(got)
    assert quarantine(states[0]) == s.quarantined(), "the skipped units in the state's quarantine"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exact_resume_from_rank_0_state_under_other_shapes(
    name: str, lakes: Lakes, oracles: Callable[[str], Oracle], tmp_path: Path
) -> None:
    """Three resumes at random points under other world sizes and batches: rank 0's state
    alone (or every rank's, their quarantines merged), one of them with two workers."""
    s, oracle, rng = SCENARIOS[name], oracles(name), random.Random(name)
    log = str(tmp_path / "rejected.log")
    mid_document = screened = 0
    for k in range(3):
        (w1, b1), (w2, b2) = rng.sample(SHAPES, 2)
        steps = rng.randrange(1, 2 * STEPS * 8 // (w1 * b1))
        before, states = run(s, lakes, log, w1, b1, steps)
        assert before == oracle.steps(w1 * b1, steps), (w1, b1, steps)
        given = states[0] if k != 1 else states[::-1]
        known = set.union(*map(quarantine, states)) if k == 1 else quarantine(states[0])
        assert known <= s.quarantined()
        rejected = rejections(log)
        workers = 2 if k == 2 else 0
        after, later = run(s, lakes, log, w2, b2, 6, state=given, workers=workers)
        assert after == oracle.steps(w2 * b2, 6, states[0]), (w1, b1, steps, w2, b2, workers)
        mid_document += int((after.samples[:, 1, 0] > 0).any())
        if s.validate and s.rejected() <= known:  # known from the state: not read again
            assert rejections(log) == rejected, "a rejected unit read again after the resume"
            screened += 1
        assert known <= quarantine(later[0]) <= s.quarantined()
    assert mid_document, "a resume in the middle of a document"
    assert screened or not s.validate, "a resume that knew the rejected units"


@pytest.mark.parametrize("name", ["lake-user-code", "mixture-skip"])
def test_workers_give_the_same_batches(
    name: str, lakes: Lakes, oracles: Callable[[str], Oracle], tmp_path: Path
) -> None:
    s = SCENARIOS[name]
    got, _ = run(s, lakes, str(tmp_path / "rejected.log"), 1, 8, 40, workers=2)
    assert got == oracles(name).steps(8, 40)


def test_a_checkpoint_holds_the_quarantine_and_resumes_without_reading_it(
    lakes: Lakes, oracles: Callable[[str], Oracle], tmp_path: Path
) -> None:
    """CheckpointManager saves a packed stream's quarantine with its samples; two ranks
    loading it know the rejected unit (screened without reading) and continue exactly."""
    s, oracle, log = SCENARIOS["lake-validate"], oracles("lake-validate"), str(tmp_path / "r.log")
    _, states = run(s, lakes, log, 1, 8, 30)
    assert quarantine(states[0]) == s.rejected()
    with ll.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        with ll.DataLoader(dataset(s, lakes, log), batch_size=8) as saver:
            saver.load_state_dict(states[0])
            manager.save(30, saver)
        loaders = [
            ll.DataLoader(dataset(s, lakes, log), batch_size=4, rank=r, world_size=2)
            for r in range(2)
        ]
        for loader in loaders:
            manager.load(loader)
            assert {(Path(q.path).name, q.row_group) for q in loader.quarantine} == {REJECT_GROUP}
        loaded = loaders[0].state_dict()
        for loader in loaders:
            loader.close()
    assert loaded == states[0]
    rejected = rejections(log)
    after, _ = run(s, lakes, log, 2, 4, 50, state=loaded)
    assert rejections(log) == rejected, "the rejected unit read again"
    assert after == oracle.steps(8, 50, loaded)


def test_states_keep_their_quarantine_and_old_states_have_none() -> None:
    a = QuarantineEntry("a.parquet", 0, 0, 10, "bad page")
    b = QuarantineEntry("b.parquet", 2, 5, 5, "rejected")
    one = PackedState("f", "c", 24).with_quarantine([b, a]).with_quarantine([a])
    assert one.quarantine == (a, b)
    assert read(one.to_dict(), PACKED, per_epoch=10) == one
    old = one.to_dict()
    del old["quarantine"]  # as lakeloader wrote it before packed streams skipped units
    assert read(old, PACKED, per_epoch=10) == PackedState("f", "c", 24)


def test_a_lake_with_no_token_is_refused(tmp_path: Path) -> None:
    """Every row empty and no separator: no sample to make, said before reading forever."""
    pq.write_table(
        pa.table({"tokens": pa.array([[]] * 20, pa.list_(pa.int64()))}), tmp_path / "a.parquet"
    )
    ds = ll.LakeDataset(tmp_path, num_partitions=C["web"], packing=ll.Packing("tokens", L))
    match = "packing found no 'tokens' token in source"
    with pytest.raises(ValueError, match=match), ll.DataLoader(ds, batch_size=4) as loader:
        next(iter(loader))


@pytest.mark.parametrize(
    ("made", "error", "match"),
    [
        ({"other": [1]}, ll.errors.ColumnNotFoundError, "has no packing column 'tokens'"),
        ({"tokens": [[1, 2]]}, TypeError, r"1-D list, array or tensor of integers.*shape \(1, 2\)"),
        ({"tokens": [0.5]}, TypeError, "of integers; it gave list of dtype float64"),
    ],
)
def test_a_transform_that_makes_no_token_list_is_named(
    lakes: Lakes, made: dict[str, Any], error: type[Exception], match: str
) -> None:
    ds = ll.LakeDataset(
        lakes.uri("web"),
        columns=["id", "text"],
        num_partitions=C["web"],
        transform=Const(made),
        packing=ll.Packing("tokens", L),
    )
    with pytest.raises(error, match=match), ll.DataLoader(ds, batch_size=4) as loader:
        next(iter(loader))


@dataclass(frozen=True)
class Const:
    """A transform that gives ``row`` whatever the row."""

    row: dict[str, Any]

    def __call__(self, _: dict[str, Any]) -> dict[str, Any]:
        return self.row


def _fails(row: dict[str, Any]) -> dict[str, Any]:
    raise ValueError(f"bad row {row['id']}")


def test_a_transform_s_own_error_names_the_unit_it_counted(lakes: Lakes) -> None:
    """The user's error comes unchanged, with a note naming the file and row group."""
    ds = ll.LakeDataset(
        lakes.uri("web"), columns=["id", "text"], transform=_fails, packing=ll.Packing("tokens", L)
    )
    with pytest.raises(ValueError, match="bad row") as caught, ll.DataLoader(ds, batch_size=4) as x:
        next(iter(x))
    (note,) = caught.value.__notes__
    assert "row transform counting the tokens of" in note
    assert str(lakes.uri("web")) in note and ".parquet row group " in note

"""Packed streams with the user's code and quarantine: a row transform that makes the tokens
(from a text column, with a token drawn from the row's seed), a batch_transform and a
collate_fn, ``on_error="skip"`` over a damaged row group and a ``validate`` that rejects a
row group; on a packed lake and on a packed mixture. Every partition's samples are its rows'
tokens exactly once per epoch, in the unpacked order (the quarantined rows' tokens never), and
a resume in the middle of a document under another world size and batch size, from the states
of every rank, continues the uninterrupted run exactly."""

from __future__ import annotations

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
from lakeloader.randomness import slot_seeds
from lakeloader.state.packed_state import PackedMixtureState, PackedState, PartitionPosition
from lakeloader.state.quarantine import QuarantineEntry
from tests.conftest import damage_row_group

C, L, EOS, SEED, MIX_SEED = 4, 16, 0, 7, 13
#: Files of each lake, row groups per file, rows per row group; the first id of each lake.
LAKES = {"web": (3, 2, 60), "code": (2, 2, 50)}
FIRST = {"web": 0, "code": 100_000}
#: The transform appends one token drawn from the row's seed, from ``DRAWN`` up.
DRAWN = 90_000_000
#: Rejected by ``validate``: every row of row group 1 of each lake's file 1.
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
    """``b = 3 input_ids``, and each sample's seed (as int64)."""
    seeds = torch.from_numpy(ll.row_seeds().view(np.int64).copy())
    return {**batch, "b": batch["input_ids"] * 3, "seed": seeds}


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
        return ("code", "web") if self.mixture else ("web",)


def source(s: Scenario, lakes: Lakes, name: str, log: str, plain: bool = False) -> ll.LakeDataset:
    """A source (``plain``: its unpacked order over the undamaged lake, ids only)."""
    kw: dict[str, Any] = {"seed": SEED, "num_partitions": C, "window": 32}
    if plain:
        return ll.LakeDataset(lakes.uri(name), columns=["id"], **kw)
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
        kw["packing"] = ll.Packing("tokens", L, eos_id=EOS, pad_id=0)
    return ll.LakeDataset(lakes.uri(name, s.skip), **kw)


def dataset(s: Scenario, lakes: Lakes, log: str) -> ll.LakeDataset | ll.Mixture:
    if not s.mixture:
        return source(s, lakes, "web", log)
    sources = {n: source(s, lakes, n, log) for n in s.names()}
    return ll.Mixture(
        sources,
        {"web": 0.6, "code": 0.4},
        seed=MIX_SEED,
        packing=ll.Packing("tokens", L, eos_id=EOS, pad_id=0),
        batch_transform=add_fields if s.batch_code else None,
    )


#: Each (source, partition)'s samples: tokens, positions, pad mask, and each sample's seed
#: (0 without a batch_transform).
Streams = dict[tuple[int, int], list[np.ndarray]]


def run(
    s: Scenario,
    lakes: Lakes,
    log: str,
    world: int,
    batch: int,
    steps: int,
    states: list[dict[str, Any]] | None = None,
    workers: int = 0,
) -> tuple[Streams, list[dict[str, Any]]]:
    """Every rank in lockstep for ``steps`` steps: each (source, partition)'s samples, and the
    ranks' states after."""
    kw: dict[str, Any] = {"batch_size": batch, "world_size": world, "num_workers": workers}
    if s.batch_code:
        kw["collate_fn"] = stack
    loaders = [ll.DataLoader(dataset(s, lakes, log), rank=r, **kw) for r in range(world)]
    for loader in loaders:
        if states is not None:
            loader.load_state_dict(states)
    its = [iter(x) for x in loaders]
    streams: Streams = {}
    for _ in range(steps):
        shares = [next(it) for it in its]
        if s.batch_code:
            for share in shares:
                assert torch.equal(share["b"], share["input_ids"] * 3)  # the batch_transform's
                assert torch.equal(share["c"], share["input_ids"] * 5)  # the collate_fn's
                assert share["n"].tolist() == [batch] * batch  # one call with the rank's samples
        whole = np.concatenate(
            [np.stack([x[k] for k in ("input_ids", "position_ids", "pad_mask")], 1) for x in shares]
        )
        src = np.concatenate(
            [x.get("source", torch.zeros(batch, dtype=torch.int64)) for x in shares]
        )
        seeds = np.concatenate(
            [x.get("seed", torch.zeros(batch, dtype=torch.int64)) for x in shares]
        )
        k = len(whole) // C  # partition-major: k samples of every partition
        for i, sample in enumerate(whole):
            key = (int(src[i]), i // k)
            row = np.concatenate([sample.reshape(-1), [seeds[i]]])
            streams.setdefault(key, []).append(row)
    out = [x.state_dict() for x in loaders]
    for x in loaders:
        x.close()
    return streams, out


def stacked(streams: Streams) -> dict[tuple[int, int], np.ndarray]:
    return {key: np.stack(rows) for key, rows in streams.items()}


# ------------------------------------------------------------------ what must come


def quarantined(s: Scenario, lakes: Lakes, name: str) -> set[int]:
    bad: set[int] = set()
    if s.skip:
        bad |= set(lakes.groups[name][DAMAGED_GROUP])
    if s.validate:
        bad |= set(lakes.groups[name][REJECT_GROUP])
    return bad


def documents(s: Scenario, lakes: Lakes, name: str, part: int, epoch: int) -> list[list[int]]:
    """A partition's documents of an epoch, in order, quarantined rows left out: the row's
    tokens (then its drawn token, from its slot's seed) and the separator."""
    plain = source(s, lakes, name, "", plain=True)
    with ll.DataLoader(plain, batch_size=len(plain)) as loader:
        loader.set_epoch(epoch)
        ids = next(iter(loader))["id"].tolist()  # one batch of every slot: partition-major
    starts, bad = plain.plan(epoch).starts, quarantined(s, lakes, name)
    out = []
    for i, row in enumerate(ids[starts[part] : starts[part + 1]]):
        if row in bad:
            continue
        doc = tokens_of(row)
        if s.transform:  # the row's slot is p + i C
            seed = int(slot_seeds(SEED, epoch, np.array([part + i * C]))[0])
            doc.append(DRAWN + int(np.random.Generator(np.random.PCG64(seed)).integers(1000)))
        out.append([*doc, EOS])
    return out


def check_exactly_once(s: Scenario, lakes: Lakes, got: dict[tuple[int, int], np.ndarray]) -> None:
    """Each (source, partition)'s samples are its epochs' documents in order, every epoch's
    last sample padded, its sample seeds the documented ones; at least two epochs through."""
    for (src, part), samples in got.items():
        name = s.names()[src]
        tokens, positions = samples[:, :L], samples[:, L : 2 * L]
        pads, seeds = samples[:, 2 * L : 3 * L].astype(bool), samples[:, 3 * L]
        want_t: list[int] = []
        want_p: list[int] = []
        epoch = 0
        while len(want_t) < tokens.size:
            for doc in documents(s, lakes, name, part, epoch):
                want_t += doc
                want_p += range(len(doc))
            pad = -len(want_t) % L
            want_t, want_p = want_t + [0] * pad, want_p + [0] * pad
            epoch += 1
        assert epoch >= 2, f"{name} partition {part}: {epoch} epochs"
        n = tokens.size
        assert tokens.ravel().tolist() == want_t[:n], f"{name} partition {part}: tokens"
        assert positions.ravel().tolist() == want_p[:n], f"{name} partition {part}: positions"
        assert (tokens[pads] == 0).all() and int(pads.sum()) > 0
        if s.batch_code:  # sample j of partition p: slot_seeds(seed, crc32(name), j C + p)
            key = zlib.crc32((name if s.mixture else "lake").encode())
            want = slot_seeds(SEED, key, np.arange(len(seeds)) * C + part).view(np.int64)
            assert seeds.tolist() == want.tolist(), f"{name} partition {part}: sample seeds"


SCENARIOS = {
    "lake-user-code": Scenario(False, transform=True, batch_code=True),
    "lake-skip": Scenario(False, skip=True),
    "lake-validate": Scenario(False, transform=True, validate=True),
    "mixture-user-code": Scenario(True, transform=True, batch_code=True),
    "mixture-skip": Scenario(True, skip=True, batch_code=True),
    "mixture-validate": Scenario(True, transform=True, validate=True),
}
#: (world size, batch size) before and after the resume, and steps before it.
RESUMES = [((1, 8), (2, 4), 23), ((2, 4), (4, 1), 17), ((4, 2), (1, 4), 31)]
STEPS = 80  # global batches of 8 samples: every partition through three epochs and more


@pytest.fixture(scope="module")
def references(lakes: Lakes, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """The uninterrupted run of a scenario (one rank, batches of 8), checked, once."""
    cache: dict[str, dict[tuple[int, int], np.ndarray]] = {}
    log = str(tmp_path_factory.mktemp("reference-log") / "rejected.log")

    def get(name: str) -> dict[tuple[int, int], np.ndarray]:
        if name not in cache:
            s = SCENARIOS[name]
            streams, _ = run(s, lakes, log, 1, 8, STEPS)
            cache[name] = stacked(streams)
            if not s.mixture:
                check_exactly_once(s, lakes, cache[name])
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_token_once_and_exact_resume_mid_document_under_other_shapes(
    name: str, lakes: Lakes, references: Callable[[str], Any], tmp_path: Path
) -> None:
    s, ref = SCENARIOS[name], references(name)
    if s.mixture:  # each source's partitions: its documents, whatever the rounds drawn
        check_exactly_once(s, lakes, ref)
    log = str(tmp_path / "rejected.log")
    want = {g for g, on in ((DAMAGED_GROUP, s.skip), (REJECT_GROUP, s.validate)) if on}
    mid_document, found_all = 0, set()
    for (w1, b1), (w2, b2), steps in RESUMES:
        before, states = run(s, lakes, log, w1, b1, steps)
        mid_document += any(x[2] > 0 for st in states for x in _partitions(st))
        found = {(Path(q.path).name, q.row_group) for st in states for q in _quarantine(st)}
        assert found <= want, found
        found_all |= found
        rejected = Path(log).read_text().count("\n") if Path(log).exists() else 0
        left = (STEPS * 8 - steps * w1 * b1) // (w2 * b2)  # the reference's samples, no more
        workers = 2 if w2 == 1 else 0
        after, _ = run(s, lakes, log, w2, b2, left, states=states[::-1], workers=workers)
        for key, samples in ref.items():
            got = np.stack(before.get(key, []) + after.get(key, []))
            assert np.array_equal(got, samples[: len(got)]), (name, w1, b1, steps, w2, b2, key)
        if found == want and s.validate:  # known from the states: screened without reading
            now = Path(log).read_text().count("\n")
            assert now == rejected, f"{now - rejected} units rejected again after the resume"
    assert found_all == want, "the states' quarantine"
    assert mid_document, "a resume in the middle of a document"


def _partitions(state: dict[str, Any]) -> list[list[int]]:
    if state["kind"] == "packed":
        return list(state["partitions"].values())
    return [x for src in state["sources"].values() for x in src["partitions"].values()]


def _quarantine(state: dict[str, Any]) -> tuple[QuarantineEntry, ...]:
    if state["kind"] == "packed":
        return PackedState.from_dict(state).quarantine
    return PackedMixtureState.from_dict(state).mixture.quarantine


def test_a_checkpoint_holds_the_quarantine_and_resumes_without_reading_it(
    lakes: Lakes, references: Callable[[str], Any], tmp_path: Path
) -> None:
    """CheckpointManager saves a packed stream's quarantine with its partitions; two ranks
    loading it know the rejected units (screened without reading) and continue exactly."""
    s, ref, log = SCENARIOS["lake-validate"], references("lake-validate"), str(tmp_path / "r.log")
    before, states = run(s, lakes, log, 1, 8, 30)
    with ll.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        with ll.DataLoader(dataset(s, lakes, log), batch_size=8) as saver:
            saver.load_state_dict(states)
            manager.save(30, saver)
        loaders = [
            ll.DataLoader(dataset(s, lakes, log), batch_size=4, rank=r, world_size=2)
            for r in range(2)
        ]
        for loader in loaders:
            manager.load(loader)
            assert {(Path(q.path).name, q.row_group) for q in loader.quarantine} == {REJECT_GROUP}
    rejected = Path(log).read_text().count("\n")
    after, _ = run(s, lakes, log, 2, 4, 50, states=[x.state_dict() for x in loaders])
    for loader in loaders:
        loader.close()
    assert Path(log).read_text().count("\n") == rejected, "rejected units read again"
    for key, samples in ref.items():
        got = np.stack(before[key] + after[key])
        assert np.array_equal(got, samples[: len(got)]), key


def test_states_merge_their_quarantines_and_old_states_have_none() -> None:
    a = QuarantineEntry("a.parquet", 0, 0, 10, "bad page")
    b = QuarantineEntry("b.parquet", 2, 5, 5, "rejected")
    at = PartitionPosition(1, 4, 2, 40, 3)
    one = PackedState("f", "c", 2, 7, {0: at}).with_quarantine([a])
    two = PackedState("f", "c", 2, 7, {1: at}).with_quarantine([b, a])
    assert PackedState.merge([one, two]).quarantine == (a, b)
    old = one.to_dict()
    del old["quarantine"]  # as lakeloader wrote it before packed streams skipped units
    assert PackedState.from_dict(old) == PackedState("f", "c", 2, 7, {0: at})


def test_a_partition_with_no_token_left_is_refused_not_read_forever(
    lakes: Lakes, tmp_path: Path
) -> None:
    """Every unit rejected: each partition's epochs are empty; after EMPTY_EPOCHS of them in a
    row the stream says so instead of reading epochs forever."""
    from lakeloader.pipeline.partition_stream import EMPTY_EPOCHS

    every = frozenset(i for ids in lakes.groups["web"].values() for i in ids)
    ds = ll.LakeDataset(
        lakes.uri("web"),
        columns=["id", "tokens"],
        num_partitions=C,
        on_error="skip",
        validate=Reject(every, str(tmp_path / "r.log")),
        packing=ll.Packing("tokens", L, eos_id=EOS),
    )
    match = f"no 'tokens' token in {EMPTY_EPOCHS} epochs in a row"
    with ll.DataLoader(ds, batch_size=4) as loader, pytest.raises(ValueError, match=match):
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
        num_partitions=C,
        transform=Const(made),
        packing=ll.Packing("tokens", L),
    )
    with ll.DataLoader(ds, batch_size=4) as loader, pytest.raises(error, match=match):
        next(iter(loader))


@dataclass(frozen=True)
class Const:
    """A transform that gives ``row`` whatever the row."""

    row: dict[str, Any]

    def __call__(self, _: dict[str, Any]) -> dict[str, Any]:
        return self.row

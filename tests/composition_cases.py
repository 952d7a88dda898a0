"""The lakes, datasets, user code and scripted quorum of the composition matrix
(tests/test_composition.py).

Every row has a unique int64 ``id``, ``grp = id % 3`` for the filter, and ``tokens``: 1 to 10
token ids of its own, ``id * 16 + j + 1``, unique across every lake (0 is the packing's eos
and pad). The lakes are written once per module: ``main`` (91 rows, 2 files of 2 row groups)
and ``code`` (56 rows, ids from 1000), each as a folder and as a Delta table (the same row
groups), each once more with a row group damaged; a followed pair appends two files of new
ids to copies of them. What a scenario must deliver is worked out here from the files, never
from a loader (a packed epoch's samples too: see :func:`stream_sizes`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from deltalake import DeltaTable, WriterProperties, write_deltalake

import lakeloader as ll
from tests.conftest import damage_row_group

Feats = frozenset[str]

C, WINDOW, SEED, GLOBAL, EOS = 4, 8, 5, 8, 0
#: seq_len 9: an epoch of code (362 tokens) has streams of 10 and 11 samples
PACKING = ll.Packing("tokens", seq_len=9, eos_id=EOS, pad_id=0)
FOLLOW = ll.Follow(poll_interval=0.01, timeout=0.3)
WEIGHTS = {"main": 115.0, "code": 80.0}  # about each source's rows with its appended ones
USER = ("transform", "batch_transform", "collate_fn")

#: Row groups of each file of each lake, and the first id of each lake.
LAYOUTS = {"main": [[24, 24], [24, 19]], "code": [[24, 13], [19]]}
FIRST_ID = {"main": 0, "code": 1000}
#: Rows of the two files appended to each followed lake (ids from ``APPENDED_ID``).
APPENDS = (12, 12)
APPENDED_ID = {"main": 200, "code": 1200}
#: The validator rejects every unit holding a row of row group 0 of the second file (the plan
#: may cut a row group into several units: each has such a row).
REJECT = frozenset(
    i
    for name, (first, second) in LAYOUTS.items()
    for i in range(FIRST_ID[name] + sum(first), FIRST_ID[name] + sum(first) + second[0])
)
#: Damaged: row group 1 of the first file, in every lake's twin.
DAMAGED_RG = 1
#: Rows of the Delta tables' row groups: the folders' layouts, as deltalake cuts them.
DELTA_RG_ROWS = 24
SCHEMA = pa.schema([("id", pa.int64()), ("grp", pa.int64()), ("tokens", pa.list_(pa.int32()))])


def tokens_of(i: int) -> list[int]:
    """Row ``i``'s tokens: 1 to 10 ids of its own."""
    return [i * 16 + j + 1 for j in range(1 + (i * 7) % 10)]


def rows(first: int, n: int) -> pa.Table:
    ids = np.arange(first, first + n, dtype=np.int64)
    return pa.table(
        {"id": ids, "grp": ids % 3, "tokens": [tokens_of(int(i)) for i in ids]}, schema=SCHEMA
    )


@dataclass(frozen=True)
class Lake:
    """A written lake: where, its ids by (file name, row group) as read back, the damaged."""

    uri: str
    groups: Mapping[tuple[str, int], frozenset[int]]
    damaged: frozenset[tuple[str, int]] = frozenset()

    @property
    def ids(self) -> frozenset[int]:
        return frozenset().union(*self.groups.values())


Lakes = dict[tuple[str, str, bool], Lake]


def read_groups(files: Sequence[Path]) -> dict[tuple[str, int], frozenset[int]]:
    """Each row group's ids, read with pyarrow."""
    out = {}
    for path in files:
        found = pq.ParquetFile(path)
        for g in range(found.num_row_groups):
            out[path.name, g] = frozenset(found.read_row_group(g, ["id"])["id"].to_pylist())
    return out


def write_folder(root: Path, name: str) -> list[Path]:
    root.mkdir(parents=True)
    first, paths = FIRST_ID[name], []
    for f, groups in enumerate(LAYOUTS[name]):
        paths.append(root / f"file-{f}.parquet")
        with pq.ParquetWriter(paths[-1], SCHEMA) as writer:
            for n in groups:
                writer.write_table(rows(first, n), row_group_size=n)
                first += n
    return paths


def write_delta(root: Path, name: str) -> list[Path]:
    first = FIRST_ID[name]
    props = WriterProperties(max_row_group_size=DELTA_RG_ROWS, write_batch_size=8)
    for groups in LAYOUTS[name]:  # one commit (one data file) per file of the folder lake
        write_deltalake(str(root), rows(first, sum(groups)), mode="append", writer_properties=props)
        first += sum(groups)
    return data_files(root)


def data_files(root: Path) -> list[Path]:
    """A Delta table's data files, by their first id (the order they were written in)."""
    files = [Path(u.removeprefix("file://")) for u in DeltaTable(str(root)).file_uris()]
    return sorted(files, key=lambda f: pq.ParquetFile(f).read_row_group(0, ["id"])["id"][0].as_py())


def build_lake(root: Path, name: str, table: str, damaged: bool) -> Lake:
    files = write_folder(root, name) if table == "folder" else write_delta(root, name)
    groups = read_groups(files)
    assert sorted(len(g) for g in groups.values()) == sorted(n for f in LAYOUTS[name] for n in f)
    if damaged:
        damage_row_group(files[0], DAMAGED_RG)
    return Lake(str(root), groups, frozenset({(files[0].name, DAMAGED_RG)} if damaged else ()))


def append(lake: Lake, name: str, table: str, which: int) -> Lake:
    """Append the ``which``-th file (0 or 1) to a followed lake: the lake with its rows."""
    data = rows(APPENDED_ID[name] + sum(APPENDS[:which]), APPENDS[which])
    root = Path(lake.uri)
    time.sleep(0.02)  # a modification time after the files listed so far
    if table == "delta":
        write_deltalake(lake.uri, data, mode="append")
        files = data_files(root)[-1:]
    else:
        files = [root / f"file-{which + 7}.parquet"]  # sorts after the lake's own
        pq.write_table(data, root.parent / f"{files[0].name}.tmp")
        os.replace(root.parent / f"{files[0].name}.tmp", files[0])  # appears whole
    return Lake(lake.uri, {**lake.groups, **read_groups(files)}, lake.damaged)


def copy_lake(lake: Lake, dest: Path) -> Lake:
    shutil.copytree(lake.uri, dest)
    return Lake(str(dest), lake.groups, lake.damaged)


# ------------------------------------------------------------------ what a scenario must deliver


def quarantined(lake: Lake, feats: Feats) -> set[tuple[str, int]]:
    """Row groups (file name, index) a run must quarantine: damaged, or rejected."""
    bad = set(lake.damaged) if "skip" in feats else set()
    if "validate" in feats:
        bad |= {g for g, ids in lake.groups.items() if ids & REJECT}
    return bad


def allowed(lake: Lake, feats: Feats) -> frozenset[int]:
    """The rows of ``lake`` that must come: the filter's, less quarantined row groups."""
    ids = set(lake.ids) - set().union(*(lake.groups[g] for g in quarantined(lake, feats)))
    return frozenset(i for i in ids if i % 3 or "filter" not in feats)


def increments(lake: Lake, name: str, feats: Feats) -> list[frozenset[int]]:
    """A source's epochs in order: a followed lake's first increment, then what was appended;
    else its rows (again and again in a mixture)."""
    ids = allowed(lake, feats)
    if "follow" not in feats:
        return [ids] * (50 if "mixture" in feats else 1)
    new = set(range(APPENDED_ID[name], APPENDED_ID[name] + sum(APPENDS)))
    return [ids - new, ids & new]


# ------------------------------------------------------------------ scenario -> datasets


def names(feats: Feats) -> tuple[str, ...]:
    """The sources, in the order of a Mixture's source indices (sorted)."""
    return ("code", "main") if "mixture" in feats else ("main",)


def table_of(feats: Feats) -> str:
    return "delta" if "delta" in feats else "folder"


def sources(feats: Feats, lakes: Lakes, tmp: Path) -> dict[str, Lake]:
    found = {n: lakes[n, table_of(feats), "skip" in feats] for n in names(feats)}
    if "follow" in feats:  # a copy of its own to append to
        found = {n: copy_lake(lake, tmp / f"followed-{n}") for n, lake in found.items()}
    return found


def appended(feats: Feats, srcs: dict[str, Lake], which: int) -> dict[str, Lake]:
    return {n: append(lake, n, table_of(feats), which) for n, lake in srcs.items()}


def source_dataset(
    feats: Feats, lake: Lake, log: str | None, plain: bool = False
) -> ll.LakeDataset:
    """A source of the scenario (``plain``: its order alone, unpacked, nothing screened)."""
    kw: dict[str, Any] = {"seed": SEED, "num_partitions": C, "window": WINDOW}
    kw["columns"] = ["id", "tokens"] if "packing" in feats else ["id"]
    if "filter" in feats:
        kw["filter"] = pc.field("grp") != 0
    if not plain:
        if "skip" in feats or "validate" in feats:
            kw["on_error"] = "skip"
        if "validate" in feats or log is not None:
            kw["validate"] = Validator("validate" in feats, log)
        if "transform" in feats:
            kw["transform"] = row_transform
        if "batch_transform" in feats:
            kw["batch_transform"] = batch_transform
        if "follow" in feats:
            kw["follow"] = FOLLOW
        if "packing" in feats and "mixture" not in feats:
            kw["packing"] = PACKING
    if "delta" in feats:
        return ll.LakeDataset.from_delta(lake.uri, **kw)
    return ll.LakeDataset(lake.uri, **kw)


def make_dataset(
    feats: Feats, srcs: dict[str, Lake], log: str | None = None
) -> ll.LakeDataset | ll.Mixture:
    if "mixture" not in feats:
        return source_dataset(feats, srcs["main"], log)
    ds = {n: source_dataset(feats, lake, log) for n, lake in srcs.items()}
    epoch_rows = None  # followed: past every source's first increment, within its second
    if "follow" in feats:  # from the layouts: a dataset made after the appends holds them
        epoch_rows = sum(sum(map(sum, LAYOUTS[n])) for n in ds) + APPENDS[0] * len(ds)
    packing = PACKING if "packing" in feats else None
    return ll.Mixture(ds, WEIGHTS, seed=SEED, epoch_rows=epoch_rows, packing=packing)


def loader_kw(feats: Feats, batch_size: int, workers: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"batch_size": batch_size, "drop_last": "drop_last" in feats}
    if workers:
        kw["num_workers"] = 2
    if "collate_fn" in feats:
        kw["collate_fn"] = collate
    return kw


# ------------------------------------------------------------------ user code (picklable)


@dataclass(frozen=True)
class Validator:
    """Rejects a unit holding a row of ``REJECT`` (if ``reject``); appends the pid of each
    call to ``log`` (if given), to show where units were decoded."""

    reject: bool
    log: str | None = None

    def __call__(self, table: pa.Table) -> bool | str:
        if self.log is not None:
            with open(self.log, "a") as fh:
                fh.write(f"{os.getpid()}\n")
        if self.reject and pc.any(pc.is_in(table["id"], pa.array(sorted(REJECT)))).as_py():
            return "a row of REJECT"
        return True


def logged_pids(log: str) -> set[int]:
    path = Path(log)
    return {int(x) for x in path.read_text().split()} if path.exists() else set()


def row_transform(row: dict[str, Any]) -> dict[str, Any]:
    """Adds ``t = 2 id`` and the pid that built the row."""
    return {**row, "t": int(row["id"]) * 2, "pid": os.getpid()}


def batch_transform(batch: dict[str, Any]) -> dict[str, Any]:
    """Adds ``b = 3 id`` (packed: ``3 input_ids``) and the pid that built the batch."""
    ids = torch.as_tensor(batch["id"] if "id" in batch else batch["input_ids"])
    return {**batch, "b": ids * 3, "pid": torch.full_like(ids, os.getpid())}


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every (scalar) field as a tensor (packed samples: each field stacked), plus
    ``c = 5 id`` (packed: ``5 input_ids``) and the pid that collated."""
    if "input_ids" in rows[0]:
        out = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        out["c"] = out["input_ids"] * 5
    else:
        out = {k: torch.tensor([int(r[k]) for r in rows], dtype=torch.int64) for k in rows[0]}
        out["c"] = out["id"] * 5
    out["pid"] = torch.full_like(out["c"], os.getpid())
    return out


#: The field each piece of user code adds, as a multiple of the row's id.
ADDED = {"transform": ("t", 2), "batch_transform": ("b", 3), "collate_fn": ("c", 5)}


# ------------------------------------------------------------------ what the loop was given

#: Packing: the samples of each stream of an epoch of each source (by its index), worked out
#: from the files (see :func:`stream_sizes`).
Needs = dict[int, list[int]]


class Collector:
    """Row ids in global order and by step, or the packed samples in global order (each step's
    shares, rank after rank: the step's samples as the loader sorted them) with their sources,
    ``batches`` then holding each step's indices into ``samples``; the pids that built
    batches; each added field checked on the way."""

    def __init__(self, feats: Feats) -> None:
        self.feats = feats
        self.ids: list[int] = []
        self.batches: list[list[int]] = []
        self.pids: set[int] = set()
        self.samples: list[np.ndarray] = []  # (input_ids, position_ids, pad_mask) x L
        self.sources: list[int] = []

    def add(self, shares: Sequence[Any]) -> None:
        self.batches.append([])
        if "packing" in self.feats:
            self._samples(shares)
            return
        for share in shares:
            ids = share["id"].tolist()
            for key, times in (ADDED[f] for f in USER if f in self.feats):
                assert share[key].tolist() == [times * i for i in ids], f"{key} != {times} id"
            if "pid" in share:
                self.pids.update(share["pid"].tolist())
            self.ids += ids
            self.batches[-1] += ids

    def _samples(self, shares: Sequence[Any]) -> None:
        keys = ("input_ids", "position_ids", "pad_mask")
        for share in shares:  # a batch_transform's or collate_fn's field: of input_ids
            for key, times in (ADDED[f] for f in USER[1:] if f in self.feats):
                assert torch.equal(share[key], share["input_ids"] * times), f"{key} != {times} x"
            if "pid" in share:
                self.pids.update(torch.as_tensor(share["pid"]).flatten().tolist())
        whole = np.concatenate([np.stack([np.asarray(s[k]) for k in keys], 1) for s in shares])
        src = np.concatenate([np.asarray(s.get("source", [0] * len(s[keys[0]]))) for s in shares])
        self.batches[-1] = list(range(len(self.samples), len(self.samples) + len(whole)))
        self.samples += list(whole.astype(np.int64))
        self.sources += [int(x) for x in src]

    def done(self, needs: Needs) -> bool:
        """Every source's epoch 0 delivered (its samples drawn: offsets count up by source)."""
        counts = Counter(self.sources)
        return all(counts[s] >= sum(sizes) for s, sizes in needs.items())


def run_to_end(
    its: Sequence[Iterator[Any]], got: Collector, needs: Needs | None, extra: int = 0
) -> None:
    """Ranks in lockstep to the end of the pass, or (``needs``) until every source's epoch 0
    came, then ``extra`` steps more."""
    if needs is None:
        for shares in zip(*its, strict=True):
            got.add(shares)
        return
    for _ in range(300):
        if got.done(needs):
            for _ in range(extra):
                got.add([next(it) for it in its])
            return
        got.add([next(it) for it in its])
    raise AssertionError(f"300 steps and epoch 0 is not through: {Counter(got.sources)}")


def row_tokens(i: int) -> int:
    """Row ``i``'s tokens in a packed stream: its own and its eos."""
    return len(tokens_of(i)) + 1


def stream_sizes(feats: Feats, lakes: Lakes) -> Needs | None:
    """Packing: the samples of each of the ``C`` streams of an epoch of each source, from the
    files: its ``T`` tokens (every row the filter keeps, a quarantined unit's too: they come as
    padding), stream ``c`` tokens ``[c T // C, (c + 1) T // C)``, cut into samples of ``L``.
    None for a followed lake, whose stream ends by itself."""
    if "packing" not in feats or "follow" in feats:
        return None
    out = {}
    for s, name in enumerate(names(feats)):
        lake = lakes[name, table_of(feats), "skip" in feats]
        total = sum(row_tokens(i) for i in lake.ids if i % 3 or "filter" not in feats)
        bounds = [c * total // C for c in range(C + 1)]
        out[s] = [-(-(b - a) // PACKING.seq_len) for a, b in itertools.pairwise(bounds)]
    return out


def sample_key(sizes: list[int], offset: int) -> tuple[int, int, int]:
    """(epoch, stream, index in it) of a source's ``offset``-th sample: sample ``j`` of an
    epoch is sample ``j // C`` of stream ``j % C`` while every stream has one, then the last
    samples of the longer streams in stream order."""
    epoch, j = divmod(offset, sum(sizes))
    fewest = min(sizes)
    if j < fewest * C:
        return epoch, j % C, j // C
    longer = [c for c, n in enumerate(sizes) if n > fewest]
    return epoch, longer[j - fewest * C], fewest


# ------------------------------------------------------------------ torchft, scripted


class Lighthouse:
    """Who takes part in the step under way, in rank order, and who heals at its quorum."""

    def __init__(self) -> None:
        self.members: list[ScriptedQuorum] = []
        self.healing: set[int] = set()  # ids of the quorums that heal from members[0]


class ScriptedQuorum:
    """One replica group's side of ``lakeloader.ft.loader.QuorumManager``, in-process: each
    step's quorum comes from the lighthouse; a healing group takes the first member's
    registered state and committed-step count, as torchft's manager does."""

    def __init__(self, lighthouse: Lighthouse, step: int = 0) -> None:
        self.lighthouse = lighthouse
        self.step = step  # steps committed
        self.rank: int | None = None
        self.participants = 0
        self.fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None:
        self.fns[key] = (load_state_dict, state_dict)

    def start_quorum(self) -> None:
        members = self.lighthouse.members
        self.participants = len(members)
        self.rank = members.index(self) if self in members else None
        if id(self) in self.lighthouse.healing:
            peer = members[0]
            for key, (load, _) in self.fns.items():
                load(peer.fns[key][1]())
            self.step = peer.step

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return self.rank

    def is_participating(self) -> bool:
        return self.rank is not None

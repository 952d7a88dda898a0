"""Checkpoints of the records before version 2 still read, load and resume where they stood.

``tests/fixtures/checkpoints`` holds one checkpoint folder per loader kind, written at 6b1ec6c
(before record version 2: a lake's ``{loader, context, extra}``, the others' ``KindRecord``) by
saving each loader of ``tests/fixtures/make_states.KINDS`` after 3 steps, over lakes identical
to ``tests/fixtures/states``' but at the folders ``manifest.json`` records, with the ids of the
next 2 batches. Reading a folder touches no lake, so it reads in any checkout; the resume
takes the read state with the recorded folders' fingerprints mapped to the committed lakes'
(as tests/test_state_compat.py does). The packed ones hold states of per-partition packing
(version 1) taken mid-epoch: they read, but a loader and ``lakeloader inspect`` refuse them with
what to do. ``CheckpointManager.load`` of the old records is shown on records written here in the
old writers' exact shapes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest

import lakeloader as ll
from lakeloader.checkpoint.folders import CheckpointFolders
from lakeloader.checkpoint.layout import Checkpoint, CommitRecord, sha256
from lakeloader.cli.audit import run_audit
from lakeloader.cli.main import main
from lakeloader.lake.snapshot import fingerprint
from tests.fixtures import make_states as ms
from tests.test_state_compat import REFUSED

HERE = Path(__file__).resolve().parent / "fixtures"
FROZEN: dict[str, Any] = json.loads((HERE / "checkpoints" / "manifest.json").read_text())
LAKE_OF = {"packed": "tokens", "packed_mixture": "tokens"}  # the others read "lake"
#: The leaves each kind's checkpoint pins.
LEAVES = {
    "plain": [""],
    "followed": [""],
    "mixture": ["a", "b"],
    "packed": ["lake"],
    "packed_mixture": ["a", "b"],
}


@pytest.fixture(scope="module", autouse=True)
def _mtimes() -> None:
    ms.set_mtimes(HERE / "states")


def translated(state: dict[str, Any], lake: str) -> dict[str, Any]:
    """A state with the recorded lake folder's fingerprint mapped to the committed lake's."""
    recorded, here = FROZEN["lakes"][lake], str(HERE / "states" / lake)
    snapshot = ll.LakeDataset(here).snapshot
    files = [dataclasses.replace(f, path=f.path.replace(here, recorded)) for f in snapshot.files]
    old, text = fingerprint(files, snapshot.table), json.dumps(state)
    assert old in text, f"the state's fingerprint is not {old}, the committed lake's at {recorded}"
    loaded: dict[str, Any] = json.loads(text.replace(old, snapshot.fingerprint))
    return loaded


def read_frozen(name: str, tmp_path: Path) -> Checkpoint:
    """The frozen checkpoint ``name`` (a copy), its record checked."""
    shutil.copytree(HERE / "checkpoints" / name, tmp_path / name)
    with ll.CheckpointManager(str(tmp_path / name), ledger=False) as manager:
        ckpt = manager.load_checkpoint()
    assert ckpt.step == FROZEN["step"] and ckpt.extra == {"lr": 0.5, "name": name}
    assert sorted(ckpt.manifests) == LEAVES[name] and ckpt.training is not None
    assert set(ckpt.sources.values()) == {FROZEN["lakes"][LAKE_OF.get(name, "lake")]}
    assert (ckpt.lake is not None) == (LEAVES[name] == [""])
    if ckpt.lake is not None:
        assert ckpt.lake.fingerprint == ckpt.state.fingerprint
        assert ckpt.context.topology == ll.Topology(1, 0, 0, ms.BATCH)
    return ckpt


@pytest.mark.parametrize("name", [n for n in LEAVES if n not in REFUSED])
def test_a_frozen_checkpoint_reads_and_resumes_where_it_stood(name: str, tmp_path: Path) -> None:
    ckpt = read_frozen(name, tmp_path)
    loader = ms.KINDS[name](HERE / "states")
    try:
        loader.load_state_dict(translated(ckpt.state_dict, LAKE_OF.get(name, "lake")))
        assert ms.next_ids(loader) == FROZEN["next_ids"][name]
    finally:
        loader.close()


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_frozen_packed_checkpoint_reads_and_is_refused_with_what_to_do(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = read_frozen(name, tmp_path)
    loader = ms.KINDS[name](HERE / "states")
    try:
        with pytest.raises(ll.StateFormatError, match=REFUSED[name]):
            loader.load_state_dict(translated(ckpt.state_dict, LAKE_OF[name]))
    finally:
        loader.close()
    assert main(["inspect", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lakeloader inspect: error: {ckpt.path}: ")
    assert re.search(REFUSED[name], err), err


def test_a_frozen_lake_checkpoint_audits(tmp_path: Path) -> None:
    shutil.copytree(HERE / "checkpoints" / "plain", tmp_path / "plain")
    report, info = run_audit(str(tmp_path / "plain"), {})
    assert report.verdict == "exactly once", info


def write_old(root: Path, step: int, loader: ll.DataLoader, extra: Any) -> None:
    """A checkpoint of ``loader`` as lakeloader wrote it before record version 2.

    The records' shapes are those of 6b1ec6c's ``StateRecord`` (a loader over one lake) and
    ``KindRecord`` (the others), ``COMMIT`` naming a lake's manifest, or none.
    """
    folders = CheckpointFolders(ll.CheckpointManager(str(root), ledger=False).store, str(root), 3)
    created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    kinds = {"lake": "lake", "mixture": "mixture", "packed stream": "packed"}
    state, kind = loader.state_dict(), kinds.get(loader.root.what, "packed-mixture")
    if kind == "lake":
        ds = loader.dataset
        manifest = folders.manifest(ds.snapshot, ds.source.describe())
        context = {
            "step": step,
            "library_version": ll.__version__,
            "created": created,
            "fingerprint": ds.fingerprint,
            "config": ds.config.to_dict(),
            "topology": loader.topology.to_dict(),
            "drop_last": loader.drop_last,
            "workers_build": loader.tracker.workers_build,
            "source": ds.source.describe(),
        }
        body = {"loader": state, "context": context, "extra": extra}
    else:
        named = loader.checkpoint_datasets()
        sources = {n: ds.source.describe() for n, ds in named.items()}
        manifests = {n: list(folders.manifest(ds.snapshot, sources[n])) for n, ds in named.items()}
        manifest = ("", "")
        body = {
            "kind": kind,
            "version": 1,
            "state": state,
            "step": step,
            "library_version": ll.__version__,
            "created": created,
            "manifests": manifests,
            "sources": sources,
            "extra": extra,
        }
    payload = msgpack.packb(body, use_bin_type=True)
    folder = root / f"step-{step:012d}"
    folder.mkdir(parents=True)
    (folder / "state.msgpack").write_bytes(payload)
    commit = CommitRecord(step, len(payload), sha256(payload), *manifest)
    (folder / "COMMIT").write_bytes(commit.to_bytes())


@pytest.mark.parametrize("name", ["plain", "mixture", "packed"])
def test_an_old_record_loads_through_the_manager(name: str, tmp_path: Path) -> None:
    ms.write_lakes(tmp_path)
    loader = ms.KINDS[name](tmp_path)
    it = iter(loader)
    for _ in range(ms.STEPS):
        next(it)
    write_old(tmp_path / "ckpt", 3, loader, {"lr": 0.5})
    want = [ms.batch_ids(next(it)) for _ in range(ms.NEXT)]
    loader.close()
    fresh = ms.KINDS[name](tmp_path)
    with ll.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        assert manager.load(fresh) == {"lr": 0.5}
    assert ms.next_ids(fresh) == want
    fresh.close()

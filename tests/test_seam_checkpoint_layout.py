"""The checkpoint's on-disk records: typed, versioned, and refused with a reason when foreign."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

import lakeloader as ll
from lakeloader.checkpoint.layout import (
    COMMIT_FILE,
    CheckpointContext,
    CommitRecord,
    StateRecord,
    step_dir_name,
)


def _saved(dataset: ll.LakeDataset, root: Path) -> ll.CheckpointManager:
    loader = ll.DataLoader(dataset, batch_size=16, drop_last=True)
    next(iter(loader))
    manager = ll.CheckpointManager(str(root))
    manager.save(1, loader, extra={"lr": 0.1})
    loader.close()
    return manager


def test_records_are_typed(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    ckpt = _saved(dataset, tmp_path).read(1)
    assert isinstance(ckpt.context, CheckpointContext)
    assert ckpt.context.topology == ll.Topology(1, 0, 0, 16) and ckpt.context.drop_last
    assert ckpt.state.position == 16 and ckpt.extra == {"lr": 0.1}
    commit = CommitRecord.from_bytes((Path(ckpt.path) / COMMIT_FILE).read_bytes())
    assert commit.step == 1 and commit.state_bytes == ckpt.nbytes


def test_an_unknown_commit_version_is_refused(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    manager = _saved(dataset, tmp_path)
    marker = tmp_path / step_dir_name(1) / COMMIT_FILE
    raw = msgpack.unpackb(marker.read_bytes())
    marker.write_bytes(msgpack.packb({**raw, "version": 2}))
    with pytest.raises(
        ll.CheckpointError, match="format version 2; this lakeloader reads version 1"
    ):
        manager.read(1)
    with pytest.raises(ll.CheckpointError, match="no usable checkpoint"):
        manager.load_checkpoint()


def test_a_context_of_lakeloader_0_1_still_reads() -> None:
    old = {
        "step": 3,
        "library_version": "0.1.0",
        "created": "2026-11-01T00:00:00+00:00",
        "fingerprint": "f",
        "config": {"seed": 0},
        "topology": {"world_size": 2, "num_workers": 1, "batch_size": 8, "drop_last": True},
        "source": "/lake",
    }
    ctx = CheckpointContext.from_dict(old)
    assert ctx.topology == ll.Topology(2, 0, 1, 8) and ctx.drop_last and not ctx.workers_build
    assert CheckpointContext.from_dict(ctx.to_dict()) == ctx


def test_corrupt_state_records_say_so() -> None:
    with pytest.raises(ll.CheckpointError, match="corrupt"):
        StateRecord.from_bytes(b"\xc1garbage")
    with pytest.raises(ll.CheckpointError, match="not a lakeloader state"):
        StateRecord.from_bytes(msgpack.packb({"loader": {"kind": "x"}, "context": {}, "extra": 0}))


def test_a_record_of_an_unknown_version_is_refused(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    manager = _saved(dataset, tmp_path)
    folder = tmp_path / step_dir_name(1)
    raw = msgpack.unpackb((folder / "state.msgpack").read_bytes())
    assert raw["record"] == 2 and list(raw["manifests"]) == [""]
    assert raw["sources"] == {"": dataset.source.describe()}
    with pytest.raises(ll.CheckpointError, match="record version 3; this lakeloader reads"):
        StateRecord.from_bytes(msgpack.packb({**raw, "record": 3}))
    manager.close()

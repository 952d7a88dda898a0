"""Checkpoints of packed loaders: a packed lake and a packed mixture saved under 2 ranks with
``CheckpointManager``, loaded back on 3 ranks at another global batch, every token once per
epoch across the resume; ``lakeloader inspect`` of them (text and ``--json``) and
``lakeloader audit`` (each source's samples, epoch by epoch)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main

L, C, EOS, PAD = 16, 4, 1_000_000_000, 0
#: Rows of each lake (the packed lake is "web"; a packed mixture reads all three).
ROWS = {"web": 300, "code": 200, "math": 60}
BASE = {"web": 10_000_000, "code": 20_000_000, "math": 30_000_000}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
#: Saved under 2 ranks of 4 samples after 5 steps; resumed under 3 ranks of 5.
BEFORE, AFTER = (2, 4, 5), (3, 5)


def tokens_of(name: str, i: int) -> list[int]:
    """Row ``i``'s tokens: 1 to 7 of them, unique across every lake, never ``PAD`` or ``EOS``."""
    return [BASE[name] + i * 100 + j + 1 for j in range(i % 7 + 1)]


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packing-checkpoints")
    for name, rows in ROWS.items():
        (root / name).mkdir()
        for f in range(2):
            ids = list(range(f * rows // 2, (f + 1) * rows // 2))
            table = pa.table({"id": ids, "tokens": [tokens_of(name, i) for i in ids]})
            pq.write_table(table, root / name / f"part-{f}.parquet", row_group_size=25)
    return root


def per_epoch(name: str) -> int:
    """Samples in an epoch of a lake, from its rows: ``C`` streams of ``L``-token samples."""
    total = sum(len(tokens_of(name, i)) + 1 for i in range(ROWS[name]))
    bounds = [c * total // C for c in range(C + 1)]
    return sum(-(-(b - a) // L) for a, b in itertools.pairwise(bounds))


def packing() -> ll.Packing:
    return ll.Packing("tokens", L, eos_id=EOS, pad_id=PAD)


def lake_dataset(lakes: Path, **kw: Any) -> ll.LakeDataset:
    cols = ["id", "tokens"]
    return ll.LakeDataset(lakes / "web", columns=cols, seed=3, num_partitions=C, **kw)


def packed(lakes: Path, **kw: Any) -> ll.LakeDataset:
    return lake_dataset(lakes, packing=packing(), **kw)


def mixture(lakes: Path) -> ll.Mixture:
    sources = {
        n: ll.LakeDataset(lakes / n, columns=["tokens"], seed=k, num_partitions=C)
        for k, n in enumerate(WEIGHTS)
    }
    return ll.Mixture(sources, WEIGHTS, seed=11, packing=packing())


def steps(
    loaders: list[ll.DataLoader], count: int, key: str | None = None
) -> list[dict[str, np.ndarray]]:
    """``count`` global steps of ranks in lockstep, each its ranks' batches in rank order."""
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(count):
        batches = [next(it) for it in iters]
        keys = ["input_ids", "pad_mask", *([] if key is None else [key])]
        out.append({k: np.concatenate([b[k].numpy() for b in batches]) for k in keys})
    return out


def ranks(make: Callable[[], Any], world: int, batch: int) -> list[ll.DataLoader]:
    return [ll.DataLoader(make(), batch_size=batch, rank=r, world_size=world) for r in range(world)]


def check_every_token_once(samples: np.ndarray, pads: np.ndarray, name: str) -> None:
    """A source's samples in the order delivered: each epoch's (its first ``per_epoch``, and so
    on; a step's samples are sorted by epoch) hold each of its tokens once, a whole epoch all
    of them, and padding only where marked."""
    lake = sorted(t for i in range(ROWS[name]) for t in tokens_of(name, i))
    n = per_epoch(name)
    assert (samples[pads] == PAD).all()
    for start in range(0, len(samples), n):
        epoch = samples[start : start + n][~pads[start : start + n]]
        got = np.sort(epoch[epoch != EOS]).tolist()
        assert len(got) == len(set(got)), f"{name}: a token twice in one epoch"
        assert set(got) <= set(lake)
        if start + n <= len(samples):
            assert got == lake, f"{name}: epoch {start // n} misses tokens"
            assert int((epoch == EOS).sum()) == ROWS[name]


def test_a_packed_loader_saved_on_2_ranks_resumes_on_3_at_another_batch(
    lakes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0's save holds the samples delivered; 3 ranks at a global batch of 15 continue from
    it into the next epoch with every token once; inspect shows the samples; the loaders'
    stats count the tokens and padding they handed out; the audit proves the samples."""
    world, batch, count = BEFORE
    root = str(tmp_path / "ckpt")
    first = ranks(lambda: packed(lakes), world, batch)
    before = steps(first, count)
    assert first[0].state_dict() == first[1].state_dict()
    with ll.CheckpointManager(root) as manager:
        manager.save(count, first[0], extra={"step": count})
    for loader in first:
        loader.close()
    done = world * batch * count
    more = -(-(per_epoch("web") + 20 - done) // (AFTER[0] * AFTER[1]))  # into epoch 1
    second = ranks(lambda: packed(lakes), *AFTER)
    with ll.CheckpointManager(root) as manager:
        for loader in second:
            assert manager.load(loader) == {"step": count}
    after = steps(second, more)
    total = done + more * AFTER[0] * AFTER[1]
    assert all(r.state_dict()["samples"] == total for r in second)
    stats = [r.stats() for r in second]
    pads = np.concatenate([s["pad_mask"] for s in after])
    assert sum(s["tokens"] for s in stats) == int((~pads).sum())
    assert sum(s["padding"] for s in stats) == int(pads.sum()) > 0
    for loader in second:
        loader.close()
    every = before + after
    samples = np.concatenate([s["input_ids"] for s in every])
    assert samples.shape == (total, L)
    check_every_token_once(samples, np.concatenate([s["pad_mask"] for s in every]), "web")
    alone = ranks(lambda: packed(lakes), 1, 5)  # one rank, uninterrupted: the same samples
    ref = np.concatenate([s["input_ids"] for s in steps(alone, total // 5)])
    alone[0].close()
    assert sorted(map(tuple, ref.tolist())) == sorted(map(tuple, samples.tolist()))

    assert main(["inspect", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["step"], info["version"]) == ("packed", count, 2)
    assert (info["samples"], info["epoch"], info["quarantine"]) == (done, None, [])
    assert info["lake"] == str(lakes / "web") and info["steps_available"] == [count]
    assert info["fingerprint"] == packed(lakes).fingerprint
    assert main(["inspect", root]) == 0
    text = capsys.readouterr().out
    assert re.search(rf"\nsamples +{done} delivered \(the same on every rank", text), text
    assert "quarantine: none" in text and "partition" not in text
    assert main(["audit", root]) == 0  # each epoch's samples, stream "lake"
    assert "every row exactly once" in capsys.readouterr().out
    plain = ll.DataLoader(lake_dataset(lakes), batch_size=4)
    with (
        ll.CheckpointManager(root) as manager,
        pytest.raises(ll.StateFormatError, match=r"'packed' state, which this DataLoader"),
    ):
        manager.load(plain)
    plain.close()


def test_inspect_shows_the_quarantine_of_a_packed_checkpoint(
    lakes: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Units a validator rejects: their tokens come as padding, never delivered; the
    checkpoint's quarantine names them (every rank's merged, as the save's barrier does across
    processes), and 3 ranks resumed from it skip them without reading; inspect lists them."""
    bad = "ids 100 to 124"

    def validate(table: pa.Table) -> str | bool:
        return bad if 100 in table.column("id").to_pylist() else True

    def make() -> ll.LakeDataset:
        return packed(lakes, on_error="skip", validate=validate)

    world, batch, _ = BEFORE
    count = -(-per_epoch("web") // (world * batch))  # a whole epoch: every unit read
    root = str(tmp_path / "ckpt")
    first = ranks(make, world, batch)
    before = steps(first, count)
    states = [r.state_dict() for r in first]
    for loader in first:
        loader.close()
    saving = ll.DataLoader(make(), batch_size=batch, rank=0, world_size=world)
    saving.load_state_dict(states)
    with ll.CheckpointManager(root) as manager:
        manager.save(count, saving)
    saving.close()
    second = ranks(make, *AFTER)
    with ll.CheckpointManager(root) as manager:
        for loader in second:
            manager.load(loader)
    caplog.clear()
    after = steps(second, 8)
    reason = f"rejected by validate: {bad}"
    assert all([q.reason for q in r.quarantine] == [reason] for r in second)
    assert not [r for r in caplog.records if "quarantined" in r.message], "read again"
    for loader in second:
        loader.close()
    gone = {t for i in range(100, 125) for t in tokens_of("web", i)}
    delivered = set(np.concatenate([s["input_ids"] for s in before + after]).ravel().tolist())
    assert not gone & delivered
    assert {t for i in range(99) for t in tokens_of("web", i)} <= delivered

    assert main(["inspect", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    [entry] = info["quarantine"]
    assert entry["path"] == str(lakes / "web" / "part-0.parquet")
    assert (entry["row_group"], entry["row_start"], entry["num_rows"]) == (4, 0, 25)
    assert entry["reason"] == reason
    assert main(["inspect", root]) == 0
    text = capsys.readouterr().out
    assert "quarantine (units skipped for good" in text and reason in text


def test_a_packed_mixture_saved_on_2_ranks_resumes_on_3_at_another_batch(
    lakes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The samples' cursor saved by rank 0 resumes 3 ranks at a global batch of 15: each
    source's tokens once per epoch (the small source past its first); inspect's table counts
    samples, each source's epoch and place in it from its samples per epoch."""
    world, batch, count = BEFORE
    root = str(tmp_path / "ckpt")
    first = ranks(lambda: mixture(lakes), world, batch)
    before = steps(first, count, "source")
    saved, other = (r.state_dict() for r in first)
    del saved["mixture"]["topology"], other["mixture"]["topology"]  # the rank's, for reports
    assert saved == other
    with ll.CheckpointManager(root) as manager:
        manager.save(count, first[0])
    for loader in first:
        loader.close()
    second = ranks(lambda: mixture(lakes), *AFTER)
    with ll.CheckpointManager(root) as manager:
        for loader in second:
            manager.load(loader)
    more = 12
    after = steps(second, more, "source")
    for loader in second:
        loader.close()
    done = world * batch * count
    total = done + more * AFTER[0] * AFTER[1]
    every = before + after
    samples = np.concatenate([s["input_ids"] for s in every])
    pads = np.concatenate([s["pad_mask"] for s in every])
    source = np.concatenate([s["source"] for s in every])
    names = np.array(sorted(WEIGHTS))[source]
    assert samples.shape == (total, L)
    for name in WEIGHTS:
        mine = names == name
        check_every_token_once(samples[mine], pads[mine], name)
    assert int((names == "math").sum()) > per_epoch("math"), "the small source's next epoch"
    alone = ranks(lambda: mixture(lakes), 1, 5)  # one rank, uninterrupted: the same samples
    ref = steps(alone, total // 5, "source")
    alone[0].close()
    ref_keyed = [
        (s, *t)
        for step in ref
        for s, t in zip(step["source"].tolist(), step["input_ids"].tolist(), strict=True)
    ]
    keyed = [(s, *t) for s, t in zip(source.tolist(), samples.tolist(), strict=True)]
    assert sorted(ref_keyed) == sorted(keyed)

    assert main(["inspect", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["unit"], info["slot"]) == ("packed-mixture", "samples", done)
    assert "pass" not in info and info["quarantine"] == []
    counts = saved["mixture"]["counts"]
    assert sum(counts.values()) == done
    for s in info["sources"]:
        n = per_epoch(s["source"])
        assert s["drawn"] == counts[s["source"]]
        assert (s["samples_per_epoch"], s["epoch"], s["samples_consumed"]) == (
            n,
            *divmod(s["drawn"], n),
        )
        assert s["samples_remaining"] == n - s["samples_consumed"]
        assert s["url"] == str(lakes / s["source"])
    assert main(["inspect", root]) == 0
    text = capsys.readouterr().out
    assert "samples drawn" in text and "consumed and remaining: samples of that epoch" in text
    assert "\npass " not in text and "rounds" not in text
    assert main(["audit", root]) == 0  # each source's samples, epoch by epoch
    assert "every row exactly once" in capsys.readouterr().out

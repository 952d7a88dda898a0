"""``lakeloader audit``: the exactly-once proof of a run, from its ledger and checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lakeloader.audit.history import AuditReport, Span, audit
from lakeloader.audit.ledger import read_entries
from lakeloader.checkpoint.kind_record import KindCheckpoint
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.checkpoint.manager import CheckpointManager
from lakeloader.cli.inspect import rebuild_plan, unit_offsets
from lakeloader.cli.tables import format_pairs, format_table
from lakeloader.errors import CheckpointError
from lakeloader.order.plan import slots_to_virtual

#: Positions of each missing or doubled span located in the lake (file, row group, row).
LOCATED = 3


def run_audit(url: str, storage_options: dict[str, Any]) -> tuple[AuditReport, dict[str, Any]]:
    """Audit the run whose checkpoints are under ``url``; the report and its plain form.

    Raises:
        CheckpointError: If there is no usable checkpoint, or a ledger entry is malformed.
    """
    manager = CheckpointManager(url, storage_options=storage_options, ledger=False)
    try:
        ckpt = manager.load_checkpoint()
        if ckpt.training is None:
            raise CheckpointError(
                f"{ckpt.path} was saved without a training context (an older lakeloader): "
                "its run has no ledger to audit"
            )
        entries, torn = read_entries(manager.store, manager.root)
    finally:
        manager.close()
    if not entries:
        raise CheckpointError(f"no audit ledger under {url} (CheckpointManager(ledger=False)?)")
    report = audit(entries, ckpt.step, ckpt.training.attempt)
    return report, _plain(report, torn, ckpt)


def _plain(
    report: AuditReport, torn: list[str], ckpt: Checkpoint | KindCheckpoint
) -> dict[str, Any]:
    epochs = []
    for e in report.epochs:
        d = dataclasses.asdict(e)
        for key in ("missing", "doubled", "replayed", "uncommitted"):
            d[key] = [[s.start, s.stop] for s in getattr(e, key)]
        d["ok"] = e.ok
        d["located"] = (
            _locate(ckpt, e.epoch, e.num_rows, e.missing + e.doubled)
            if isinstance(ckpt, Checkpoint) and not e.ok
            else []
        )
        epochs.append(d)
    return {
        "checkpoint": ckpt.path,
        "head_step": report.head_step,
        "head_attempt": report.head_attempt,
        "ok": report.ok,
        "chain": [dataclasses.asdict(link) for link in report.chain],
        "epochs": epochs,
        "problems": list(report.problems),
        "torn_segments": torn,
    }


def _locate(ckpt: Checkpoint, epoch: int, num_rows: int, spans: tuple[Span, ...]) -> list[str]:
    """Where the first positions of each span lie in the lake.

    Only when the epoch ran on the checkpoint's snapshot (the same number of rows).
    """
    state = dataclasses.replace(ckpt.state, epoch=epoch)
    try:
        plan = rebuild_plan(dataclasses.replace(ckpt, state=state))
    except CheckpointError:
        return []
    if plan.num_rows != num_rows:
        return []
    out = []
    files = ckpt.snapshot.files
    for span in spans:
        slots = np.arange(span.start, min(span.stop, span.start + LOCATED), dtype=np.int64)
        units, offsets = unit_offsets(plan, slots_to_virtual(plan, slots))
        for slot, unit, offset in zip(
            slots.tolist(), units.tolist(), offsets.tolist(), strict=True
        ):
            f = files[int(plan.units.file_index[unit])]
            rg = int(plan.units.row_group[unit])
            out.append(f"position {slot}: {f.path} row group {rg} row {offset}")
    return out


def render_audit_text(info: dict[str, Any]) -> str:
    """The readable report of ``lakeloader audit``."""
    chain = " -> ".join(
        f"{c['attempt']} ({c['steps']} steps on world {'/'.join(map(str, c['world_sizes']))})"
        for c in info["chain"]
    )
    head = format_pairs(
        [
            ("checkpoint", info["checkpoint"]),
            ("committed history", f"ends at step {info['head_step']:,}"),
            ("attempts", chain or "-"),
        ]
    )
    rows = []
    for e in info["epochs"]:
        status = "complete" if e["complete"] else "in progress"
        if not e["ok"]:
            status = "ERROR"
        rows.append(
            [
                e["epoch"],
                f"{e['num_rows']:,}",
                f"{e['trained']:,}",
                f"{e['dropped']:,}",
                _rows(e["replayed"]),
                _rows(e["uncommitted"]),
                ", ".join(f"{w}x{b}" for w, b in e["topologies"]),
                status,
            ]
        )
    table = format_table(
        [
            "epoch",
            "rows",
            "trained",
            "dropped",
            "replayed",
            "uncommitted",
            "ranks x batch",
            "status",
        ],
        rows,
    )
    lines = [head, table]
    for e in info["epochs"]:
        for key, word in (("missing", "never trained on"), ("doubled", "trained on twice")):
            for start, stop in e[key]:
                lines.append(f"ERROR epoch {e['epoch']}: positions [{start}, {stop}) {word}")
        lines += [f"  {where}" for where in e["located"]]
    lines += [f"ERROR {p}" for p in info["problems"]]
    lines += [f"note: {t}" for t in info["torn_segments"]]
    verdict = "every row exactly once" if info["ok"] else "NOT exactly once"
    lines.append(f"verdict: {verdict} in the committed history")
    return "\n".join(lines)


def _rows(spans: list[list[int]]) -> str:
    return f"{sum(b - a for a, b in spans):,}" if spans else "-"

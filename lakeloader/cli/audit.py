"""``lakeloader audit``: the exactly-once proof of a run, from its ledger and checkpoints."""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

import numpy as np

from lakeloader.audit.history import AuditReport, Span, audit, epoch_name
from lakeloader.audit.ledger import LEDGER_DIR, read_entries
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.checkpoint.manager import CheckpointManager
from lakeloader.cli.checkpoints import find_checkpoint
from lakeloader.cli.inspect import rebuild_plan, requested
from lakeloader.cli.tables import format_pairs, format_table, full_urls, lake_url
from lakeloader.errors import CheckpointError
from lakeloader.io.fetch import url_of
from lakeloader.io.retry import RetryPolicy
from lakeloader.state.view import locate

#: Positions of each missing or doubled span located in the lake (file, row group, row).
LOCATED = 3
#: The report's last line, by the audit's verdict.
_VERDICTS = {
    "exactly once": "every row exactly once in the committed history",
    "NOT exactly once": "NOT exactly once in the committed history",
    "unverified": "unverified: no row missing or doubled in what the ledger recorded, but part "
    "of the committed history was not recorded (UNVERIFIED above)",
}


def run_audit(
    url: str, storage_options: dict[str, Any], retry: RetryPolicy | None = None
) -> tuple[AuditReport, dict[str, Any]]:
    """Audit the run whose checkpoints are under ``url``; the report and its plain form.

    Raises:
        CheckpointError: If the run has no ledger, or a ledger with no complete entry.
    """
    with CheckpointManager(
        url, storage_options=storage_options, retry=retry, ledger=False
    ) as manager:
        found = find_checkpoint(manager)
        ckpt = found.checkpoint
        if ckpt.training is None:
            raise CheckpointError(
                f"{ckpt.path} was saved without a training context (an older lakeloader): "
                "its run has no ledger to audit"
            )
        entries, torn = read_entries(manager.store, manager.root)
        if not entries:
            raise CheckpointError(_no_entries(manager, url, torn, ckpt))
    report = audit(entries, ckpt.step, ckpt.training.attempt)
    info = _plain(report, [full_urls(t, url) for t in torn], ckpt)
    info["skipped_damaged"] = found.skipped
    return report, info


def _no_entries(manager: CheckpointManager, url: str, torn: list[str], ckpt: Checkpoint) -> str:
    """Why a ledger gave no entry: there is none, or its segments are cut short or empty."""
    folder = posixpath.join(manager.root, LEDGER_DIR)
    where = url_of(manager.fs, folder)
    if torn:
        return (
            f"the audit ledger {where} holds no complete entry: "
            f"{'; '.join(full_urls(t, url) for t in torn)}; no step of the run is recorded, "
            "so there is nothing to audit"
        )
    segments = [p for p in manager.store.sizes(folder) if p.endswith(".jsonl")]
    if segments:
        return (
            f"the audit ledger {where} holds no entry: its segment(s) "
            f"{', '.join(url_of(manager.fs, p) for p in segments)} are empty"
        )
    leaves = sorted(ckpt.manifests)
    over = "one lake" if leaves == [""] else f"the sources {', '.join(map(repr, leaves))}"
    return (
        f"no audit ledger under {url} (no {LEDGER_DIR}/ folder): the run was saved with "
        f"CheckpointManager(ledger=False), or its loader (over {over}, as {ckpt.path} "
        "says) kept no record of the steps it delivered (the manager then logs a warning "
        "naming it at the first save)"
    )


def _plain(report: AuditReport, torn: list[str], ckpt: Checkpoint) -> dict[str, Any]:
    epochs = []
    for e in report.epochs:
        d = dataclasses.asdict(e)
        for key in ("missing", "doubled", "unrecorded", "replayed", "uncommitted", "skipped"):
            d[key] = [[s.start, s.stop] for s in getattr(e, key)]
        d["ok"] = e.ok
        d["located"] = (
            _locate(ckpt, e.epoch, e.num_rows, e.missing + e.doubled)
            if ckpt.lake is not None and not e.ok and not e.stream
            else []
        )
        epochs.append(d)
    return {
        "checkpoint": ckpt.path,
        "head_step": report.head_step,
        "head_attempt": report.head_attempt,
        "ok": report.ok,
        "verdict": report.verdict,
        "unverified": list(report.unverified),
        "chain": [dataclasses.asdict(link) for link in report.chain],
        "epochs": epochs,
        "problems": list(report.problems),
        "torn_segments": torn,
        **requested(ckpt.state_dict),
    }


def _locate(ckpt: Checkpoint, epoch: int, num_rows: int, spans: tuple[Span, ...]) -> list[str]:
    """Where the first positions of each span lie in the lake (if on the checkpoint's snapshot)."""
    try:
        plan = rebuild_plan(ckpt, epoch)
    except CheckpointError:
        return []
    if plan.num_rows != num_rows:
        return []
    slots = np.concatenate([np.arange(s.start, min(s.stop, s.start + LOCATED)) for s in spans])
    return [
        f"position {at.slot}: {lake_url(ckpt.source, at.file)} row group {at.row_group} "
        f"row {at.row_offset}"
        for at in locate(plan, ckpt.snapshot, slots)
    ]


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
    streams = any(e["stream"] for e in info["epochs"])
    rows = []
    for e in info["epochs"]:
        status = "complete" if e["complete"] else "in progress"
        if not e["ok"]:
            status = "ERROR"
        elif e["unrecorded"]:
            status = "unverified"
        cells = [e["epoch"], f"{e['num_rows']:,}", f"{e['trained']:,}", f"{e['dropped']:,}"]
        cells += [_rows(e[k]) for k in ("skipped", "replayed", "uncommitted")]
        cells += [", ".join(f"{w}x{b}" for w, b in e["topologies"]), status]
        rows.append([e["stream"]] * streams + cells)
    columns = ["epoch", "rows", "trained", "dropped", "skipped", "replayed", "uncommitted"]
    table = format_table(["stream"] * streams + columns + ["ranks x batch", "status"], rows)
    lines = [head, table]
    for e in info["epochs"]:
        name = epoch_name(e["stream"], e["epoch"])
        for key, word in (("missing", "never trained on"), ("doubled", "trained on twice")):
            for start, stop in e[key]:
                lines.append(f"ERROR {name}: positions [{start}, {stop}) {word}")
        lines += [f"  {where}" for where in e["located"]]
        for start, stop in e["skipped"]:
            lines.append(f"{name}: positions [{start}, {stop}) skipped on request (skip())")
    skips = info["steps_skipped"]
    if skips["done"] or skips["pending"]:
        lines.append(f"skipped on request: {skips['done']} steps ({skips['pending']} to come)")
    lines += [
        f"quarantined on request: {q['path']} row group {q['row_group']} rows "
        f"{q['row_start']}+{q['num_rows']} ({q['reason']})"
        for q in info["quarantined_steps"]
    ]
    lines += [f"ERROR {p}" for p in info["problems"]]
    lines += [f"UNVERIFIED {u}" for u in info["unverified"]]
    lines += [f"note: {t}" for t in info["torn_segments"]]
    lines.append(f"verdict: {_VERDICTS[info['verdict']]}")
    return "\n".join(lines)


def _rows(spans: list[list[int]]) -> str:
    return f"{sum(b - a for a, b in spans):,}" if spans else "-"

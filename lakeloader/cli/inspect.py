"""What a checkpoint says: position, where every rank and worker resumes, rows consumed and left.

From the checkpoint alone (the lake is never touched), as plain dicts (JSON-ready).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.cli.tables import format_pairs, format_table, lake_url, record_table
from lakeloader.errors import CheckpointError
from lakeloader.lake.snapshot import Snapshot
from lakeloader.order.plan import (
    EpochPlan,
    make_units,
    plan_epoch,
    slots_to_virtual,
    virtual_to_piece,
)
from lakeloader.pipeline.backfill import backfill_view
from lakeloader.state.formats import quarantine_in
from lakeloader.state.requests import QUARANTINE_STEP, Requests
from lakeloader.state.tracker import ReaderStateTracker
from lakeloader.state.view import rank_dict
from lakeloader.topology import Topology

#: Row ranges shown per cell of the ``--ranges`` table (``--json`` lists all of them).
RANGES_SHOWN = 4
#: Category codes of a row in :func:`row_ranges`.
_CONSUMED, _REMAINING, _DROPPED = 0, 1, 2
_CATEGORIES = ("consumed", "remaining", "dropped")


def rebuild_plan(ckpt: Checkpoint, epoch: int | None = None) -> EpochPlan:
    """The plan of the saved epoch (or ``epoch``), from the manifest and the saved config only.

    Raises:
        CheckpointError: If the state does not belong to the pinned snapshot.
    """
    state, cfg = ckpt.state, ckpt.state.config
    if state.fingerprint != ckpt.snapshot.fingerprint:
        raise CheckpointError(
            f"{ckpt.path}: the state's fingerprint {state.fingerprint} is not its manifest's "
            f"{ckpt.snapshot.fingerprint}"
        )
    units = make_units([f.row_group_rows for f in ckpt.snapshot.files], int(cfg["max_unit_rows"]))
    plan = plan_epoch(
        units,
        seed=int(cfg["seed"]),
        epoch=state.epoch if epoch is None else epoch,
        shuffle=bool(cfg["shuffle"]),
        num_partitions=int(cfg["num_partitions"]),
        window=int(cfg["window"]),
    )
    if plan.num_rows != state.num_rows:
        raise CheckpointError(
            f"{ckpt.path}: the state counts {state.num_rows} rows, its manifest {plan.num_rows}"
        )
    return plan


def _topology_dict(topo: Topology, drop_last: bool) -> dict[str, Any]:
    return {
        "world_size": topo.world_size,
        "num_workers": topo.num_workers,
        "batch_size": topo.batch_size,
        "drop_last": drop_last,
        "global_batch": topo.global_batch,
    }


def _virtual_of_every_slot(plan: EpochPlan) -> np.ndarray:
    """``slots_to_virtual(plan, arange(N))`` in O(N): one call per window of each partition."""
    c_count, width = plan.num_partitions, plan.window
    out = np.empty(plan.num_rows, dtype=np.int64)
    for c in range(c_count):
        size = int(plan.starts[c + 1] - plan.starts[c])
        for first in range(0, size, width):
            slots = np.arange(first, min(first + width, size), dtype=np.int64) * c_count + c
            out[slots] = slots_to_virtual(plan, slots)
    return out


def row_ranges(
    plan: EpochPlan, snapshot: Snapshot, position: int, deliver_stop: int
) -> list[dict[str, Any]]:
    """Per non-empty row group, the row ranges consumed, remaining and dropped this epoch.

    Slots ``[0, position)`` are consumed, ``[position, deliver_stop)`` remain and
    ``[deliver_stop, N)`` are (or will be) dropped. Ranges are ``[start, end)`` row offsets
    inside the row group.
    """
    n = plan.num_rows
    if not n:  # a lake without rows: no range
        return []
    rg_rows = np.array([r for f in snapshot.files for r in f.row_group_rows], dtype=np.int64)
    per_file = [len(f.row_group_rows) for f in snapshot.files]
    rg_file = np.repeat(np.arange(len(per_file)), per_file)
    first_rg = np.concatenate([[0], np.cumsum(per_file)])
    rg_index = np.arange(len(rg_rows)) - first_rg[rg_file]
    rg_base = np.concatenate([[0], np.cumsum(rg_rows)]).astype(np.int64)
    piece, row = virtual_to_piece(plan, _virtual_of_every_slot(plan))
    unit = plan.piece_unit[piece]
    offset = plan.units.row_start[unit] + plan.piece_start[piece] + row
    flat_rg = first_rg[plan.units.file_index[unit]] + plan.units.row_group[unit]
    lake_row = rg_base[flat_rg] + offset
    category = np.full(n, _REMAINING, dtype=np.int8)
    category[lake_row[:position]] = _CONSUMED
    category[lake_row[deliver_stop:]] = _DROPPED
    boundary = np.zeros(n, dtype=bool)
    boundary[rg_base[:-1][rg_rows > 0]] = True
    boundary[1:] |= category[1:] != category[:-1]
    run_start = np.flatnonzero(boundary)
    run_stop = np.append(run_start[1:], n)
    run_rg = np.searchsorted(rg_base, run_start, side="right") - 1
    out = {
        g: {
            "file_index": int(rg_file[g]),
            "file": snapshot.files[rg_file[g]].path,
            "row_group": int(rg_index[g]),
            "rows": int(rg_rows[g]),
            **{name: [] for name in _CATEGORIES},
        }
        for g in np.flatnonzero(rg_rows > 0).tolist()
    }
    for s, e, g, c in np.stack([run_start, run_stop, run_rg, category[run_start]], 1).tolist():
        base = int(rg_base[g])
        out[g][_CATEGORIES[c]].append([s - base, e - base])
    return list(out.values())


def inspect_checkpoint(
    ckpt: Checkpoint,
    *,
    drop_last: bool | None = None,
    ranges: bool = False,
    steps_available: list[int] | None = None,
    world_size: int | None = None,
    num_workers: int | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Describe a checkpoint: position, per-rank and per-worker locations, metadata.

    ``world_size``, ``num_workers``, ``batch_size`` and ``drop_last`` override the saved ones
    (None: the saved one); ``ranges`` adds, per row group, the row ranges consumed, remaining and
    dropped. ``rows_remaining`` is ``N - G - rows_dropped``; of those, ``rows_to_drop`` will be
    dropped by ``drop_last`` under the topology used (for a followed lake: ``rows_to_carry``
    open the next increment's first step instead).

    Raises:
        CheckpointError: If it records no topology (written by lakeloader < 0.2).
    """
    saved = ckpt.context.topology
    if saved is None:
        raise CheckpointError(f"{ckpt.path} records no topology (written by lakeloader < 0.2)")
    state, ctx, plan = ckpt.state, ckpt.context, rebuild_plan(ckpt)
    given = {"world_size": world_size, "num_workers": num_workers, "batch_size": batch_size}
    topo = dataclasses.replace(saved, **{k: v for k, v in given.items() if v is not None})
    drop = ctx.drop_last if drop_last is None else drop_last
    tracker = ReaderStateTracker.standing_at(
        state, topo, drop_last=drop, workers_build=ctx.workers_build
    )
    if state.config.get("backfill"):  # every rank's workers decode the whole steps
        view = backfill_view(tracker, plan, ckpt.snapshot, topo)
    else:
        view = tracker.view(plan, ckpt.snapshot)
    followed = ckpt.snapshot.increment is not None
    g, n, dropped = view.position, view.num_rows, view.rows_dropped
    assert n is not None  # a lake's epoch has an end
    remaining = max(0, n - g - dropped)
    extra = ckpt.extra
    info: dict[str, Any] = {
        **head_info(ckpt, steps_available),
        "source": ckpt.source,
        "fingerprint": state.fingerprint,
        "config": state.config,
        "config_hash": state.config_hash,
        "quarantine": [q.to_dict() for q in state.quarantine],
        "extra": {
            "type": type(extra).__name__,
            "keys": sorted(map(str, extra)) if isinstance(extra, dict) else None,
        },
        "lake": {
            "files": len(ckpt.snapshot.files),
            "row_groups": sum(len(f.row_group_rows) for f in ckpt.snapshot.files),
            "rows": n,
        },
        "epoch": view.epoch,
        "position": g,
        "num_rows": n,
        "rows_consumed": g,
        "rows_remaining": remaining,
        "rows_dropped": dropped,
        # a followed lake carries a short tail into its next increment instead of dropping it
        "rows_to_drop": 0 if followed else view.rows_to_drop,
        "rows_to_carry": view.rows_to_drop if followed else 0,
        "finished": view.steps_remaining == 0,
        "steps_remaining": view.steps_remaining,
        "step_in_epoch": g // topo.global_batch if g % topo.global_batch == 0 else None,
        "topology_saved": _topology_dict(saved, ctx.drop_last),
        "topology": _topology_dict(topo, drop),
        "workers_build": ctx.workers_build,
        "ranks": [{**rank_dict(r), "steps_remaining": view.steps_remaining} for r in view.ranks],
        "workers": [rank_dict(w) for w in view.workers],
    }
    if ranges:
        deliver_stop = g + remaining - view.rows_to_drop
        info["ranges"] = row_ranges(plan, ckpt.snapshot, g, deliver_stop)
    for entry in [*info["ranks"], *info["workers"], *info.get("ranges", [])]:
        if entry["file"] is not None:
            entry["file"] = lake_url(ckpt.source, entry["file"])
    for entry in info["quarantine"]:
        entry["path"] = lake_url(ckpt.source, entry["path"])
    return info


def _topology_text(t: dict[str, Any]) -> str:
    return (
        f"{t['world_size']} ranks x {t['batch_size']:,} rows = {t['global_batch']:,} per step, "
        f"{t['num_workers']} workers, drop_last={str(t['drop_last']).lower()}"
    )


def _ranges_text(ranges: list[list[int]]) -> str:
    shown = " ".join(f"[{s:,}, {e:,})" for s, e in ranges[:RANGES_SHOWN])
    more = len(ranges) - RANGES_SHOWN
    return (shown + (f" +{more:,} more" if more > 0 else "")) or "-"


def _unit_rows(w: dict[str, Any]) -> str:
    if w["row_offset"] is None:
        return "-"
    return f"[{w['row_offset']:,}, {w['row_offset'] + w['rows']:,})"


def head_info(ckpt: Checkpoint, steps_available: list[int] | None) -> dict[str, Any]:
    """What :func:`head_pairs` shows, of every kind of checkpoint (null when unknown)."""
    return {
        "path": ckpt.path,
        "step": ckpt.step,
        "steps_available": steps_available,
        "created": ckpt.context.created or None,
        "library_version": ckpt.context.library_version or None,
        "state_bytes": ckpt.nbytes,
    }


def head_pairs(info: dict[str, Any]) -> list[tuple[str, Any]]:
    """The first lines of every kind of checkpoint's report: its folder, step, when and size."""
    steps = info["steps_available"]
    saved = f" (saved: {', '.join(map(str, steps))})" if steps else ""
    return [
        ("checkpoint", info["path"]),
        ("step", f"{info['step']:,}{saved}"),
        ("created", info["created"] or "-"),
        ("library version", info["library_version"] or "-"),
        ("state size", f"{info['state_bytes']:,} bytes"),
    ]


def render_text(info: dict[str, Any]) -> str:
    """The readable report of ``lakeloader inspect`` for a dict from :func:`inspect_checkpoint`."""
    extra, cfg, lake = info["extra"], info["config"], info["lake"]
    topo, saved = info["topology"], info["topology_saved"]
    quarantine = info["quarantine"]
    config = " ".join(
        f"{k}={','.join(v) if isinstance(v, list) else str(v).lower()}" for k, v in cfg.items()
    )
    if extra["keys"] is not None:
        extras = f"keys: {', '.join(extra['keys']) or '-'}"
    else:
        extras = "none" if extra["type"] == "NoneType" else extra["type"]
    skipped = f"{len(quarantine):,} units, {sum(q['num_rows'] for q in quarantine):,} rows skipped"
    out = [
        format_pairs(
            [
                *head_pairs(info),
                ("source", info["source"] or "-"),
                ("lake", f"{lake['files']:,} files, {lake['row_groups']:,} row groups"),
                ("fingerprint", info["fingerprint"]),
                ("config hash", info["config_hash"]),
                ("config", config),
                ("extras", extras),
                ("quarantine", f"{skipped} (listed below)" if quarantine else "none"),
            ]
        ),
        format_pairs(
            [
                ("epoch", info["epoch"]),
                ("position (G)", f"{info['position']:,} of {info['num_rows']:,} rows"),
                ("rows consumed", info["rows_consumed"]),
                ("rows remaining", info["rows_remaining"]),
                ("rows dropped", info["rows_dropped"]),
                (
                    ("rows carried into the next increment", info["rows_to_carry"])
                    if info["rows_to_carry"]
                    else ("rows to drop", info["rows_to_drop"])
                ),
                ("saved topology", _topology_text(saved)),
                ("topology used", _topology_text(topo) + (" (override)" if topo != saved else "")),
                ("steps remaining", info["steps_remaining"]),
            ]
        ),
    ]
    where, workers = ["file", "row_group", "row_offset", "slot"], info["workers"]
    if info["finished"]:
        out.append(
            f"epoch {info['epoch']} has no step left under this topology: a resumed loader "
            f"goes on with epoch {info['epoch'] + 1}"
        )
    else:
        title = "next step, per rank (where its first row comes from):"
        out.append(record_table(info["ranks"], ["rank", "rows", *where], title))
        if workers and info["workers_build"]:
            title = "per worker (worker k builds the k-th next step of its rank):"
            steps = [{**w, "step": f"+{w['step_offset']}"} for w in workers]
            out.append(record_table(steps, ["rank", "worker", "step", "rows", *where], title))
        elif workers:
            title = (
                "per worker (workers decode units in the order their rank first needs them, "
                "the j-th to worker j mod W; the first of each):"
            )
            units = [{**w, "rows": _unit_rows(w)} for w in workers]
            out.append(record_table(units, ["rank", "worker", "file", "row_group", "rows"], title))
    if quarantine:
        out.append("\n".join(quarantine_text(quarantine)))
    if "ranges" in info:
        title = "row ranges this epoch ([start, end) inside each row group; --json lists all):"
        ranges = [{**r, **{c: _ranges_text(r[c]) for c in _CATEGORIES}} for r in info["ranges"]]
        out.append(record_table(ranges, ["file", "row_group", "rows", *_CATEGORIES], title))
    return "\n\n".join(out)


def requested(state: dict[str, Any]) -> dict[str, Any]:
    """What the training loop asked, from a checkpoint's state: skips, units quarantined.

    ``steps_skipped``: done and still to skip (``skip()``); ``quarantined_steps``: the units
    ``quarantine_step()`` quarantined; ``steps_to_quarantine``: steps it named still to come.
    """
    requests = Requests.of_state(state)
    return {
        "steps_delivered": requests.delivered,
        "steps_skipped": {"done": requests.skipped, "pending": requests.pending},
        "steps_to_quarantine": [named for _, named in requests.bad_steps],
        "quarantined_steps": [
            q.to_dict() for q in quarantine_in(state) if q.reason.startswith(QUARANTINE_STEP)
        ],
    }


def requested_text(info: dict[str, Any]) -> list[tuple[str, Any]]:
    """The lines of :func:`requested`'s report (the quarantine's table names the units)."""
    skips = info["steps_skipped"]
    skipped = f"{skips['done']:,}" + (
        f" (and {skips['pending']:,} to come)" if skips["pending"] else ""
    )
    return [
        ("steps delivered", f"{info['steps_delivered']:,}"),
        ("steps skipped on request", skipped),
        ("units quarantined by quarantine_step", len(info["quarantined_steps"])),
        (
            "steps to quarantine when they come",
            ", ".join(map(str, info["steps_to_quarantine"])) or "-",
        ),
    ]


def quarantine_text(quarantine: list[dict[str, Any]]) -> list[str]:
    """The quarantine's paragraphs: a line, and the table of its units when there are some."""
    if not quarantine:
        return ["quarantine: none"]
    rows = [
        [
            q["path"],
            q["row_group"],
            f"[{q['row_start']:,}, {q['row_start'] + q['num_rows']:,})",
            q["num_rows"],
            q["reason"],
        ]
        for q in quarantine
    ]
    return [
        "quarantine (units skipped for good, on every rank and after every resume):",
        format_table(["file", "row group", "rows", "count", "reason"], rows),
    ]

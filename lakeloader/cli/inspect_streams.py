"""``lakeloader inspect`` of a Mixture's or a packed loader's checkpoint, from its state alone.

A mixture: per source, its epoch, the rows (a packed mixture's samples) consumed and remaining
and its realised share against its weight, then the weights' history. A packed loader: the
samples delivered (its epoch's size is not in the checkpoint). Every kind: the quarantine.
"""

from __future__ import annotations

from typing import Any

from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.cli.inspect import head_info, head_pairs, quarantine_text
from lakeloader.cli.tables import format_pairs, format_table, lake_url
from lakeloader.errors import StateFormatError
from lakeloader.order.mixture import MixWeights
from lakeloader.state.formats import MIXTURE, PACKED, PACKED_MIXTURE, read
from lakeloader.state.mixture_state import MixtureState
from lakeloader.state.quarantine import QuarantineEntry


def inspect_kind(ckpt: Checkpoint, steps_available: list[int]) -> dict[str, Any]:
    """The report's data (what ``--json`` prints), by the kind of the saved state.

    Raises:
        StateFormatError: If the state is not one this lakeloader reads, naming the checkpoint.
    """
    kind, state = ckpt.state_dict.get("kind"), ckpt.state_dict
    head = {
        "kind": kind,
        **head_info(ckpt, steps_available),
        "extra_type": type(ckpt.extra).__name__,
    }
    try:
        if kind == PACKED.kind:
            return {**head, **_packed(state, ckpt)}
        if kind == PACKED_MIXTURE.kind:
            mixture = _mixture(read(state, PACKED_MIXTURE), ckpt, "samples")
            for name in ("pass", "pass_rows", "pass_rows_done"):  # an endless stream: no pass
                del mixture[name]
            return {**head, **mixture}
        return {**head, **_mixture(read(state, MIXTURE), ckpt, "rows")}
    except StateFormatError as exc:
        raise StateFormatError(f"{ckpt.path}: {exc}") from exc


def _packed(state: dict[str, Any], ckpt: Checkpoint) -> dict[str, Any]:
    """A packed state's samples; a version 1 state's epoch instead (read at its start only)."""
    old = state.get("version") == 1
    at = read(state, PACKED, per_epoch=1)  # version 1: its samples are its epoch
    return {
        "version": state.get("version"),
        "fingerprint": at.fingerprint,
        "config_hash": at.config,
        "samples": None if old else at.samples,
        "epoch": at.samples if old else None,
        "quarantine": _quarantine(at.quarantine, ckpt),
        "lake": ckpt.sources.get("lake"),
    }


def _quarantine(entries: tuple[QuarantineEntry, ...], ckpt: Checkpoint) -> list[dict[str, Any]]:
    """The entries as plain data, each file's path as the URL of the lake it is in."""
    urls = [
        url
        for source in ckpt.sources.values()
        for url in ([source] if isinstance(source, str) else list(source or []))
    ]
    out = []
    for entry in entries:
        found = (lake_url(u, entry.path) for u in urls)
        path = next((p for p, u in zip(found, urls, strict=True) if p.startswith(u)), entry.path)
        out.append({**entry.to_dict(), "path": path})
    return out


def _mixture(state: MixtureState, ckpt: Checkpoint, unit: str) -> dict[str, Any]:
    """Realised shares are over the whole run (``unit``: rows, or a packed mixture's samples)."""
    weights = MixWeights.of(state.history[-1].weights)
    shares = dict(zip(weights.names, weights.shares, strict=True))
    drawn = sum(state.counts.values())
    sources = []
    for name in sorted(set(state.counts) | set(state.sources)):
        count = state.counts.get(name, 0)
        record = state.sources.get(name)
        per_epoch = record.rows if record is not None else None
        epoch, consumed = record.where(count) if record is not None else (None, None)
        sources.append(
            {
                "source": name,
                "in_mixture": name in state.sources,
                "weight": shares.get(name, 0.0),
                "realised_share": count / drawn if drawn else 0.0,
                "drawn": count,
                "epoch": epoch,
                f"{unit}_per_epoch": per_epoch,
                f"{unit}_consumed": consumed,
                f"{unit}_remaining": (
                    per_epoch - consumed if per_epoch and consumed is not None else None
                ),
                "fingerprint": state.sources[name].fingerprint if name in state.sources else None,
                "url": ckpt.sources.get(name),
            }
        )
    return {
        "unit": unit,
        "seed": state.seed,
        "slot": state.slot,
        "pass": state.epoch,
        "pass_rows": state.epoch_rows,
        "pass_rows_done": state.slot - state.epoch_start,
        "topology_saved": dict(state.topology),
        "history": [{"start": c.start, "weights": dict(c.weights)} for c in state.history],
        "sources": sources,
        "quarantine": _quarantine(state.quarantine, ckpt),
    }


def render_kind_text(info: dict[str, Any]) -> str:
    """The readable report of a dict from :func:`inspect_kind` (ending in a newline)."""
    common = head_pairs(info)
    if info["kind"] == PACKED.kind:
        if info["samples"] is None:
            where = f"the start of epoch {info['epoch']} (a version 1 state)"
        else:
            where = (
                f"{info['samples']:,} delivered (the same on every rank; its epoch follows from "
                "the lake's token counts and the packing, which the checkpoint does not keep)"
            )
        pairs = [*common, ("lake", info["lake"] or "-"), ("fingerprint", info["fingerprint"])]
        pairs += [("config hash", info["config_hash"]), ("samples", where)]
        return "\n\n".join([format_pairs(pairs), *quarantine_text(info["quarantine"])]) + "\n"
    unit, packed = info["unit"], info["kind"] == PACKED_MIXTURE.kind
    pairs = [*common, ("mixture", f"{len(info['sources'])} sources, seed {info['seed']}")]
    if packed:
        pairs += [("samples drawn", info["slot"])]
    else:
        done, of = info["pass_rows_done"], info["pass_rows"]
        pairs += [
            ("slots drawn", info["slot"]),
            ("pass", f"{info['pass']} ({done:,} of {of:,} rows)"),
        ]
    head = format_pairs(pairs)
    rows = [
        [
            s["source"] + ("" if s["in_mixture"] else " (removed)"),
            f"{s['weight']:.3f}",
            f"{s['realised_share']:.3f}",
            s["drawn"],
            *[s[k] for k in ("epoch", f"{unit}_consumed", f"{unit}_remaining")],
            s["url"] or "-",
        ]
        for s in info["sources"]
    ]
    table = format_table(
        ["source", "weight", "share", "drawn", "epoch", "consumed", "remaining", "lake"], rows
    )
    history = format_table(
        [f"from {'sample' if packed else 'slot'}", "weights"],
        [
            [c["start"], ", ".join(f"{k}={v:g}" for k, v in sorted(c["weights"].items()))]
            for c in info["history"]
        ],
    )
    legend = (
        f"sources (epoch: the source's own; consumed and remaining: {unit} of that epoch; "
        f"share: of all {'samples' if packed else 'slots'} drawn)"
    )
    parts = [head, legend, table, "weights", history, *quarantine_text(info["quarantine"])]
    return "\n\n".join(parts) + "\n"

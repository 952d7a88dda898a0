"""``lakeloader inspect`` of a Mixture's checkpoint.

Per source: its epoch, the rows of that epoch consumed and remaining, and its realised share
against its weight; then the weights' history. Everything comes from the checkpoint's state
(O(sources)): no lake is read.
"""

from __future__ import annotations

from typing import Any

from lakeloader.checkpoint.mixture_record import MixtureCheckpoint
from lakeloader.cli.tables import format_pairs, format_table
from lakeloader.order.mixture import MixWeights


def inspect_mixture(ckpt: MixtureCheckpoint, steps_available: list[int]) -> dict[str, Any]:
    """The report's data (what ``--json`` prints).

    Realised shares are over the whole run (slots drawn from each source / all slots drawn).
    """
    record, state = ckpt.record, ckpt.record.state
    weights = MixWeights.of(state.history[-1].weights)
    shares = dict(zip(weights.names, weights.shares, strict=True))
    drawn = sum(state.counts.values())
    sources = []
    for name in sorted(set(state.counts) | set(state.sources)):
        count = state.counts.get(name, 0)
        rows = state.sources[name].rows if name in state.sources else None
        epoch, consumed = divmod(count, rows) if rows else (None, None)
        sources.append(
            {
                "source": name,
                "in_mixture": name in state.sources,
                "weight": shares.get(name, 0.0),
                "realised_share": count / drawn if drawn else 0.0,
                "drawn": count,
                "epoch": epoch,
                "rows_per_epoch": rows,
                "rows_consumed": consumed,
                "rows_remaining": rows - consumed if rows and consumed is not None else None,
                "fingerprint": state.sources[name].fingerprint if name in state.sources else None,
                "url": record.sources.get(name),
            }
        )
    return {
        "kind": "mixture",
        "path": ckpt.path,
        "step": ckpt.step,
        "steps_available": steps_available,
        "created": record.created,
        "library_version": record.library_version,
        "state_bytes": ckpt.nbytes,
        "seed": state.seed,
        "slot": state.slot,
        "pass": state.epoch,
        "pass_rows": state.epoch_rows,
        "pass_rows_done": state.slot - state.epoch_start,
        "topology_saved": dict(state.topology),
        "history": [{"start": c.start, "weights": dict(c.weights)} for c in state.history],
        "sources": sources,
        "extra_type": type(record.extra).__name__,
    }


def render_mixture_text(info: dict[str, Any]) -> str:
    """The readable report of a dict from :func:`inspect_mixture`."""
    steps = info["steps_available"]
    head = format_pairs(
        [
            ("checkpoint", info["path"]),
            (
                "step",
                f"{info['step']:,}" + (f" (saved: {', '.join(map(str, steps))})" if steps else ""),
            ),
            ("created", info["created"] or "-"),
            ("library version", info["library_version"] or "-"),
            ("state size", f"{info['state_bytes']:,} bytes"),
            ("mixture", f"{len(info['sources'])} sources, seed {info['seed']}"),
            ("slots drawn", info["slot"]),
            ("pass", f"{info['pass']} ({info['pass_rows_done']:,} of {info['pass_rows']:,} rows)"),
        ]
    )
    rows = [
        [
            s["source"] + ("" if s["in_mixture"] else " (removed)"),
            f"{s['weight']:.3f}",
            f"{s['realised_share']:.3f}",
            s["drawn"],
            "-" if s["epoch"] is None else s["epoch"],
            "-" if s["rows_consumed"] is None else s["rows_consumed"],
            "-" if s["rows_remaining"] is None else s["rows_remaining"],
            s["url"] or "-",
        ]
        for s in info["sources"]
    ]
    table = format_table(
        ["source", "weight", "share", "drawn", "epoch", "consumed", "remaining", "lake"], rows
    )
    history = format_table(
        ["from slot", "weights"],
        [
            [c["start"], ", ".join(f"{k}={v:g}" for k, v in sorted(c["weights"].items()))]
            for c in info["history"]
        ],
    )
    return "\n\n".join(
        [
            head,
            "sources (epoch: the source's own; consumed and remaining: rows "
            "of that epoch; share: of all slots drawn)",
            table,
            "weights",
            history,
        ]
    )

"""``lakeloader inspect`` of a Mixture's or a packed loader's checkpoint.

A mixture, per source: its epoch, the rows of that epoch consumed and remaining, and its
realised share against its weight; then the weights' history. A packed loader, per partition:
its epoch, next row, token offset inside that row, tokens and padding delivered. Everything
comes from the checkpoint's state (O(sources), O(C)): no lake is read.
"""

from __future__ import annotations

from typing import Any

from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.cli.tables import format_pairs, format_table
from lakeloader.order.mixture import MixWeights
from lakeloader.state.mixture_state import MixtureState
from lakeloader.state.packed_state import PackedMixtureState, PackedState


def inspect_kind(ckpt: Checkpoint, steps_available: list[int]) -> dict[str, Any]:
    """The report's data (what ``--json`` prints), by the kind of the saved state."""
    kind, state = ckpt.state_dict.get("kind"), ckpt.state_dict
    head = {
        "kind": kind,
        "path": ckpt.path,
        "step": ckpt.step,
        "steps_available": steps_available,
        "created": ckpt.context.created,
        "library_version": ckpt.context.library_version,
        "state_bytes": ckpt.nbytes,
        "extra_type": type(ckpt.extra).__name__,
    }
    if kind == "packed":
        return {**head, **_packed(PackedState.from_dict(state), ckpt)}
    if kind == "packed-mixture":
        both = PackedMixtureState.from_dict(state)
        mixture = _mixture(both.mixture, ckpt)
        partitions = {n: _packed(s, ckpt) for n, s in both.sources.items()}
        return {**head, **mixture, "rounds": True, "packed": partitions}
    return {**head, **_mixture(MixtureState.from_dict(state), ckpt)}


def _packed(state: PackedState, ckpt: Checkpoint) -> dict[str, Any]:
    partitions = [
        {
            "partition": p,
            "epoch": x.epoch,
            "row": x.row,
            "token_offset": x.offset,
            "tokens": x.tokens,
            "padding": x.padding,
        }
        for p, x in sorted(state.partitions.items())
    ]
    return {
        "fingerprint": state.fingerprint,
        "samples_per_partition": state.samples,
        "num_partitions": state.num_partitions,
        "tokens": sum(x["tokens"] for x in partitions),
        "padding": sum(x["padding"] for x in partitions),
        "partitions": partitions,
        "lake": ckpt.sources.get("lake"),
    }


def _mixture(state: MixtureState, ckpt: Checkpoint) -> dict[str, Any]:
    """Realised shares are over the whole run (slots, or rounds, drawn from each source / all)."""
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
                "url": ckpt.sources.get(name),
            }
        )
    return {
        "seed": state.seed,
        "slot": state.slot,
        "pass": state.epoch,
        "pass_rows": state.epoch_rows,
        "pass_rows_done": state.slot - state.epoch_start,
        "topology_saved": dict(state.topology),
        "history": [{"start": c.start, "weights": dict(c.weights)} for c in state.history],
        "sources": sources,
    }


def render_kind_text(info: dict[str, Any]) -> str:
    """The readable report of a dict from :func:`inspect_kind`."""
    steps = info["steps_available"]
    saved = f" (saved: {', '.join(map(str, steps))})" if steps else ""
    common = [
        ("checkpoint", info["path"]),
        ("step", f"{info['step']:,}{saved}"),
        ("created", info["created"] or "-"),
        ("library version", info["library_version"] or "-"),
        ("state size", f"{info['state_bytes']:,} bytes"),
    ]
    if info["kind"] == "packed":
        return _packed_text(info, common)
    if info["kind"] == "packed-mixture":
        tables = [_packed_text(packed, []) for packed in info["packed"].values()]
        names = list(info["packed"])
        parts = [f"source {n}\n\n{t}" for n, t in zip(names, tables, strict=True)]
        mixture = render_kind_text({**info, "kind": "mixture"})
        return "\n\n".join([mixture, "(a packed mixture: drawn counts rounds)", *parts])
    head = format_pairs(
        [
            *common,
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


def _packed_text(info: dict[str, Any], common: list[tuple[str, Any]]) -> str:
    head = format_pairs(
        [
            *common,
            ("lake", info["lake"] or "-"),
            ("fingerprint", info["fingerprint"]),
            ("samples", f"{info['samples_per_partition']:,} per partition"),
            ("tokens", f"{info['tokens']:,} delivered, {info['padding']:,} of padding"),
        ]
    )
    rows = [
        [x["partition"], x["epoch"], x["row"], x["token_offset"], x["tokens"], x["padding"]]
        for x in info["partitions"]
    ]
    headers = ["partition", "epoch", "next row", "token offset", "tokens", "padding"]
    return "\n\n".join([head, format_table(headers, rows)])

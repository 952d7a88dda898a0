"""The ``lakeloader`` command: ``plan``, ``inspect`` and ``demo``.

``plan`` shows a lake and the cut of an epoch, ``inspect`` a checkpoint's position under any
topology, ``demo`` runs the end-to-end job.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from lakeloader.cli.tables import format_pairs, format_table, to_json
from lakeloader.errors import LakeError
from lakeloader.units import human_bytes

logger = logging.getLogger(__name__)

#: Files listed by ``lakeloader plan`` unless ``--files`` asks for more.
DEFAULT_FILES_SHOWN = 20


def _emit(text: str, *, error: bool = False) -> None:
    """Write command output (the library itself only logs)."""
    stream = sys.stderr if error else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def _storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--storage-option expects KEY=VALUE, got {pair!r}")
        options[key] = value
    return options


def _cmd_plan(args: argparse.Namespace) -> int:
    from lakeloader.cli.describe import describe_plan
    from lakeloader.dataset import LakeDataset

    ds = LakeDataset(
        args.lake,
        columns=args.columns.split(",") if args.columns else None,
        storage_options=_storage_options(args.storage_option),
        seed=args.seed,
        shuffle=not args.no_shuffle,
        num_partitions=args.num_partitions,
        progress=None if not args.json else False,
        **({"window": args.window} if args.window else {}),
    )
    info = describe_plan(
        ds, world_size=args.world_size, batch_size=args.batch_size, drop_last=args.drop_last
    )
    if args.json:
        _emit(to_json(info))
        return 0
    lake, epoch = info["lake"], info["epoch"]
    out = [
        format_pairs(
            [
                ("lake", lake["source"]),
                ("files", lake["files"]),
                ("row groups", f"{lake['row_groups']:,} ({lake['empty_row_groups']:,} empty)"),
                ("rows", lake["rows"]),
                ("size", human_bytes(lake["bytes"])),
                ("fingerprint", lake["fingerprint"]),
                ("partition columns", ", ".join(lake["partition_columns"]) or "-"),
            ]
        ),
        "",
        format_table(["column", "type"], list(info["schema"].items())),
        "",
        format_pairs(
            [
                (
                    "units",
                    f"{epoch['units']:,} of {epoch['unit_rows_min']:,}"
                    f"..{epoch['unit_rows_max']:,} rows",
                ),
                ("seed / shuffle", f"{info['config']['seed']} / {info['config']['shuffle']}"),
                ("partitions (C)", info["config"]["num_partitions"]),
                (
                    "rows per partition",
                    f"{epoch['partition_rows_min']:,}..{epoch['partition_rows_max']:,}",
                ),
                (
                    "window",
                    f"{info['config']['window']:,} rows "
                    f"({epoch['windows_per_partition']:,} per partition)",
                ),
                (
                    "global batch",
                    f"{epoch['global_batch']:,} = {epoch['world_size']} ranks x "
                    f"{epoch['batch_size']:,}",
                ),
                ("steps per epoch", epoch["steps"]),
                ("rows in last step", epoch["rows_in_last_step"]),
                ("rows dropped", epoch["rows_dropped"]),
                ("C divides batch", epoch["c_divides_global_batch"]),
                ("partitions per rank", epoch["partitions_per_rank"]),
                (
                    "resident per rank",
                    "about " + human_bytes(epoch["resident_bytes_per_rank_estimate"]),
                ),
            ]
        ),
        "",
    ]
    files = info["files"][: args.files]
    out.append(
        format_table(
            ["file", "bytes", "row groups", "rows"],
            [[f["path"], f["bytes"], f["row_groups"], f["rows"]] for f in files],
        )
    )
    if len(info["files"]) > len(files):
        out.append(f"... {len(info['files']) - len(files):,} more files (--files N shows more)")
    _emit("\n".join(out))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from lakeloader.cli.demo import run_demo

    report = run_demo(args.dir, rows=args.rows, steps_before_crash=args.crash_at)
    _emit(to_json(report) if args.json else report["text"])
    return 0 if report["ok"] else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    import dataclasses

    from lakeloader.cli.inspect import inspect_checkpoint, open_checkpoint, render_text

    overrides = {
        "world_size": args.world_size,
        "num_workers": args.num_workers,
        "batch_size": args.batch_size,
        "drop_last": args.drop_last,
    }
    for name, least in (("world_size", 1), ("batch_size", 1), ("num_workers", 0)):
        if overrides[name] is not None and overrides[name] < least:
            flag = "--" + name.replace("_", "-")
            _emit(f"lakeloader inspect: error: {flag} must be >= {least}", error=True)
            return 2
    ckpt, steps = open_checkpoint(args.checkpoint, args.step, _storage_options(args.storage_option))
    given = {k: v for k, v in overrides.items() if v is not None and k != "drop_last"}
    topology = dataclasses.replace(ckpt.context.topology, **given)
    info = inspect_checkpoint(
        ckpt,
        topology=topology,
        drop_last=args.drop_last,
        ranges=args.ranges,
        steps_available=steps,
    )
    _emit(to_json(info) if args.json else render_text(info))
    return 0


def _add_io_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every command that reads a store shares: storage options and ``--json``."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lakeloader`` command."""
    parser = argparse.ArgumentParser(
        prog="lakeloader",
        description="Deterministic, exactly-resumable Parquet lakes for PyTorch.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="what a lake holds and how an epoch is cut")
    plan.add_argument("lake", help="folder, glob, file or URL of the lake")
    plan.add_argument("--columns", help="comma-separated columns to read")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--no-shuffle", action="store_true", help="path order")
    plan.add_argument("--num-partitions", type=int, default=None, help="C (default: library's)")
    plan.add_argument("--window", type=int, default=None, help="rows per shuffle window")
    plan.add_argument("--world-size", type=int, default=1)
    plan.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    plan.add_argument("--drop-last", action="store_true")
    plan.add_argument("--files", type=int, default=DEFAULT_FILES_SHOWN, help="files to list")
    _add_io_arguments(plan)
    plan.set_defaults(func=_cmd_plan)

    demo = sub.add_parser(
        "demo", help="generate a lake, train, crash, resume on another topology, report"
    )
    demo.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    demo.add_argument("--rows", type=int, default=60_000, help="rows in the generated lake")
    demo.add_argument("--crash-at", type=int, default=None, help="step of the crash")
    demo.add_argument("--json", action="store_true", help="machine-readable report")
    demo.set_defaults(func=_cmd_demo)

    inspect = sub.add_parser(
        "inspect", help="a checkpoint's position: per rank and worker, rows consumed and left"
    )
    inspect.add_argument("checkpoint", help="a checkpoint step folder, or the root holding them")
    inspect.add_argument("--step", type=int, default=None, help="step to inspect under a root")
    inspect.add_argument("--world-size", type=int, default=None, help="instead of the saved one")
    inspect.add_argument("--num-workers", type=int, default=None, help="instead of the saved one")
    inspect.add_argument("--batch-size", type=int, default=None, help="rows per rank per step")
    inspect.add_argument(
        "--drop-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="instead of the saved setting",
    )
    inspect.add_argument(
        "--ranges", action="store_true", help="row ranges consumed and remaining per row group"
    )
    _add_io_arguments(inspect)
    inspect.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lakeloader`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except LakeError as exc:
        _emit(f"lakeloader {args.command}: error: {exc}", error=True)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The ``lakeloader`` command: ``plan``, ``inspect``, ``audit``, ``clean`` and ``demo``.

``plan`` shows a lake and the cut of an epoch, ``inspect`` a checkpoint's position under any
topology, ``audit`` proves exactly-once delivery from a run's ledger (exit status 1 when a row
is missing or doubled), ``clean`` removes the shared memory of loaders that were killed,
``demo`` runs the end-to-end job. Bad arguments and failures print one line and exit with status 2
(``--verbose`` adds the traceback of an unexpected error).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from lakeloader._version import __version__
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


def _count(least: int) -> Any:
    """An argparse type: an integer of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help, examples kept as written."""


def _cmd_clean(args: argparse.Namespace) -> int:
    import tempfile

    from lakeloader.cache.shm import SHM_DIR, sweep

    folders = [f for f in (args.dir or [SHM_DIR, tempfile.gettempdir()]) if os.path.isdir(f)]
    removed = [(path, size) for folder in folders for path, size in sweep(folder)]
    if args.json:
        _emit(
            to_json(
                {"looked_in": folders, "removed": [{"path": p, "bytes": b} for p, b in removed]}
            )
        )
    elif removed:
        _emit(format_table(["removed", "bytes"], [[p, human_bytes(b)] for p, b in removed]))
    else:
        _emit(f"nothing to remove in {', '.join(folders)}: no folder of a dead lakeloader process")
    return 0


def _open_lake(args: argparse.Namespace, kind: str, **kwargs: Any) -> Any:
    """The dataset of ``lakeloader plan``'s LAKE: a folder, a Delta or an Iceberg table."""
    from lakeloader.dataset import LakeDataset

    if kind == "delta":
        return LakeDataset.from_delta(args.lake, version=args.table_version, **kwargs)
    if kind == "iceberg":
        return LakeDataset.from_iceberg(args.lake, snapshot_id=args.table_version, **kwargs)
    return LakeDataset(args.lake, **kwargs)


def _cmd_plan(args: argparse.Namespace) -> int:
    from lakeloader.cli.describe import describe_plan
    from lakeloader.lake.tables.detect import table_kind

    options = _storage_options(args.storage_option)
    kind = table_kind(args.lake, options) if args.table == "auto" else args.table
    if args.table_version is not None and kind == "folder":
        raise ValueError(
            f"--table-version is for a Delta or Iceberg table; {args.lake} is a folder"
        )
    ds = _open_lake(
        args,
        kind,
        columns=args.columns.split(",") if args.columns else None,
        storage_options=options,
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
                ("table", lake["table"] or "-"),
                ("deleted rows", f"{lake['deleted_rows']:,}"),
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

    from lakeloader.checkpoint.kind_record import KindCheckpoint
    from lakeloader.cli.inspect import inspect_checkpoint, open_checkpoint, render_text
    from lakeloader.cli.inspect_follow import lake_details, render_details
    from lakeloader.cli.inspect_streams import inspect_kind, render_kind_text
    from lakeloader.cli.inspect_training import render_training, training_details

    overrides = {
        "world_size": args.world_size,
        "num_workers": args.num_workers,
        "batch_size": args.batch_size,
        "drop_last": args.drop_last,
    }
    ckpt, steps = open_checkpoint(args.checkpoint, args.step, _storage_options(args.storage_option))
    if isinstance(ckpt, KindCheckpoint):  # per source or partition: no topology to map onto
        report = inspect_kind(ckpt, steps)
        report["training"] = training_details(ckpt.training)
        text = render_kind_text(report) + "\n" + format_pairs(render_training(report["training"]))
        _emit(to_json(report) if args.json else text)
        return 0
    given = {k: v for k, v in overrides.items() if v is not None and k != "drop_last"}
    topology = dataclasses.replace(ckpt.context.topology, **given)
    info = inspect_checkpoint(
        ckpt,
        topology=topology,
        drop_last=args.drop_last,
        ranges=args.ranges,
        steps_available=steps,
    )
    options = _storage_options(args.storage_option)
    info["lake_details"] = details = lake_details(ckpt, options, not args.no_lag)
    info["training"] = training_details(ckpt.training)
    lines = render_details(details) + render_training(info["training"])
    text = render_text(info) + ("\n" + format_pairs(lines) + "\n" if lines else "")
    _emit(to_json(info) if args.json else text)
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from lakeloader.cli.audit import render_audit_text, run_audit

    report, info = run_audit(args.checkpoint, _storage_options(args.storage_option))
    _emit(to_json(info) if args.json else render_audit_text(info))
    return 0 if report.ok else 1


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
        formatter_class=_Help,
    )
    parser.add_argument("--version", action="version", version=f"lakeloader {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO level; tracebacks of errors"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser(
        "plan",
        help="what a lake holds and how an epoch is cut",
        formatter_class=_Help,
        epilog="example:\n  lakeloader plan s3://bucket/lake/ --world-size 8 --batch-size 64 "
        "--storage-option endpoint_url=http://127.0.0.1:9000",
    )
    plan.add_argument(
        "lake",
        help="folder, glob, file or URL of the lake; a Delta table's folder; an Iceberg "
        "table's metadata/*.metadata.json",
    )
    plan.add_argument(
        "--table",
        choices=("auto", "folder", "delta", "iceberg"),
        default="auto",
        help="what LAKE is (auto: a folder with _delta_log/ is Delta, *.metadata.json Iceberg)",
    )
    plan.add_argument(
        "--table-version",
        type=_count(0),
        default=None,
        help="Delta version or Iceberg snapshot id (None: the newest)",
    )
    plan.add_argument("--columns", help="comma-separated columns to read")
    plan.add_argument("--seed", type=int, default=0, help="seed of the order")
    plan.add_argument("--no-shuffle", action="store_true", help="path order")
    plan.add_argument(
        "--num-partitions", type=_count(1), default=None, help="C (None: the library's default)"
    )
    plan.add_argument(
        "--window", type=_count(1), default=None, help="rows per shuffle window (None: default)"
    )
    plan.add_argument("--world-size", type=_count(1), default=1, help="ranks")
    plan.add_argument("--batch-size", type=_count(1), default=256, help="rows per rank per step")
    plan.add_argument("--drop-last", action="store_true", help="drop a short last global batch")
    plan.add_argument("--files", type=_count(0), default=DEFAULT_FILES_SHOWN, help="files to list")
    _add_io_arguments(plan)
    plan.set_defaults(func=_cmd_plan)

    demo = sub.add_parser(
        "demo",
        help="generate a lake, train, crash, resume on another topology, report",
        formatter_class=_Help,
        epilog="example:\n  lakeloader demo --rows 20000",
    )
    demo.add_argument("--dir", default=None, help="working folder (None: a temporary one, kept)")
    demo.add_argument("--rows", type=_count(1000), default=60_000, help="rows in the lake")
    demo.add_argument("--crash-at", type=_count(1), default=None, help="step of the crash")
    demo.add_argument("--json", action="store_true", help="machine-readable report")
    demo.set_defaults(func=_cmd_demo)

    inspect = sub.add_parser(
        "inspect",
        help="a checkpoint's position: per rank and worker, rows consumed and left",
        formatter_class=_Help,
        epilog="examples:\n  lakeloader inspect runs/7/ckpt\n"
        "  lakeloader inspect runs/7/ckpt --world-size 16 --ranges --json",
    )
    inspect.add_argument("checkpoint", help="a checkpoint step folder, or the root holding them")
    inspect.add_argument("--step", type=_count(0), default=None, help="step (None: the newest)")
    inspect.add_argument("--world-size", type=_count(1), default=None, help="None: the saved one")
    inspect.add_argument("--num-workers", type=_count(0), default=None, help="None: the saved one")
    inspect.add_argument("--batch-size", type=_count(1), default=None, help="None: the saved one")
    inspect.add_argument(
        "--drop-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="instead of the saved setting",
    )
    inspect.add_argument(
        "--ranges", action="store_true", help="row ranges consumed and remaining per row group"
    )
    inspect.add_argument(
        "--no-lag",
        action="store_true",
        help="for a followed lake, do not look at the lake for what was appended since",
    )
    _add_io_arguments(inspect)
    inspect.set_defaults(func=_cmd_inspect)

    audit = sub.add_parser(
        "audit",
        help="prove from the ledger that every row was trained on exactly once (exit 1 if not)",
        formatter_class=_Help,
        epilog="examples:\n  lakeloader audit runs/7/ckpt\n  lakeloader audit s3://b/ckpt --json",
    )
    audit.add_argument("checkpoint", help="the checkpoints' root folder (any fsspec URL)")
    _add_io_arguments(audit)
    audit.set_defaults(func=_cmd_audit)

    clean = sub.add_parser(
        "clean",
        help="remove the shared memory of lakeloader processes that were killed",
        formatter_class=_Help,
        epilog="example:\n  lakeloader clean --json",
    )
    clean.add_argument(
        "dir", nargs="*", help="folders to sweep (None: /dev/shm and the temporary folder)"
    )
    clean.add_argument("--json", action="store_true", help="machine-readable output")
    clean.set_defaults(func=_cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lakeloader`` console script."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument (one line, status 2)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except (LakeError, KeyError, ValueError, OSError) as exc:  # what bad input raises
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        _emit(f"lakeloader {args.command}: error: {message}", error=True)
        return 2
    except Exception as exc:
        if args.verbose:
            raise
        _emit(
            f"lakeloader {args.command}: error: {type(exc).__name__}: {exc} (run with "
            "--verbose for the traceback)",
            error=True,
        )
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The arguments of the ``lakeloader`` command: one parser, one line per usage error (status 2).

Every subcommand takes ``-v``/``--verbose`` before or after its name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from lakeloader._version import __version__
from lakeloader.errors import LakeError


class UsageError(LakeError, ValueError):
    """A command-line argument names nothing the command can use (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help, examples kept as written."""


def _count(least: int, kind: Callable[[str], float] = int, what: str = "an integer") -> Any:
    """An argparse type: a number of at least ``least`` (``kind`` of the text, ``what`` it is)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= least:  # NaN seconds too
            shown = value if kind is int else text
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {shown}")
        return value

    return parse


def _pair(text: str) -> tuple[str, str]:
    """An argparse type: ``KEY=VALUE``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_io_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every command that reads a store shares."""
    parser.add_argument(
        "--storage-option",
        action="append",
        type=_pair,
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable)",
    )
    parser.add_argument(
        "--retry-seconds",
        type=_count(0, float, "seconds"),
        default=30.0,
        metavar="S",
        help="give up on a store that keeps failing (down, unreachable, 5xx) after S seconds "
        "of retries; --verbose logs each retry",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lakeloader`` command (``command`` names the subcommand)."""
    parser = _Parser(
        prog="lakeloader",
        description="Deterministic, exactly-resumable Parquet lakes for PyTorch.",
        formatter_class=_Help,
    )
    parser.add_argument("--version", action="version", version=f"lakeloader {__version__}")
    verbose = "log at INFO level (each storage retry too); tracebacks of errors"
    parser.add_argument("-v", "--verbose", action="store_true", help=verbose)
    common = _Parser(add_help=False)  # --verbose after the subcommand, too
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str, epilog: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, parents=[common], help=summary, formatter_class=_Help, epilog=epilog
        )

    plan = command(
        "plan",
        "what a lake holds and how an epoch is cut",
        "example:\n  lakeloader plan s3://bucket/lake/ --world-size 8 --batch-size 64 "
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
        help="Delta version or Iceberg snapshot id (None: the newest)",
    )
    plan.add_argument("--columns", help="comma-separated columns to read")
    plan.add_argument("--seed", type=int, default=0, help="seed of the order")
    plan.add_argument("--no-shuffle", action="store_true", help="path order")
    plan.add_argument("--num-partitions", type=_count(1), help="C (None: the library's default)")
    plan.add_argument("--window", type=_count(1), help="rows per shuffle window (None: default)")
    plan.add_argument("--world-size", type=_count(1), default=1, help="ranks")
    plan.add_argument("--batch-size", type=_count(1), default=256, help="rows per rank per step")
    plan.add_argument("--drop-last", action="store_true", help="drop a short last global batch")
    plan.add_argument("--files", type=_count(0), default=20, help="files to list")
    _add_io_arguments(plan)

    demo = command(
        "demo",
        "generate a lake, train, crash, resume on another topology, report",
        "example:\n  lakeloader demo --rows 20000",
    )
    demo.add_argument("--dir", help="working folder (None: a temporary one, kept)")
    demo.add_argument("--rows", type=_count(1000), default=60_000, help="rows in the lake")
    demo.add_argument("--crash-at", type=_count(1), help="step of the crash")
    demo.add_argument("--json", action="store_true", help="machine-readable report")

    inspect = command(
        "inspect",
        "a checkpoint's position: per rank and worker, rows consumed and left",
        "examples:\n  lakeloader inspect runs/7/ckpt\n"
        "  lakeloader inspect runs/7/ckpt --world-size 16 --ranges --json",
    )
    inspect.add_argument(
        "checkpoint",
        help="the checkpoints' root folder (the URL given to CheckpointManager), or one step "
        "folder under it",
    )
    inspect.add_argument("--step", type=_count(0), help="step (None: the newest)")
    for flag, least in (("--world-size", 1), ("--num-workers", 0), ("--batch-size", 1)):
        inspect.add_argument(flag, type=_count(least), help="None: the saved one")
    inspect.add_argument(
        "--drop-last", action=argparse.BooleanOptionalAction, help="instead of the saved setting"
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

    audit = command(
        "audit",
        "prove from the ledger that every row was trained on exactly once (exit status "
        "0: exactly once, 1: NOT exactly once, 3: unverified, 2: error)",
        "exit status:\n"
        "  0  every row exactly once in the committed history\n"
        "  1  NOT exactly once: a row missing or doubled (listed, located in the lake)\n"
        "  2  an error (no checkpoint, no ledger, a bad argument)\n"
        "  3  unverified: part of the history was not recorded (the ledger was attached late)\n"
        "examples:\n  lakeloader audit runs/7/ckpt\n  lakeloader audit s3://b/ckpt --json",
    )
    audit.add_argument(
        "checkpoint", help="the checkpoints' root folder (the URL given to CheckpointManager)"
    )
    _add_io_arguments(audit)

    clean = command(
        "clean",
        "remove the shared memory of lakeloader processes that were killed",
        "example:\n  lakeloader clean --json",
    )
    clean.add_argument(
        "dir", nargs="*", help="local folders to sweep (None: /dev/shm and the temporary folder)"
    )
    clean.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of a command line; SystemExit (status 2, one line) for a usage error.

    An unknown argument is reported by the subcommand it follows, whose ``--help`` lists
    what it takes.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        prog = f"{parser.prog} {args.command}"
        parser.exit(
            2, f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (see {prog} --help)\n"
        )
    return args

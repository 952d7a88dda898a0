"""The ``lakeloader`` command: ``plan``, ``inspect``, ``audit``, ``clean`` and ``demo``.

Every failure prints one line naming the path or URL and exits with status 2 (``--verbose``
adds the traceback of an unexpected error); ``audit`` exits with its verdict's status.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lakeloader.cache.shm import SHM_DIR, sweep
from lakeloader.cli.audit import render_audit_text, run_audit
from lakeloader.cli.checkpoints import open_checkpoint
from lakeloader.cli.demo import run_demo
from lakeloader.cli.inspect import (
    inspect_checkpoint,
    render_text,
    requested,
    requested_text,
)
from lakeloader.cli.inspect_follow import lake_details, render_details, render_training
from lakeloader.cli.inspect_streams import inspect_kind, render_kind_text
from lakeloader.cli.parser import UsageError, parse
from lakeloader.cli.tables import format_pairs, format_table, full_urls, record_table, to_json
from lakeloader.dataset import LakeDataset
from lakeloader.errors import LakeError, StorageRetryWarning, StoreUnavailableError
from lakeloader.io.fetch import url_of
from lakeloader.io.retry import RetryPolicy
from lakeloader.lake.manifest import from_manifest
from lakeloader.lake.tables.sources import table_kind
from lakeloader.order.plan import steps_in_epoch
from lakeloader.units import human_bytes

#: What ``lakeloader audit`` exits with, by the audit's verdict (2 is any error).
AUDIT_EXIT = {"exactly once": 0, "NOT exactly once": 1, "unverified": 3}
#: What a command gives: its data (what ``--json`` prints), its readable text, its exit status.
Result = tuple[Any, str, int]


def _cmd_clean(args: argparse.Namespace) -> Result:
    sweeps = "clean sweeps local folders: /dev/shm, the temporary folder, a loader's cache_dir"
    for folder in args.dir:
        if not os.path.isdir(folder):
            what = f"{folder} is a file" if os.path.exists(folder) else f"no such folder: {folder}"
            raise UsageError(f"{what} ({sweeps})")
    folders = args.dir or [f for f in (SHM_DIR, tempfile.gettempdir()) if os.path.isdir(f)]
    removed = [(path, size) for folder in folders for path, size in sweep(folder)]
    listed = [{"path": p, "bytes": b} for p, b in removed]
    text = f"nothing to remove in {', '.join(folders)}: no folder of a dead lakeloader process"
    if removed:
        text = format_table(["removed", "bytes"], [[p, human_bytes(b)] for p, b in removed])
    return {"looked_in": folders, "removed": listed}, text, 0


def describe_plan(
    ds: LakeDataset, *, world_size: int, batch_size: int, drop_last: bool = False
) -> dict[str, Any]:
    """Summarise a lake and the cut of its epochs under one topology (plain types).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> pq.write_table(pa.table({"id": range(1000)}), f"{root}/a.parquet", row_group_size=100)
        >>> d = describe_plan(LakeDataset(root), world_size=2, batch_size=32)
        >>> d["lake"]["rows"], d["epoch"]["steps"], d["epoch"]["partitions_per_rank"]
        (1000, 16, 8.0)
        >>> tmp.cleanup()
    """
    snap, cfg = ds.snapshot, ds.config
    n = len(ds)
    global_batch = world_size * batch_size
    sizes = np.diff(ds.plan(0).starts)
    bytes_per_row = sum(sum(f.row_group_bytes) for f in snap.files) / max(1, n)
    open_windows = cfg.num_partitions / world_size
    unit_rows = ds.units.num_rows
    steps = steps_in_epoch(0, n, global_batch, drop_last)
    return {
        "lake": {
            "source": ds.source.describe(),
            "files": len(snap.files),
            "row_groups": snap.num_row_groups,
            "empty_row_groups": sum(r == 0 for f in snap.files for r in f.row_group_rows),
            "rows": n,
            "bytes": sum(f.size for f in snap.files),
            "fingerprint": snap.fingerprint,
            "partition_columns": [k for k, _ in snap.partition_types],
            "table": None if snap.table is None else snap.table.describe(),
            "deleted_rows": sum(len(f.deleted) for f in snap.files),
        },
        "schema": {f.name: str(f.type) for f in snap.schema},
        "config": cfg.to_dict(),
        "config_hash": ds.config_hash,
        "epoch": {
            "units": len(ds.units),
            "unit_rows_min": int(unit_rows.min()) if len(unit_rows) else 0,
            "unit_rows_max": int(unit_rows.max()) if len(unit_rows) else 0,
            "partition_rows_min": int(sizes.min()),
            "partition_rows_max": int(sizes.max()),
            "windows_per_partition": int(-(-int(sizes.max()) // cfg.window)),
            "world_size": world_size,
            "batch_size": batch_size,
            "global_batch": global_batch,
            "steps": steps,
            "rows_in_last_step": n - (steps - 1) * global_batch if steps else 0,
            "rows_dropped": n - steps * global_batch if drop_last else 0,
            "c_divides_global_batch": global_batch % cfg.num_partitions == 0,
            "partitions_per_rank": open_windows,
            "resident_bytes_per_rank_estimate": int(
                open_windows * min(cfg.window, int(sizes.max())) * bytes_per_row
            ),
        },
        "files": [
            {
                "path": url_of(ds.fs, f.path),
                "bytes": f.size,
                "row_groups": len(f.row_group_rows),
                "rows": f.num_rows,
                "partitions": dict(f.partitions),
            }
            for f in snap.files
        ],
    }


def _cmd_plan(args: argparse.Namespace) -> Result:
    options = dict(args.storage_option)
    kind = table_kind(args.lake, options) if args.table == "auto" else args.table
    if args.table_version is not None and kind == "folder":
        raise ValueError(
            f"--table-version is for a Delta or Iceberg table; {args.lake} is a folder"
        )
    kwargs: dict[str, Any] = {
        "columns": args.columns.split(",") if args.columns else None,
        "storage_options": options,
        "seed": args.seed,
        "shuffle": not args.no_shuffle,
        "num_partitions": args.num_partitions,
        "progress": None if not args.json else False,
        "retry": RetryPolicy(deadline=args.retry_seconds),
        **({"window": args.window} if args.window else {}),
    }
    if kind == "delta":
        ds = LakeDataset.from_delta(args.lake, version=args.table_version, **kwargs)
    elif kind == "iceberg":
        ds = LakeDataset.from_iceberg(args.lake, snapshot_id=args.table_version, **kwargs)
    else:
        ds = LakeDataset(args.lake, **kwargs)
    info = describe_plan(
        ds, world_size=args.world_size, batch_size=args.batch_size, drop_last=args.drop_last
    )
    lake, epoch, cfg = info["lake"], info["epoch"], info["config"]
    units = f"{epoch['units']:,} of {epoch['unit_rows_min']:,}..{epoch['unit_rows_max']:,} rows"
    per_partition = f"{epoch['partition_rows_min']:,}..{epoch['partition_rows_max']:,}"
    window = f"{cfg['window']:,} rows ({epoch['windows_per_partition']:,} per partition)"
    batch = f"{epoch['global_batch']:,} = {epoch['world_size']} ranks x {epoch['batch_size']:,}"
    resident = "about " + human_bytes(epoch["resident_bytes_per_rank_estimate"])
    files = [{**f, "file": f["path"]} for f in info["files"][: args.files]]
    more = len(info["files"]) - len(files)
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
        format_table(["column", "type"], list(info["schema"].items())),
        format_pairs(
            [
                ("units", units),
                ("seed / shuffle", f"{cfg['seed']} / {cfg['shuffle']}"),
                ("partitions (C)", cfg["num_partitions"]),
                ("rows per partition", per_partition),
                ("window", window),
                ("global batch", batch),
                ("steps per epoch", epoch["steps"]),
                ("rows in last step", epoch["rows_in_last_step"]),
                ("rows dropped", epoch["rows_dropped"]),
                ("C divides batch", epoch["c_divides_global_batch"]),
                ("partitions per rank", epoch["partitions_per_rank"]),
                ("resident per rank", resident),
            ]
        ),
        record_table(files, ["file", "bytes", "row_groups", "rows"]),
    ]
    if more > 0:
        out[-1] += f"\n... {more:,} more files (--files N shows more)"
    return info, "\n\n".join(out), 0


def _cmd_demo(args: argparse.Namespace) -> Result:
    report = run_demo(args.dir, rows=args.rows, steps_before_crash=args.crash_at)
    return report, report["text"], 0 if report["ok"] else 1


def _cmd_inspect(args: argparse.Namespace) -> Result:
    options, retry = dict(args.storage_option), RetryPolicy(deadline=args.retry_seconds)
    found = open_checkpoint(args.checkpoint, args.step, options, retry)
    ckpt = found.checkpoint
    _warn_skipped(args, found.skipped)
    lag = not args.no_lag
    if ckpt.lake is None:  # per source or partition: no topology to map onto
        info = inspect_kind(ckpt, found.steps)
        info["lake_details"] = leaves = {  # each lake it pins: a mixture's sources, a packed lake
            leaf: lake_details(from_manifest(manifest), ckpt.sources[leaf], options, lag, retry)
            for leaf, manifest in sorted(ckpt.manifests.items())
        }
        lines = [line for leaf, d in leaves.items() for line in render_details(d, leaf)]
        head, end = render_kind_text(info), ""
    else:
        info = inspect_checkpoint(
            ckpt,
            drop_last=args.drop_last,
            ranges=args.ranges,
            steps_available=found.steps,
            world_size=args.world_size,
            num_workers=args.num_workers,
            batch_size=args.batch_size,
        )
        details = lake_details(ckpt.snapshot, ckpt.source, options, lag, retry)
        info["lake_details"] = details
        head, lines, end = render_text(info), render_details(details), "\n"
    info["skipped_damaged"] = found.skipped
    info["training"] = None if ckpt.training is None else ckpt.training.to_dict()
    info["requests"] = requested(ckpt.state_dict)
    lines += requested_text(info["requests"]) + render_training(info["training"])
    return info, f"{head}\n{format_pairs(lines)}{end}", 0


def _cmd_audit(args: argparse.Namespace) -> Result:
    retry = RetryPolicy(deadline=args.retry_seconds)
    report, info = run_audit(args.checkpoint, dict(args.storage_option), retry)
    _warn_skipped(args, info["skipped_damaged"])
    return info, render_audit_text(info), AUDIT_EXIT[report.verdict]


def _warn_skipped(args: argparse.Namespace, skipped: list[str]) -> None:
    """One line per newer checkpoint passed over as damaged."""
    for line in skipped:
        _say(args, "warning", f"damaged checkpoint passed over: {line}")


COMMANDS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "plan": _cmd_plan,
    "demo": _cmd_demo,
    "inspect": _cmd_inspect,
    "audit": _cmd_audit,
    "clean": _cmd_clean,
}


def _log_to_stderr(verbose: bool) -> None:
    """Log to stderr (INFO with ``--verbose``); storage retries only with ``--verbose``."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not verbose:  # the error names the store, the attempts and the deadline
        handler.addFilter(lambda record: record.name != "lakeloader.io.retry")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _say(args: argparse.Namespace, kind: str, message: object) -> None:
    """A warning or an error in one line on stderr, paths of the command's store as URLs."""
    target = getattr(args, "lake", None) or getattr(args, "checkpoint", None) or ""
    sys.stderr.write(
        f"lakeloader {args.command}: {kind}: {_one_line(full_urls(str(message), target))}\n"
    )
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lakeloader`` console script."""
    try:
        args = parse(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument (one line, status 2)
        return exc.code if isinstance(exc.code, int) else 2
    _log_to_stderr(args.verbose)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = lambda message, *_, **__: _say(args, "warning", message)
            if not args.verbose:  # the error names the store, the attempts and the deadline
                warnings.simplefilter("ignore", StorageRetryWarning)
            data, text, status = COMMANDS[args.command](args)
            sys.stdout.write((to_json(data) if args.json else text) + "\n")
            sys.stdout.flush()
            return status
    except (LakeError, KeyError, ValueError, OSError) as exc:  # what bad input raises
        message = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
        if isinstance(exc, StoreUnavailableError):
            message += f" (here: --retry-seconds, now {args.retry_seconds:g})"
        _say(args, "error", message)
        return 2
    except Exception as exc:
        if args.verbose:
            raise
        hint = "(run with --verbose for the traceback)"
        _say(args, "error", f"{type(exc).__name__}: {_one_line(str(exc))} {hint}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

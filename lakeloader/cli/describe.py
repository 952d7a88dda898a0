"""What a lake holds and how an epoch is cut: the data behind ``lakeloader plan``."""

from __future__ import annotations

from typing import Any

import numpy as np

from lakeloader.dataset import LakeDataset
from lakeloader.io.fetch import url_of
from lakeloader.order.plan import steps_in_epoch


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

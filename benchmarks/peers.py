"""lakeloader against the physical reference and the peer libraries, on the reference lake.

One command runs every loader, in one run, over the same lake (:mod:`benchmarks.reference_lake`,
64 files x 4 row groups x 32,768 rows, 1.29 GB, zstd), the same columns and batches of 1,024
rows, twice: the numeric columns (``id`` int64, ``label`` int32, ``f0..f15`` float32) as torch
tensors, then the same plus ``text`` (a list of str per batch).

Loaders (each in its own subprocess, so that memory is per loader):

==================  ======================================================================
``pyarrow-dataset`` the reference (1.00): ``pyarrow.dataset.dataset(files).to_batches(
                    columns, batch_size=1024)``, all threads, each column to a tensor
                    (``torch.from_numpy``), text ``to_pylist()``; path order, no shuffle
``pyarrow-iter``    ``ParquetFile.iter_batches(batch_size=1024, use_threads=False)`` file by
                    file with ``pa.set_cpu_count(1)``: one thread; path order
``lakeloader-wN``   ``lakeloader.DataLoader(LakeDataset(lake, columns, seed=0),
                    batch_size=1024, num_workers=N)``, N = 0, 1, 2; shuffled (16 partitions,
                    16,384-row windows, units permuted)
``torch-map``       ``torch.utils.data.DataLoader(ParquetMapDataset, batch_size=1024,
                    shuffle=True, num_workers=2)``: a straightforward map-style dataset whose
                    ``__getitem__`` returns one row as a dict, decoding a row group on first
                    touch and keeping every decoded row group; torch's ``default_collate``
``torchdata``       ``torchdata.stateful_dataloader.StatefulDataLoader`` over the same dataset
``hf-streaming``    ``datasets.load_dataset("parquet", data_files=files, streaming=True,
                    columns=...)``, ``.shuffle(seed=0, buffer_size=10_000)``,
                    ``.with_format("torch")``, ``.iter(batch_size=1024)`` in process
``litdata``         ``litdata.StreamingDataset`` over the Parquet files (``index_parquet_dataset``
                    on a folder of symlinks, ``ParquetLoader(columns=...)``, shuffle=True),
                    ``StreamingDataLoader(batch_size=1024, num_workers=2)`` (spawn: with
                    polars imported for the index it refuses fork)
``mosaic``          ``streaming.StreamingDataset`` (shuffle=True, seed 0) over an MDS copy,
                    torch ``DataLoader(batch_size=1024, num_workers=2)``; the conversion
                    (``MDSWriter``, row by row) is timed apart and is of the first
                    ``--mosaic-files`` files only (see below)
==================  ======================================================================

Rules, the same for every loader:

- The page cache is warm for everyone: every file of the lake (and of the MDS copies) is read
  once before the first run, and the machine has 24 GiB for a 1.3 GB lake.
- Time runs from the first ``iter()`` (worker start-up included) to the last batch;
  building the dataset object (listing, footers, HF's builder) is reported as ``setup``.
- lakeloader and pyarrow do a full pass. A peer stops at the first of a full pass or
  ``--peer-seconds`` (default 30 s) of iteration; rows/s is the rows it delivered over the time
  it took. Mosaic's conversion row by row in Python takes minutes per million rows, so it
  converts only the first ``--mosaic-files`` (default 8 of 64) files; its capped run reads
  far fewer rows than that, so the cap, not the subset, ends it.
- Repetitions interleave (all loaders once, then all again in reverse order); the best
  rows/s of ``--reps`` (2) is reported, and the median beside it (the reference itself swings
  by up to 2x between repetitions on this machine).
- The timed repetitions sample only RSS and the cache folder, which cost the sampler
  microseconds. Proportional set sizes (PSS) come from one more repetition per loader, whose
  speed is kept in the JSON but not used: reading ``smaps_rollup`` walks every page table of a
  process, 5-7 ms per sample for pyarrow and 12-14 ms for lakeloader with two workers (three
  processes mapping the cache), which slowed the runs it observed unevenly.
- MB/s is rows/s times the decoded bytes of a row in the lake (76 B numeric; 76 B plus the
  mean UTF-8 bytes of ``text`` with text), the same for every loader whatever dtype it
  delivers; the dtypes it delivered are in the JSON.
- Memory is sampled every 0.1 s by the parent over the child and all its descendants:
  ``peak RSS`` is the peak (over every repetition) of the sum of RSS over the tree (shared
  pages counted once per process), ``PSS+shm`` (the memory repetition) the peak sum of
  proportional set sizes (no double counting) plus the memory of the files lakeloader's
  cache keeps in ``/dev/shm`` (allocated blocks; the pages of them that processes map are
  taken out of the PSS so that they count once).

Run: ``python -m benchmarks.peers`` (about 25 minutes; peers from the venvs named by
``--bench-python`` and ``--mosaic-python``, see benchmarks/README.md), ``--smoke`` for a tiny
lake in a few seconds per loader (peers that do not import are skipped, and say so). Results go
to ``benchmarks/results/peers.json`` and ``peers.md`` (``--out`` elsewhere). ``--compare REV``
adds ``lakeloader-w2`` of another git revision to the same run, interleaved with the others,
so that a change's effect is measured side by side against the same reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    emit_result,
    machine,
    markdown_table,
    mib,
    pinned_tree,
    run_child,
    warm_page_cache,
    write_results,
)
from benchmarks.reference_lake import (
    ALL_COLUMNS,
    NUMERIC_COLUMNS,
    SMALL,
    data_files,
    lake_info,
    write_reference_lake,
)

BATCH = 1024
SEED = 0
REFERENCE = "pyarrow-dataset"
DEFAULT_LAKE = "/tmp/lakeloader-reference-lake"
NUMERIC_ROW_BYTES = 8 + 4 + 16 * 4


@dataclass(frozen=True)
class Loader:
    name: str
    env: str  # "bench" (the peers' venv), "mosaic" (its own venv)
    full_pass: bool  # False: capped at --peer-seconds
    shuffle: str
    workers: int
    needs: str = ""  # module a peer needs; empty for lakeloader and pyarrow


LOADERS = [
    Loader("pyarrow-dataset", "bench", True, "none (path order)", 0),
    Loader("pyarrow-iter", "bench", True, "none (path order)", 0),
    Loader("lakeloader-w0", "bench", True, "global: units permuted, 16 partitions, windows", 0),
    Loader("lakeloader-w1", "bench", True, "global: units permuted, 16 partitions, windows", 1),
    Loader("lakeloader-w2", "bench", True, "global: units permuted, 16 partitions, windows", 2),
    Loader("torch-map", "bench", False, "global (RandomSampler)", 2, "torch"),
    Loader("torchdata", "bench", False, "global (RandomSampler)", 2, "torchdata"),
    Loader(
        "hf-streaming", "bench", False, "file order shuffled + 10,000-row buffer", 0, "datasets"
    ),
    Loader("litdata", "bench", False, "chunks (files) shuffled, then rows", 2, "litdata"),
    Loader("mosaic", "mosaic", False, "py1e over shards", 2, "streaming"),
]
BY_NAME = {x.name: x for x in LOADERS}
SMOKE_LEFT_OUT = ("pyarrow-iter", "lakeloader-w1")  # same code paths as their neighbours


# =============================================================================== children
def _to_torch(batch: Any, columns: list[str]) -> dict[str, Any]:
    """A pyarrow RecordBatch as the delivered batch: tensors, and a list of str for text."""
    import torch

    out: dict[str, Any] = {}
    for name in columns:
        col = batch.column(name)
        if name == "text":
            out[name] = col.to_pylist()
        else:
            out[name] = torch.from_numpy(col.to_numpy(zero_copy_only=False))
    return out


def _pyarrow_dataset(lake: str, columns: list[str], _: argparse.Namespace) -> Iterable[Any]:
    import pyarrow.dataset as pads
    import torch  # noqa: F401  (imported before the clock starts)

    dataset = pads.dataset(data_files(lake), format="parquet")

    def batches() -> Iterator[Any]:
        for b in dataset.to_batches(columns=columns, batch_size=BATCH, use_threads=True):
            yield _to_torch(b, columns)

    return _Lazy(batches)


def _pyarrow_iter(lake: str, columns: list[str], _: argparse.Namespace) -> Iterable[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch  # noqa: F401  (imported before the clock starts)

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    files = data_files(lake)

    def batches() -> Iterator[Any]:
        for f in files:
            pf = pq.ParquetFile(f)
            for b in pf.iter_batches(batch_size=BATCH, columns=columns, use_threads=False):
                yield _to_torch(b, columns)

    return _Lazy(batches)


def _lakeloader(workers: int) -> Callable[[str, list[str], argparse.Namespace], Iterable[Any]]:
    def make(lake: str, columns: list[str], args: argparse.Namespace) -> Iterable[Any]:
        import lakeloader

        ds = lakeloader.LakeDataset(lake, columns=columns, seed=SEED)
        return lakeloader.DataLoader(
            ds, batch_size=BATCH, num_workers=workers, cache_dir=args.shm_dir
        )

    return make


class _Lazy:
    """An iterable whose iterator is made by a function, so ``iter()`` starts the clock."""

    def __init__(self, make: Callable[[], Iterator[Any]]) -> None:
        self.make = make

    def __iter__(self) -> Iterator[Any]:
        return self.make()


def _map_dataset(lake: str, columns: list[str]) -> Any:
    import bisect

    import numpy as np
    import pyarrow.parquet as pq
    import torch

    class ParquetMapDataset(torch.utils.data.Dataset[dict[str, Any]]):
        """Row ``i`` of the lake; each process decodes a row group on first touch and keeps it."""

        def __init__(self, files: list[str], columns: list[str]) -> None:
            self.files, self.columns = files, columns
            self.groups: list[tuple[int, int]] = []  # (file index, row group)
            self.starts: list[int] = [0]
            for i, f in enumerate(files):
                meta = pq.ParquetFile(f).metadata
                for g in range(meta.num_row_groups):
                    self.groups.append((i, g))
                    self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
            self.cache: dict[int, dict[str, Any]] = {}

        def __len__(self) -> int:
            return self.starts[-1]

        def _group(self, k: int) -> dict[str, Any]:
            got = self.cache.get(k)
            if got is None:
                f, g = self.groups[k]
                table = pq.ParquetFile(self.files[f]).read_row_group(g, columns=self.columns)
                got = {
                    c: table.column(c).to_pylist()
                    if c == "text"
                    else np.asarray(table.column(c).to_numpy())
                    for c in self.columns
                }
                self.cache[k] = got
            return got

        def __getitem__(self, i: int) -> dict[str, Any]:
            k = bisect.bisect_right(self.starts, i) - 1
            cols = self._group(k)
            j = i - self.starts[k]
            return {c: cols[c][j] for c in self.columns}

    return ParquetMapDataset(data_files(lake), columns)


def _map_loader(stateful: bool) -> Callable[[str, list[str], argparse.Namespace], Iterable[Any]]:
    """torch's DataLoader, or torchdata's StatefulDataLoader, over the map-style dataset."""

    def make(lake: str, columns: list[str], args: argparse.Namespace) -> Iterable[Any]:
        import torch

        if stateful:
            import torchdata.stateful_dataloader as sdl

            cls = sdl.StatefulDataLoader
        else:
            cls = torch.utils.data.DataLoader
        return cls(  # type: ignore[no-any-return]
            _map_dataset(lake, columns),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(SEED),
        )

    return make


def _hf(lake: str, columns: list[str], args: argparse.Namespace) -> Iterable[Any]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(Path(args.work) / "hf-cache"))
    from datasets import load_dataset

    ds = load_dataset(
        "parquet", data_files=data_files(lake), split="train", streaming=True, columns=columns
    )
    ds = ds.shuffle(seed=SEED, buffer_size=10_000).with_format("torch")
    return _Lazy(lambda: iter(ds.iter(batch_size=BATCH)))


def _litdata(lake: str, columns: list[str], args: argparse.Namespace) -> Iterable[Any]:
    from litdata import StreamingDataLoader, StreamingDataset, index_parquet_dataset
    from litdata.streaming.item_loader import ParquetLoader

    links = Path(args.work) / "litdata-lake"  # its index.json must not land in the lake
    if not (links / "index.json").exists():
        shutil.rmtree(links, ignore_errors=True)
        links.mkdir(parents=True)
        for f in data_files(lake):
            (links / Path(f).name).symlink_to(f)
        index_parquet_dataset(str(links))
    ds = StreamingDataset(
        str(links),
        item_loader=ParquetLoader(columns=columns),
        shuffle=True,
        seed=SEED,
        cache_dir=str(Path(args.work) / "litdata-cache"),
    )
    # LitData refuses fork once polars (its Parquet indexer) is imported: spawn, as it asks.
    loader: Iterable[Any] = StreamingDataLoader(
        ds, batch_size=BATCH, num_workers=2, multiprocessing_context="spawn"
    )
    return loader


def _stub_torchvision() -> None:
    """mosaicml-streaming imports torchvision, whose CUDA build fails beside the CPU torch."""
    import importlib.machinery
    import types

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {"__init__": lambda self, *a, **k: None})

    for name in ("torchvision", "torchvision.datasets", "torchvision.transforms"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__getattr__ = missing  # type: ignore[method-assign]
        sys.modules[name] = module
    sys.modules["torchvision.transforms.functional"] = sys.modules["torchvision.transforms"]


def _mds_dir(work: str, columns: list[str]) -> Path:
    return Path(work) / ("mds-text" if "text" in columns else "mds-numeric")


def _mosaic(lake: str, columns: list[str], args: argparse.Namespace) -> Iterable[Any]:
    _stub_torchvision()
    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(
        local=str(_mds_dir(args.work, columns)),
        shuffle=True,
        shuffle_seed=SEED,
        batch_size=BATCH,
    )
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=2)


def convert_mds(lake: str, work: str, columns: list[str], files: int) -> dict[str, Any]:
    """Write the first ``files`` files of the lake as MDS, row by row (Mosaic's way)."""
    _stub_torchvision()
    import pyarrow.parquet as pq
    from streaming import MDSWriter

    out = _mds_dir(work, columns)
    marker = out / "_converted.json"
    if marker.exists():
        done: dict[str, Any] = json.loads(marker.read_text())
        if done.get("files") == files and done.get("lake") == lake_info(lake)["params"]:
            return done
    shutil.rmtree(out, ignore_errors=True)
    types = {c: ("str" if c == "text" else "int64" if c == "id" else "int32") for c in columns}
    types.update({c: "float32" for c in columns if c.startswith("f")})
    t0 = time.perf_counter()
    rows = 0
    with MDSWriter(out=str(out), columns=types, compression=None) as writer:
        for f in data_files(lake)[:files]:
            table = pq.read_table(f, columns=columns)
            cols = {
                c: table.column(c).to_pylist() if c == "text" else table.column(c).to_numpy()
                for c in columns
            }
            for i in range(table.num_rows):
                writer.write({c: cols[c][i] for c in columns})
            rows += table.num_rows
    done = {
        "files": files,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 2),
        "lake": lake_info(lake)["params"],
        "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
    }
    marker.write_text(json.dumps(done))
    return done


MAKERS: dict[str, Callable[[str, list[str], argparse.Namespace], Iterable[Any]]] = {
    "pyarrow-dataset": _pyarrow_dataset,
    "pyarrow-iter": _pyarrow_iter,
    "lakeloader-w0": _lakeloader(0),
    "lakeloader-w1": _lakeloader(1),
    "lakeloader-w2": _lakeloader(2),
    "torch-map": _map_loader(stateful=False),
    "torchdata": _map_loader(stateful=True),
    "hf-streaming": _hf,
    "litdata": _litdata,
    "mosaic": _mosaic,
}


def _rows(batch: Any) -> int:
    return len(batch["id"])


def _describe(batch: Any) -> dict[str, str]:
    """Type (and dtype) of every column of a delivered batch."""
    out = {}
    for k, v in batch.items():
        dtype = getattr(v, "dtype", None)
        inner = f"[{type(v[0]).__name__}]" if isinstance(v, list) and v else ""
        out[str(k)] = f"{type(v).__name__}{inner}" + (f" {dtype}" if dtype is not None else "")
    return out


def child(args: argparse.Namespace) -> int:
    """Run one loader and emit its result line; leave at once, whatever happens.

    ``os._exit`` skips finalisers: some peers' worker shutdown takes seconds after a cap, and a
    loader whose ``__del__`` starts threads at interpreter exit can hang there.
    """
    try:
        emit_result(_measure(args))
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    columns = list(ALL_COLUMNS if args.text else NUMERIC_COLUMNS)
    loader = BY_NAME[args.child]
    cap = None if loader.full_pass else args.peer_seconds
    t0 = time.perf_counter()
    iterable = MAKERS[args.child](args.lake, columns, args)
    setup = time.perf_counter() - t0
    rows = batches = 0
    first_batch_s = 0.0
    dtypes: dict[str, str] = {}
    capped = False
    t0 = time.perf_counter()
    for batch in iterable:
        if not batches:
            first_batch_s = time.perf_counter() - t0
            dtypes = _describe(batch)
        rows += _rows(batch)
        batches += 1
        if cap is not None and time.perf_counter() - t0 >= cap:
            capped = True
            break
    seconds = time.perf_counter() - t0
    stats = iterable.stats() if hasattr(iterable, "stats") else None
    return {
        "loader": args.child,
        "rows": rows,
        "batches": batches,
        "seconds": seconds,
        "setup_seconds": setup,
        "first_batch_seconds": first_batch_s,
        "capped": capped,
        "dtypes": dtypes,
        "loader_stats": stats,
    }


# ================================================================================ parent
def _python_for(loader: Loader, args: argparse.Namespace) -> str:
    return str(args.mosaic_python if loader.env == "mosaic" else args.bench_python)


def _importable(python: str, module: str) -> bool:
    if not Path(python).exists() and shutil.which(python) is None:
        return False
    if module == "streaming":
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); "
        code += "from benchmarks.peers import _stub_torchvision as s; s(); import streaming"
    else:
        code = f"import {module}"
    probe = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return probe.returncode == 0


def _child_cmd(loader: Loader, args: argparse.Namespace, text: bool, shm: str) -> list[str]:
    name = loader.name.split("@")[0]  # a lakeloader of another revision runs as itself
    cmd = [_python_for(loader, args), "-m", "benchmarks.peers", "--child", name]
    cmd += ["--lake", args.lake, "--work", args.work, "--shm-dir", shm]
    cmd += ["--peer-seconds", str(args.peer_seconds)]
    return [*cmd, "--text"] if text else cmd


def _text_bytes(lake: str) -> float:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total = rows = 0
    for f in data_files(lake):
        col = pq.read_table(f, columns=["text"]).column("text")
        total += pc.sum(pc.binary_length(col)).as_py()
        rows += len(col)
    return total / rows


def parent(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tree, src_note = pinned_tree(args.src)
    print(f"children run from {tree}: {src_note}", flush=True)
    params = dict(SMALL) if args.smoke else {}
    t0 = time.perf_counter()
    write_reference_lake(args.lake, **params)
    lake_seconds = time.perf_counter() - t0
    info = lake_info(args.lake)
    row_bytes = {"numeric": float(NUMERIC_ROW_BYTES)}
    row_bytes["text"] = NUMERIC_ROW_BYTES + _text_bytes(args.lake)
    chosen = [BY_NAME[n] for n in args.loaders] if args.loaders else list(LOADERS)
    skipped: dict[str, str] = {}
    runnable: list[Loader] = []
    for loader in chosen:
        if loader.needs and not _importable(_python_for(loader, args), loader.needs):
            why = f"{loader.needs} does not import under {_python_for(loader, args)}"
            if not args.smoke:
                raise SystemExit(f"{loader.name}: {why} (only --smoke may skip a peer)")
            skipped[loader.name] = why
            print(f"skipped {loader.name}: {why} (smoke mode only)", flush=True)
            continue
        runnable.append(loader)
    trees = {loader.name: tree for loader in runnable}
    compared = None
    if args.compare:  # the same loader at another revision, interleaved: an A/B in one run
        other, compared = pinned_tree(args.compare)
        print(f"lakeloader-w2@{compared['commit']} runs from {other}", flush=True)
        twin = replace(BY_NAME["lakeloader-w2"], name=f"lakeloader-w2@{compared['commit']}")
        runnable.append(twin)
        trees[twin.name] = other
    conversions: dict[str, Any] = {}
    if any(x.name == "mosaic" for x in runnable):
        for kind, cols in (("numeric", NUMERIC_COLUMNS), ("text", ALL_COLUMNS)):
            code = (
                "import json, sys; from benchmarks.peers import convert_mds; "
                f"print(json.dumps(convert_mds({args.lake!r}, {args.work!r}, {cols!r}, "
                f"{args.mosaic_files})))"
            )
            out = subprocess.run(
                [args.mosaic_python, "-c", code],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).parents[1],
            )
            conversions[kind] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"mosaic conversion ({kind}): {conversions[kind]}", flush=True)
    mds = [_mds_dir(args.work, c) for c in (NUMERIC_COLUMNS, ALL_COLUMNS)]
    warmed = warm_page_cache([args.lake, *[d for d in mds if d.exists()]])
    runs: dict[str, list[dict[str, Any]]] = {}
    for text in (False, True):
        kind = "text" if text else "numeric"
        samples: dict[str, list[dict[str, Any]]] = {x.name: [] for x in runnable}
        for rep in range(args.reps + 1):  # the last one measures memory (PSS)
            timed = rep < args.reps
            for loader in runnable if rep % 2 == 0 else runnable[::-1]:
                shm = tempfile.mkdtemp(prefix="lakeloader-bench-", dir="/dev/shm")
                try:
                    run = run_child(
                        _child_cmd(loader, args, text, shm),
                        timeout=args.timeout,
                        watch_dir=shm,
                        cwd=trees[loader.name],
                        pss=not timed,
                    )
                finally:
                    shutil.rmtree(shm, ignore_errors=True)
                sample: dict[str, Any] = {"rep": rep, "returncode": run.returncode, **run.peaks}
                sample["timed"] = timed
                sample["wall_seconds"] = run.wall_seconds
                if run.result is None:
                    sample["error"] = run.stderr_tail
                else:
                    sample.update(run.result)
                    sample["rows_per_s"] = run.result["rows"] / max(run.result["seconds"], 1e-9)
                samples[loader.name].append(sample)
                rate = sample.get("rows_per_s")
                print(
                    f"[{kind} {'rep ' + str(rep) if timed else 'memory rep'}] {loader.name}: "
                    + (f"{rate:,.0f} rows/s" if rate else f"FAILED: {run.stderr_tail[-300:]}")
                    + f", peak RSS tree {mib(run.peaks['peak_rss_tree'])} MiB, memory sampler "
                    + f"{run.peaks['sampler_cpu_ms_per_sample']} ms CPU per sample",
                    flush=True,
                )
        runs[kind] = _summarise(runnable, samples, row_bytes[kind])
    return {
        "setup": {
            "lake": args.lake,
            "lake_info": info,
            "lake_write_seconds": round(lake_seconds, 2),
            "batch_size": BATCH,
            "columns": {"numeric": NUMERIC_COLUMNS, "text": ALL_COLUMNS},
            "row_bytes": row_bytes,
            "peer_seconds": args.peer_seconds,
            "reps": args.reps,
            "page_cache": f"warm for everyone ({warmed:,} bytes read before the runs)",
            "mosaic_files": args.mosaic_files,
            "mosaic_conversion": conversions,
            "bench_python": args.bench_python,
            "mosaic_python": args.mosaic_python,
            "smoke": bool(args.smoke),
            "machine": machine(),
            "lakeloader_source": src_note,
            "compared_with": compared,
        },
        "skipped": skipped,
        "runs": runs,
    }


def _summarise(
    loaders: list[Loader], samples: dict[str, list[dict[str, Any]]], row_bytes: float
) -> list[dict[str, Any]]:
    rows = []
    for loader in loaders:
        ok = [s for s in samples[loader.name] if "rows_per_s" in s and s["timed"]]
        memory = [s for s in samples[loader.name] if not s["timed"]]
        best = max(ok, key=lambda s: s["rows_per_s"]) if ok else None
        rows.append(
            {
                "loader": loader.name,
                "shuffle": loader.shuffle,
                "workers": loader.workers,
                "full_pass": loader.full_pass,
                "ok": best is not None,
                "rows_per_s": best["rows_per_s"] if best else None,
                "median_rows_per_s": statistics.median(s["rows_per_s"] for s in ok) if ok else None,
                "mb_per_s": best["rows_per_s"] * row_bytes / 1e6 if best else None,
                "rows": best["rows"] if best else None,
                "seconds": best["seconds"] if best else None,
                "setup_seconds": best["setup_seconds"] if best else None,
                "first_batch_seconds": best["first_batch_seconds"] if best else None,
                "capped": best["capped"] if best else None,
                "dtypes": best["dtypes"] if best else None,
                "peak_rss_tree": max(s["peak_rss_tree"] for s in samples[loader.name]),
                "peak_pss_plus_shm": max(s["peak_pss_plus_shm"] for s in memory),
                "peak_processes": max(s["peak_processes"] for s in samples[loader.name]),
                "samples": samples[loader.name],
            }
        )
    ref = next((r for r in rows if r["loader"] == REFERENCE and r["ok"]), None)
    for r in rows:
        r["x_reference"] = (
            r["rows_per_s"] / ref["rows_per_s"] if ref is not None and r["ok"] else None
        )
        r["x_reference_median"] = (
            r["median_rows_per_s"] / ref["median_rows_per_s"]
            if ref is not None and r["ok"]
            else None
        )
    return rows


def render(report: dict[str, Any]) -> str:
    s = report["setup"]
    p = s["lake_info"]["params"]
    lines = [
        "# Peers: lakeloader, the physical reference and the peer libraries",
        "",
        f"Lake: {s['lake_info']['rows']:,} rows, {p['files']} files x {p['row_groups']} row "
        f"groups x {p['rows_per_group']:,} rows, {s['lake_info']['bytes_on_disk'] / 1e9:.2f} GB "
        f"on disk, zstd. Batch {s['batch_size']:,}. Page cache: {s['page_cache']}. "
        f"Best of {s['reps']} interleaved repetitions (x pyarrow: best against best; the "
        "median column: median against median, since the reference itself swings by up to 2x "
        "between repetitions here). Peak RSS is the largest of every repetition; PSS+shm "
        "comes from one more repetition that samples it (see the module docstring).",
        "",
        f"Cap: lakeloader and pyarrow do a full pass; every peer stops at the first of a full "
        f"pass or {s['peer_seconds']:g} s of iteration (start-up included). Machine: "
        f"{s['machine']}. lakeloader measured: {s['lakeloader_source']}"
        + (f"; beside it, interleaved: {s['compared_with']}." if s.get("compared_with") else "."),
        "",
    ]
    if s["mosaic_conversion"]:
        conv = "; ".join(
            f"{k}: {v['rows']:,} rows of the first {v['files']} files in {v['seconds']:.0f} s "
            f"({v['rows'] / v['seconds']:,.0f} rows/s), {v['bytes'] / 1e6:.0f} MB"
            for k, v in s["mosaic_conversion"].items()
        )
        lines += [f"Mosaic MDS conversion (not in the timings): {conv}.", ""]
    for name, why in report["skipped"].items():
        lines += [f"Skipped {name}: {why} (smoke mode).", ""]
    for kind, title in (("numeric", "numeric columns"), ("text", "numeric columns + text")):
        lines += [
            f"## {title} ({s['row_bytes'][kind]:.1f} decoded bytes per row)",
            "",
            markdown_table(
                [
                    "loader",
                    "workers",
                    "shuffle",
                    "rows",
                    "seconds",
                    "rows/s",
                    "MB/s",
                    "x pyarrow",
                    "x pyarrow (medians)",
                    "peak RSS tree MiB",
                    "PSS+shm MiB",
                    "setup s",
                    "first batch s",
                ],
                [
                    [
                        r["loader"],
                        r["workers"],
                        r["shuffle"],
                        r["rows"] if r["ok"] else "failed",
                        round(r["seconds"], 1) if r["ok"] else None,
                        round(r["rows_per_s"]) if r["ok"] else None,
                        round(r["mb_per_s"], 1) if r["ok"] else None,
                        round(r["x_reference"], 3) if r["x_reference"] is not None else None,
                        _rounded(r.get("x_reference_median")),
                        mib(r["peak_rss_tree"]),
                        mib(r["peak_pss_plus_shm"]),
                        round(r["setup_seconds"], 2) if r["ok"] else None,
                        round(r["first_batch_seconds"], 2) if r["ok"] else None,
                    ]
                    for r in report["runs"][kind]
                ],
            ),
            "",
        ]
        ref = next((r for r in report["runs"][kind] if r["loader"] == REFERENCE and r["ok"]), None)
        for r in report["runs"][kind]:
            if ref is None or not r["ok"]:
                continue
            widened = [
                f"{c} {t.split()[-1]}"
                for c, t in sorted(r["dtypes"].items())
                if ref["dtypes"].get(c) != t
            ]
            if widened:
                lines += [f"- {r['loader']} delivers other types than the lake's: "]
                lines[-1] += ", ".join(widened) + " (MB/s counts the lake's types)."
        failed = [r for r in report["runs"][kind] if not r["ok"]]
        for r in failed:
            lines += [f"- {r['loader']} failed: `{r['samples'][-1].get('error', '')[-400:]}`"]
        lines += [""]
    return "\n".join(lines)


def _rounded(ratio: float | None) -> float | None:
    """A ratio to 3 decimals (None stays None: a failed loader, or a report from before)."""
    return None if ratio is None else round(ratio, 3)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Rows/s of every loader, numeric and with text, on a log scale (False: no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = [k for k in ("numeric", "text") if k in report["runs"]]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), sharey=True)
    for ax, kind in zip(list(getattr(axes, "flat", [axes])), kinds, strict=True):
        rows = [r for r in report["runs"][kind] if r["ok"]][::-1]
        names = [r["loader"] for r in rows]
        rates = [r["rows_per_s"] for r in rows]
        colors = [
            "tab:blue"
            if n.startswith("lakeloader")
            else "tab:gray"
            if n.startswith("pyarrow")
            else "tab:orange"
            for n in names
        ]
        ax.barh(names, rates, color=colors)
        ax.set_xscale("log")
        ax.set_xlabel("rows/s (log)")
        ax.set_title(f"{kind}: batch {report['setup']['batch_size']}, best of reps")
        for y, r in enumerate(rows):
            ax.text(r["rows_per_s"], y, f" {r['x_reference']:.3g}x", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lake", help=f"the lake's folder (default {DEFAULT_LAKE})")
    parser.add_argument("--work", default="/tmp/lakeloader-peers-work", help="MDS, caches")
    parser.add_argument("--out", help="results folder (default benchmarks/results)")
    parser.add_argument("--name", help="results file name (default peers, smoke: peers-smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny lake, 1 rep, 1 s cap")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--peer-seconds", type=float, default=30.0)
    parser.add_argument("--mosaic-files", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="per child process")
    parser.add_argument("--loaders", nargs="*", choices=list(BY_NAME), help="a subset")
    parser.add_argument(
        "--src",
        help="lakeloader to measure: a git revision exported to /tmp (default HEAD), or "
        "'worktree' (the default with --smoke)",
    )
    default_bench = "/work/benchenv/bin/python"
    parser.add_argument(
        "--bench-python",
        default=default_bench if Path(default_bench).exists() else sys.executable,
    )
    parser.add_argument("--mosaic-python", default="/work/mosaicenv/bin/python")
    parser.add_argument(
        "--compare",
        help="also run lakeloader-w2 of this git revision (exported like --src), interleaved "
        "with the others in the same run: a side-by-side A/B",
    )
    parser.add_argument("--render", help="re-render the .md and .png of this JSON; no run")
    parser.add_argument("--child", choices=list(BY_NAME), help=argparse.SUPPRESS)
    parser.add_argument("--text", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shm-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.smoke:  # seconds: 1 repetition, 1 s caps, the reference, lakeloader at 0 and 2
        args.reps, args.peer_seconds, args.mosaic_files = 1, min(args.peer_seconds, 1.0), 1
        args.loaders = args.loaders or [n for n in BY_NAME if n not in SMOKE_LEFT_OUT]
    args.lake = args.lake or (str(Path(args.work) / "smoke-lake") if args.smoke else DEFAULT_LAKE)
    args.name = args.name or ("peers-smoke" if args.smoke else "peers")
    args.src = args.src or ("worktree" if args.smoke else "HEAD")
    report = json.loads(Path(args.render).read_text()) if args.render else parent(args)
    json_path, md_path = write_results(args.name, report, render(report), args.out)
    print(render(report))
    print(f"wrote {json_path} and {md_path}")
    if plot(report, json_path.with_suffix(".png")):
        print(f"wrote {json_path.with_suffix('.png')}")
    return 0 if all(r["ok"] for run in report["runs"].values() for r in run) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Helpers shared by the benchmarks: results files, memory of a process tree, markdown tables."""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = RESULTS_DIR.parents[1]
#: Prefix of the one stdout line in which a child process hands its result to the parent.
RESULT_PREFIX = "BENCH-RESULT "


# ------------------------------------------------------------------------------- results
def write_results(
    name: str, data: dict[str, Any], markdown: str, out_dir: str | Path | None = None
) -> tuple[Path, Path]:
    """Write ``NAME.json`` and ``NAME.md`` under ``out_dir`` (default ``benchmarks/results``)."""
    folder = Path(out_dir) if out_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers get thousands separators and are right-aligned.

    >>> print(markdown_table(["a", "n"], [["x", 1234], ["y", 0.5]]))
    | a | n |
    |---|--:|
    | x | 1,234 |
    | y | 0.5 |
    """
    numeric = [
        all(isinstance(r[i], int | float) and not isinstance(r[i], bool) for r in rows)
        for i in range(len(headers))
    ]
    out = ["| " + " | ".join(headers) + " |"]
    out.append("|" + "|".join("--:" if n else "---" for n in numeric) + "|")
    out.extend("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)
    return "\n".join(out)


def cell(value: Any) -> str:
    """One table cell, formatted as lakeloader's plain-text tables do; None as a dash."""
    from lakeloader.cli.tables import _cell  # here: the peers' children need not import lakeloader

    return "-" if value is None else _cell(value)


def mib(n: float) -> float:
    """Bytes to MiB, rounded to 0.1."""
    return round(n / 2**20, 1)


def machine() -> dict[str, Any]:
    """What a result depends on besides the code: cores, load, versions."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for module in ("torch", "pyarrow", "numpy"):
        mod = sys.modules.get(module)
        if mod is not None:
            info[module] = getattr(mod, "__version__", "?")
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        if head.returncode == 0:
            info["commit"] = head.stdout.strip()
    except OSError:
        pass
    return info


# ------------------------------------------------------------------------ pinned code
def pinned_tree(src: str) -> tuple[Path, dict[str, Any]]:
    """A folder to run children from, so that a long run measures one version of lakeloader.

    ``src="worktree"``: the repository itself. Otherwise a git revision (``HEAD``): its
    ``lakeloader/`` is exported with ``git archive`` (read-only for the repository) next to a
    copy of this ``benchmarks/`` folder, under ``/tmp`` (removed at exit); children started
    there with ``-m`` import that lakeloader, whatever is being edited in the work tree
    meanwhile. ``tests/`` is copied too: the object stores' launchers (``tests/stores.py``)
    serve the benchmarks.
    """
    dirty = subprocess.run(
        ["git", "status", "--short", "lakeloader"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split("\n")
    dirty = [line for line in dirty if line.strip()]
    if src == "worktree":
        commit = machine().get("commit", "?")
        return ROOT, {"src": src, "commit": commit, "worktree_changes": dirty}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", src], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    folder = Path(f"/tmp/lakeloader-bench-src-{commit}")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # nothing left in /tmp after
    if not (folder / "lakeloader" / "__init__.py").exists():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, "lakeloader"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    for helpers in ("benchmarks", "tests"):  # the stores' fixtures live in tests/stores.py
        shutil.rmtree(folder / helpers, ignore_errors=True)
        shutil.copytree(
            ROOT / helpers,
            folder / helpers,
            ignore=shutil.ignore_patterns("results", "__pycache__"),
        )
    note = {"src": src, "commit": commit, "worktree_changes_not_measured": dirty}
    return folder, note


# ------------------------------------------------------------------ process-tree memory
def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants, from ``/proc/PID/task/TID/children``."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
            except OSError:
                continue
    return out


def _kib_field(path: str, key: str) -> int:
    """A ``key: N kB`` field of a /proc file, in bytes (0 if the process is gone)."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes(pid: int) -> int:
    """Resident set size of one process."""
    return _kib_field(f"/proc/{pid}/status", "VmRSS:")


def pss_and_shmem_bytes(pid: int) -> tuple[int, int]:
    """(proportional set size, its shared-memory part) of one process, (0, 0) if it is gone.

    PSS splits shared pages among their users; the shared-memory part is the pages of tmpfs
    files it maps. Both come from one read of ``smaps_rollup``: the kernel walks every page
    table of the process for each read, which costs tens of milliseconds for a process that
    maps a large file, so the sampler reads it once per process per sample.
    """
    pss = shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Pss_Shmem:"):
                    shmem = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return pss, shmem


def dir_bytes(path: str | Path) -> int:
    """Memory held by the files below ``path`` (see ``lakeloader.cache.shm.allocated_bytes``)."""
    from lakeloader.cache.shm import allocated_bytes  # the parent's import, not the children's

    return allocated_bytes(path)


@dataclass
class TreeSampler:
    """Samples the memory of a process tree in a thread until stopped.

    ``peak_rss`` is the peak of the *sum* of the RSS of every process of the tree (pages
    shared between processes counted once per process, as asked for); ``peak_pss`` is the peak
    sum of proportional set sizes (shared pages split, so it does not double count);
    ``peak_dir`` the peak memory of files under ``watch_dir`` (allocated blocks: tmpfs files
    count as memory but are in no process's RSS until mapped); ``peak_total`` the peak of PSS
    without its shared-memory part, plus those files (so a mapped page counts once).
    ``peak_processes``: most processes seen at once; ``cpu_seconds``: the CPU the sampling
    thread itself used (it shares the machine with what it measures).
    """

    pid: int
    interval: float = 0.1
    watch_dir: str | None = None
    pss: bool = True
    peak_rss: int = 0
    peak_pss: int = 0
    peak_dir: int = 0
    peak_total: int = 0
    peak_processes: int = 0
    samples: int = 0
    cpu_seconds: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        t0 = time.thread_time()
        pids = tree_pids(self.pid)
        rss = sum(rss_bytes(p) for p in pids)
        both = [pss_and_shmem_bytes(p) for p in pids] if self.pss else []
        pss = sum(p for p, _ in both)
        shm = dir_bytes(self.watch_dir) if self.watch_dir else 0
        # Mapped shared-memory pages are in PSS and in the files both: count them once.
        mapped_shm = sum(s for _, s in both) if shm else 0
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_dir = max(self.peak_dir, shm)
        self.peak_total = max(self.peak_total, (pss - mapped_shm if self.pss else rss) + shm)
        self.peak_processes = max(self.peak_processes, len(pids))
        self.samples += 1
        self.cpu_seconds += time.thread_time() - t0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def peaks(self) -> dict[str, int]:
        return {
            "peak_rss_tree": self.peak_rss,
            "peak_pss_tree": self.peak_pss,
            "peak_shm_files": self.peak_dir,
            "peak_pss_plus_shm": self.peak_total,
            "peak_processes": self.peak_processes,
            "memory_samples": self.samples,
            "sampler_cpu_ms_per_sample": round(1e3 * self.cpu_seconds / max(1, self.samples), 2),
        }


@dataclass
class ChildRun:
    """What a sampled child process left: its result line, exit status, memory peaks."""

    returncode: int
    result: dict[str, Any] | None
    stderr_tail: str
    peaks: dict[str, int]
    wall_seconds: float


def run_child(
    cmd: Sequence[str],
    *,
    timeout: float,
    interval: float = 0.1,
    watch_dir: str | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path = ROOT,
    pss: bool = True,
) -> ChildRun:
    """Run ``cmd``, sample its process tree's memory, and parse its ``RESULT_PREFIX`` line.

    ``pss=False`` samples RSS and the watched folder only: proportional set sizes cost the
    sampler (and so the machine it shares with the child) a page-table walk per process.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    with TreeSampler(proc.pid, interval=interval, watch_dir=watch_dir, pss=pss) as sampler:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            err += f"\n(killed after the {timeout:.0f} s timeout)"
    return ChildRun(
        proc.returncode,
        result_of(out),
        "\n".join(err.strip().splitlines()[-15:]),
        sampler.peaks(),
        time.perf_counter() - t0,
    )


def result_of(stdout: str) -> dict[str, Any] | None:
    """The result a child handed over with :func:`emit_result` (its last one), or None."""
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
    return result


def emit_result(result: dict[str, Any]) -> None:
    """Hand a child's result to the parent (one stdout line)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()


def warm_page_cache(paths: Sequence[str | Path]) -> int:
    """Read every file below ``paths`` once, so that every loader starts with a warm cache."""
    total = 0
    for root in paths:
        for folder, _, names in os.walk(root):
            for name in names:
                with open(os.path.join(folder, name), "rb") as fh:
                    while chunk := fh.read(1 << 24):
                        total += len(chunk)
    return total

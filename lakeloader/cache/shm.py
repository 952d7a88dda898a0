"""The folder of a process's decoded units: shared memory when it has room, and cleanup."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

#: Where unit files go by default.
SHM_DIR = "/dev/shm"
#: Name prefix of the per-process unit folders.
UNIT_DIR_PREFIX = "lakeloader"


def default_cache_dir(need_bytes: int) -> str | None:
    """``SHM_DIR`` if it has ``need_bytes`` free, else None (the temp folder; warns if too full)."""
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return None
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    if free >= need_bytes:
        return SHM_DIR
    logger.warning(
        "only %d MiB are free in %s, less than cache_bytes (%d MiB): decoded units go to %s "
        "instead, which is slower. Give the machine or container more shared memory (docker: "
        "--shm-size), lower cache_bytes, or choose a folder with cache_dir=...",
        free >> 20,
        SHM_DIR,
        need_bytes >> 20,
        tempfile.gettempdir(),
    )
    return None


def make_unit_dir(root: str | None) -> str:
    """Create this process's unit folder, first removing folders left by dead processes."""
    base = root if root is not None else tempfile.gettempdir()
    sweep(base)
    return tempfile.mkdtemp(prefix=f"{UNIT_DIR_PREFIX}-{os.getpid()}-", dir=base)


def sweep(base: str) -> list[tuple[str, int]]:
    """Remove the unit folders under ``base`` whose process is dead; return ``(path, bytes)``."""
    removed = []
    for name in sorted(os.listdir(base)):
        prefix, _, rest = name.partition("-")
        pid = rest.split("-")[0]
        if prefix == UNIT_DIR_PREFIX and pid.isdigit() and not _alive(int(pid)):
            path = os.path.join(base, name)
            size = allocated_bytes(path)
            logger.info("removing %s, left by dead process %s", path, pid)
            shutil.rmtree(path, ignore_errors=True)
            removed.append((path, size))
    return removed


def allocated_bytes(folder: str | os.PathLike[str]) -> int:
    """Memory (or disk) the files under ``folder`` hold, 0 if the folder is gone.

    Allocated blocks are counted, so that a sparse arena counts the pages written, not its size.
    """
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(parent, name)).st_blocks * 512
            except OSError:  # removed meanwhile
                continue
    return total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True

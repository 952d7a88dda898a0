"""The checkpoint root on its store: step folders, shared manifests, commits and pruning.

:class:`CheckpointFolders` is the one writer of the layout :mod:`lakeloader.checkpoint.layout`
describes, through the retried :class:`~lakeloader.checkpoint.store.CheckpointStore`.
"""

from __future__ import annotations

import logging
import posixpath
import uuid
from collections.abc import Mapping
from typing import Any

from lakeloader.checkpoint.layout import (
    COMMIT_FILE,
    MANIFEST_DIR,
    STATE_FILE,
    STEP_DIR_RE,
    CommitRecord,
    sha256,
    step_dir_name,
)
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.lake.manifest import pack_manifest
from lakeloader.lake.snapshot import Snapshot

logger = logging.getLogger(__name__)


class CheckpointFolders:
    """Step folders and manifests under one root (``root``: a path of ``store``'s filesystem)."""

    def __init__(self, store: CheckpointStore, root: str, keep: int) -> None:
        self.store = store
        self.root = root
        self.keep = keep
        self._manifests: dict[str, str] = {}  # manifests known intact: path -> SHA-256

    def path(self, *parts: str) -> str:
        """A path under the root."""
        return posixpath.join(self.root, *parts)

    def step_folder(self, step: int) -> str:
        """The folder of a step's checkpoint."""
        return self.path(step_dir_name(step))

    def step_dirs(self) -> dict[int, str]:
        """Every step folder, committed or not."""
        try:
            entries = self.store.ls(self.root)
        except FileNotFoundError:
            return {}
        names = [entry.rstrip("/") for entry in entries]
        return {int(m.group(1)): name for name in names if (m := STEP_DIR_RE.search(name))}

    def committed(self, dirs: dict[int, str] | None = None) -> list[int]:
        """Steps with a ``COMMIT``, oldest first (of ``dirs``; None: every step folder)."""
        dirs = self.step_dirs() if dirs is None else dirs
        exists = self.store.exists
        return sorted(s for s, d in dirs.items() if exists(posixpath.join(d, COMMIT_FILE)))

    def manifest(self, snapshot: Snapshot, source: Any) -> tuple[str, str]:
        """Write the snapshot's manifest unless an intact one is there; (relative path, sha)."""
        rel = posixpath.join(MANIFEST_DIR, f"{snapshot.fingerprint}.msgpack")
        known = self._manifests.get(rel)
        if known is not None:
            return rel, known
        data = pack_manifest(snapshot, source)
        digest = sha256(data)
        path = self.path(rel)
        try:
            intact = sha256(self.store.cat(path)) == digest
        except FileNotFoundError:
            intact = False
        if not intact:  # absent, or torn by an earlier crash: (re)write it whole
            self.store.makedirs(self.path(MANIFEST_DIR))
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self.store.put(tmp, data)
            self.store.mv(tmp, path)
        self._manifests[rel] = digest
        return rel, digest

    def uncommit(self, folder: str) -> None:
        """Make a step folder's checkpoint invisible, then remove the folder."""
        commit = posixpath.join(folder, COMMIT_FILE)
        if self.store.exists(commit):
            self.store.rm(commit)
        if self.store.exists(folder):
            self.store.rm(folder, recursive=True)

    def commit(
        self,
        step: int,
        payload: bytes,
        manifest: tuple[str, str],
        parts: Mapping[str, tuple[int, str]],
    ) -> None:
        """Write a step's state, then its ``COMMIT`` listing every part; prune.

        The folder is there, emptied (:meth:`uncommit`) before any rank wrote into it.
        """
        folder = self.step_folder(step)
        self.store.put(posixpath.join(folder, STATE_FILE), payload)
        marker = CommitRecord(step, len(payload), sha256(payload), *manifest, parts=parts)
        self.store.put(posixpath.join(folder, COMMIT_FILE), marker.to_bytes())
        size = len(payload) + sum(n for n, _ in parts.values())
        logger.info("checkpoint of step %d written to %s (%d bytes)", step, folder, size)
        self.prune(step)

    def prune(self, current: int) -> None:
        """Keep the newest ``keep`` committed checkpoints; drop half-written folders."""
        dirs = self.step_dirs()
        committed = self.committed(dirs)
        doomed = committed[: -self.keep] + [s for s in dirs if s not in committed and s != current]
        for s in doomed:
            self.uncommit(dirs[s])

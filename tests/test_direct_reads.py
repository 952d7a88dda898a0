"""Ranged reads of S3 objects on presigned URLs (``lakeloader.io.direct``), on a real server.

The unit reads of an S3 lake go over presigned URLs and pooled keep-alive connections
instead of s3fs's request pipeline. These tests hold them to what s3fs gives: the same bytes,
the same failures (a rewritten object, refused credentials, a store restarted under pooled
connections), and s3fs itself where the URL would lose part of the request (a proxy).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
import pytest

import lakeloader as ll
from lakeloader.io import direct, pinned
from lakeloader.io.fetch import FOOTER_TAIL_BYTES
from lakeloader.lake.discovery import version_token
from tests.conftest import write_lake

if TYPE_CHECKING:
    from tests.stores import ObjectStore, RestartableStore

pytest_plugins = ["tests.stores"]


def _object(store: ObjectStore, size: int) -> tuple[str, bytes, str]:
    """A new object of ``size`` random bytes: its path, bytes and version token."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    bucket = store.new_bucket("direct")
    fs = store.filesystem()
    path = f"{bucket}/blob.bin"
    fs.pipe_file(path, data)
    fs.invalidate_cache()
    return path, data, version_token(fs.info(path))


def test_ranges_are_the_bytes_s3fs_reads(s3_store: ObjectStore) -> None:
    fs = s3_store.filesystem()
    reader = direct.direct_for(fs)
    assert reader is not None, "an s3fs filesystem on a plain endpoint reads directly"
    path, data, version = _object(s3_store, 3 * 1024 * 1024 + 17)
    ranges = [(0, 1), (5, 70_000), (len(data) - FOOTER_TAIL_BYTES, len(data)), (0, len(data))]
    for pinned_to in (version, ""):
        got = pinned.cat_ranges(fs, path, pinned_to, ranges)
        assert [bytes(b) for b in got] == [data[s:e] for s, e in ranges]
    assert [bytes(b) for b in got] == fs.cat_ranges(
        [path] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges]
    )


def test_a_rewritten_object_fails_naming_it(s3_store: ObjectStore) -> None:
    fs = s3_store.filesystem()
    path, data, version = _object(s3_store, 4096)
    assert bytes(pinned.cat_ranges(fs, path, version, [(0, 10)])[0]) == data[:10]
    fs.pipe_file(path, data[::-1])  # same size, other bytes: another ETag
    for ranges in ([(0, 10)], [(0, 10), (100, 200), (300, 4096)]):  # one, or all at once
        with pytest.raises(ll.LakeChangedError) as err:
            pinned.cat_ranges(fs, path, version, ranges)
        assert str(err.value).startswith(f"s3://{path}: the file was rewritten"), err.value
        assert version in str(err.value) and "412" in str(err.value)


def test_a_deleted_object_fails_naming_it(s3_store: ObjectStore) -> None:
    fs = s3_store.filesystem()
    path, _, version = _object(s3_store, 4096)
    fs.rm(path)
    with pytest.raises(ll.LakeChangedError, match=f"s3://{path}: the file was rewritten or del"):
        pinned.cat_ranges(fs, path, version, [(0, 10)])


def test_a_wrong_secret_is_refused_at_once_naming_the_url(
    s3_store: ObjectStore, tmp_path: Path
) -> None:
    write_lake(tmp_path / "lake", [[100, 100]] * 2)
    _, url = s3_store.upload(tmp_path / "lake", "direct-creds")
    ds = ll.LakeDataset(url, storage_options=s3_store.storage_options, seed=0)
    bad = {**s3_store.storage_options, "secret": "not-the-secret"}
    fs = fsspec.filesystem("s3", **bad)
    assert direct.direct_for(fs) is not None
    info = ds.snapshot.files[0]
    with pytest.raises(PermissionError, match="HTTP 403"):
        pinned.cat_ranges(fs, info.path, info.version, [(0, 4)])
    reader = ds.reader()
    reader.fs = fs
    with pytest.raises(ll.StoreAccessError) as err:
        reader.fetch(0, 0)
    message = str(err.value)
    assert message.startswith(f"s3://{info.path}: the store refused access"), message
    assert "AWS_ACCESS_KEY_ID" in message and "Not retried" in message


def test_pooled_connections_survive_a_store_restart(
    restartable_s3_store: RestartableStore,
) -> None:
    store = restartable_s3_store
    fs = store.filesystem(fresh=True)
    path, data, version = _object(store, 100_000)
    reader = direct.direct_for(fs)
    assert reader is not None
    assert bytes(reader.read(path, version, 0, 100)) == data[:100]
    store.restart()  # the pooled connection is dead now
    _serving(store, path)
    assert bytes(reader.read(path, version, 100, 5000)) == data[100:5000]


def _serving(store: RestartableStore, path: str, seconds: float = 30.0) -> None:
    """Wait until a restarted store serves ``path`` again through a fresh client: its S3
    gateway answers 500 InternalError for a moment after the port opens, which is the
    store's readiness, not what a pooled connection must survive."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            store.filesystem(fresh=True).cat_file(path, start=0, end=1)
            return
        except Exception:  # s3fs raises what botocore gives: anything until it serves
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_proxy_in_the_environment_leaves_reads_to_s3fs(
    s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = s3_store.filesystem(fresh=True)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert direct.direct_for(fs) is None
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert direct.direct_for(fs) is not None, "an endpoint the proxy is bypassed for"


def test_other_filesystems_read_as_before() -> None:
    assert direct.direct_for(fsspec.filesystem("file")) is None
    assert direct.direct_for(fsspec.filesystem("memory")) is None


def test_a_forked_child_opens_connections_of_its_own(s3_store: ObjectStore) -> None:
    """Pooled sockets are the process's own: a forked child that asks for the reader of the
    very filesystem object it inherited gets one of its own, without the parent's connections.

    (The child does not read: s3fs's event loop does not survive a fork, which is why workers
    rebuild their filesystem from its pickle; this guards the sockets all the same.)
    """
    import multiprocessing as mp

    fs = s3_store.filesystem()
    path, data, version = _object(s3_store, 10_000)
    parent = direct.direct_for(fs)
    assert parent is not None
    assert bytes(parent.read(path, version, 0, 10)) == data[:10]  # a connection is pooled now
    assert parent._idle
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_reader_in_child, args=(fs, send))  # inherited, not pickled
    child.start()
    inherited, replaced, pooled, open_copies = receive.recv()
    child.join(30)
    assert child.exitcode == 0
    assert inherited, "the child sees the parent's reader"
    assert replaced and not pooled
    assert open_copies == 0, "the child closed its copies of the parent's sockets"
    assert direct.direct_for(fs) is parent, "the parent keeps its own"
    assert bytes(parent.read(path, version, 20, 30)) == data[20:30]


def _reader_in_child(fs: fsspec.AbstractFileSystem, send: Any) -> None:
    before = direct._DIRECT.get(fs)
    reader = direct.direct_for(fs)
    assert reader is not None
    idle = [c for conns in (before._idle if before else {}).values() for c in conns]
    open_copies = sum(c.sock is not None for c in idle) if idle else -1  # -1: none inherited
    send.send((before is not None, reader is not before, bool(reader._idle), open_copies))


def test_s3fs_reads_where_a_presigned_url_would_drop_an_option(s3_store: ObjectStore) -> None:
    """Custom certificate checks (here ``verify=False``) keep the reads in s3fs, pinned all
    the same: the same bytes, and a rewrite caught."""
    options = {**s3_store.storage_options, "client_kwargs": {"verify": False}}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    assert direct.direct_for(fs) is None
    path, data, version = _object(s3_store, 70_000)
    ranges = [(0, 1), (5, 60_000), (69_000, 70_000)]
    got = pinned.cat_ranges(fs, path, version, ranges)
    assert [bytes(b) for b in got] == [data[s:e] for s, e in ranges]
    s3_store.filesystem().pipe_file(path, data[::-1])
    with pytest.raises(ll.LakeChangedError, match=f"s3://{path}: the file was rewritten"):
        pinned.cat_ranges(fs, path, version, [(0, 10)])


def test_presigned_urls_are_kept_for_the_newest_files_only(
    s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct, "URL_CACHE_FILES", 2)
    fs = s3_store.filesystem(fresh=True)
    reader = direct.direct_for(fs)
    assert reader is not None
    objects = [_object(s3_store, 1000 + k) for k in range(3)]
    for path, data, version in objects:
        assert bytes(reader.read(path, version, 0, 8)) == data[:8]
    assert list(reader._urls) == [(p, v) for p, _, v in objects[1:]]


def test_a_status_error_crosses_to_the_loader_process_whole() -> None:
    """A worker sends its error home pickled: the status must come with the message."""
    import pickle

    sent = direct.HTTPStatusError("GET s3://b/k bytes=0-9: status 404", 404)
    back = pickle.loads(pickle.dumps(sent))
    assert (type(back), str(back), back.code) == (type(sent), str(sent), 404)

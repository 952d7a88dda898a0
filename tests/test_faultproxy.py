"""The fault proxy of tests/faultproxy.py and the restartable S3 store, with plain s3fs."""

from __future__ import annotations

import http.client
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import botocore.exceptions
import fsspec
import pytest

from tests.faultproxy import FaultProxy

if TYPE_CHECKING:
    from tests.stores import ObjectStore, RestartableStore

pytest_plugins = ["tests.stores", "tests.faultproxy"]

#: What botocore raises for a connection closed at once (EndpointConnectionError when aiohttp
#: finds the connection closed as it sends, ConnectionClosedError when it waits for the answer).
CLOSED = (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError)
MB = 1 << 20
BIG = bytes(range(256)) * (6 * MB // 256)  # 6 MiB, every offset's byte known


def _fs(options: dict[str, Any], **extra: Any) -> fsspec.AbstractFileSystem:
    """A new s3fs client of its own (no cached listings, no pooled connections)."""
    return fsspec.filesystem("s3", skip_instance_cache=True, **options, **extra)


def _impatient(options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """A client that tries once: s3fs and botocore retry for several seconds otherwise."""
    fs = _fs(options, config_kwargs={"retries": {"total_max_attempts": 1}})
    fs.retries = 1
    return fs


@pytest.fixture
def bucket(s3_store: ObjectStore) -> str:
    name = s3_store.new_bucket("proxy")
    s3_store.filesystem().pipe(f"{name}/big", BIG)  # straight to the store, not counted
    return name


def _status(port: int, method: str, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_counts_a_known_sequence_of_requests(s3_proxy: FaultProxy, bucket: str) -> None:
    fs = _fs(s3_proxy.storage_options)
    fs.pipe(f"{bucket}/small", b"hello world")
    assert fs.info(f"{bucket}/small")["size"] == 11
    assert fs.cat_file(f"{bucket}/big", start=MB, end=5 * MB) == BIG[MB : 5 * MB]
    assert fs.cat_file(f"{bucket}/small", start=6, end=11) == b"world"
    assert sorted(fs.ls(bucket, detail=False)) == [f"{bucket}/big", f"{bucket}/small"]
    seen = s3_proxy.exchanges()
    assert [(e.method, e.key, e.status, e.fault) for e in seen] == [
        ("PUT", f"{bucket}/small", 200, None),
        ("HEAD", f"{bucket}/small", 200, None),
        ("GET", f"{bucket}/big", 206, None),
        ("GET", f"{bucket}/small", 206, None),
        ("GET", bucket, 200, None),
    ]
    assert [e.byte_range for e in seen] == [None, None, (MB, 5 * MB - 1), (6, 10), None]
    assert [e.body_bytes for e in seen[:4]] == [0, 0, 4 * MB, 5]
    assert "list-type=2" in seen[4].query
    assert [e.byte_range for e in s3_proxy.gets_for("/big")] == [(MB, 5 * MB - 1)]
    assert s3_proxy.bytes_sent("/big") == 4 * MB
    assert s3_proxy.bytes_sent() == sum(e.body_bytes for e in seen)
    assert s3_proxy.by_method() == {"PUT": 1, "HEAD": 1, "GET": 3}
    assert s3_proxy.connections == 1, "keep-alive: one connection for the whole sequence"
    assert s3_proxy.reset() == seen
    assert s3_proxy.exchanges() == [] and s3_proxy.connections == 0


def test_a_fraction_of_503s_is_retried_through(s3_proxy: FaultProxy, bucket: str) -> None:
    fs = _fs(s3_proxy.storage_options)
    reads = 16
    s3_proxy.seed(3)  # 5 of the 21 draws fall below 0.25 (seed 0 has none in its first 16)
    with s3_proxy.faults(error_rate=0.25, methods={"GET"}, error_code="SlowDown"):
        for i in range(reads):
            assert (
                fs.cat_file(f"{bucket}/big", start=i * 1000, end=i * 1000 + 10)
                == (BIG[i * 1000 : i * 1000 + 10])
            )
    gets = s3_proxy.gets_for("/big")
    errors = s3_proxy.select("GET", "/big", status=503)
    assert len(gets) - len(errors) == reads, "each read succeeds once"
    assert s3_proxy.faults_injected() == {"error": len(errors)}
    assert 0.05 <= len(errors) / len(gets) <= 0.5, f"{len(errors)} of {len(gets)}"


@pytest.mark.parametrize("fault", ["drop_rate", "truncate_rate"])
def test_one_dropped_or_cut_response_is_retried(
    s3_proxy: FaultProxy, bucket: str, fault: str
) -> None:
    fs = _fs(s3_proxy.storage_options)
    with s3_proxy.faults(**{fault: 1.0}, limit=1, match="/big"):
        assert fs.cat_file(f"{bucket}/big", start=0, end=2 * MB) == BIG[: 2 * MB]
    first, second = s3_proxy.gets_for("/big")
    if fault == "drop_rate":
        assert (first.fault, first.status, first.body_bytes) == ("drop", None, 0)
    else:
        assert (first.fault, first.status, first.body_bytes) == ("truncate", 206, MB)
    assert (second.fault, second.status, second.body_bytes) == (None, 206, 2 * MB)


def test_bodies_cut_every_time_raise_a_payload_error(s3_proxy: FaultProxy, bucket: str) -> None:
    fs = _impatient(s3_proxy.storage_options)
    with s3_proxy.faults(truncate_rate=1.0), pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(f"{bucket}/big", start=0, end=MB)


def test_down_refuses_or_closes_connections_then_comes_back(
    s3_proxy: FaultProxy, bucket: str
) -> None:
    fs = _impatient(s3_proxy.storage_options)
    path, port = f"/{bucket}/big", s3_proxy.port
    with s3_proxy.outage("refuse"):
        assert s3_proxy.is_down
        with pytest.raises(ConnectionRefusedError):
            _status(port, "HEAD", path)
        with pytest.raises(botocore.exceptions.EndpointConnectionError):
            fs.cat_file(path, start=0, end=10)
    assert not s3_proxy.is_down
    assert fs.cat_file(path, start=0, end=10) == BIG[:10], "the same client works again"
    with s3_proxy.outage("close"):
        with pytest.raises(ConnectionResetError):  # RemoteDisconnected is one
            _status(port, "HEAD", path)
        with pytest.raises(CLOSED):
            fs.cat_file(path, start=0, end=10)
    assert fs.cat_file(path, start=0, end=10) == BIG[:10]
    assert s3_proxy.port == port


def test_the_restartable_store_keeps_its_objects(restartable_s3_store: RestartableStore) -> None:
    store = restartable_s3_store
    fs = store.filesystem()
    fs.mkdir("kept")
    fs.pipe("kept/a", b"before the restart")
    port, first_pid = int(store.endpoint.rsplit(":", 1)[1]), store.pid
    with FaultProxy(store.endpoint, store.storage_options) as proxy:
        store.stop()
        assert not store.running
        with pytest.raises(ConnectionRefusedError):
            _status(port, "GET", "/")
        # Behind the proxy a stopped store is a 503 ServiceUnavailable (as from a balancer).
        assert _status(proxy.port, "GET", "/kept/a") == 503
        assert proxy.faults_injected() == {"upstream": 1}
        began = time.monotonic()
        store.start()
        assert time.monotonic() - began < 10
        assert store.running and store.pid != first_pid
        assert store.endpoint == f"http://127.0.0.1:{port}"
        assert fs.cat_file("kept/a") == b"before the restart", "the same client, after a restart"
        assert _fs(proxy.storage_options).cat_file("kept/a") == b"before the restart"
    store.restart(kill=True)  # a crash loses nothing written before it
    assert _fs(store.storage_options).cat_file("kept/a") == b"before the restart"

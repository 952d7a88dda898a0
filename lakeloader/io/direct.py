"""Ranged GETs of S3 objects on presigned URLs over plain keep-alive connections.

:func:`direct_for` says when (an s3fs filesystem whose requests carry nothing a URL would
lose); anything else reads through s3fs. Failures are raised as the reader expects: 404 as
:class:`FileNotFoundError`, 401 and 403 as :class:`PermissionError`, other statuses as
:class:`HTTPStatusError`, a dropped connection or a short body as :class:`ConnectionError`.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
import urllib.parse
import urllib.request
import weakref
from collections.abc import Sequence
from typing import Any, Final

import fsspec
from fsspec.asyn import sync

from lakeloader.io.sparse import Blob
from lakeloader.lake.discovery import version_value

logger = logging.getLogger(__name__)

#: How long a presigned URL is asked to stay valid, and when it is made again.
URL_SECONDS: Final = 3600
URL_RENEW_SECONDS: Final = 1800
#: Presigned URLs kept (one per file and version; about a kilobyte each).
URL_CACHE_FILES: Final = 4096
#: Seconds a connection waits for the store before it counts as dropped.
SOCKET_TIMEOUT: Final = 60.0
#: Idle connections kept per host.
POOL_SIZE: Final = 64
#: Environment variables that route requests through a proxy (http.client ignores them).
_PROXY_VARIABLES: Final = ("http_proxy", "https_proxy", "all_proxy")


class HTTPStatusError(OSError):
    """The store answered a ranged GET with another status than 206 (``code``: the status)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.code = status

    def __reduce__(self) -> tuple[type[HTTPStatusError], tuple[str, int]]:
        return type(self), (str(self), self.code)  # a worker sends it home pickled


class DirectRanges:
    """Ranged reads of one s3fs filesystem's objects, on URLs its client presigns."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.pid = os.getpid()  # a forked child must not share the parent's connections
        self._urls: dict[tuple[str, str], tuple[float, urllib.parse.SplitResult]] = {}
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def read_all(self, path: str, version: str, ranges: Sequence[tuple[int, int]]) -> list[Blob]:
        """Ranges of ``path`` (see :meth:`read`): the first in this thread, others in threads.

        The first failure, in the order of the ranges, is raised.
        """
        out: list[bytearray | BaseException] = [bytearray()] * len(ranges)  # each set below

        def one(k: int) -> None:
            try:
                out[k] = self.read(path, version, *ranges[k])
            except BaseException as exc:  # raised below, in the caller's thread
                out[k] = exc

        others = [
            threading.Thread(target=one, args=(k,), name="lakeloader-range", daemon=True)
            for k in range(1, len(ranges))
        ]
        for thread in others:
            thread.start()
        one(0)
        for thread in others:
            thread.join()
        failed = [blob for blob in out if isinstance(blob, BaseException)]
        if failed:
            raise failed[0]
        return [blob for blob in out if isinstance(blob, bytearray)]

    def read(self, path: str, version: str, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of ``path`` at ``version`` (``""``: unpinned).

        Raises:
            FileNotFoundError: If the object (or that version of it) is not there.
            PermissionError: If the store refuses a freshly presigned URL.
            HTTPStatusError: For another status than 206 (412: a rewritten object).
            ConnectionError: If the connection drops or the body comes short.
        """
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if (etag := version_value(version, "ETag")) is not None:
            headers["If-Match"] = etag
        try:
            return self._get(self._url(path, version, renew=False), headers, end - start)
        except PermissionError:  # an expired URL or session token: once more, signed anew
            return self._get(self._url(path, version, renew=True), headers, end - start)

    def _url(self, path: str, version: str, *, renew: bool) -> urllib.parse.SplitResult:
        key, now = (path, version), time.monotonic()
        with self._lock:
            made = self._urls.get(key)
        if made is not None and not renew and now - made[0] < URL_RENEW_SECONDS:
            return made[1]
        params = {}
        if (version_id := version_value(version, "version_id")) is not None:
            params["VersionId"] = version_id
        signed: str = sync(self._fs.loop, self._fs._url, path, expires=URL_SECONDS, **params)
        url = urllib.parse.urlsplit(signed)
        with self._lock:
            self._urls.pop(key, None)
            self._urls[key] = (now, url)
            while len(self._urls) > URL_CACHE_FILES:  # the least recently made out
                del self._urls[next(iter(self._urls))]
        return url

    def _get(
        self, url: urllib.parse.SplitResult, headers: dict[str, str], length: int
    ) -> bytearray:
        target = f"{url.path}?{url.query}" if url.query else url.path
        shown = f"{url.scheme}://{url.netloc}{url.path}"  # never the signature
        host = (url.scheme, url.netloc)
        for fresh in (False, True):
            conn, reused = self._connection(host, fresh)
            try:
                conn.request("GET", target, headers=headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if reused and not fresh:  # an idle connection the store had closed
                    continue
                raise ConnectionError(f"{shown}: {type(exc).__name__}: {exc}") from exc
            break
        try:
            # 206; or 200 for a range that is the whole object, from a store that says so
            whole = response.status == http.client.OK and response.length == length
            if response.status != http.client.PARTIAL_CONTENT and not whole:
                raise _status_error(shown, response)
            body = _read_into(response, length, shown)
        except BaseException:
            conn.close()
            raise
        if not response.will_close:
            with self._lock:
                idle = self._idle.setdefault(host, [])
                if len(idle) < POOL_SIZE:
                    idle.append(conn)
                    return body
        conn.close()
        return body

    def _connection(
        self, host: tuple[str, str], fresh: bool
    ) -> tuple[http.client.HTTPConnection, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(host)
                if idle:
                    return idle.pop(), True
        scheme, netloc = host
        kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = kind(netloc, timeout=SOCKET_TIMEOUT)
        _OPEN.add(conn)
        return conn, False


def _status_error(url: str, response: http.client.HTTPResponse) -> OSError:
    """The exception for an answer that is not the range asked for."""
    body = " ".join(response.read(2048).decode("utf-8", "replace").split())
    status = response.status
    message = f"{url}: HTTP {status} {body}".strip()
    if status == http.client.NOT_FOUND:
        return FileNotFoundError(message)
    if status in (http.client.UNAUTHORIZED, http.client.FORBIDDEN):
        return PermissionError(message)
    return HTTPStatusError(message, status)


def _read_into(response: http.client.HTTPResponse, length: int, url: str) -> bytearray:
    """The body of a 206 answer of ``length`` bytes, read into one buffer."""
    if response.length is not None and response.length != length:
        raise ConnectionError(f"{url}: {response.length} bytes answered for a range of {length}")
    body = bytearray(length)
    view, got = memoryview(body), 0
    try:
        while got < length:
            n = response.readinto(view[got:])
            if not n:
                break
            got += n
    except (OSError, http.client.HTTPException) as exc:
        raise ConnectionError(f"{url}: {type(exc).__name__} after {got} bytes: {exc}") from exc
    finally:
        view.release()
    if got != length:
        raise ConnectionError(f"{url}: {got} bytes read for a range of {length}")
    if not response.isclosed() and response.read(1):  # (a chunked body's end is read here)
        raise ConnectionError(f"{url}: more bytes answered than the range of {length}")
    return body


_DIRECT: weakref.WeakKeyDictionary[Any, DirectRanges] = weakref.WeakKeyDictionary()
_DIRECT_LOCK = threading.Lock()
#: Every connection this process opened (and has not dropped).
_OPEN: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()


def _drop_inherited() -> None:
    """In a forked child: close the copies of the parent's sockets, take a lock of its own.

    The parent's sockets stay open; a thread of the parent may hold the parent's lock.
    """
    global _DIRECT_LOCK
    _DIRECT_LOCK = threading.Lock()
    for conn in list(_OPEN):
        if conn.sock is not None:
            conn.sock.close()
            conn.sock = None
    _OPEN.clear()


os.register_at_fork(after_in_child=_drop_inherited)


def direct_for(fs: fsspec.AbstractFileSystem) -> DirectRanges | None:
    """The direct reader of an s3fs filesystem, or None where its requests need s3fs."""
    if not hasattr(fs, "_call_s3") or not hasattr(fs, "_url"):
        return None
    client_kwargs = getattr(fs, "client_kwargs", None) or {}
    config_kwargs = getattr(fs, "config_kwargs", None) or {}
    if any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARIABLES):
        endpoint = client_kwargs.get("endpoint_url") or getattr(fs, "endpoint_url", None)
        host = urllib.parse.urlsplit(endpoint).hostname if endpoint else None
        if host is None or not urllib.request.proxy_bypass(host):  # NO_PROXY does not exempt it
            return None
    if (
        client_kwargs.get("verify", True) is not True
        or config_kwargs.get("proxies")
        or getattr(fs, "req_kw", None)
        or getattr(fs, "s3_additional_kwargs", None)
    ):
        return None
    with _DIRECT_LOCK:
        direct = _DIRECT.get(fs)
        if direct is None or direct.pid != os.getpid():
            direct = _DIRECT[fs] = DirectRanges(fs)
            logger.debug("ranged reads of %s go over presigned URLs", fs)
        return direct

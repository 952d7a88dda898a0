"""A loopback HTTP reverse proxy that counts requests and injects faults, for object-store tests.

``FaultProxy(upstream)`` listens on 127.0.0.1 (a free port) and forwards every request to the
store's endpoint byte for byte, the ``Host`` header included, so SigV4 signatures stay valid.
It runs its own event loop in a background thread; the test thread switches it at run time:

- counting: every exchange is recorded (method, path, query, ``Range`` header, status, bytes
  of the response body sent, fault, duration); ``gets_for``, ``count``, ``bytes_sent``,
  ``by_method`` and ``reset`` read and clear the record;
- faults drawn from a seeded RNG (``set_faults`` / ``faults``): a fraction of requests answered
  503 with an S3 XML error body (``SlowDown`` or ``ServiceUnavailable``), a fraction whose
  connection is closed before any response, a fraction whose body is cut short (the full
  ``Content-Length`` is announced, about half of the body is sent, then the connection is
  closed), and an optional delay before each request is forwarded;
- outages (``down`` / ``up`` / ``outage``): ``"refuse"`` closes the listening socket (new
  connections are refused, as by a stopped server), ``"close"`` accepts and closes every
  connection at once; either way open connections are cut.

A store that cannot be reached (stopped behind the proxy) is answered 503 ``ServiceUnavailable``
(recorded with fault ``"upstream"``), as a load balancer in front of it would.

Only HTTP/1.1 with ``Content-Length`` or chunked bodies is handled (what botocore, aiohttp and
the stores speak); a request's ``Expect: 100-continue`` is answered by the proxy itself and
left out of the forwarded request (SigV4 never signs it). Request bodies are held in memory
(no multipart uploads through the proxy); response bodies are streamed.

Use in a test module with ``pytest_plugins = ["tests.stores", "tests.faultproxy"]``; the
function-scoped fixture ``s3_proxy`` is a started ``FaultProxy`` in front of the session's
``s3_store``, and ``proxy.storage_options`` are the store's with the proxy as endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import pytest

if TYPE_CHECKING:
    from tests.stores import ObjectStore

HOST = "127.0.0.1"
#: Bytes forwarded at a time from the store to the client.
CHUNK = 256 * 1024
#: Longest request or response head accepted.
HEAD_LIMIT = 64 * 1024
#: Seconds ``start`` and the run-time switches wait for the proxy's loop.
LOOP_DEADLINE = 10.0

Fault = Literal["error", "drop", "truncate"]
Outage = Literal["refuse", "close"]

#: What the proxy answers when the store cannot be reached (as a load balancer would).
UNREACHABLE_STATUS, UNREACHABLE_CODE = 503, "ServiceUnavailable"
#: S3's wording for the 503s it answers, by error code.
S3_503_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "ServiceUnavailable": "Service is unable to handle request.",
}


@dataclass(frozen=True)
class Exchange:
    """One request the proxy received and what became of it.

    Attributes:
        method: ``GET``, ``HEAD``, ``PUT``, ...
        path: The URL path, percent-decoded (``/bucket/key`` for path-style S3).
        query: The raw query string (``list-type=2&prefix=...`` for a listing).
        range: The request's ``Range`` header, or None.
        status: The status sent to the client; None if no response head was sent.
        body_bytes: Bytes of response body sent to the client.
        fault: The fault injected (``"error"``, ``"drop"``, ``"truncate"``), ``"upstream"``
            if the store could not be reached (answered 503 ``ServiceUnavailable``), or None.
        seconds: From the end of the request head to the end of the response.
    """

    method: str
    path: str
    query: str
    range: str | None
    status: int | None
    body_bytes: int
    fault: str | None
    seconds: float

    @property
    def key(self) -> str:
        """The path without its leading slash (``bucket/key``)."""
        return self.path.lstrip("/")

    @property
    def byte_range(self) -> tuple[int, int] | None:
        """``(first, last)`` of a ``bytes=first-last`` range; None for other or no ranges."""
        if self.range is None or not self.range.startswith("bytes="):
            return None
        first, _, last = self.range[len("bytes=") :].partition("-")
        if not first.isdigit() or not last.isdigit():
            return None
        return int(first), int(last)


@dataclass(frozen=True)
class Faults:
    """What to inject, for each request that matches, drawn from the proxy's seeded RNG.

    Attributes:
        error_rate: Fraction answered ``error_status`` with an S3 XML error body.
        drop_rate: Fraction whose connection is closed before any response is sent.
        truncate_rate: Fraction whose response body is cut short (then the connection closed);
            a response without a body is dropped instead.
        delay: Seconds to wait before each matching request is forwarded.
        error_status: Status of the injected errors.
        error_code: S3 error code in their body (``SlowDown``, ``ServiceUnavailable``, ...).
        match: Only requests whose percent-decoded path contains this; None: all.
        methods: Only these methods; None: all.
        limit: Stop injecting after this many faults; None: no limit.
    """

    error_rate: float = 0.0
    drop_rate: float = 0.0
    truncate_rate: float = 0.0
    delay: float = 0.0
    error_status: int = 503
    error_code: str = "SlowDown"
    match: str | None = None
    methods: frozenset[str] | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        rates = (self.error_rate, self.drop_rate, self.truncate_rate)
        if any(r < 0 for r in rates) or sum(rates) > 1:
            raise ValueError(f"fault rates must be >= 0 and sum to at most 1, got {rates}")

    def applies(self, method: str, path: str) -> bool:
        """Whether a request is subject to these faults."""
        return (self.methods is None or method in self.methods) and (
            self.match is None or self.match in path
        )


NO_FAULTS = Faults()


@dataclass
class _Request:
    head: bytes  # as forwarded (request line and headers, ending in a blank line)
    body: bytes  # as forwarded (raw chunked framing kept)
    method: str
    path: str
    query: str
    range: str | None
    close: bool  # the client asked to close after this exchange


@dataclass
class _ResponseHead:
    raw: bytes
    status: int
    length: int | None  # None: chunked or until the connection closes
    chunked: bool
    close: bool


class _DroppedError(Exception):
    """The exchange ends with the client connection closed (a fault, or the store's)."""


class _UnreachableError(Exception):
    """The store could not be connected to, or closed the connection before answering."""


def _headers(lines: list[bytes]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _wants_close(version: str, headers: dict[str, str]) -> bool:
    connection = headers.get("connection", "").lower()
    return connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")


async def _copy_chunk(reader: asyncio.StreamReader) -> tuple[bytes, int]:
    """One chunk of a chunked body, raw (size line, data, CRLF), and its data's size."""
    size_line = await reader.readuntil(b"\r\n")
    size = int(size_line.split(b";")[0].strip(), 16)
    if size == 0:  # the last chunk, then trailers up to an empty line
        trailer = b""
        while True:
            line = await reader.readuntil(b"\r\n")
            trailer += line
            if line == b"\r\n":
                return size_line + trailer, 0
    data = await reader.readexactly(size + 2)
    return size_line + data, size


async def _read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> _Request | None:
    """The next request on a client connection, or None at a clean end of the connection.

    A client that expects ``100 Continue`` gets it here, before its body is read.
    """
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise
        return None
    first, *lines = head[:-4].split(b"\r\n")
    method, target, version = first.decode("latin-1").split(" ", 2)
    headers = _headers(lines)
    split = urllib.parse.urlsplit(target)
    if headers.get("expect", "").lower() == "100-continue":
        lines = [line for line in lines if not line.lower().startswith(b"expect:")]
        head = b"\r\n".join([first, *lines]) + b"\r\n\r\n"
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            raw, size = await _copy_chunk(reader)
            body += raw
            if size == 0:
                break
    elif int(headers.get("content-length", "0")) > 0:
        body = await reader.readexactly(int(headers["content-length"]))
    return _Request(
        head=head,
        body=body,
        method=method,
        path=urllib.parse.unquote(split.path),
        query=split.query,
        range=headers.get("range"),
        close=_wants_close(version, headers),
    )


async def _read_response_head(reader: asyncio.StreamReader, method: str) -> _ResponseHead:
    while True:
        raw = await reader.readuntil(b"\r\n\r\n")
        first, *lines = raw[:-4].split(b"\r\n")
        version, status_text, *_ = first.decode("latin-1").split(" ", 2)
        status = int(status_text)
        if not 100 <= status < 200:
            break  # interim responses (100 Continue) are not passed on
    headers = _headers(lines)
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    if method == "HEAD" or status in (204, 304):
        length: int | None = 0
    elif chunked or "content-length" not in headers:
        length = None
    else:
        length = int(headers["content-length"])
    close = _wants_close(version, headers) or (length is None and not chunked)
    return _ResponseHead(raw, status, length, chunked, close)


def _hang_up(writer: asyncio.StreamWriter) -> None:
    """End a client connection at once, even when another process holds its socket too.

    ``abort()`` only closes this process's descriptor: a DataLoader worker forked from the
    process under test (where the proxy's thread runs) inherits the descriptor and keeps the
    connection open, so the client would wait for an answer that never comes. A shutdown acts
    on the connection itself: the client sees it end.
    """
    sock = writer.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    writer.transport.abort()


def _error_response(status: int, code: str, method: str, path: str) -> tuple[bytes, bytes]:
    """(head, body) of an S3-style error."""
    message = S3_503_MESSAGES.get(code, "Injected by the test's fault proxy.")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{path}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()
    reason = "Slow Down" if code == "SlowDown" else "Service Unavailable"
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "x-amz-request-id: faultproxy\r\n"
        "\r\n"
    ).encode()
    return head, (b"" if method == "HEAD" else body)


class _Upstream:
    """One connection to the store, opened on demand, for one client connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, request: _Request) -> tuple[asyncio.StreamReader, _ResponseHead]:
        """Send a request and read the response head; a stale kept-alive connection is retried
        once on a fresh one (nothing of its response had arrived, so the store never saw it)."""
        for attempt in (0, 1):
            fresh = self.conn is None
            if self.conn is None:
                try:
                    self.conn = await asyncio.open_connection(self.host, self.port)
                except OSError as exc:
                    raise _UnreachableError from exc
            reader, writer = self.conn
            try:
                writer.write(request.head + request.body)
                await writer.drain()
                return reader, await _read_response_head(reader, request.method)
            except (OSError, asyncio.IncompleteReadError) as exc:
                self.close()
                if fresh or attempt == 1:
                    raise _UnreachableError from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


class FaultProxy:
    """A counting, fault-injecting reverse proxy on 127.0.0.1 in front of ``upstream``.

    Args:
        upstream: The store's endpoint, ``http://127.0.0.1:PORT``.
        storage_options: The store's fsspec options; ``storage_options`` gives them back
            with the proxy as ``endpoint_url``.
        seed: Seed of the RNG that decides which requests get a fault.
        port: Port to listen on; 0 (default) picks a free one.

    Start and stop it with ``with FaultProxy(...) as proxy:`` or ``start()`` / ``stop()``;
    every other method may be called from any thread while it runs.
    """

    def __init__(
        self,
        upstream: str,
        storage_options: dict[str, Any] | None = None,
        *,
        seed: int = 0,
        port: int = 0,
    ) -> None:
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = upstream
        self._upstream_addr = (parts.hostname, parts.port)
        self._options = dict(storage_options or {})
        self.port = port
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._faults = NO_FAULTS
        self._injected = 0
        self._exchanges: list[Exchange] = []
        self._connections = 0
        self._in_flight = self._peak = 0  # requests being answered now, and at most
        self._outage: Outage | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.StreamWriter] = set()

    # ------------------------------------------------------------------ life cycle
    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy."""
        return f"http://{HOST}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """The store's fsspec options with the proxy as endpoint."""
        return {**self._options, "endpoint_url": self.endpoint}

    def start(self) -> FaultProxy:
        """Start the loop thread and listen; return self."""
        if self._thread is not None:
            raise RuntimeError("the proxy is already running")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"faultproxy->{self.upstream}", daemon=True
        )
        self._thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        """Close every connection, stop the loop and join its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(LOOP_DEADLINE)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Any) -> Any:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the proxy is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(LOOP_DEADLINE)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, HOST, self.port, reuse_address=True, limit=HEAD_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close_listener(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _cut_clients(self) -> None:
        for writer in list(self._clients):
            _hang_up(writer)
        self._clients.clear()

    async def _shutdown(self) -> None:
        await self._close_listener()
        self._cut_clients()
        await asyncio.sleep(0)  # let the handlers see their connections go

    # ------------------------------------------------------------------ outages
    def down(self, how: Outage = "refuse") -> None:
        """Simulate a store that is down: ``"refuse"`` new connections (the listening socket
        is closed) or ``"close"`` each at once; connections already open are cut."""
        if how not in ("refuse", "close"):
            raise ValueError(f"how must be 'refuse' or 'close', got {how!r}")
        self._call(self._go_down(how))

    async def _go_down(self, how: Outage) -> None:
        self._outage = how
        if how == "refuse":
            await self._close_listener()
        self._cut_clients()

    def up(self) -> None:
        """End an outage: listen again on the same port and forward as before."""
        self._call(self._go_up())

    async def _go_up(self) -> None:
        self._outage = None
        if self._server is None:
            await self._listen()

    @property
    def is_down(self) -> bool:
        """Whether an outage is on."""
        return self._outage is not None

    @contextlib.contextmanager
    def outage(self, how: Outage = "refuse") -> Iterator[None]:
        """``down(how)`` for the ``with`` block, then ``up()``."""
        self.down(how)
        try:
            yield
        finally:
            self.up()

    # ------------------------------------------------------------------ faults
    def set_faults(self, faults: Faults | None = None, /, **fields: Any) -> None:
        """Inject ``faults`` (or ``Faults(**fields)``) from now on; ``set_faults()`` stops."""
        chosen = replace(faults or NO_FAULTS, **fields)
        if isinstance(chosen.methods, (set, list, tuple)):
            chosen = replace(chosen, methods=frozenset(m.upper() for m in chosen.methods))
        with self._lock:
            self._faults = chosen
            self._injected = 0

    def clear_faults(self) -> None:
        """Stop injecting faults."""
        self.set_faults()

    @contextlib.contextmanager
    def faults(self, faults: Faults | None = None, /, **fields: Any) -> Iterator[None]:
        """``set_faults`` for the ``with`` block, then ``clear_faults``."""
        self.set_faults(faults, **fields)
        try:
            yield
        finally:
            self.clear_faults()

    def seed(self, seed: int) -> None:
        """Reseed the RNG that decides which requests get a fault."""
        with self._lock:
            self._rng.seed(seed)

    def _draw(self, method: str, path: str) -> tuple[Faults, Fault | None]:
        with self._lock:
            faults = self._faults
            if not faults.applies(method, path) or (
                faults.limit is not None and self._injected >= faults.limit
            ):
                return faults, None
            if not (faults.error_rate or faults.drop_rate or faults.truncate_rate):
                return faults, None
            u = self._rng.random()
            fault: Fault | None = None
            if u < faults.error_rate:
                fault = "error"
            elif u < faults.error_rate + faults.drop_rate:
                fault = "drop"
            elif u < faults.error_rate + faults.drop_rate + faults.truncate_rate:
                fault = "truncate"
            if fault is not None:
                self._injected += 1
            return faults, fault

    # ------------------------------------------------------------------ counting
    def exchanges(self) -> list[Exchange]:
        """Every exchange recorded since the start or the last ``reset``, in order of ending."""
        with self._lock:
            return list(self._exchanges)

    def reset(self) -> list[Exchange]:
        """Forget the recorded exchanges (and the counts of connections and peak); return them."""
        with self._lock:
            done, self._exchanges = self._exchanges, []
            self._connections = 0
            self._peak = self._in_flight
        return done

    def peak_in_flight(self) -> int:
        """Most requests being answered at once since the start or the last ``reset``."""
        with self._lock:
            return self._peak

    def select(
        self,
        method: str | None = None,
        contains: str | None = None,
        *,
        status: int | None = None,
        fault: str | None = None,
    ) -> list[Exchange]:
        """The exchanges with this method, path substring, status and fault (None: any)."""
        return [
            e
            for e in self.exchanges()
            if (method is None or e.method == method)
            and (contains is None or contains in e.path)
            and (status is None or e.status == status)
            and (fault is None or e.fault == fault)
        ]

    def count(self, method: str | None = None, contains: str | None = None, **kw: Any) -> int:
        """How many exchanges ``select`` gives."""
        return len(self.select(method, contains, **kw))

    def gets_for(self, contains: str) -> list[Exchange]:
        """The GETs of paths containing ``contains`` (listings are GETs of the bucket)."""
        return self.select("GET", contains)

    def bytes_sent(self, contains: str | None = None, method: str | None = None) -> int:
        """Bytes of response body sent to clients."""
        return sum(e.body_bytes for e in self.select(method, contains))

    def by_method(self) -> Counter[str]:
        """Exchanges per method."""
        return Counter(e.method for e in self.exchanges())

    def faults_injected(self) -> Counter[str]:
        """Exchanges per injected fault (and ``"upstream"`` for an unreachable store)."""
        return Counter(e.fault for e in self.exchanges() if e.fault is not None)

    @property
    def connections(self) -> int:
        """Client connections accepted since the start or the last ``reset``."""
        with self._lock:
            return self._connections

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self._exchanges.append(exchange)

    # ------------------------------------------------------------------ serving
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._outage is not None:
            _hang_up(writer)
            return
        with self._lock:
            self._connections += 1
        self._clients.add(writer)
        upstream = _Upstream(*self._upstream_addr)
        try:
            while self._outage is None:
                request = await _read_request(reader, writer)
                if request is None:
                    break
                if await self._exchange(request, writer, upstream) or request.close:
                    break
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # the client went away or spoke something else: its connection ends
        except _DroppedError:
            pass
        finally:
            upstream.close()
            self._clients.discard(writer)
            _hang_up(writer)

    async def _exchange(
        self, request: _Request, client: asyncio.StreamWriter, upstream: _Upstream
    ) -> bool:
        """Answer one request; True if the client connection must end after it."""
        faults, fault = self._draw(request.method, request.path)
        tally = _Tally(self, request, fault)
        with self._lock:
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
        try:
            if faults.delay and faults.applies(request.method, request.path):
                await asyncio.sleep(faults.delay)
            if fault == "drop":
                raise _DroppedError("drop")
            if fault != "error":
                try:
                    reader, response = await upstream.send(request)
                except _UnreachableError:
                    tally.fault = "upstream"
            if fault == "error" or tally.fault == "upstream":
                status, code = (
                    (faults.error_status, faults.error_code)
                    if fault == "error"
                    else (UNREACHABLE_STATUS, UNREACHABLE_CODE)
                )
                head, body = _error_response(status, code, request.method, request.path)
                tally.status, tally.bytes = status, len(body)
                tally.finish()
                client.write(head + body)
                await client.drain()
                return False
            if fault == "truncate" and response.length == 0:
                tally.fault = "drop"
                raise _DroppedError("drop")
            tally.status = response.status
            if response.length == 0:
                tally.finish()
            client.write(response.raw)
            await _relay_body(reader, client, response, tally)
            await client.drain()
            if response.close:
                upstream.close()
            return response.close
        except _DroppedError as exc:
            tally.fault = tally.fault or str(exc)
            raise
        finally:
            tally.finish()
            with self._lock:
                self._in_flight -= 1


class _Tally:
    """What one exchange sent; recorded by ``finish`` *before* its last bytes go out, so that
    a client that has its answer always finds the exchange in the record."""

    def __init__(self, proxy: FaultProxy, request: _Request, fault: str | None) -> None:
        self.proxy, self.request, self.fault = proxy, request, fault
        self.status: int | None = None
        self.bytes = 0
        self.began = time.monotonic()
        self.done = False

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        r = self.request
        self.proxy._record(
            Exchange(
                method=r.method,
                path=r.path,
                query=r.query,
                range=r.range,
                status=self.status,
                body_bytes=self.bytes,
                fault=self.fault,
                seconds=time.monotonic() - self.began,
            )
        )


async def _relay_body(
    reader: asyncio.StreamReader,
    client: asyncio.StreamWriter,
    response: _ResponseHead,
    tally: _Tally,
) -> None:
    """Stream the response body to the client, counting its bytes; a ``"truncate"`` fault
    sends about half of it (at least one byte short), then ends the exchange with a drop."""
    truncate = tally.fault == "truncate"
    if response.chunked:
        while True:
            raw, size = await _copy_chunk(reader)
            if truncate and tally.bytes > 0:
                raise _DroppedError("truncate")
            tally.bytes += size
            if size == 0:
                tally.finish()
            client.write(raw)
            await client.drain()
            if size == 0:
                return
    remaining = response.length
    cut = None if not truncate or remaining is None else remaining // 2
    while remaining is None or remaining > 0:
        want = CHUNK if remaining is None else min(CHUNK, remaining)
        if cut is not None:
            want = min(want, cut - tally.bytes)
            if want <= 0:
                raise _DroppedError("truncate")
        data = await reader.read(want)
        if not data:
            if remaining is None:
                return  # the body ends with the connection
            raise _DroppedError("upstream")
        tally.bytes += len(data)
        if remaining is not None:
            remaining -= len(data)
            if remaining == 0 and not truncate:
                tally.finish()
        client.write(data)
        await client.drain()
    if truncate:
        raise _DroppedError("truncate")


# ------------------------------------------------------------------------- fixtures
@pytest.fixture
def s3_proxy(s3_store: ObjectStore) -> Iterator[FaultProxy]:
    """A started ``FaultProxy`` in front of the session's S3 store (seed 0, no faults)."""
    with FaultProxy(s3_store.endpoint, s3_store.storage_options) as proxy:
        yield proxy

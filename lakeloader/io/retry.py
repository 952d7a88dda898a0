"""Retrying transient storage failures with exponential backoff, jitter and a deadline.

Failures are classified by type, errno, HTTP status and class name along the chain of causes,
without importing the optional clients. An outage is warned about once, every retry logged.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from lakeloader.errors import StorageRetryWarning, StoreUnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: errno values that mean "try again": s3fs maps 503/SlowDown and 409 to EBUSY, 500 to
#: EREMOTEIO; the rest are the socket's own.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,
        errno.EREMOTEIO,
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.EAGAIN,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)
#: Client exception classes (by qualified name) whose subclasses are all transient.
TRANSIENT_CLASSES = frozenset(
    {
        "botocore.exceptions.ConnectionError",
        "botocore.exceptions.HTTPClientError",
        "aiohttp.client_exceptions.ClientError",
    }
)
#: Failures that no wait can fix, whatever they were raised while handling.
DEFINITIVE = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
#: HTTP statuses worth retrying (request timeout, throttling, server errors).
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: S3 error codes that are throttling or a server's bad moment.
TRANSIENT_S3_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"}
)


class _Outage:
    """How many requests of this process are being retried now; an outage begins at the first."""

    def __init__(self) -> None:
        self._reset()
        # A forked worker starts with no request of its own under way, and a free lock.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._retrying = 0

    def begin(self) -> bool:
        """A request starts being retried: True if it is the first (an outage begins)."""
        with self._lock:
            self._retrying += 1
            return self._retrying == 1

    def end(self) -> None:
        """A request that was retried is over (it succeeded, or failed for good)."""
        with self._lock:
            self._retrying -= 1


_OUTAGE = _Outage()


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often to retry a transient storage failure.

    Attempt ``n`` (from 0) waits a random time in ``[0, min(max_delay, initial_delay * 2**n)]``
    ("full jitter", so that many ranks hitting the same store do not retry in lockstep, and
    never past the deadline), until ``deadline`` seconds have passed since the first attempt
    began (so a first attempt that hangs before it fails counts against the deadline).

    Attributes:
        deadline: Seconds from the first attempt after which a transient failure is no
            longer retried.
        initial_delay: Upper bound of the first wait, in seconds.
        max_delay: Upper bound of any wait, in seconds.

    Example:
        >>> RetryPolicy(deadline=0).call(lambda: 42, "s3://bucket/lake/a.parquet")
        42
    """

    deadline: float = 300.0
    initial_delay: float = 0.25
    max_delay: float = 15.0

    def __post_init__(self) -> None:
        if self.deadline < 0 or self.initial_delay <= 0 or self.max_delay < self.initial_delay:
            raise ValueError(
                "RetryPolicy needs deadline >= 0 and 0 < initial_delay <= max_delay; got "
                f"deadline={self.deadline}, initial_delay={self.initial_delay}, "
                f"max_delay={self.max_delay}"
            )

    def call(self, fn: Callable[[], T], url: str) -> T:
        """Run ``fn``, retrying transient failures until the deadline.

        Args:
            fn: The storage operation.
            url: What it reads or writes, for logs and errors (never credentials).

        Raises:
            StoreUnavailableError: When the deadline passes; names the URL, the number of
                attempts and the last cause (chained).
            Exception: Whatever ``fn`` raised, at once, if it is not transient.
        """
        started = time.monotonic()
        attempt, retrying = 0, False
        try:
            while True:
                try:
                    return fn()
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    elapsed = time.monotonic() - started
                    if elapsed >= self.deadline:
                        raise StoreUnavailableError(
                            f"{url}: the store kept failing for {elapsed:.1f} s over "
                            f"{attempt + 1} attempts (retry deadline {self.deadline:g} s); last "
                            f"cause: {describe(exc)}. Check that the store is up and reachable, "
                            "or raise RetryPolicy(deadline=...); the loader's position is "
                            "unchanged, so a state taken before this error resumes exactly"
                        ) from exc
                    if not retrying:
                        retrying = True
                        if _OUTAGE.begin():  # once per outage, not per request or retry
                            warnings.warn(
                                f"transient storage error on {url} ({describe(exc)}): it and "
                                "every request failing meanwhile are retried for up to "
                                f"{self.deadline:g} s each before StoreUnavailableError is "
                                "raised (RetryPolicy(deadline=...) sets it); each retry is "
                                "logged by the 'lakeloader' logger",
                                StorageRetryWarning,
                                stacklevel=2,  # call(), the caller of call()
                            )
                    cap = min(self.max_delay, self.initial_delay * 2.0**attempt)
                    delay = min(random.uniform(0.0, cap), self.deadline - elapsed)
                    logger.warning(
                        "transient storage error on %s (%s); retry %d in %.2f s",
                        url,
                        describe(exc),
                        attempt + 1,
                        delay,
                    )
                    time.sleep(delay)
                    attempt += 1
        finally:
            if retrying:
                _OUTAGE.end()


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then each ``__cause__`` (else ``__context__``) of the one before."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def response_of(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and the S3 error code of an error (or None).

    The status is an int ``code`` (gcsfs, direct reads), else a botocore ``response``'s.
    """
    response = getattr(exc, "response", None)
    response = response if isinstance(response, dict) else {}
    status = getattr(exc, "code", None)
    if not isinstance(status, int):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    s3 = response.get("Error", {}).get("Code")
    return (status if isinstance(status, int) else None), (None if s3 is None else str(s3))


def is_transient(exc: BaseException) -> bool:
    """Whether waiting and retrying could make this failure go away.

    The exception and its causes are examined (s3fs chains botocore's error as the cause of
    the ``OSError`` it raises).

    >>> is_transient(ConnectionRefusedError(111, "refused"))
    True
    >>> is_transient(OSError(errno.EBUSY, "SlowDown"))
    True
    >>> is_transient(FileNotFoundError("s3://bucket/a.parquet"))
    False
    >>> is_transient(ValueError("Parquet magic bytes not found"))
    False
    """
    for current in causes(exc):
        if isinstance(current, DEFINITIVE):
            return False
        if isinstance(current, ConnectionError | TimeoutError):
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        if {f"{c.__module__}.{c.__qualname__}" for c in type(current).__mro__} & TRANSIENT_CLASSES:
            return True
        status, s3_code = response_of(current)
        if status in TRANSIENT_STATUSES or s3_code in TRANSIENT_S3_CODES:
            return True
    return False

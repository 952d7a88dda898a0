"""Refused access: telling it from other failures, and where credentials come from."""

from __future__ import annotations

from typing import Final

from lakeloader.errors import StoreAccessError
from lakeloader.io.retry import causes, describe

#: Exception classes of the clients (botocore, google-auth) that mean "no access".
_REFUSALS: Final = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "DefaultCredentialsError",
        "RefreshError",
    }
)

#: Where each protocol's credentials come from: storage_options keys, environment variables.
_SOURCES: Final = {
    "s3": (
        "key, secret and token (or profile)",
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE",
    ),
    "gs": (
        "token (a service-account JSON file, 'google_default' or 'anon')",
        "GOOGLE_APPLICATION_CREDENTIALS",
    ),
}
_SOURCES["s3a"] = _SOURCES["s3"]
_SOURCES["gcs"] = _SOURCES["gs"]


def refused(exc: BaseException) -> bool:
    """Whether an error (or one of its causes) means the store refused access.

    >>> refused(PermissionError("Forbidden")), refused(FileNotFoundError("gone"))
    (True, False)
    """
    return any(
        isinstance(seen, PermissionError)
        or type(seen).__name__ in _REFUSALS
        or getattr(seen, "code", None) in (401, 403)  # gcsfs' HttpError
        for seen in causes(exc)
    )


def access_error(url: str, exc: BaseException, needs: str = "list and read") -> StoreAccessError:
    """The error for a refused request: the URL, what was refused, where credentials come from.

    >>> str(access_error("s3://b/run", PermissionError("Forbidden"), "write"))[:60]
    's3://b/run: the store refused access (PermissionError: Forbi'
    """
    protocol = url.split("://", 1)[0] if "://" in url else ""
    keys, env = _SOURCES.get(protocol, ("the client's credential options", "the client's"))
    return StoreAccessError(
        f"{url}: the store refused access ({describe(exc)}). Credentials come from "
        f"storage_options ({keys}) or the environment ({env}); check that they are set, "
        f"valid, and may {needs} this location. Not retried: a refusal does not pass"
    )

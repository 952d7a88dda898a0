"""Storage options for the table libraries, from the fsspec ones every ``LakeDataset`` takes.

One dict of fsspec (s3fs) options serves ``deltalake`` (object_store keys), pyiceberg (``s3.*``
properties) and fsspec; keys already in a library's own spelling (upper-case, or dotted) are
passed to that library as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The region given when none is: object_store and pyarrow otherwise ask AWS for it.
DEFAULT_REGION = "us-east-1"


def _s3_settings(options: Mapping[str, Any]) -> dict[str, str]:
    """Endpoint, credentials and region from s3fs options (absent ones left out)."""
    client = dict(options.get("client_kwargs") or {})
    found = {
        "endpoint": options.get("endpoint_url") or client.get("endpoint_url"),
        "key": options.get("key") or client.get("aws_access_key_id"),
        "secret": options.get("secret") or client.get("aws_secret_access_key"),
        "token": options.get("token") or client.get("aws_session_token"),
        "region": client.get("region_name") or options.get("region_name"),
    }
    return {k: str(v) for k, v in found.items() if v}


def _own(options: Mapping[str, Any], upper: bool) -> dict[str, Any]:
    """The keys already spelled for a table library: upper-case ones, or dotted ones."""
    return {k: v for k, v in options.items() if (k.isupper() if upper else "." in k)}


def fsspec_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The fsspec options among ``options``, and those the table libraries' keys imply.

    Endpoint, credentials and region given only as object_store keys (``AWS_*``, as
    ``deltalake`` takes them) or pyiceberg properties (``s3.*``) serve s3fs too; fsspec's own
    keys win over them.

    >>> fsspec_options({"key": "k", "s3.region": "x"})
    {'client_kwargs': {'region_name': 'x'}, 'key': 'k'}
    >>> fsspec_options({"AWS_ACCESS_KEY_ID": "k", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    {'key': 'k', 'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9'}}
    """
    plain = {k: v for k, v in options.items() if not k.isupper() and "." not in k}
    upper = _own(options, upper=True)
    spelled = {name: upper[key] for key, name in _OBJECT_STORE.items() if key in upper}
    dotted = {f"s3.{_ICEBERG[name]}": value for name, value in spelled.items()}
    implied = from_iceberg_properties({**dotted, **_own(options, upper=False)})
    return {**implied, **plain}


#: Each S3 setting's object_store key, and its pyiceberg property (after ``s3.``).
_SPELLINGS = {
    "endpoint": ("AWS_ENDPOINT_URL", "endpoint"),
    "key": ("AWS_ACCESS_KEY_ID", "access-key-id"),
    "secret": ("AWS_SECRET_ACCESS_KEY", "secret-access-key"),
    "token": ("AWS_SESSION_TOKEN", "session-token"),
    "region": ("AWS_REGION", "region"),
}
_DELTA = {name: key for name, (key, _) in _SPELLINGS.items()}
_ICEBERG = {name: prop for name, (_, prop) in _SPELLINGS.items()}
#: object_store's S3 keys, by what they give.
_OBJECT_STORE = {key: name for name, key in _DELTA.items()} | {"AWS_ENDPOINT": "endpoint"}


def delta_options(options: Mapping[str, Any]) -> dict[str, str]:
    """object_store options for ``deltalake`` from fsspec (s3fs) options.

    >>> delta_options({"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'AWS_ENDPOINT_URL': 'http://127.0.0.1:9', 'AWS_ACCESS_KEY_ID': 'k',
     'AWS_SECRET_ACCESS_KEY': 's', 'AWS_REGION': 'us-east-1', 'AWS_ALLOW_HTTP': 'true'}
    """
    s3 = _s3_settings(options)
    out = {_DELTA[k]: v for k, v in s3.items()}
    if s3:
        out.setdefault("AWS_REGION", DEFAULT_REGION)
    if s3.get("endpoint", "").startswith("http://"):
        out["AWS_ALLOW_HTTP"] = "true"
    out.update({k: str(v) for k, v in _own(options, upper=True).items()})
    return out


def iceberg_properties(options: Mapping[str, Any]) -> dict[str, str]:
    """The FileIO properties of pyiceberg from fsspec (s3fs) options.

    >>> iceberg_properties({"key": "k", "secret": "s"})
    {'s3.access-key-id': 'k', 's3.secret-access-key': 's', 's3.region': 'us-east-1'}
    """
    s3 = _s3_settings(options)
    out = {f"s3.{_ICEBERG[k]}": v for k, v in s3.items()}
    if s3:
        out.setdefault("s3.region", DEFAULT_REGION)
    out.update({k: str(v) for k, v in _own(options, upper=False).items()})
    return out


def from_iceberg_properties(properties: Mapping[str, str]) -> dict[str, Any]:
    """s3fs options from pyiceberg's S3 properties (the endpoint and credentials).

    >>> from_iceberg_properties({"s3.endpoint": "http://127.0.0.1:9", "s3.access-key-id": "k"})
    {'key': 'k', 'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9'}}
    """
    keys = {name: f"s3.{_ICEBERG[name]}" for name in ("key", "secret", "token")}
    out: dict[str, Any] = {k: properties[p] for k, p in keys.items() if p in properties}
    client_keys = {"endpoint_url": "s3.endpoint", "region_name": "s3.region"}
    client = {k: properties[p] for k, p in client_keys.items() if p in properties}
    if client:
        out["client_kwargs"] = client
    return out

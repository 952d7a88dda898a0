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
#: Each S3 setting's object_store key and pyiceberg property.
_SPELLINGS = {
    "endpoint": ("AWS_ENDPOINT_URL", "s3.endpoint"),
    "key": ("AWS_ACCESS_KEY_ID", "s3.access-key-id"),
    "secret": ("AWS_SECRET_ACCESS_KEY", "s3.secret-access-key"),
    "token": ("AWS_SESSION_TOKEN", "s3.session-token"),
    "region": ("AWS_REGION", "s3.region"),
}
#: object_store's S3 keys, by what they give.
_OBJECT_STORE = {key: name for name, (key, _) in _SPELLINGS.items()} | {"AWS_ENDPOINT": "endpoint"}


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


def _spelled(options: Mapping[str, Any], upper: bool) -> dict[str, str]:
    """The S3 settings of s3fs options as object_store keys (``upper``) or pyiceberg ones.

    The region defaults to :data:`DEFAULT_REGION`; keys already in the library's own spelling
    (upper-case, or dotted) are added as they are.
    """
    at = 0 if upper else 1
    out = {_SPELLINGS[k][at]: v for k, v in _s3_settings(options).items()}
    if out:
        out.setdefault(_SPELLINGS["region"][at], DEFAULT_REGION)
    if upper and out.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        out["AWS_ALLOW_HTTP"] = "true"
    own = {k: str(v) for k, v in options.items() if (k.isupper() if upper else "." in k)}
    return {**out, **own}


def _as_fsspec(found: Mapping[str, Any]) -> dict[str, Any]:
    """s3fs options from S3 settings by name (endpoint and region go in ``client_kwargs``)."""
    out: dict[str, Any] = {k: found[k] for k in ("key", "secret", "token") if k in found}
    client_keys = {"endpoint_url": "endpoint", "region_name": "region"}
    client = {k: found[name] for k, name in client_keys.items() if name in found}
    if client:
        out["client_kwargs"] = client
    return out


def fsspec_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The fsspec options among ``options``, and those the table libraries' keys imply.

    Endpoint, credentials and region given only as object_store keys (``AWS_*``, as
    ``deltalake`` takes them) or pyiceberg properties (``s3.*``) serve s3fs too; fsspec's own
    keys win over them, and pyiceberg's over object_store's.

    >>> fsspec_options({"key": "k", "s3.region": "x"})
    {'client_kwargs': {'region_name': 'x'}, 'key': 'k'}
    >>> fsspec_options({"AWS_ACCESS_KEY_ID": "k", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    {'key': 'k', 'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9'}}
    """
    plain = {k: v for k, v in options.items() if not k.isupper() and "." not in k}
    found = {name: options[key] for key, name in _OBJECT_STORE.items() if key in options}
    found |= {name: options[prop] for name, (_, prop) in _SPELLINGS.items() if prop in options}
    return {**_as_fsspec(found), **plain}


def delta_options(options: Mapping[str, Any]) -> dict[str, str]:
    """object_store options for ``deltalake`` from fsspec (s3fs) options.

    >>> delta_options({"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'AWS_ENDPOINT_URL': 'http://127.0.0.1:9', 'AWS_ACCESS_KEY_ID': 'k',
     'AWS_SECRET_ACCESS_KEY': 's', 'AWS_REGION': 'us-east-1', 'AWS_ALLOW_HTTP': 'true'}
    """
    return _spelled(options, upper=True)


def iceberg_properties(options: Mapping[str, Any]) -> dict[str, str]:
    """The FileIO properties of pyiceberg from fsspec (s3fs) options.

    >>> iceberg_properties({"key": "k", "secret": "s"})
    {'s3.access-key-id': 'k', 's3.secret-access-key': 's', 's3.region': 'us-east-1'}
    """
    return _spelled(options, upper=False)


def from_iceberg_properties(properties: Mapping[str, str]) -> dict[str, Any]:
    """s3fs options from pyiceberg's S3 properties (endpoint, credentials, region).

    >>> from_iceberg_properties({"s3.endpoint": "http://127.0.0.1:9", "s3.access-key-id": "k"})
    {'key': 'k', 'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9'}}
    """
    return _as_fsspec({n: properties[p] for n, (_, p) in _SPELLINGS.items() if p in properties})

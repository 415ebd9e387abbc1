"""From a backend URL (``s3://bucket/prefix`` or ``file:///path``) to an object store."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlparse

from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.stores.base import ObjectStore

SCHEMES = ("s3", "file")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def store_from_url(url: str, **options: Any) -> ObjectStore:
    """Open the store a backend URL names.

    ``options`` go to the store's constructor. For S3 (:class:`~airflow_stateful.core.stores.s3.S3ObjectStore`):
    ``endpoint_url``, ``region_name``, credentials, ``profile_name``, ``role_arn``/``assume_role_kwargs``/
    ``sts_endpoint_url``, ``verify``, ``config_kwargs``, ``server_side_encryption``, ``sse_kms_key_id``,
    ``bucket_key_enabled``, ``expected_bucket_owner`` or a ready ``client``; every one is checked before the
    first request. For a directory: ``fsync``. Without credentials, S3 uses boto3's standard chain.
    S3 options given for a ``file://`` URL are an error, not ignored: encryption or an expected owner that
    silently did nothing would be worse.
    """
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"backend_url must be a non-empty string, not {url!r}")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigurationError(
                f"backend_url {url!r}: file URLs need an absolute path, e.g. file:///var/state"
            )
        path = unquote(parsed.path)
        if not path.startswith("/"):
            raise ConfigurationError(
                f"backend_url {url!r}: file URLs need an absolute path, e.g. file:///var/state"
            )
        from airflow_stateful.core.stores.local import LocalObjectStore

        s3_only = sorted(set(options) - {"fsync"})
        if s3_only:
            raise ConfigurationError(
                f"backend_url {url!r} is a local directory; the S3 option(s) {', '.join(s3_only)} do not apply"
            )
        return LocalObjectStore(root=path, **options)
    if parsed.scheme == "s3":
        rest = url[len("s3://") :] if url.lower().startswith("s3://") else parsed.netloc + parsed.path
        authority = rest.split("/", 1)[0]
        if "@" in rest or ":" in authority:
            # Never echo the URL: a secret key may sit anywhere in it (AWS secret keys contain '/').
            bucket = rest.rpartition("@")[2].split("/", 1)[0] if "@" in rest else ""
            named = f" for bucket {bucket!r}" if _BUCKET_RE.fullmatch(bucket) else ""
            raise ConfigurationError(
                f"backend_url{named} must not carry credentials (user:password@ or ':' in the bucket); put "
                "them in the Airflow connection (conn_id) or the AWS credential chain. The URL is not "
                "repeated here because it may hold a secret."
            )
        if not parsed.netloc:
            raise ConfigurationError(f"backend_url {url!r} has no bucket; use s3://bucket/prefix")
        if not _BUCKET_RE.fullmatch(parsed.netloc):
            raise ConfigurationError(
                f"backend_url {url!r}: {parsed.netloc!r} is not a valid S3 bucket name (3-63 characters: "
                "lower-case letters, digits, '.' and '-')."
            )
        if parsed.query or parsed.fragment:
            raise ConfigurationError(f"backend_url {url!r} must not carry a query or a fragment.")
        prefix = unquote(parsed.path).strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ConfigurationError(f"backend_url {url!r} has an invalid prefix {prefix!r}")
        try:
            from airflow_stateful.core.stores.s3 import S3ObjectStore
        except ImportError as exc:  # pragma: no cover - boto3 is a dependency
            raise ConfigurationError("s3:// backends need boto3: pip install boto3") from exc
        return S3ObjectStore(bucket=parsed.netloc, prefix=prefix, **options)
    raise ConfigurationError(
        f"backend_url {url!r} has the unsupported scheme {parsed.scheme!r}; use one of "
        + ", ".join(f"{s}://" for s in SCHEMES)
    )

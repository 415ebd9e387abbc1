"""An Airflow ``aws`` connection read into S3 store options, the amazon provider's way, without importing Airflow.

Apart from :class:`~airflow_stateful.hooks.state.StateHook` so that the CLI can open a store from a connection
given in the environment (``AIRFLOW_CONN_<ID>``) without paying for Airflow's import (seconds per command), and
both read a connection the same way: the hook hands over the fields of the connection Airflow found, the CLI the
fields of the one it parsed (:func:`connection_from_env`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlparse, urlsplit

from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.stores.s3_options import (
    check_assume_role,
    check_config_kwargs,
    check_request_args,
    check_verify,
)

# The amazon provider's `aws` connection, read key by key; anything else in the extra is ignored (never passed
# through), so a connection shared with the amazon provider's own hooks keeps working. Values are checked
# (airflow_stateful.core.stores.s3_options) before the store is built, with errors naming the extra key.
_TEXT_EXTRAS = ("region_name", "profile_name", "role_arn", "endpoint_url", "addressing_style")
#: service_config.s3.extra_args -> S3ObjectStore argument. These are boto3's names, the ones S3Hook's
#: `extra_args` takes: the amazon provider has no connection-level setting for encryption or the owner.
EXTRA_ARGS = {
    "ServerSideEncryption": "server_side_encryption",
    "SSEKMSKeyId": "sse_kms_key_id",
    "BucketKeyEnabled": "bucket_key_enabled",
    "ExpectedBucketOwner": "expected_bucket_owner",
}
_WHERE = {
    "server_side_encryption": "service_config.s3.extra_args.ServerSideEncryption",
    "sse_kms_key_id": "service_config.s3.extra_args.SSEKMSKeyId",
    "bucket_key_enabled": "service_config.s3.extra_args.BucketKeyEnabled",
    "expected_bucket_owner": "service_config.s3.extra_args.ExpectedBucketOwner",
}
_SESSION_NAME_INVALID = re.compile(r"[^\w+=,.@-]")


def _mapping(parent: dict[str, Any], key: str, *, what: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigurationError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _text(parent: dict[str, Any], key: str, *, what: str, secret: bool = False) -> str | None:
    value = parent.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        shown = type(value).__name__ if secret else repr(value)
        raise ConfigurationError(f"{what} must be a string, not {shown}")
    return value


@dataclass(frozen=True)
class ConnectionFields:
    """What the store needs of a connection. The password never shows in ``repr`` (nor in any message)."""

    conn_id: str
    login: str | None = None
    password: str | None = field(default=None, repr=False)
    host: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)


def connection_source(conn_id: str, options: dict[str, Any]) -> str:
    """Where the credentials of a store opened from connection ``conn_id`` come from, in words (for errors)."""
    if "aws_access_key_id" in options:
        return f"the connection {conn_id!r}"
    if options.get("profile_name"):
        return f"AWS profile {options['profile_name']!r}, named by the connection {conn_id!r}"
    return f"boto3's standard credential chain: the connection {conn_id!r} holds no key"


def missing_connection_source(conn_id: str) -> str:
    """The same, when the connection ``conn_id`` does not exist (boto3's chain is used instead)."""
    return (
        f"boto3's standard credential chain (the connection {conn_id!r} that [stateful] conn_id or --conn-id "
        "names does not exist: mistyped?)"
    )


def s3_options(conn: ConnectionFields) -> dict[str, Any]:
    """S3 store options from the ``aws`` connection ``conn``.

    Read the amazon provider's way, so a connection made for its hooks works here unchanged: keys from
    login/password (else the extra's ``aws_access_key_id``/``aws_secret_access_key``), ``aws_session_token``,
    ``region_name``, ``profile_name``, ``role_arn`` with ``assume_role_method`` (``assume_role`` only) and
    ``assume_role_kwargs``, ``verify``, ``config_kwargs``, and the endpoints: ``service_config.s3.endpoint_url``,
    else ``endpoint_url`` (else an http(s) host), with STS at ``service_config.sts.endpoint_url``.
    Encryption and the expected owner are ``service_config.s3.extra_args`` in boto3's names
    (:data:`EXTRA_ARGS`). Every value is checked here, before anything is written; an error names the
    connection and the extra key, never a secret.

    The result holds the connection's secrets: it goes to the store's constructor and nowhere else.
    """
    name = f"connection {conn.conn_id!r}"

    def where(key: str) -> str:
        return f"{name} extra {key}"

    extra = conn.extra
    if not isinstance(extra, dict):
        raise ConfigurationError(f"{name}: the extra must be a JSON object")
    service = _mapping(extra, "service_config", what=where("service_config"))
    s3_service = _mapping(service, "s3", what=where("service_config.s3"))
    sts_service = _mapping(service, "sts", what=where("service_config.sts"))
    extra_args = _mapping(s3_service, "extra_args", what=where("service_config.s3.extra_args"))

    options: dict[str, Any] = {}
    # Credentials, in the amazon provider's order: both of login/password, else both from the extra.
    if conn.login and conn.password:
        options["aws_access_key_id"], options["aws_secret_access_key"] = conn.login, conn.password
    else:
        key_id = _text(extra, "aws_access_key_id", what=where("aws_access_key_id"))
        secret = _text(extra, "aws_secret_access_key", what=where("aws_secret_access_key"), secret=True)
        if key_id and secret:
            options["aws_access_key_id"], options["aws_secret_access_key"] = key_id, secret
    token = _text(extra, "aws_session_token", what=where("aws_session_token"), secret=True)
    if token:
        options["aws_session_token"] = token
    for key in _TEXT_EXTRAS:
        value = _text(extra, key, what=where(key))
        if value:
            options[key] = value
    # The service's own endpoint wins over the global one, as in the amazon provider.
    endpoint = _text(s3_service, "endpoint_url", what=where("service_config.s3.endpoint_url"))
    if endpoint:
        options["endpoint_url"] = endpoint
    if "endpoint_url" not in options and conn.host and urlparse(conn.host).scheme in ("http", "https"):
        options["endpoint_url"] = conn.host
    sts_endpoint = _text(sts_service, "endpoint_url", what=where("service_config.sts.endpoint_url"))
    if sts_endpoint:
        options["sts_endpoint_url"] = sts_endpoint
    if extra.get("verify") is not None:
        options["verify"] = check_verify(extra["verify"], source=where)
    if extra.get("config_kwargs") is not None:
        options["config_kwargs"] = check_config_kwargs(extra["config_kwargs"], source=where)
    _assume_role_options(conn.conn_id, extra, options, where)

    unknown = sorted(str(k) for k in extra_args if k not in EXTRA_ARGS)
    if unknown:
        raise ConfigurationError(
            f"{where('service_config.s3.extra_args')} has the unsupported key(s) "
            f"{', '.join(map(repr, unknown))}; accepted: {', '.join(EXTRA_ARGS)}"
        )
    for key, option in EXTRA_ARGS.items():
        if extra_args.get(key) is not None:
            options[option] = extra_args[key]

    def source(option: str) -> str:
        return where(_WHERE[option])

    check_request_args(options, source=source)
    return options


def _assume_role_options(conn_id: str, extra: dict[str, Any], options: dict[str, Any], where: Any) -> None:
    """``role_arn``, ``assume_role_method`` and ``assume_role_kwargs``, as the amazon provider reads them."""
    role_arn = options.get("role_arn")
    if not role_arn:
        return
    method = extra.get("assume_role_method") or "assume_role"
    if method != "assume_role":
        raise ConfigurationError(
            f"{where('assume_role_method')} {method!r} is not supported here, only 'assume_role'. For web "
            "identity (IRSA, EKS pod identity), leave role_arn out: boto3's standard chain reads "
            "AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE by itself."
        )
    kwargs = dict(_mapping(extra, "assume_role_kwargs", what=where("assume_role_kwargs")))
    # The amazon provider's default session name, so CloudTrail shows the same one for both.
    default_name = _SESSION_NAME_INVALID.sub("", f"Airflow_{conn_id}")[:64]
    kwargs.setdefault("RoleSessionName", default_name)
    check_assume_role(role_arn, kwargs, source=where)
    options["assume_role_kwargs"] = kwargs


def connection_from_env(conn_id: str, text: str) -> ConnectionFields | None:
    """The connection ``AIRFLOW_CONN_<ID>`` holds, parsed as Airflow parses it (its JSON form, or a URI
    ``aws://LOGIN:PASSWORD@HOST:PORT/SCHEMA?EXTRA``); ``None`` for a URI this reader does not handle (a host
    that carries its own scheme, ``aws://http://...``), which the caller then leaves to Airflow.

    tests/test_cli_light.py checks every form against Airflow's own ``Connection``.
    """
    name = f"connection {conn_id!r} (environment variable AIRFLOW_CONN_{conn_id.upper()})"
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{name} is not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(data, dict):
            raise ConfigurationError(f"{name} must be a JSON object or a URI")
        extra = data.get("extra") or {}
        if isinstance(extra, str):
            extra = _json_extra(extra, name)
        return ConnectionFields(
            conn_id=conn_id,
            login=_field(data, "login", name),
            password=_field(data, "password", name),
            host=_field(data, "host", name),
            extra=extra,
        )
    if text.count("://") != 1:
        return None
    scheme = urlsplit(text).scheme
    parts = urlsplit(text.replace(f"{scheme}://", "//", 1))
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if "__extra__" in query:
        extra = _json_extra(query["__extra__"], name)
    else:
        extra = {}
        for key, value in query.items():
            try:
                extra[key] = json.loads(value) if value else value
            except ValueError:
                extra[key] = value
    return ConnectionFields(
        conn_id=conn_id,
        login=unquote(parts.username) if parts.username else parts.username,
        password=unquote(parts.password) if parts.password else parts.password,
        host=unquote(parts.hostname or ""),
        extra=extra,
    )


def _json_extra(text: str, name: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except ValueError:
        raise ConfigurationError(f"{name}: its extra is not valid JSON") from None
    if not isinstance(extra, dict):
        raise ConfigurationError(f"{name}: its extra must be a JSON object")
    return extra


def _field(data: dict[str, Any], key: str, name: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, (str, int)):
        raise ConfigurationError(f"{name}: {key} must be a string, not {type(value).__name__}")
    return str(value)

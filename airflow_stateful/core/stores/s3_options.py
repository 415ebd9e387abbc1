"""The S3 options of an enterprise bucket, checked before the first request: encryption, owner, TLS, botocore.

The names are the ones users already know from Airflow's amazon provider (its ``aws`` connection and its
``S3Hook(extra_args=...)``), never new ones:

* ``server_side_encryption``, ``sse_kms_key_id``, ``bucket_key_enabled`` and ``expected_bucket_owner`` are
  boto3's ``ServerSideEncryption``, ``SSEKMSKeyId``, ``BucketKeyEnabled`` and ``ExpectedBucketOwner``, the
  keys of ``S3Hook``'s ``extra_args``. Encryption goes on every ``PutObject`` and ``CreateMultipartUpload``
  (parts inherit it); the owner goes on every request, reads and deletes included.
* ``verify`` and ``config_kwargs`` are the connection extras of the same names: TLS verification (a bool or a
  CA bundle path) and the keyword arguments of :class:`botocore.config.Config`.

Every check raises :class:`~airflow_stateful.core.errors.ConfigurationError` naming the option (as its
caller spells it: a connection extra, a ``STATEFUL_*`` variable or a keyword argument) and the bad value, so
a typo fails before anything is written rather than as an S3 error halfway through a commit. Values are
echoed only where they are not secret: a proxy URL may carry a password and is never repeated.

No Airflow import here: pods run this with only boto3.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow_stateful.core.errors import ConfigurationError

if TYPE_CHECKING:
    from botocore.config import Config

Source = Callable[[str], str]
"""How a caller names an option in an error: ``sse_kms_key_id`` -> ``STATEFUL_S3_SSE_KMS_KEY_ID``, ..."""

SSE_ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")
"""S3's server-side encryption algorithms: SSE-S3, SSE-KMS and dual-layer SSE-KMS."""
KMS_ALGORITHMS = ("aws:kms", "aws:kms:dsse")
ADDRESSING_STYLES = ("auto", "path", "virtual")
DEFAULT_RETRIES = {"mode": "standard", "max_attempts": 5}
"""botocore's retries unless ``config_kwargs`` says otherwise: standard mode (exponential backoff with jitter,
a retry quota per client), 6 attempts in all (botocore reads ``max_attempts`` as *retries* here). S3 throttles
with 503 SlowDown under load and answers an occasional 500 or reset; six attempts ride those out, and
botocore's retry quota stops a client from hammering an endpoint that keeps failing."""
DEFAULT_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 20}
"""botocore's timeouts unless ``config_kwargs`` says otherwise (its own defaults are 60 s each).

With them a request to an endpoint that accepts connections and never answers (or never accepts them) gives
up after at most 6 attempts x (5 s + 20 s) = 150 s plus under 2 s of backoff, a quarter of the default lease
ttl (600 s): the lease heartbeat gets its answer, and a commit its error, long before the lease could expire
unnoticed. The read timeout bounds every wait for the next bytes (an answer, or room to send), not a whole
transfer, so a large part moving slowly but steadily is never cut off; on S3 even a slow answer comes within
a few seconds. See docs/reliability.md."""
WORKER_ONLY_CONFIG_KWARGS = frozenset({"proxies", "proxies_config", "client_cert"})
"""``config_kwargs`` that describe the worker, not the bucket: never given to a pod. A proxy URL may hold a
password, and the certificate paths are files on the worker, not in the pod's image."""

_OWNER_RE = re.compile(r"^[0-9]{12}$")
_KMS_KEY_RE = re.compile(r"^\S{1,2048}$")


def _same(option: str) -> str:
    return option


def _one_of(value: object, choices: tuple[str, ...], *, what: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigurationError(f"{what} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _bool(value: object, *, what: str) -> bool:
    if not isinstance(value, bool):
        hint = " (write true or false without quotes)" if isinstance(value, str) else ""
        raise ConfigurationError(f"{what} must be true or false, not {value!r}{hint}")
    return value


def check_encryption(
    server_side_encryption: object = None,
    sse_kms_key_id: object = None,
    bucket_key_enabled: object = None,
    *,
    source: Source = _same,
) -> dict[str, Any]:
    """The SSE arguments of every ``PutObject`` and ``CreateMultipartUpload``; ``{}`` leaves it to the bucket.

    A KMS key id or a bucket-key flag only means something with SSE-KMS, so giving one without
    ``server_side_encryption="aws:kms"`` is an error rather than a setting silently dropped. (Bucket keys are
    not available with dual-layer ``aws:kms:dsse``.) Without a key id, SSE-KMS uses the account's
    AWS-managed key ``aws/s3``.
    """
    args: dict[str, Any] = {}
    if server_side_encryption is not None:
        args["ServerSideEncryption"] = _one_of(
            server_side_encryption, SSE_ALGORITHMS, what=source("server_side_encryption")
        )
    if sse_kms_key_id is not None:
        if not isinstance(sse_kms_key_id, str) or not _KMS_KEY_RE.fullmatch(sse_kms_key_id):
            raise ConfigurationError(
                f"{source('sse_kms_key_id')} must be a KMS key id, key ARN or alias, not {sse_kms_key_id!r}"
            )
        if args.get("ServerSideEncryption") not in KMS_ALGORITHMS:
            raise ConfigurationError(
                f"{source('sse_kms_key_id')} {sse_kms_key_id!r} needs {source('server_side_encryption')} "
                f"aws:kms or aws:kms:dsse, not {server_side_encryption!r}"
            )
        args["SSEKMSKeyId"] = sse_kms_key_id
    if bucket_key_enabled is not None:
        flag = _bool(bucket_key_enabled, what=source("bucket_key_enabled"))
        if args.get("ServerSideEncryption") != "aws:kms":
            raise ConfigurationError(
                f"{source('bucket_key_enabled')} {flag!r} needs {source('server_side_encryption')} aws:kms "
                f"(S3 bucket keys are for SSE-KMS only), not {server_side_encryption!r}"
            )
        args["BucketKeyEnabled"] = flag
    return args


def check_expected_bucket_owner(owner: object, *, source: Source = _same) -> dict[str, str]:
    """``{"ExpectedBucketOwner": owner}`` for every request, or ``{}``.

    A string of 12 digits only: an account id written as a JSON number would lose its leading zeros and the
    requests would be refused as if the bucket belonged to someone else.
    """
    if owner is None:
        return {}
    if not isinstance(owner, str) or not _OWNER_RE.fullmatch(owner):
        hint = " (write it as a string: account ids may start with 0)" if isinstance(owner, int) else ""
        raise ConfigurationError(
            f"{source('expected_bucket_owner')} must be a 12-digit AWS account id, not {owner!r}{hint}"
        )
    return {"ExpectedBucketOwner": owner}


def check_request_args(options: Mapping[str, Any], *, source: Source = _same) -> dict[str, Any]:
    """The encryption and owner options of ``options`` (store keyword arguments) as request arguments.

    For callers that gather the options from elsewhere (a connection, ``STATEFUL_S3_*``) and want the error
    now, naming the option their way, rather than when the store is built.
    """
    encryption = check_encryption(
        options.get("server_side_encryption"),
        options.get("sse_kms_key_id"),
        options.get("bucket_key_enabled"),
        source=source,
    )
    return {**encryption, **check_expected_bucket_owner(options.get("expected_bucket_owner"), source=source)}


def check_verify(verify: object, *, source: Source = _same) -> bool | str | None:
    """TLS verification: ``None`` (botocore's default, verify), ``True``, ``False`` or a CA bundle path.

    The strings ``"false"`` and ``"true"`` are refused: botocore would take ``"false"`` for the path of a CA
    bundle and fail at the first request. A path must exist now, not at the first request of a commit.
    """
    if verify is None or isinstance(verify, bool):
        return verify
    what = source("verify")
    if not isinstance(verify, str) or not verify:
        raise ConfigurationError(f"{what} must be true, false or the path of a CA bundle, not {verify!r}")
    if verify.strip().lower() in ("true", "false", "yes", "no", "0", "1"):
        raise ConfigurationError(
            f"{what} must be true, false or the path of a CA bundle, not the string {verify!r} "
            "(write true or false without quotes)"
        )
    if not os.path.exists(verify):
        raise ConfigurationError(f"{what}: the CA bundle {verify!r} does not exist")
    return verify


# -- config_kwargs -> botocore Config ------------------------------------------------------------------------
def _number(value: object, *, what: str, minimum: float, integer: bool = False) -> Any:
    wrong_kind = isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
    if wrong_kind or not isinstance(value, (int, float)) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigurationError(f"{what} must be {kind} >= {minimum:g}, not {value!r}")
    return value


def _mapping(value: object, *, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _keys(value: Mapping[str, Any], allowed: Mapping[str, Any] | frozenset[str], *, what: str) -> None:
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ConfigurationError(
            f"{what} has the unknown key(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(allowed))}"
        )


def _retries(value: object, *, what: str) -> dict[str, Any]:
    retries = _mapping(value, what=what)
    _keys(retries, frozenset({"mode", "max_attempts", "total_max_attempts"}), what=what)
    checked: dict[str, Any] = {}
    if "mode" in retries:
        checked["mode"] = _one_of(retries["mode"], ("legacy", "standard", "adaptive"), what=f"{what}.mode")
    if "max_attempts" in retries:
        checked["max_attempts"] = _number(
            retries["max_attempts"], what=f"{what}.max_attempts", minimum=0, integer=True
        )
    if "total_max_attempts" in retries:
        checked["total_max_attempts"] = _number(
            retries["total_max_attempts"], what=f"{what}.total_max_attempts", minimum=1, integer=True
        )
    return checked


_S3_CONFIG: dict[str, Callable[[object, str], Any]] = {
    "addressing_style": lambda v, what: _one_of(v, ADDRESSING_STYLES, what=what),
    "use_accelerate_endpoint": lambda v, what: _bool(v, what=what),
    "use_dualstack_endpoint": lambda v, what: _bool(v, what=what),
    "payload_signing_enabled": lambda v, what: _bool(v, what=what),
    "use_arn_region": lambda v, what: _bool(v, what=what),
    "us_east_1_regional_endpoint": lambda v, what: _one_of(v, ("legacy", "regional"), what=what),
}


def _s3(value: object, *, what: str) -> dict[str, Any]:
    s3 = _mapping(value, what=what)
    _keys(s3, _S3_CONFIG, what=what)
    return {key: _S3_CONFIG[key](s3[key], f"{what}.{key}") for key in s3}


def _text(value: object, *, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a non-empty string, not {value!r}")
    return value


def _proxies(value: object, *, what: str) -> dict[str, str]:
    proxies = _mapping(value, what=what)
    for key, url in proxies.items():
        if not isinstance(key, str) or not isinstance(url, str):
            # The value is not repeated: a proxy URL may carry a user and password.
            raise ConfigurationError(
                f"{what} maps a scheme to a proxy URL; the entry {key!r} is not a string"
            )
    return dict(proxies)


def _proxies_config(value: object, *, what: str) -> dict[str, Any]:
    config = _mapping(value, what=what)
    _keys(
        config,
        frozenset({"proxy_ca_bundle", "proxy_client_cert", "proxy_use_forwarding_for_https"}),
        what=what,
    )
    return copy.deepcopy(dict(config))


def _client_cert(value: object, *, what: str) -> str | tuple[str, str]:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, str) and v for v in value):
        return (value[0], value[1])
    raise ConfigurationError(f"{what} must be a certificate path or [certificate, key] paths, not {value!r}")


def _signature_version(value: object, *, what: str) -> str:
    text = _text(value, what=what)
    if text == "unsigned":
        raise ConfigurationError(f"{what} 'unsigned' cannot write to a bucket; leave it out (SigV4)")
    return text


_CONFIG_KWARGS: dict[str, Callable[[object, str], Any]] = {
    "connect_timeout": lambda v, what: _number(v, what=what, minimum=0.001),
    "read_timeout": lambda v, what: _number(v, what=what, minimum=0.001),
    "max_pool_connections": lambda v, what: _number(v, what=what, minimum=1, integer=True),
    "retries": lambda v, what: _retries(v, what=what),
    "s3": lambda v, what: _s3(v, what=what),
    "proxies": lambda v, what: _proxies(v, what=what),
    "proxies_config": lambda v, what: _proxies_config(v, what=what),
    "client_cert": lambda v, what: _client_cert(v, what=what),
    "tcp_keepalive": lambda v, what: _bool(v, what=what),
    "user_agent_extra": lambda v, what: _text(v, what=what),
    "user_agent_appid": lambda v, what: _text(v, what=what),
    "signature_version": lambda v, what: _signature_version(v, what=what),
    "use_fips_endpoint": lambda v, what: _bool(v, what=what),
    "use_dualstack_endpoint": lambda v, what: _bool(v, what=what),
    "request_checksum_calculation": lambda v, what: _one_of(
        v, ("when_supported", "when_required"), what=what
    ),
    "response_checksum_validation": lambda v, what: _one_of(
        v, ("when_supported", "when_required"), what=what
    ),
    "defaults_mode": lambda v, what: _one_of(
        v, ("legacy", "standard", "in-region", "cross-region", "mobile", "auto"), what=what
    ),
}
CONFIG_KWARGS = frozenset(_CONFIG_KWARGS)
"""The botocore ``Config`` options accepted in ``config_kwargs`` (read key by key, never passed wholesale)."""


def check_config_kwargs(config_kwargs: object, *, source: Source = _same) -> dict[str, Any]:
    """A checked copy of ``config_kwargs`` (the amazon provider's extra of that name), ``{}`` for ``None``.

    Only the options in :data:`CONFIG_KWARGS`, each with its type and range checked; anything else is an
    error naming the key, not a setting silently ignored or handed to botocore unread.
    """
    if config_kwargs is None:
        return {}
    what = source("config_kwargs")
    kwargs = _mapping(config_kwargs, what=what)
    _keys(kwargs, _CONFIG_KWARGS, what=what)
    return {key: _CONFIG_KWARGS[key](kwargs[key], f"{what}.{key}") for key in kwargs}


def parse_config_kwargs(raw: str, *, what: str) -> dict[str, Any]:
    """``config_kwargs`` from JSON text (a ``STATEFUL_S3_CONFIG_KWARGS`` variable), checked."""
    try:
        value = json.loads(raw)
    except ValueError:
        raise ConfigurationError(f"{what} must be a JSON object, not {raw[:200]!r}") from None
    return check_config_kwargs(value, source=lambda option: what)


def botocore_config(
    config_kwargs: Mapping[str, Any],
    *,
    addressing_style: str | None = None,
    endpoint_url: str | None = None,
    min_pool_connections: int = 10,
) -> Config:
    """The client's botocore ``Config``: the user's ``config_kwargs`` merged with what the store needs.

    The store's needs win only where they must: the connection pool is at least ``min_pool_connections``
    (parallel part uploads and ranged downloads would otherwise wait for a connection, and urllib3 would
    discard the extra ones), retries default to :data:`DEFAULT_RETRIES`, the connect and read timeouts to
    :data:`DEFAULT_TIMEOUTS` (so a hung endpoint cannot hold a task for longer than a fraction of its lease),
    and the addressing style defaults to ``path`` with a custom endpoint (MinIO and friends) and ``auto`` on
    AWS.
    """
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    merged = copy.deepcopy(dict(config_kwargs))
    s3 = dict(merged.get("s3") or {})
    configured_style = s3.get("addressing_style")
    if addressing_style is not None:
        _one_of(addressing_style, ADDRESSING_STYLES, what="addressing_style")
        if configured_style is not None and configured_style != addressing_style:
            raise ConfigurationError(
                f"addressing_style {addressing_style!r} contradicts config_kwargs.s3.addressing_style "
                f"{configured_style!r}; keep one (config_kwargs is the amazon provider's way)"
            )
    s3["addressing_style"] = configured_style or addressing_style or ("path" if endpoint_url else "auto")
    merged["s3"] = s3
    merged.setdefault("retries", dict(DEFAULT_RETRIES))
    # Validate a response's checksum when the request asks (ChecksumMode), not on every GET: the store asks for
    # it on every read except a chunk's, whose SHA-256 the restore checks anyway (S3ObjectStore.get_chunk).
    merged.setdefault("response_checksum_validation", "when_required")
    for option, seconds in DEFAULT_TIMEOUTS.items():
        merged.setdefault(option, seconds)
    merged["max_pool_connections"] = max(int(merged.get("max_pool_connections", 10)), min_pool_connections)
    try:
        return Config(**merged)
    except (BotoCoreError, TypeError, ValueError) as exc:
        raise ConfigurationError(f"config_kwargs: botocore refused the configuration: {exc}") from None


def pod_config_kwargs(
    config_kwargs: Mapping[str, Any], *, addressing_style: str | None = None
) -> dict[str, Any]:
    """The part of ``config_kwargs`` a pod may be given (no proxy, no worker path), the addressing style in it."""
    kept = {k: copy.deepcopy(v) for k, v in config_kwargs.items() if k not in WORKER_ONLY_CONFIG_KWARGS}
    if addressing_style and not (kept.get("s3") or {}).get("addressing_style"):
        kept["s3"] = {**(kept.get("s3") or {}), "addressing_style": addressing_style}
    return kept


# -- assume role -----------------------------------------------------------------------------------------------
ASSUME_ROLE_KWARGS = frozenset(
    {
        "RoleSessionName",
        "ExternalId",
        "DurationSeconds",
        "Policy",
        "PolicyArns",
        "Tags",
        "TransitiveTagKeys",
        "SourceIdentity",
    }
)
"""STS ``AssumeRole`` arguments accepted in ``assume_role_kwargs``. ``SerialNumber``/``TokenCode`` (MFA) are
not: a one-time code cannot renew credentials in the middle of a long task."""
_ROLE_ARN_RE = re.compile(r"^arn:[a-z0-9-]+:iam::[0-9]{12}:role/[\w+=,.@/-]{1,512}$")
_SESSION_NAME_RE = re.compile(r"^[\w+=,.@-]{2,64}$")


def check_assume_role(
    role_arn: object, assume_role_kwargs: object, *, source: Source = _same
) -> dict[str, Any] | None:
    """The ``AssumeRole`` arguments (``RoleArn`` included), or ``None`` without ``role_arn``."""
    if role_arn is None:
        if assume_role_kwargs:
            raise ConfigurationError(f"{source('assume_role_kwargs')} is set but {source('role_arn')} is not")
        return None
    if not isinstance(role_arn, str) or not _ROLE_ARN_RE.fullmatch(role_arn):
        raise ConfigurationError(
            f"{source('role_arn')} must be an IAM role ARN (arn:aws:iam::<account>:role/<name>), not {role_arn!r}"
        )
    what = source("assume_role_kwargs")
    kwargs = dict(_mapping(assume_role_kwargs or {}, what=what))
    unknown = sorted(str(k) for k in kwargs if k not in ASSUME_ROLE_KWARGS)
    if unknown:
        mfa = (
            " (MFA codes cannot renew credentials during a task)"
            if {"SerialNumber", "TokenCode"} & set(unknown)
            else ""
        )
        raise ConfigurationError(
            f"{what} has the unsupported key(s) {', '.join(map(repr, unknown))}{mfa}; "
            f"accepted: {', '.join(sorted(ASSUME_ROLE_KWARGS))}"
        )
    name = kwargs.setdefault("RoleSessionName", "airflow-stateful")
    if not isinstance(name, str) or not _SESSION_NAME_RE.fullmatch(name):
        raise ConfigurationError(
            f"{what}.RoleSessionName must be 2-64 characters of letters, digits and +=,.@_-, not {name!r}"
        )
    if "DurationSeconds" in kwargs:
        _number(kwargs["DurationSeconds"], what=f"{what}.DurationSeconds", minimum=900, integer=True)
    if "ExternalId" in kwargs and (
        not isinstance(kwargs["ExternalId"], str) or len(kwargs["ExternalId"]) < 2
    ):
        # Not repeated: an external id is not a secret in AWS's model, but some teams treat it as one.
        raise ConfigurationError(f"{what}.ExternalId must be a string of 2-1224 characters")
    return {**kwargs, "RoleArn": role_arn}


def parse_bool(raw: str, *, what: str) -> bool:
    """``true``/``false`` (any case) from an environment variable."""
    text = raw.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise ConfigurationError(f"{what} must be true or false, not {raw!r}")


def parse_verify(raw: str, *, what: str) -> bool | str:
    """``STATEFUL_S3_VERIFY``: ``true``, ``false`` or the path of a CA bundle inside the pod's image."""
    text = raw.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    checked = check_verify(text, source=lambda option: what)
    assert checked is not None
    return checked

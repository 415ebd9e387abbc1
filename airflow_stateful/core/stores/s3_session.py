"""Credentials for the S3 client: access keys, a named profile, or an assumed role that renews itself.

This follows the amazon provider's ``aws`` connection (``role_arn``, ``assume_role_kwargs``, ``profile_name``,
``service_config.sts.endpoint_url``) with boto3 and botocore only, so it also runs in pods without Airflow:

* the *source* credentials are the connection's keys, else its ``profile_name``, else boto3's standard chain;
* with ``role_arn``, the S3 client signs with the role's temporary credentials, fetched from STS on the first
  request (building a store costs no request) and fetched again before they expire, so a task that runs for
  longer than the role session (an hour by default) never fails with ``ExpiredToken`` halfway through a commit.

Credentials live only inside botocore's credential objects: nothing here logs, repeats or returns them.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow_stateful.core.errors import ConfigurationError

if TYPE_CHECKING:
    import boto3
    from botocore.config import Config
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

ADVISORY_REFRESH = 5 * 60
"""Seconds before expiry from which a request fetches new role credentials if no other thread is doing so."""
MANDATORY_REFRESH = 2 * 60
"""Seconds before expiry from which every request waits for new role credentials."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def assumed_role_credentials(
    sts_client: Any,
    assume_role_kwargs: Mapping[str, Any],
    *,
    time_fetcher: Callable[[], datetime.datetime] = _now,
) -> Any:
    """botocore credentials for a role, fetched with ``sts_client.assume_role`` when first used and renewed.

    botocore's own windows (renew 15 min, block 10 min before expiry) would call STS before nearly every
    request with a 15-minute role session (STS's shortest); renewing 5 min ahead (2 min blocking) keeps one
    STS call per session while leaving a request minutes of validity.

    :param assume_role_kwargs: the ``AssumeRole`` arguments, ``RoleArn`` and ``RoleSessionName`` included
        (see :func:`~airflow_stateful.core.stores.s3_options.check_assume_role`).
    :param time_fetcher: the clock botocore judges expiry by (tests move it forward).
    """
    from botocore.credentials import DeferredRefreshableCredentials

    class AssumedRoleCredentials(DeferredRefreshableCredentials):
        _advisory_refresh_timeout = ADVISORY_REFRESH
        _mandatory_refresh_timeout = MANDATORY_REFRESH

        def __repr__(self) -> str:
            return f"AssumedRoleCredentials(role_arn={assume_role_kwargs['RoleArn']!r})"

    def fetch() -> dict[str, str]:
        response = sts_client.assume_role(**assume_role_kwargs)
        creds = response["Credentials"]
        log.debug("assumed role %s until %s", assume_role_kwargs["RoleArn"], creds["Expiration"])
        return {
            "access_key": creds["AccessKeyId"],
            "secret_key": creds["SecretAccessKey"],
            "token": creds["SessionToken"],
            "expiry_time": creds["Expiration"].isoformat(),
        }

    return AssumedRoleCredentials(refresh_using=fetch, method="assume-role", time_fetcher=time_fetcher)


def _session_with(credentials: Any, *, region_name: str | None) -> boto3.session.Session:
    """A boto3 session whose only credential source is ``credentials`` (botocore's public resolver API)."""
    import boto3
    import botocore.session
    from botocore.credentials import CredentialProvider, CredentialResolver

    class Fixed(CredentialProvider):
        METHOD = "airflow-stateful-assume-role"

        def load(self) -> Any:
            return credentials

    core = botocore.session.Session()
    core.register_component("credential_provider", CredentialResolver(providers=[Fixed()]))
    return boto3.session.Session(botocore_session=core, region_name=region_name)


SMALL_PUT_BYTES = 64 * 1024
"""PUTs up to this size are sent without ``Expect: 100-continue`` (see :func:`skip_expect_for_small_puts`)."""


def skip_expect_for_small_puts(client: Any) -> None:
    """Send small PUTs (a head, a manifest, a state document) without ``Expect: 100-continue``.

    botocore asks for ``100 Continue`` before every PUT body, so each PUT waits one extra round trip before it
    sends its body: for a head record of a few KiB that is a sizeable share of a small commit. The handshake only
    helps when the server refuses before the body is sent (a 412); sending a few KiB in vain then costs less
    than the round trip on every commit. Larger bodies (chunks, parts) keep it. Nothing else changes: the
    conditions, the checksums and the signature are the same.
    """
    client.meta.events.register(
        "before-send.s3.PutObject", _drop_expect_if_small, unique_id="airflow-stateful-small-put"
    )


def _drop_expect_if_small(request: Any, **_: Any) -> None:
    length = request.headers.get("Content-Length")
    if length is not None and int(length) <= SMALL_PUT_BYTES and "Expect" in request.headers:
        del request.headers["Expect"]


def s3_client(
    *,
    config: Config,
    endpoint_url: str | None = None,
    region_name: str | None = None,
    aws_access_key_id: str | None = None,
    aws_secret_access_key: str | None = None,
    aws_session_token: str | None = None,
    profile_name: str | None = None,
    assume_role: Mapping[str, Any] | None = None,
    sts_endpoint_url: str | None = None,
    verify: bool | str | None = None,
) -> S3Client:
    """The S3 client: source credentials, then (with ``assume_role``) the role's renewing credentials.

    As in the amazon provider, STS is reached at ``sts_endpoint_url`` (its ``service_config.sts.endpoint_url``)
    and never at the S3 ``endpoint_url``; the STS client shares the TLS and botocore settings.
    """
    import boto3
    from botocore.exceptions import ProfileNotFound

    try:
        source = boto3.session.Session(
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            region_name=region_name,
            profile_name=profile_name,
        )
    except ProfileNotFound:
        raise ConfigurationError(
            f"profile_name {profile_name!r} is not in the AWS config or credentials file of this machine"
        ) from None
    session = source
    if assume_role is not None:
        sts = source.client("sts", endpoint_url=sts_endpoint_url, verify=verify, config=config)
        session = _session_with(assumed_role_credentials(sts, assume_role), region_name=source.region_name)
    return session.client("s3", endpoint_url=endpoint_url, verify=verify, config=config)

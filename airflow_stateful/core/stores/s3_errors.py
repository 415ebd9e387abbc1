"""What an S3 error means to the caller, in this package's errors, with a message that says what to do.

botocore reports every failure as a ``ClientError`` with a code (or as a transport exception without one); the
commit protocol needs to tell apart a lost condition (``412``, or ``409`` when two conditional writes race), a
missing object, a missing bucket, denied access, a KMS key it may not use, an endpoint without conditional
writes, and a transfer that broke on the way. This module is the one place that reads those codes, so the
store's requests and its streamed upload and download paths (:mod:`~airflow_stateful.core.stores.s3_upload`,
:mod:`~airflow_stateful.core.stores.s3_download`) judge the same error the same way. No message holds a secret.
"""

from __future__ import annotations

from typing import Protocol

from airflow_stateful.core.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    StoreUnavailableError,
)

NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
"""Codes of an object (or its upload) that does not exist."""
LOST_CONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
"""Codes of a conditional write that lost: the object exists or changed, or another conditional write won."""
ACCESS = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "403"}
"""Codes of credentials or a policy that do not allow the request."""
KMS = "KMS."
"""Prefix of the codes S3 answers when it cannot use the object's KMS key."""


READ_ATTEMPTS = 3
"""Times a read is sent in all when its answer's body breaks off or fails its checksum on the way.

botocore retries a request that failed (a reset, a timeout, a 5xx) but not one whose *body* broke afterwards:
it hands the body over as a stream, and reading it is the caller's business. A cut connection or a body that
fails botocore's CRC32 check (S3 returns the checksum each object was written with) says nothing about the
stored object, so the read is sent again before anyone is told, and then told that it was the transfer."""


def transit_error(exc: BaseException) -> bool:
    """Whether ``exc`` broke the transfer of an answer's body (the stored object is not judged by it)."""
    from botocore.exceptions import (
        ConnectionClosedError,
        FlexibleChecksumError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    kinds = (
        ConnectionClosedError,
        FlexibleChecksumError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
        ShortRange,
    )
    return isinstance(exc, kinds)


class ShortRange(Exception):
    """A ranged GET answered fewer (or more) bytes than the range holds: the transfer, not the object."""


def client_error_code(exc: Exception) -> str | None:
    """The S3 error code of a botocore ``ClientError``; ``None`` for an error that never got an answer."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return str(response.get("Error", {}).get("Code", ""))


def _http_status(exc: Exception) -> int | None:
    """The HTTP status of the answer behind a botocore ``ClientError``; ``None`` without one."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


class Translate(Protocol):
    """A store's :func:`translate`, with its own bucket and endpoint filled in."""

    def __call__(
        self,
        exc: Exception,
        key: str,
        *,
        conditional: bool = False,
        reading: bool = False,
        listing: bool = False,
    ) -> Exception: ...


def translate(
    exc: Exception,
    key: str,
    *,
    url: str,
    bucket: str,
    endpoint_url: str | None,
    expected_bucket_owner: str | None,
    credential_source: str = "boto3's standard credential chain",
    conditional: bool = False,
    reading: bool = False,
    listing: bool = False,
) -> Exception:
    """Map a botocore error to one of ours, with a message that says what to do and holds no secret.

    Whatever says the store cannot be used as configured (no bucket, no or refused credentials, a KMS key it
    may not use, an endpoint that is not S3 or lacks conditional writes, an endpoint that does not answer) is a
    :class:`StoreUnavailableError`, so a command line calls every one a configuration problem (exit 2).

    :param url: the store's ``s3://bucket/prefix``, named in every message.
    :param credential_source: where the credentials came from, in words (named when they are missing or refused).
    :param conditional: the request was a conditional write: a missing object means the condition lost.
    :param reading: ``exc`` broke the body of an answer, after :data:`READ_ATTEMPTS` reads.
    :param listing: the request listed ``key`` as a prefix (S3 answers a listing 404 only for a missing bucket).
    """
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    code = client_error_code(exc)
    where = f"{url} (object {key!r})" if key and not listing else url
    at = endpoint_url or "AWS"
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return StoreUnavailableError(
            f"no S3 credentials for {url}: they were to come from {credential_source}, which found none "
            f"({type(exc).__name__}). Fix [stateful] conn_id (or --conn-id), give the connection a key, or "
            "set up the AWS credential chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, a role)."
        )
    if code in LOST_CONDITION:
        return PreconditionFailedError(f"conditional write to {where} lost: the object exists or changed")
    status = _http_status(exc)
    if code == "" and status is not None:  # an answer, but no S3 error document in it
        what = "a listing of" if listing else "a request on"
        return StoreUnavailableError(
            f"the endpoint {at} answered {what} bucket {bucket!r} with HTTP {status} and no S3 error: it does not "
            "look like an S3 API. Check endpoint_url: the S3 API's address and port, not a console or a web "
            "server's."
        )
    if code in NOT_FOUND and listing:
        return StoreUnavailableError(
            f"the endpoint {at} answered a listing of bucket {bucket!r} with {code} Not Found: it does not "
            "look like an S3 API (S3 answers NoSuchBucket for a missing bucket). Check endpoint_url: the S3 "
            "API's address and port, not a console or a web server's."
        )
    if code in NOT_FOUND:
        if conditional:
            return PreconditionFailedError(f"conditional write to {where} lost: the object is gone")
        return ObjectNotFoundError(f"object {key!r} does not exist in {url}")
    if code == "NoSuchBucket":
        return StoreUnavailableError(
            f"bucket {bucket!r} does not exist at {at}; create it (this package never creates one) or fix "
            "backend_url."
        )
    if code in ACCESS:
        owner = (
            f", and that account {expected_bucket_owner} owns the bucket (expected_bucket_owner)"
            if expected_bucket_owner
            else ""
        )
        return StoreUnavailableError(
            f"access to {where} was denied ({code}); check the credentials, which came from "
            f"{credential_source}, the role they assume, the bucket policy{owner}."
        )
    if code is not None and code.startswith(KMS):
        return StoreUnavailableError(
            f"S3 could not use the KMS key of {where} ({code}); check sse_kms_key_id and that the key "
            "policy lets these credentials use it (kms:GenerateDataKey to write, kms:Decrypt to read)."
        )
    if code == "NotImplemented":
        return StoreUnavailableError(
            f"the endpoint behind {url} does not support a request the commit protocol needs "
            "(conditional writes: If-None-Match / If-Match); use an S3-compatible store that does."
        )
    if reading and code is None and transit_error(exc):
        return StoreError(
            f"reading {where} failed {READ_ATTEMPTS} times in a row: the answer broke off or failed its "
            f"checksum on the way ({type(exc).__name__}: {exc}). The bytes were not used; the stored object "
            "was not judged by them. Check the network path to the endpoint (proxies, load balancers)."
        )
    if code is None:
        name = type(exc).__name__
        return StoreUnavailableError(f"cannot reach {where} at {at}: {name}: {exc}")
    return StoreError(f"S3 request on {where} failed: {code}: {exc}")

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


class Translate(Protocol):
    """A store's :func:`translate`, with its own bucket and endpoint filled in."""

    def __call__(
        self, exc: Exception, key: str, *, conditional: bool = False, reading: bool = False
    ) -> Exception: ...


def translate(
    exc: Exception,
    key: str,
    *,
    url: str,
    bucket: str,
    endpoint_url: str | None,
    expected_bucket_owner: str | None,
    conditional: bool = False,
    reading: bool = False,
) -> Exception:
    """Map a botocore error to one of ours, with a message that says what to do and holds no secret.

    :param url: the store's ``s3://bucket/prefix``, named in every message.
    :param conditional: the request was a conditional write: a missing object means the condition lost.
    :param reading: ``exc`` broke the body of an answer, after :data:`READ_ATTEMPTS` reads.
    """
    code = client_error_code(exc)
    where = f"{url} (object {key!r})"
    if code in LOST_CONDITION:
        return PreconditionFailedError(f"conditional write to {where} lost: the object exists or changed")
    if code in NOT_FOUND:
        if conditional:
            return PreconditionFailedError(f"conditional write to {where} lost: the object is gone")
        return ObjectNotFoundError(f"object {key!r} does not exist in {url}")
    if code == "NoSuchBucket":
        return StoreUnavailableError(
            f"bucket {bucket!r} does not exist at {endpoint_url or 'AWS'}; create it or fix backend_url."
        )
    if code in ACCESS:
        owner = (
            f", and that account {expected_bucket_owner} owns the bucket (expected_bucket_owner)"
            if expected_bucket_owner
            else ""
        )
        return StoreError(
            f"access to {where} was denied ({code}); check the credentials of the connection "
            f"or the AWS credential chain (and the role it assumes), the bucket policy{owner}."
        )
    if code is not None and code.startswith(KMS):
        return StoreError(
            f"S3 could not use the KMS key of {where} ({code}); check sse_kms_key_id and that the key "
            "policy lets these credentials use it (kms:GenerateDataKey to write, kms:Decrypt to read)."
        )
    if code == "NotImplemented":
        return StoreError(
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
        return StoreUnavailableError(f"cannot reach {where}: {name}: {exc}")
    return StoreError(f"S3 request on {where} failed: {code}: {exc}")

"""The streamed multipart upload of a file larger than one part, created only if the key is absent.

The file is read once, in order, hashing every part as it goes, while up to ``max_concurrency`` parts are
uploaded in parallel; memory stays at about ``(max_concurrency + 1) * part_size`` whatever the file size.
``CompleteMultipartUpload`` carries ``If-None-Match: *``, so the object appears whole or not at all, and only
if no other writer created it first.

Multipart requests are not idempotent the way a ``PutObject`` is, and botocore retries them: a retried
``CreateMultipartUpload`` can leave an upload nobody knows about, a retried completion can find its own first
attempt's object. Both are handled here, beside the upload they belong to; the store
(:class:`~airflow_stateful.core.stores.s3.S3ObjectStore`) hands over its client, its bucket and its request
arguments, and sends smaller files with one ``PutObject``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from airflow_stateful.core.stores.base import ProgressCallback, StoredFile
from airflow_stateful.core.stores.s3_errors import LOST_CONDITION, Translate, client_error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MAX_PARTS = 10_000
"""S3's limit of parts in one multipart upload: a file above ``MAX_PARTS * part_size`` gets larger parts."""


def upload_multipart(
    client: S3Client,
    executor: Callable[[], ThreadPoolExecutor],
    *,
    bucket: str,
    key: str,
    full_key: str,
    path: Path,
    size: int,
    part_size: int,
    max_concurrency: int,
    owner: Mapping[str, Any],
    write_args: Mapping[str, Any],
    translate: Translate,
    progress: ProgressCallback | None,
) -> StoredFile:
    """Upload ``path`` (``size`` bytes) to ``full_key`` in parts, if the key is absent; abort on any failure.

    :param key: the store's key, named in errors; ``full_key`` is the bucket's (the store's prefix added).
    :param executor: the store's thread pool, asked for only once the upload exists.
    :param owner: the ``ExpectedBucketOwner`` argument (or none), sent with every request.
    :param write_args: encryption and owner, sent with ``CreateMultipartUpload`` (parts inherit the encryption).
    :param translate: the store's error translation.
    """
    part_size = max(part_size, math.ceil(size / MAX_PARTS))
    sent = time.monotonic()
    try:
        # Declaring CRC32 (as s3transfer does) lets the server verify each part and, on moto, spares a
        # full re-read of the object at completion; see docs/performance.md.
        created = client.create_multipart_upload(
            Bucket=bucket, Key=full_key, ChecksumAlgorithm="CRC32", **write_args
        )
    except Exception as exc:
        raise translate(exc, key) from exc
    upload_id = created["UploadId"]
    if created.get("ResponseMetadata", {}).get("RetryAttempts"):
        _abort_lost_creates(
            client, bucket, full_key, upload_id, owner=owner, window=time.monotonic() - sent + 1.0
        )
    digest = hashlib.sha256()
    total = 0
    parts: dict[int, dict[str, str]] = {}

    def send(number: int, chunk: bytes) -> None:
        response = client.upload_part(
            Bucket=bucket,
            Key=full_key,
            UploadId=upload_id,
            PartNumber=number,
            Body=chunk,
            ChecksumAlgorithm="CRC32",
            **owner,
        )
        parts[number] = {"ETag": response["ETag"], "ChecksumCRC32": response.get("ChecksumCRC32", "")}
        if progress:
            progress(len(chunk))

    pending: deque[Future[None]] = deque()
    try:
        pool = executor()
        with open(path, "rb") as fh:
            number = 0
            while chunk := fh.read(part_size):
                number += 1
                digest.update(chunk)
                total += len(chunk)
                pending.append(pool.submit(send, number, chunk))
                del chunk  # the future holds the only reference; memory stays bounded
                while len(pending) >= max_concurrency:
                    pending.popleft().result()
        while pending:
            pending.popleft().result()
        _complete(client, bucket, full_key, upload_id, parts, owner=owner)
    except BaseException as exc:
        for future in pending:
            future.cancel()
        for future in pending:
            if not future.cancelled():
                future.exception()
        # The original error matters more than a failed abort; GC removes what is left.
        with contextlib.suppress(Exception):
            client.abort_multipart_upload(Bucket=bucket, Key=full_key, UploadId=upload_id, **owner)
        if isinstance(exc, Exception):
            raise translate(exc, key, conditional=True) from exc
        raise
    return StoredFile(key=key, size=total, sha256=digest.hexdigest())


def _abort_lost_creates(
    client: S3Client,
    bucket: str,
    full_key: str,
    upload_id: str,
    *,
    owner: Mapping[str, Any],
    window: float,
) -> None:
    """Abort the uploads that earlier attempts of our retried CreateMultipartUpload created.

    CreateMultipartUpload is not idempotent: when an attempt lands but its answer is lost (a reset, a
    timeout, a cut body), botocore's retry creates a second upload, and the first one's id is known to
    nobody. Its parts would stay, billed, for ever, and no object listing (so no GC) shows them. They are
    the uploads of this very key initiated at most ``window`` seconds (how long our call took, plus a
    second for the store's clock resolution) before ours. Best effort: if this fails, the bucket's
    lifecycle rule ``AbortIncompleteMultipartUpload`` (docs/reliability.md) is the backstop.
    """
    import datetime

    with contextlib.suppress(Exception):
        listed = client.list_multipart_uploads(Bucket=bucket, Prefix=full_key, **owner)
        uploads = [u for u in listed.get("Uploads", []) if u.get("Key") == full_key]
        ours = next((u for u in uploads if u.get("UploadId") == upload_id), None)
        if ours is None:
            return
        since = ours["Initiated"] - datetime.timedelta(seconds=window)
        for upload in uploads:
            if upload["UploadId"] != upload_id and since <= upload["Initiated"] <= ours["Initiated"]:
                client.abort_multipart_upload(
                    Bucket=bucket, Key=full_key, UploadId=upload["UploadId"], **owner
                )


def _complete(
    client: S3Client,
    bucket: str,
    full_key: str,
    upload_id: str,
    parts: dict[int, dict[str, str]],
    *,
    owner: Mapping[str, Any],
) -> None:
    """Complete the upload if the key is absent; a retry that finds its own first attempt's object succeeds."""
    try:
        client.complete_multipart_upload(
            Bucket=bucket,
            Key=full_key,
            UploadId=upload_id,
            MultipartUpload=cast(
                Any,
                {
                    "Parts": [
                        {"PartNumber": n, **{k: v for k, v in parts[n].items() if v}} for n in sorted(parts)
                    ]
                },
            ),
            IfNoneMatch="*",
            **owner,
        )
    except Exception as exc:
        if client_error_code(exc) not in LOST_CONDITION | {"NoSuchUpload"}:
            raise
        # A retried completion whose first attempt landed: the object's multipart ETag (MD5 of the
        # parts' MD5s, "-N") proves it holds exactly our parts.
        md5s = b"".join(bytes.fromhex(parts[n]["ETag"].strip('"')) for n in sorted(parts))
        expected = f'"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(parts)}"'
        try:
            actual = client.head_object(Bucket=bucket, Key=full_key, **owner)["ETag"]
        except Exception:
            raise exc from None
        if actual != expected:
            raise

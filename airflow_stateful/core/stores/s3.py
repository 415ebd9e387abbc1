"""S3 (and any S3-compatible endpoint) as an object store, with conditional writes.

create-if-absent is ``PutObject``/``CompleteMultipartUpload`` with ``If-None-Match: *``; compare-and-swap is
``PutObject`` with ``If-Match: <etag>``. S3 answers a lost condition with 412 (or 409 when two conditional
writes race), which becomes :class:`PreconditionFailedError` (every error is read in one place,
:mod:`~airflow_stateful.core.stores.s3_errors`).

Large files are streamed both ways, in their own modules: the multipart upload reads the file once, hashing it
as parts go up in parallel (:mod:`~airflow_stateful.core.stores.s3_upload`), and downloads fetch ranges in
parallel and hash them in order (:mod:`~airflow_stateful.core.stores.s3_download`). Memory stays at about
``(max_concurrency + 1) * part_size`` whatever the file size. This module holds the store itself: its options,
its keys, and the requests on single objects and listings.

Only boto3 is needed (this module also runs inside Kubernetes pods without Airflow). Credentials come from
the arguments (an Airflow connection, resolved by the caller), a profile, an assumed role, or boto3's standard
chain (:mod:`~airflow_stateful.core.stores.s3_session`).

Enterprise buckets: every object this store writes carries the configured server-side encryption (SSE-S3 or
SSE-KMS with a key id and bucket key; multipart parts inherit it from ``CreateMultipartUpload``), and every
request carries ``ExpectedBucketOwner`` when one is configured, so a bucket name that now belongs to another
account is refused by S3 instead of receiving the checkpoints. The options are checked when the store is
built, before any request (:mod:`~airflow_stateful.core.stores.s3_options`); none of them costs a request.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from airflow_stateful.core.errors import PreconditionFailedError, StatefulError, StoreError
from airflow_stateful.core.stores.base import (
    Blob,
    CommonPrefix,
    ObjectInfo,
    ObjectStore,
    ProgressCallback,
    StoredFile,
    too_large,
)
from airflow_stateful.core.stores.s3_download import Download, read_range
from airflow_stateful.core.stores.s3_errors import NOT_FOUND, READ_ATTEMPTS, transit_error, translate
from airflow_stateful.core.stores.s3_listing import checked, delimited_pages
from airflow_stateful.core.stores.s3_options import (
    botocore_config,
    check_assume_role,
    check_config_kwargs,
    check_encryption,
    check_expected_bucket_owner,
    check_verify,
)
from airflow_stateful.core.stores.s3_upload import MAX_PARTS, upload_multipart

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import PaginatorConfigTypeDef

__all__ = ["MAX_PARTS", "MIB", "READ_ATTEMPTS", "S3ObjectStore"]

MIB = 1024 * 1024


class S3ObjectStore(ObjectStore):
    """Objects below ``s3://bucket/prefix``.

    :param bucket: the bucket; it must exist.
    :param prefix: key prefix inside the bucket (no leading or trailing ``/`` needed).
    :param client: a ready boto3 S3 client. When given, the credential, endpoint, TLS and botocore arguments
        below are ignored (encryption and the expected owner still apply); when omitted, a client is built
        from them, falling back to boto3's standard credential chain.
    :param endpoint_url: an S3-compatible endpoint (MinIO, moto, ...); ``None`` for AWS.
    :param profile_name: a profile of the AWS config/credentials files, the source of credentials.
    :param role_arn: a role to assume (STS ``AssumeRole``) with the source credentials; its temporary
        credentials are renewed before they expire.
    :param assume_role_kwargs: more ``AssumeRole`` arguments: ``RoleSessionName``, ``ExternalId``,
        ``DurationSeconds``, ``Policy``, ``PolicyArns``, ``Tags``, ``TransitiveTagKeys``, ``SourceIdentity``.
    :param sts_endpoint_url: where STS is (the amazon provider's ``service_config.sts.endpoint_url``).
    :param verify: TLS verification: ``True``/``None`` (default), ``False``, or the path of a CA bundle.
    :param config_kwargs: botocore ``Config`` options (retries, timeouts, ``s3.addressing_style``, proxies,
        pool size, ...), merged with the store's own needs; see
        :func:`~airflow_stateful.core.stores.s3_options.botocore_config`.
    :param addressing_style: ``"path"``, ``"virtual"`` or ``"auto"``; default ``"path"`` with a custom
        endpoint. ``config_kwargs={"s3": {"addressing_style": ...}}`` says the same the amazon provider's way.
    :param server_side_encryption: ``"AES256"`` (SSE-S3), ``"aws:kms"`` (SSE-KMS) or ``"aws:kms:dsse"``, set
        on every object written; ``None`` leaves it to the bucket's default encryption.
    :param sse_kms_key_id: the KMS key (id, ARN or alias) for SSE-KMS; default: the AWS-managed ``aws/s3``.
    :param bucket_key_enabled: use an S3 bucket key with SSE-KMS (fewer KMS requests, lower cost).
    :param expected_bucket_owner: the 12-digit account that must own the bucket; sent with every request.
    :param part_size: multipart part size; also the threshold above which files go multipart.
    :param max_concurrency: parts in flight at once, for uploads and downloads.
    :param list_page_size: keys per ListObjectsV2 page (1-1,000; S3's maximum by default). Smaller pages only
        cost requests; the tests use them to run every listing across page boundaries.
    :param credential_source: where the credentials come from, in words (``"connection 'minio'"``), named by
        the errors of missing or refused credentials; never a secret. Default: said from the arguments.
    """

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        client: S3Client | None = None,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        profile_name: str | None = None,
        role_arn: str | None = None,
        assume_role_kwargs: dict[str, Any] | None = None,
        sts_endpoint_url: str | None = None,
        verify: bool | str | None = None,
        config_kwargs: dict[str, Any] | None = None,
        addressing_style: str | None = None,
        server_side_encryption: str | None = None,
        sse_kms_key_id: str | None = None,
        bucket_key_enabled: bool | None = None,
        expected_bucket_owner: str | None = None,
        part_size: int = 8 * MIB,
        max_concurrency: int = 4,
        list_page_size: int = 1000,
        credential_source: str | None = None,
    ) -> None:
        if part_size < 5 * MIB:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum), not {part_size}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, not {max_concurrency}")
        if not 1 <= list_page_size <= 1000:
            raise ValueError(
                f"list_page_size must be between 1 and 1000 (S3's maximum), not {list_page_size}"
            )
        # Every option is checked before the client exists: bad input never reaches S3.
        self._owner: dict[str, Any] = dict(check_expected_bucket_owner(expected_bucket_owner))
        # Every write (PutObject, CreateMultipartUpload) carries both; every other request carries the owner.
        self._write_args: dict[str, Any] = {
            **check_encryption(server_side_encryption, sse_kms_key_id, bucket_key_enabled),
            **self._owner,
        }
        self.server_side_encryption = server_side_encryption
        self.sse_kms_key_id = sse_kms_key_id
        self.expected_bucket_owner = expected_bucket_owner
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.list_page_size = list_page_size
        self.endpoint_url = endpoint_url
        self.credential_source = credential_source or _credential_source(
            client=client, keys=aws_access_key_id is not None, profile_name=profile_name, role_arn=role_arn
        )
        if client is None:
            from airflow_stateful.core.stores.s3_session import s3_client, skip_expect_for_small_puts

            assume_role = check_assume_role(role_arn, assume_role_kwargs)
            config = botocore_config(
                check_config_kwargs(config_kwargs),
                addressing_style=addressing_style,
                endpoint_url=endpoint_url,
                min_pool_connections=max(16, max_concurrency * 4),
            )
            client = s3_client(
                config=config,
                endpoint_url=endpoint_url,
                region_name=region_name,
                aws_access_key_id=aws_access_key_id,
                aws_secret_access_key=aws_secret_access_key,
                aws_session_token=aws_session_token,
                profile_name=profile_name,
                assume_role=assume_role,
                sts_endpoint_url=sts_endpoint_url,
                verify=check_verify(verify),
            )
            skip_expect_for_small_puts(client)  # a client of the caller's is used as it is
        self.client = client
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        # Small chunks are latency-bound: more of them in flight than multipart parts (the pool below is sized
        # for both; max_pool_connections must cover it).
        self.parallelism = max(8, max_concurrency * 2)
        self._pool: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        # Never show credentials; the endpoint is not secret.
        return f"S3ObjectStore(url={self.url!r}, endpoint_url={self.endpoint_url!r})"

    # -- helpers -------------------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"invalid object key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.max_concurrency, thread_name_prefix="stateful-s3"
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _translate(
        self,
        exc: Exception,
        key: str,
        *,
        conditional: bool = False,
        reading: bool = False,
        listing: bool = False,
    ) -> Exception:
        """:func:`~airflow_stateful.core.stores.s3_errors.translate` with this store's bucket and endpoint.

        The streamed upload and download are handed this method, so their errors read like the store's own.
        """
        return translate(
            exc,
            key,
            url=self.url,
            bucket=self.bucket,
            endpoint_url=self.endpoint_url,
            expected_bucket_owner=self.expected_bucket_owner,
            credential_source=self.credential_source,
            conditional=conditional,
            reading=reading,
            listing=listing,
        )

    # -- interface -----------------------------------------------------------------------------------------
    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        return self._get(key, max_bytes=max_bytes, checksum=True)

    def get_chunk(self, key: str, *, size: int) -> bytes:
        # No response checksum asked for (the client's default is "when_required"): the caller's SHA-256 check
        # covers every byte. The length is still checked, by botocore and by max_bytes.
        return self._get(key, max_bytes=size, checksum=False).data

    def get_range(self, key: str, *, offset: int, length: int) -> bytes:
        return read_range(
            self.client,
            bucket=self.bucket,
            key=key,
            full_key=self._key(key),
            owner=self._owner,
            translate=self._translate,
            offset=offset,
            length=length,
        )

    def _get(self, key: str, *, max_bytes: int | None, checksum: bool) -> Blob:
        mode: dict[str, Any] = {"ChecksumMode": "ENABLED"} if checksum else {}
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                response = self.client.get_object(
                    Bucket=self.bucket, Key=self._key(key), **mode, **self._owner
                )
            except Exception as exc:
                raise self._translate(exc, key) from exc
            body = response["Body"]
            try:
                if max_bytes is None:
                    data = body.read()
                else:
                    size = int(response.get("ContentLength", 0))
                    if size > max_bytes:
                        body.close()  # the body is never read
                        raise too_large(key, self.url, size, max_bytes)
                    data = body.read(max_bytes + 1)
                    if len(data) > max_bytes:
                        body.close()
                        raise too_large(key, self.url, len(data), max_bytes)
                    # Read to the end: only then does botocore check the length and the checksum (a body cut
                    # short under a rewritten Content-Length is otherwise taken as the whole object).
                    data += body.read()
            except StatefulError:
                raise
            except Exception as exc:
                body.close()
                if attempt < READ_ATTEMPTS and transit_error(exc):
                    continue
                raise self._translate(exc, key, reading=True) from exc
            return Blob(data=data, etag=response["ETag"])
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        adopt_identical: bool = True,
    ) -> str:
        if if_none_match and if_match is not None:
            raise ValueError("if_none_match and if_match exclude each other")
        kwargs: dict[str, Any] = {}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        elif if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            response = self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, **kwargs, **self._write_args
            )
        except Exception as exc:
            error = self._translate(exc, key, conditional=bool(kwargs))
            if if_none_match and adopt_identical and isinstance(error, PreconditionFailedError):
                # botocore retries a request whose answer was lost; if the first attempt created the object,
                # the retry sees 412. Identical bytes mean the create is ours and succeeded.
                with contextlib.suppress(StatefulError):
                    existing = self.get(key)
                    if memoryview(existing.data) == memoryview(data):  # data may be any bytes-like
                        return existing.etag
            try:
                raise error from exc
            finally:
                # The raised error's traceback holds this frame, whose ``error`` holds the error: a cycle
                # that would keep ``data`` (a chunk of up to 8 MiB) alive until the next GC pass.
                del error
        return str(response["ETag"])

    def upload_file(self, key: str, path: Path, *, progress: ProgressCallback | None = None) -> StoredFile:
        size = Path(path).stat().st_size
        digest = hashlib.sha256()
        if size <= self.part_size:
            with open(path, "rb") as fh:
                data = fh.read()
            digest.update(data)
            self.put(key, data, if_none_match=True)
            if progress:
                progress(len(data))
            return StoredFile(key=key, size=len(data), sha256=digest.hexdigest())
        return upload_multipart(
            self.client,
            self._executor,
            bucket=self.bucket,
            key=key,
            full_key=self._key(key),
            path=Path(path),
            size=size,
            part_size=self.part_size,
            max_concurrency=self.max_concurrency,
            owner=self._owner,
            write_args=self._write_args,
            translate=self._translate,
            progress=progress,
        )

    def download_file(
        self,
        key: str,
        dest: Path,
        *,
        size: int,
        sha256: str,
        progress: ProgressCallback | None = None,
    ) -> None:
        download = Download(
            client=self.client,
            bucket=self.bucket,
            key=key,
            full_key=self._key(key),
            url=self.url,
            owner=self._owner,
            translate=self._translate,
            dest=dest,
            size=size,
            sha256=sha256,
            progress=progress,
        )
        if size <= self.part_size:
            download.whole()
        else:
            download.ranged(self._executor, part_size=self.part_size, max_concurrency=self.max_concurrency)

    @property
    def _pages(self) -> PaginatorConfigTypeDef:
        return {"PageSize": self.list_page_size}

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """ListObjectsV2, page by page, in the server's order: byte-wise on S3, directory-walk on SeaweedFS."""
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(
                Bucket=self.bucket, Prefix=full_prefix, PaginationConfig=self._pages, **self._owner
            ):
                for obj in page.get("Contents", []):
                    yield ObjectInfo(
                        key=obj["Key"][strip:], size=obj["Size"], last_modified=obj["LastModified"]
                    )
        except Exception as exc:
            raise self._translate(exc, prefix, listing=True) from exc

    def list_delimited(self, prefix: str, delimiter: str) -> Iterator[ObjectInfo | CommonPrefix]:
        """ListObjectsV2 with ``Delimiter``: a page holds up to 1,000 entries, objects and common prefixes
        together, and a common prefix costs one entry however many objects it covers. Each page is merged into
        key order; across pages the order is the server's (see :meth:`ObjectStore.list_objects`). The pages are
        checked as they come (:mod:`~airflow_stateful.core.stores.s3_listing`): where a server's paging
        contradicts itself, the listing goes on from the plain listing, rolled up here."""
        if not delimiter:
            raise ValueError("the delimiter of a delimited listing must not be empty")
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            pages = paginator.paginate(
                Bucket=self.bucket,
                Prefix=full_prefix,
                Delimiter=delimiter,
                PaginationConfig=self._pages,
                **self._owner,
            )
            yield from checked(
                delimited_pages(iter(cast("Iterable[dict[str, Any]]", pages)), strip=strip),
                delimiter=delimiter,
                rolled_up=lambda: ObjectStore.list_delimited(self, prefix, delimiter),
                where=f"{self.url}/{prefix}* (delimiter {delimiter!r})",
                is_pagination_error=lambda exc: type(exc).__name__ == "PaginationError",
            )
        except StatefulError:
            raise
        except Exception as exc:
            raise self._translate(exc, prefix, listing=True) from exc

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        kwargs: dict[str, Any] = {"IfMatch": if_match} if if_match is not None else {}
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key), **kwargs, **self._owner)
        except Exception as exc:
            raise self._translate(exc, key, conditional=if_match is not None) from exc

    def delete_many(self, keys: Iterable[str]) -> None:
        batch: list[str] = []
        for key in keys:
            batch.append(self._key(key))
            if len(batch) == 1000:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, full_keys: list[str]) -> None:
        try:
            response = self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in full_keys], "Quiet": True},
                **self._owner,
            )
        except Exception as exc:
            raise self._translate(
                exc, full_keys[0][len(self.prefix) + 1 :] if self.prefix else full_keys[0]
            ) from exc
        errors = [e for e in response.get("Errors", []) if e.get("Code") not in NOT_FOUND]
        if errors:
            first = errors[0]
            raise StoreError(
                f"could not delete {len(errors)} object(s) from {self.url}, first {first.get('Key')!r}: "
                f"{first.get('Code')}: {first.get('Message')}"
            )


def _credential_source(*, client: object, keys: bool, profile_name: str | None, role_arn: str | None) -> str:
    """Where a store's credentials come from, in words, when its opener did not say."""
    if client is not None:
        source = "the boto3 client given to the store"
    elif keys:
        source = "the access key given to the store"
    elif profile_name:
        source = f"AWS profile {profile_name!r}"
    else:
        source = "boto3's standard credential chain (no connection configured)"
    return f"{source}, assuming role {role_arn!r}" if role_arn else source

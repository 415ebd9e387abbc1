"""The verified download of a stored file: one GET for a small one, parallel ranged GETs for a large one.

Either way the bytes go through :mod:`~airflow_stateful.core.stores.verify`, so ``dest`` appears only when
size and SHA-256 match what the manifest recorded. A large file is fetched in ``part_size`` ranges, up to
``max_concurrency`` at once, and hashed in order as they arrive; memory stays at about ``max_concurrency``
ranges whatever the file size.

A read whose answer broke on the way (:func:`~airflow_stateful.core.stores.s3_errors.transit_error`) is sent
again, up to :data:`~airflow_stateful.core.stores.s3_errors.READ_ATTEMPTS` times, before anyone is told: the
transfer is not the stored object. The store (:class:`~airflow_stateful.core.stores.s3.S3ObjectStore`) hands
over its client, its bucket and its request arguments.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_stateful.core.errors import CheckpointCorruptError, StatefulError
from airflow_stateful.core.stores.base import ProgressCallback
from airflow_stateful.core.stores.s3_errors import (
    READ_ATTEMPTS,
    ShortRange,
    Translate,
    client_error_code,
    transit_error,
)
from airflow_stateful.core.stores.verify import VerifiedFileWriter, copy_verified

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


@dataclass(frozen=True)
class Download:
    """One verified download of a stored object to a local file, as :meth:`S3ObjectStore.download_file` asks.

    :param client: the store's boto3 client; ``bucket`` its bucket.
    :param key: the store's key, named in errors; ``full_key`` is the bucket's (the store's prefix added).
    :param url: the store's ``s3://bucket/prefix``, named in errors.
    :param owner: the ``ExpectedBucketOwner`` argument (or none), sent with every request.
    :param translate: the store's error translation.
    :param dest: where the file appears, only once it has ``size`` bytes and ``sha256``.
    """

    client: S3Client
    bucket: str
    key: str
    full_key: str
    url: str
    owner: Mapping[str, Any]
    translate: Translate
    dest: Path
    size: int
    sha256: str
    progress: ProgressCallback | None = None

    def _verified(self) -> dict[str, Any]:
        """What the bytes are checked against before ``dest`` appears (named in errors as this object)."""
        return {
            "key": self.key,
            "where": self.url,
            "size": self.size,
            "sha256": self.sha256,
            "progress": self.progress,
        }

    def whole(self) -> None:
        """Download with one GET."""
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=self.full_key, **self.owner)["Body"]
            except Exception as exc:
                raise self.translate(exc, self.key) from exc
            try:
                copy_verified(body, self.dest, **self._verified())
            except CheckpointCorruptError:
                # Wrong bytes twice are the object's; once may be the way (a body cut short under a
                # rewritten length, from an endpoint that sends no checksum): read it again first.
                if attempt < READ_ATTEMPTS:
                    continue
                raise
            except Exception as exc:
                if attempt < READ_ATTEMPTS and transit_error(exc):
                    continue
                raise self.translate(exc, self.key, reading=True) from exc
            return

    def ranged(
        self, executor: Callable[[], ThreadPoolExecutor], *, part_size: int, max_concurrency: int
    ) -> None:
        """Download in ``part_size`` ranges, up to ``max_concurrency`` in flight at once on the store's thread
        pool (``executor``), hashed in order as they arrive."""

        def fetch(start: int, end: int) -> bytes:
            for attempt in range(1, READ_ATTEMPTS + 1):
                try:
                    response = self.client.get_object(
                        Bucket=self.bucket, Key=self.full_key, Range=f"bytes={start}-{end}", **self.owner
                    )
                except Exception as exc:
                    if client_error_code(exc) == "InvalidRange":
                        return b""  # shorter than recorded: the size check below names it corrupt
                    raise
                total = str(response.get("ContentRange", "")).rpartition("/")[2]
                if total.isdigit() and int(total) != self.size:
                    raise CheckpointCorruptError(
                        f"object {self.key!r} in {self.url} is corrupt: expected {self.size} bytes, the store holds "
                        f"{total}. The bytes were not used."
                    )
                try:
                    data: bytes = response["Body"].read()
                    if len(data) != end - start + 1:
                        # The object is long enough (Content-Range says so): the answer was cut short.
                        raise ShortRange(f"bytes {start}-{end}: {len(data)} bytes arrived")
                except Exception as exc:
                    if attempt < READ_ATTEMPTS and transit_error(exc):
                        continue
                    raise self.translate(exc, self.key, reading=True) from exc
                return data
            raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

        # Produced as they are sent, never listed up front: a large file has many ranges.
        todo = ((start, min(start + part_size, self.size) - 1) for start in range(0, self.size, part_size))
        pending: deque[Future[bytes]] = deque()
        pool = executor()
        try:
            with VerifiedFileWriter(self.dest, **self._verified()) as writer:
                for start, end in todo:
                    pending.append(pool.submit(fetch, start, end))
                    if len(pending) >= max_concurrency:
                        break
                while pending:
                    writer.write(pending.popleft().result())
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending.append(pool.submit(fetch, *nxt))
        except StatefulError:
            raise
        except Exception as exc:
            raise self.translate(exc, self.key) from exc
        finally:
            for future in pending:
                future.cancel()


def read_range(
    client: S3Client,
    *,
    bucket: str,
    key: str,
    full_key: str,
    owner: Mapping[str, Any],
    translate: Translate,
    offset: int,
    length: int,
) -> bytes:
    """One ranged GET of ``length`` bytes from ``offset`` (:meth:`S3ObjectStore.get_range`), sent again when the
    answer broke off on the way. An object that ends before the range gives what it has: the caller's SHA-256
    check of each chunk then names it corrupt."""
    if length <= 0:
        return b""
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            response = client.get_object(
                Bucket=bucket, Key=full_key, Range=f"bytes={offset}-{offset + length - 1}", **owner
            )
        except Exception as exc:
            if client_error_code(exc) == "InvalidRange":
                return b""  # the object ends before the range starts
            raise translate(exc, key) from exc
        try:
            data: bytes = response["Body"].read()
            content_range = str(response.get("ContentRange") or "")
            if not content_range:  # answered 200: a server that ignores Range sent the whole object
                return data[offset : offset + length]
            total = content_range.rpartition("/")[2]
            expected = length if not total.isdigit() else max(0, min(length, int(total) - offset))
            if len(data) != expected:
                raise ShortRange(
                    f"bytes {offset}-{offset + length - 1}: {len(data)} of {expected} bytes arrived"
                )
        except StatefulError:
            raise
        except Exception as exc:
            if attempt < READ_ATTEMPTS and transit_error(exc):
                continue
            raise translate(exc, key, reading=True) from exc
        return data
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

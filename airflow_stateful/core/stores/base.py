"""The small object-store interface the commit protocol is written against.

Two real implementations exist: :class:`~airflow_stateful.core.stores.s3.S3ObjectStore` and
:class:`~airflow_stateful.core.stores.local.LocalObjectStore`. Both pass the same contract suite
(``tests/contract``). The protocol needs only a handful of operations, but two of them must be
*conditional*: create-if-absent (``put(..., if_none_match=True)``) and compare-and-swap
(``put(..., if_match=etag)``). Everything else (fencing, atomic visibility) is built on those two.

Keys are relative to the store's root (an S3 bucket + prefix, or a directory) and use ``/``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from airflow_stateful.core.errors import ObjectTooLargeError

ProgressCallback = Callable[[int], None]
"""Called with the number of bytes moved since the previous call."""

CHUNK_SIZE = 1024 * 1024
"""Read/hash granularity for streamed files; memory per stream stays around this size."""


@dataclass(frozen=True)
class Blob:
    """A small object read whole, with the ETag to use for a later compare-and-swap."""

    data: bytes
    etag: str


@dataclass(frozen=True)
class ObjectInfo:
    """One entry of a listing."""

    key: str
    size: int
    last_modified: datetime


@dataclass(frozen=True)
class CommonPrefix:
    """An entry of a delimited listing (:meth:`ObjectStore.list_delimited`) standing for every object whose key
    starts with ``prefix``, as S3's ``CommonPrefixes``: one entry however many objects it covers."""

    prefix: str


@dataclass(frozen=True)
class StoredFile:
    """What :meth:`ObjectStore.upload_file` wrote: size and SHA-256 of the bytes actually sent."""

    key: str
    size: int
    sha256: str


def too_large(key: str, where: str, size: int, max_bytes: int) -> ObjectTooLargeError:
    return ObjectTooLargeError(
        f"object {key!r} in {where} is {size} bytes, more than the {max_bytes} bytes a record of its kind may "
        "have; it was not read. It was altered or written by something else: inspect it before writing to "
        "this identity again."
    )


class ObjectStore(abc.ABC):
    """Byte storage with conditional writes. Implementations must be safe to share between threads."""

    #: URL of the store's root, without credentials; used in messages and metadata.
    url: str

    #: How many chunks a commit or a restore moves at once on this store (threads sharing it).
    parallelism: int = 4

    @abc.abstractmethod
    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        """Read a small object whole. Raises ObjectNotFoundError when it does not exist.

        ``max_bytes`` caps what is read: a larger object raises ObjectTooLargeError (see :func:`too_large`)
        before its body is read, so a crafted record cannot make every reader allocate and parse megabytes.
        """

    def get_chunk(self, key: str, *, size: int) -> bytes:
        """Read a content-addressed object of ``size`` bytes whose SHA-256 the caller checks itself.

        Like :meth:`get` (a longer object is refused unread), except that a store may skip a transport
        checksum of its own: the caller's SHA-256 check covers every byte, so a second hash would only cost time.
        """
        return self.get(key, max_bytes=size).data

    def get_range(self, key: str, *, offset: int, length: int) -> bytes:
        """Read ``length`` bytes of ``key`` from ``offset`` (a run of chunks inside a pack, format 5).

        The caller checks every chunk's SHA-256, so no transport checksum is asked for; an object shorter than
        the range gives fewer bytes (the caller's check then names the chunk corrupt). This default reads the
        whole object: a store that can read a range (S3, the local store) overrides it.
        """
        data = self.get(key).data
        return data[offset : offset + length]

    @abc.abstractmethod
    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        adopt_identical: bool = True,
    ) -> str:
        """Write a small object and return its new ETag.

        ``if_none_match=True`` creates only if the key is absent; ``if_match`` replaces only if the
        current ETag equals it (a missing key also fails). A lost condition raises
        PreconditionFailedError and leaves the object as it was. A store may accept a create whose key
        already holds exactly the same bytes (a retried request whose first attempt landed), unless
        ``adopt_identical`` is off: content-addressed objects turn it off, because an identical object that
        exists may be somebody's garbage that maintenance is deleting (docs/adr/0004).
        """

    @abc.abstractmethod
    def upload_file(self, key: str, path: Path, *, progress: ProgressCallback | None = None) -> StoredFile:
        """Stream a local file to a new, immutable object (create-if-absent), hashing it on the way.

        Memory stays bounded whatever the file size. The object is visible only once complete.
        """

    @abc.abstractmethod
    def download_file(
        self,
        key: str,
        dest: Path,
        *,
        size: int,
        sha256: str,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Stream an object into ``dest``, verifying its size and SHA-256.

        ``dest`` appears only when the bytes are verified; on a mismatch it is not created (or left as
        it was) and CheckpointCorruptError names the object.
        """

    @abc.abstractmethod
    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """All objects whose key starts with ``prefix``, each exactly once, in the store's order.

        S3 and the local store list in byte-wise key order, but S3-compatible servers need not: SeaweedFS lists
        in directory-walk order (``a/b`` before ``a-b``), across pages too. No caller may depend on the order;
        one that shows or compares listings sorts what it needs.
        """

    def list_delimited(self, prefix: str, delimiter: str) -> Iterator[ObjectInfo | CommonPrefix]:
        """The objects under ``prefix`` with everything past a ``delimiter`` rolled up, as S3's ListObjectsV2
        does with ``Delimiter``: why a fleet of identities can be listed one entry per identity.

        For each key that starts with ``prefix``: if ``delimiter`` (any non-empty string, not only ``/``) occurs
        in the key after ``prefix``, the key up to and including its first such occurrence is a
        :class:`CommonPrefix`, listed once however many keys share it; otherwise the object itself is listed.
        Entries come in the store's order (see :meth:`list_objects`: byte-wise on S3 and the local store, not on
        every S3-compatible server). Keys that share a common prefix are exactly
        the keys that start with it, so a store can list a common prefix without listing its objects (S3 and
        the local store do); this default lists them all and rolls them up here.
        """
        if not delimiter:
            raise ValueError("the delimiter of a delimited listing must not be empty")
        rolled_up: set[str] = (
            set()
        )  # the listing's order is the store's: a prefix's keys need not be adjacent
        for info in self.list_objects(prefix):
            cut = info.key.find(delimiter, len(prefix))
            if cut < 0:
                yield info
            elif (rolled := info.key[: cut + len(delimiter)]) not in rolled_up:
                rolled_up.add(rolled)
                yield CommonPrefix(rolled)

    @abc.abstractmethod
    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Delete one object; a missing key is not an error unless ``if_match`` is given."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete objects, ignoring missing ones. Stores with a batch API override this."""
        for key in keys:
            self.delete(key)

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections or thread pools."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

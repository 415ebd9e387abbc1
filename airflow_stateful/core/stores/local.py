"""A directory as an object store: the embedded default, and the reference for the contract suite.

Conditional writes are built from POSIX guarantees rather than from a lock server:

* create-if-absent writes a temporary file, ``fsync``s it, then ``link()``s it to the final name. ``link``
  fails atomically when the name exists, so two creators can never both win and a reader can never see a
  half-written object.
* compare-and-swap takes an exclusive ``flock`` on a per-key lock file, compares the current content's
  ETag and ``rename()``s the new file over the old one. Readers do not lock: ``rename`` is atomic, so they
  see the old bytes or the new ones.

The ETag of a local object is the SHA-256 of its content; CAS is only used for the small head records.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from airflow_stateful.core.errors import (
    ConfigurationError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from airflow_stateful.core.stores.base import (
    CHUNK_SIZE,
    Blob,
    CommonPrefix,
    ObjectInfo,
    ObjectStore,
    ProgressCallback,
    StoredFile,
    too_large,
)
from airflow_stateful.core.stores.verify import copy_verified

_INTERNAL_DIR = "~stateful"
"""Temporary and lock files; never listed. Inside the root so ``link``/``rename`` stay on one filesystem; ``~`` cannot start an identity, so no identity can collide with it."""


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _holds_a_file(directory: Path) -> bool:
    """Whether any file lies below ``directory`` (links are not followed); stops at the first one."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return False
    folders = []
    for entry in entries:
        if entry.is_symlink():
            continue
        if not entry.is_dir(follow_symlinks=False):
            return True
        folders.append(Path(entry.path))
    return any(_holds_a_file(folder) for folder in folders)


class LocalObjectStore(ObjectStore):
    """Objects as files below ``root``.

    :param root: the directory; created by the first write, so that opening a store only to read it (the CLI's
        ``ls`` of a mistyped path, a sensor) creates nothing. A root that exists but is not a directory is
        refused here.
    :param fsync: flush data and directory entries to disk before a write returns (turn off only in tests).
    """

    def __init__(self, *, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.fsync = fsync
        if self.root.exists() and not self.root.is_dir():
            raise ConfigurationError(
                f"cannot use {self.root} as a local state directory: it is not a directory"
            )
        self.url = self.root.as_uri()
        self._ready = False

    def exists(self) -> bool:
        """Whether the state directory is there (a read finds nothing in a missing one; a write creates it)."""
        return self.root.is_dir()

    def _internal(self, name: str) -> Path:
        """``~stateful/<name>`` (``tmp`` or ``locks``), with the root, created on the first write."""
        if not self._ready:
            try:
                (self.root / _INTERNAL_DIR / "tmp").mkdir(parents=True, exist_ok=True)
                (self.root / _INTERNAL_DIR / "locks").mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigurationError(f"cannot use {self.root} as a local state directory: {exc}") from exc
            self._ready = True
        return self.root / _INTERNAL_DIR / name

    def __repr__(self) -> str:
        return f"LocalObjectStore(root={str(self.root)!r})"

    # -- paths ---------------------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"invalid object key {key!r}")
        if key.split("/", 1)[0] == _INTERNAL_DIR:
            raise ValueError(f"object key {key!r} uses the reserved folder {_INTERNAL_DIR!r}")
        return self.root / key

    def _tmp_path(self) -> Path:
        return self._internal("tmp") / uuid.uuid4().hex

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        name = hashlib.sha256(key.encode()).hexdigest()
        fd = os.open(self._internal("locks") / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _write_tmp(self, data: bytes) -> Path:
        tmp = self._tmp_path()
        with open(tmp, "wb") as fh:
            fh.write(data)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())
        return tmp

    def _publish_new(self, tmp: Path, dest: Path, key: str) -> None:
        """Give ``tmp`` the name ``dest`` only if nothing has that name yet."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(tmp, dest)
        except FileExistsError:
            raise PreconditionFailedError(f"object {key!r} already exists in {self.url}") from None
        finally:
            tmp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_dir(dest.parent)

    # -- interface -----------------------------------------------------------------------------------------
    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        try:
            with open(self._path(key), "rb") as fh:
                if max_bytes is None:
                    data = fh.read()
                else:
                    size = os.fstat(fh.fileno()).st_size
                    if size > max_bytes:
                        raise too_large(key, self.url, size, max_bytes)
                    data = fh.read(max_bytes + 1)
                    if len(data) > max_bytes:  # grew since the stat: still too large
                        raise too_large(key, self.url, len(data), max_bytes)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"object {key!r} does not exist in {self.url}") from None
        return Blob(data=data, etag=_etag(data))

    def get_range(self, key: str, *, offset: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as fh:
                return os.pread(fh.fileno(), length, offset)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"object {key!r} does not exist in {self.url}") from None

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
        dest = self._path(key)
        tmp = self._write_tmp(data)
        try:
            if if_none_match:
                self._publish_new(tmp, dest, key)
            elif if_match is not None:
                with self._key_lock(key):
                    try:
                        current = _etag(dest.read_bytes())
                    except FileNotFoundError:
                        raise PreconditionFailedError(
                            f"object {key!r} does not exist in {self.url}; compare-and-swap lost"
                        ) from None
                    if current != if_match:
                        raise PreconditionFailedError(f"object {key!r} changed since it was read")
                    os.replace(tmp, dest)
                if self.fsync:
                    _fsync_dir(dest.parent)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                with self._key_lock(key):
                    os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return _etag(data)

    def upload_file(self, key: str, path: Path, *, progress: ProgressCallback | None = None) -> StoredFile:
        dest = self._path(key)
        tmp = self._tmp_path()
        digest = hashlib.sha256()
        size = 0
        try:
            with open(path, "rb") as src, open(tmp, "wb") as out:
                while chunk := src.read(CHUNK_SIZE):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    if progress:
                        progress(len(chunk))
                if self.fsync:
                    out.flush()
                    os.fsync(out.fileno())
            self._publish_new(tmp, dest, key)
        finally:
            tmp.unlink(missing_ok=True)
        return StoredFile(key=key, size=size, sha256=digest.hexdigest())

    def download_file(
        self,
        key: str,
        dest: Path,
        *,
        size: int,
        sha256: str,
        progress: ProgressCallback | None = None,
    ) -> None:
        try:
            src: BinaryIO = open(self._path(key), "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"object {key!r} does not exist in {self.url}") from None
        copy_verified(src, dest, key=key, where=self.url, size=size, sha256=sha256, progress=progress)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects below ``prefix`` in key order, lazily: only directories that can hold such keys are read,
        one at a time, so a caller that stops early (a bounded listing) never walks the rest of the tree.

        A prefix that could leave the root (an absolute path, a ``.``/``..`` segment) is refused, and links
        inside the root are never followed, so a listing never reads outside the state directory.
        """
        segments = prefix.split("/")
        if (
            prefix.startswith("/")
            or "\x00" in prefix
            or any(part in ("", ".", "..") for part in segments[:-1])
        ):
            raise ValueError(f"invalid object key prefix {prefix!r}: it must stay inside the store's root")
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root
        if start.is_symlink() or not start.is_dir():
            return
        yield from self._walk(start, base_dir, prefix)

    def _walk(self, directory: Path, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return  # removed while listed
        items = []
        for entry in entries:
            if (not rel and entry.name == _INTERNAL_DIR) or entry.is_symlink():
                continue
            key = f"{rel}/{entry.name}" if rel else entry.name
            folder = entry.is_dir(follow_symlinks=False)
            # "a/" sorts where every key below "a" sorts among its siblings, so the walk yields keys in order.
            items.append((f"{key}/" if folder else key, key, entry, folder))
        items.sort(key=lambda item: item[0])
        for order, key, entry, folder in items:
            if folder:
                if order.startswith(prefix) or prefix.startswith(order):
                    yield from self._walk(Path(entry.path), key, prefix)
                continue
            if not key.startswith(prefix):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield ObjectInfo(
                key=key, size=st.st_size, last_modified=datetime.fromtimestamp(st.st_mtime, tz=timezone.utc)
            )

    def list_delimited(self, prefix: str, delimiter: str) -> Iterator[ObjectInfo | CommonPrefix]:
        """The delimited listing walked like :meth:`list_objects` (lazily, in key order, inside the root, never
        through a link), but a folder whose every key rolls up into one common prefix is not walked: only
        enough of it is read to know it holds an object (a folder left empty lists nothing, as on S3), and not
        even that when a file beside it rolls up into the same prefix (an identity's ``~head.json``)."""
        if not delimiter:
            raise ValueError("the delimiter of a delimited listing must not be empty")
        if (
            prefix.startswith("/")
            or "\x00" in prefix
            or any(p in ("", ".", "..") for p in prefix.split("/")[:-1])
        ):
            raise ValueError(f"invalid object key prefix {prefix!r}: it must stay inside the store's root")
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root
        if start.is_symlink() or not start.is_dir():
            return
        last = None
        for entry in self._walk_delimited(start, base_dir, prefix, delimiter):
            if isinstance(entry, CommonPrefix):
                if entry.prefix == last:
                    continue
                last = entry.prefix
            yield entry

    def _walk_delimited(
        self, directory: Path, rel: str, prefix: str, delimiter: str
    ) -> Iterator[ObjectInfo | CommonPrefix]:
        """Entries of ``directory`` in key order; a common prefix may repeat (the caller lists it once)."""
        try:
            listed = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return  # removed while listed
        items = []
        for entry in listed:
            if (not rel and entry.name == _INTERNAL_DIR) or entry.is_symlink():
                continue
            key = f"{rel}/{entry.name}" if rel else entry.name
            folder = entry.is_dir(follow_symlinks=False)
            order = f"{key}/" if folder else key  # every key below a folder starts with "<folder>/"
            rolled = None
            if order.startswith(prefix) and (cut := order.find(delimiter, len(prefix))) >= 0:
                rolled = order[: cut + len(delimiter)]
            items.append((order, key, entry, folder, rolled))
        items.sort(key=lambda item: item[0])
        beside = {rolled for _, _, _, folder, rolled in items if rolled is not None and not folder}
        for order, key, entry, folder, rolled in items:
            if rolled is not None:
                if not folder or rolled in beside or _holds_a_file(Path(entry.path)):
                    yield CommonPrefix(rolled)
            elif folder:
                if order.startswith(prefix) or prefix.startswith(order):
                    yield from self._walk_delimited(Path(entry.path), key, prefix, delimiter)
            elif key.startswith(prefix):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield ObjectInfo(
                    key=key,
                    size=st.st_size,
                    last_modified=datetime.fromtimestamp(st.st_mtime, tz=timezone.utc),
                )

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        path = self._path(key)
        with self._key_lock(key):
            if if_match is not None:
                try:
                    current = _etag(path.read_bytes())
                except FileNotFoundError:
                    raise PreconditionFailedError(f"object {key!r} does not exist in {self.url}") from None
                if current != if_match:
                    raise PreconditionFailedError(f"object {key!r} changed since it was read")
            try:
                path.unlink()
            except FileNotFoundError:
                return
        # Drop directories left empty so listings and `du` stay clean; stop at the root.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
                    break
                raise
            parent = parent.parent

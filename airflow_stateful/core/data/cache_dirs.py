"""The restore cache's directories on disk: opened without following links, trusted only when private.

The cache (:mod:`~airflow_stateful.core.data.chunk_cache`) keeps chunk ``<sha256>`` at
``<directory>/<sha256[:2]>/<sha256>``. Whoever can write there as the worker's user (another task, a job
container sharing a hostPath cache) can plant anything in those places: a link, a FIFO, a directory open to
others. The promise is that a planted entry costs a download and nothing more, so:

* the cache directory and every fan-out directory are opened ``O_DIRECTORY | O_NOFOLLOW`` and used only by
  descriptor (a link is never followed, and cannot be swapped in after the check), and trusted only when owned
  by this user with no access for group or others (:func:`open_fanout`);
* chunk files are opened ``O_NOFOLLOW | O_NONBLOCK``: a FIFO opens at once instead of blocking until someone
  writes to it, and is then discarded as not a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path

SHA256 = re.compile(r"[0-9a-f]{64}")
TMP_PREFIX = ".tmp-"
STALE_TEMP_SECONDS = 3600
"""A temporary file this old belongs to a writer that died; an eviction scan deletes it."""
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CHUNK_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""How a chunk file is opened: never through a link, and never blocking on a FIFO planted in its place."""


class UnsafeCacheDirectory(OSError):
    """A cache directory is a symbolic link, not a directory, owned by another user, or open to others."""


def _check_owner(fd: int, name: str, *, private: bool) -> None:
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheDirectory(errno.ENOTDIR, "is not a directory", name)
    if info.st_uid != os.geteuid():
        raise UnsafeCacheDirectory(
            errno.EPERM,
            f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}); refusing to keep "
            "checkpoint bytes where another user can read or plant them",
            name,
        )
    if private and stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafeCacheDirectory(
            errno.EPERM, f"has mode {stat.S_IMODE(info.st_mode):o}, open to others (not 0700)", name
        )


def open_private_directory(path: Path) -> int:
    """A descriptor of directory ``path`` (created 0700 if missing), refused unless it is safe to keep
    checkpoint bytes in: a real directory (not a link), owned by this user, then forced to mode 0700."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if path.is_symlink():
        raise UnsafeCacheDirectory(errno.ELOOP, "is a symbolic link; refusing to use it", str(path))
    fd = os.open(path, _DIRECTORY)
    try:
        _check_owner(fd, str(path), private=False)
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_fanout(root: int, name: str, *, create: bool) -> int | None:
    """A descriptor of fan-out directory ``name`` in the cache ``root``, or ``None`` when it does not exist
    (and ``create`` is false). With ``create``, a missing one is made 0700, and a link in its place (planted:
    the cache never makes one) is removed first; unlinking a link never touches what it points at.

    Raises :class:`UnsafeCacheDirectory` for anything else that is not a private directory of this user.
    """
    for attempt in (1, 2):
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=root)
        try:
            fd = os.open(name, _DIRECTORY, dir_fd=root)
        except FileNotFoundError:
            if create and attempt == 1:
                continue  # removed between the mkdir and the open: once more
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if create and attempt == 1 and discard_entry(root, name):
                continue
            raise UnsafeCacheDirectory(
                exc.errno, "is not a directory of the cache (a link or a file)", name
            ) from None
        try:
            _check_owner(fd, name, private=True)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise UnsafeCacheDirectory(
        errno.ELOOP, "keeps being replaced", name
    )  # pragma: no cover - a race lost twice


@contextlib.contextmanager
def fanout(root: int, name: str, *, create: bool = False) -> Iterator[int | None]:
    """:func:`open_fanout`, closed afterwards."""
    fd = open_fanout(root, name, create=create)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def discard_entry(root: int, name: str) -> bool:
    """Remove ``name`` from ``root`` if it is a link or a file (never a directory's contents): what was planted
    where a fan-out directory belongs."""
    try:
        info = os.stat(name, dir_fd=root, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            return False
        os.unlink(name, dir_fd=root)
    except OSError:
        return False
    return True


def read_exactly(fd: int, size: int) -> bytes:
    parts = []
    remaining = size
    while remaining > 0:
        part = os.read(fd, remaining)
        if not part:
            break
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def unlink_quietly(name: str, dir_fd: int) -> bool:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True


def scan(root: int) -> tuple[list[tuple[int, int, str, str]], int]:
    """Every chunk file as ``(mtime_ns, size, fan-out directory, name)`` and the bytes the cache holds; deletes
    the temporary files of writers that died. Fan-out directories that are not private ones of this user are
    skipped (never counted, never evicted from)."""
    files: list[tuple[int, int, str, str]] = []
    total = 0
    stale = time.time_ns() - STALE_TEMP_SECONDS * 1_000_000_000
    with os.scandir(root) as top:
        subdirs = [e.name for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    for sub in subdirs:
        try:
            fd = open_fanout(root, sub, create=False)
        except OSError:
            continue
        if fd is None:
            continue
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    if entry.name.startswith(TMP_PREFIX):
                        if info.st_mtime_ns < stale and unlink_quietly(entry.name, fd):
                            continue
                        total += info.st_size
                    elif SHA256.fullmatch(entry.name):
                        files.append((info.st_mtime_ns, info.st_size, sub, entry.name))
                        total += info.st_size
        finally:
            os.close(fd)
    return files, total

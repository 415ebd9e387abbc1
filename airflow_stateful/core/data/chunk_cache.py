"""The worker's restore cache: chunks a retry on the same machine does not download again.

Why it is safe to keep checkpoint bytes on local disk and use them later: a chunk is named by the SHA-256 of
its bytes, and a restore only asks for chunks its *committed, verified* tree names, with their SHA-256 and
size. So a file here is used only when its bytes hash to exactly what the tree asks for; anything else (a
torn write, a flipped bit, a file somebody edited) is deleted and the chunk is downloaded. A bad cache can
cost a download, never wrong bytes. ``download_files`` checks the bytes once more before writing them.

What the cache must still protect is confidentiality (checkpoint bytes are sensitive): the directory is
created 0700, must be owned by the worker's user and must not be a symbolic link (a directory another user
planted in a shared ``/tmp`` is refused, and the restore goes on without a cache). Every operation is made
relative to a descriptor of that checked directory, so it cannot be swapped for a link afterwards; the fan-out
directories are opened the same way and used only when private (:mod:`~airflow_stateful.core.data.cache_dirs`),
and a link, FIFO or socket planted in a chunk's place is discarded, never followed or blocked on. Files are
0600.

Several threads (the restore pool) and several processes (tasks on the same worker) share one directory:

* files are written to a temporary name in the same directory and renamed into place, so a reader sees a
  whole file or none;
* the size is capped (``max_bytes``): once over it, the least recently used files (by modification time,
  refreshed on every hit) are deleted down to 90 % of the cap, under an ``flock`` so two processes do not
  both evict; each process rescans the directory after adding an eighth of the cap, so the others' files
  count too (between two scans the cap can be exceeded by at most that much per process);
* a failure of the cache itself (disk full, a read-only or foreign directory) never fails a restore: it is
  logged once as a warning and the restore goes on downloading.

Memory stays bounded: every call handles one chunk (at most 4 MiB).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from airflow_stateful.core.data.cache_dirs import (
    CHUNK_READ,
    SHA256,
    TMP_PREFIX,
    UnsafeCacheDirectory,
    discard_entry,
    fanout,
    open_private_directory,
    read_exactly,
    scan,
    unlink_quietly,
    write_all,
)
from airflow_stateful.core.data.restore import ChunkCache
from airflow_stateful.core.records.trees import ChunkRef, Tree
from airflow_stateful.core.settings import RESTORE_CACHE_MAX_BYTES, StatefulSettings

log = logging.getLogger("airflow_stateful")

_LOCK_FILE = ".lock"
TRIM_TO = 0.9
"""An eviction deletes down to this fraction of ``max_bytes``, so a full cache does not evict on every put."""
RESCAN_EVERY = 8
"""A process rescans the directory after adding ``max_bytes / RESCAN_EVERY`` (other processes add files too)."""


@dataclass(frozen=True)
class CacheStats:
    """What a cache object did so far (counts and bytes); for logs and tests."""

    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    discarded: int = 0
    stored: int = 0
    stored_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0


class LocalChunkCache(ChunkCache):
    """Chunks kept in a directory on the worker, named by their SHA-256, verified on every read.

    Pass it to ``CheckpointStore.restore_files(..., cache=...)``. Nothing is done on disk until first use;
    an unusable directory is then reported once (a warning) and the cache does nothing.

    :param directory: where the chunks live (``<directory>/<sha256[:2]>/<sha256>``); created 0700.
    :param max_bytes: the size the cache is kept under, evicting the least recently used chunks.
    """

    def __init__(
        self, *, directory: str | os.PathLike[str], max_bytes: int = RESTORE_CACHE_MAX_BYTES
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, not {max_bytes!r}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._trim_lock = threading.Lock()
        self._fd: int | None = None
        self._opened = False
        self._reads = True
        self._writes = True
        self._scanned: int | None = None
        self._added = 0
        self._stats = CacheStats()

    def __repr__(self) -> str:
        return f"LocalChunkCache(directory={str(self.directory)!r}, max_bytes={self.max_bytes})"

    @property
    def stats(self) -> CacheStats:
        return self._stats

    @property
    def usable(self) -> bool:
        """False once the directory was refused or failed (the cache then does nothing)."""
        return self._root() is not None

    def close(self) -> None:
        """Close the directory; the cache does nothing afterwards. Call it only once no restore uses it."""
        with self._lock:
            fd, self._fd, self._opened, self._reads = self._fd, None, True, False
        if fd is not None:
            os.close(fd)

    # -- the ChunkCache interface ----------------------------------------------------------------------------
    def get(self, chunk: ChunkRef) -> bytes | None:
        """The chunk's bytes if a file here has exactly its size and SHA-256; ``None`` otherwise (a file that
        does not match is deleted, never returned)."""
        root = self._root()
        if root is None or not self._reads or not SHA256.fullmatch(chunk.sha256):
            return None
        sub = chunk.sha256[:2]
        try:
            with fanout(root, sub) as folder:
                if folder is None:
                    self._count(misses=1)
                    return None
                return self._read_chunk(folder, chunk)
        except UnsafeCacheDirectory as exc:
            if discard_entry(root, sub):
                self._discard_note(sub, f"not a directory of the cache ({exc.strerror})")
            else:
                self._count(misses=1)
                log.warning("restore cache %s: %s/ is not used: %s", self.directory, sub, exc.strerror)
            return None
        except OSError as exc:
            self._fail("read from", exc, reads=True)
            return None

    def _read_chunk(self, folder: int, chunk: ChunkRef) -> bytes | None:
        name = chunk.sha256
        try:
            fd = os.open(name, CHUNK_READ, dir_fd=folder)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, or a socket, in a chunk's place
                self._discard(folder, name, None, f"not a regular file ({exc.strerror})")
                return None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self._discard(folder, name, info, "not a regular file")
                return None
            if info.st_size != chunk.size:
                self._discard(folder, name, info, f"{info.st_size} bytes, expected {chunk.size}")
                return None
            data = read_exactly(fd, chunk.size)
            got = hashlib.sha256(data).hexdigest()
            if len(data) != chunk.size or got != chunk.sha256:
                self._discard(folder, name, info, f"its bytes hash to {got}")
                return None
            with contextlib.suppress(OSError):  # a read-only cache still serves hits
                os.utime(fd)  # most recently used
        finally:
            os.close(fd)
        self._count(hits=1, hit_bytes=len(data))
        return data

    def holds(self, chunk: ChunkRef) -> bool:
        """Whether a file of the chunk's size is here (a stat, no read: for telling a warm cache from a cold one;
        :meth:`get` still verifies the bytes before any are used)."""
        root = self._root()
        if root is None or not self._reads or not SHA256.fullmatch(chunk.sha256):
            return False
        try:
            with fanout(root, chunk.sha256[:2]) as folder:
                if folder is None:
                    return False
                info = os.stat(chunk.sha256, dir_fd=folder, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(info.st_mode) and info.st_size == chunk.size

    def put(self, chunk: ChunkRef, data: bytes) -> None:
        """Keep ``data`` as the chunk (the caller verified it; :meth:`get` verifies it again anyway)."""
        root = self._root()
        if (
            root is None
            or not self._writes
            or not SHA256.fullmatch(chunk.sha256)
            or len(data) != chunk.size
            or chunk.size > self.max_bytes
        ):
            return
        name, tmp = chunk.sha256, f"{TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            with fanout(root, chunk.sha256[:2], create=True) as folder:
                assert folder is not None  # created
                try:
                    fd = os.open(
                        tmp,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                        dir_fd=folder,
                    )
                    try:
                        write_all(fd, data)
                    finally:
                        os.close(fd)
                    os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
                except OSError:
                    unlink_quietly(tmp, folder)
                    raise
        except UnsafeCacheDirectory as exc:
            log.warning(
                "restore cache %s: %s/ is not used: %s", self.directory, chunk.sha256[:2], exc.strerror
            )
            return
        except OSError as exc:
            self._fail("write to", exc, reads=False)
            return
        self._count(stored=1, stored_bytes=len(data))
        with self._lock:
            self._added += len(data)
            due = (
                self._scanned is None
                or self._scanned + self._added > self.max_bytes
                or self._added * RESCAN_EVERY >= self.max_bytes
            )
        if due:
            self.trim()

    # -- beyond the interface ------------------------------------------------------------------------------
    def refresh(self, chunk: ChunkRef) -> bool:
        """True if a file of the chunk's size is here (marked most recently used); its bytes are verified
        only when :meth:`get` reads them."""
        root = self._root()
        if root is None or not self._reads or not SHA256.fullmatch(chunk.sha256):
            return False
        try:
            with fanout(root, chunk.sha256[:2]) as folder:
                if folder is None:
                    return False
                info = os.stat(chunk.sha256, dir_fd=folder, follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode) or info.st_size != chunk.size:
                    return False
                os.utime(chunk.sha256, dir_fd=folder, follow_symlinks=False)
        except OSError:
            return False
        return True

    def remember_files(self, tree: Tree, source: str | os.PathLike[str]) -> int:
        """Keep the chunks of ``tree`` that the cache lacks, read from ``source``: what was just saved.

        The chunks a task uploads are the ones its retry restores, so a commit fills the cache as a restore
        does. ``source`` is the ``files=`` of the save (a file or a directory). Every chunk is hashed again and
        skipped if it no longer matches the tree (the file changed since). A tree larger than the cap is not
        kept at all: a restore reads chunks in order, and least-recently-used eviction would delete each one
        just before it is needed. Never raises; returns the chunks written.
        """
        if tree.total_size > self.max_bytes or self._root() is None or not self._writes:
            return 0
        source = Path(source)
        written = 0
        try:
            single = source.is_file()
            for entry in tree.files:
                missing = [(offset, c) for offset, c in _offsets(entry.chunks) if not self.refresh(c)]
                if not missing or not self._writes:
                    continue
                path = source if single else source / entry.path
                with open(path, "rb") as f:
                    for offset, chunk in missing:
                        f.seek(offset)
                        data = f.read(chunk.size)
                        if len(data) == chunk.size and hashlib.sha256(data).hexdigest() == chunk.sha256:
                            self.put(chunk, data)
                            written += 1
        except OSError as exc:
            log.warning("restore cache %s: not filled from %s: %s", self.directory, source, exc)
        return written

    def trim(self) -> None:
        """Evict least recently used chunks until the cache is within its cap (to 90 % of it) and delete
        temporary files of writers that died. Skipped if another thread of this process is at it."""
        root = self._root()
        if root is None or not self._trim_lock.acquire(blocking=False):
            return
        try:
            lock = os.open(
                _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root
            )
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one evicting process at a time; a scan takes milliseconds
                with self._lock:
                    added_before = self._added
                files, total = scan(root)
                evicted = evicted_bytes = 0
                if total > self.max_bytes:
                    files.sort()
                    goal = int(self.max_bytes * TRIM_TO)
                    for _, size, sub, name in files:
                        if total <= goal:
                            break
                        if self._evict(root, sub, name):
                            total -= size
                            evicted += 1
                            evicted_bytes += size
                with self._lock:
                    self._scanned, self._added = total, self._added - added_before
                if evicted:
                    self._count(evicted=evicted, evicted_bytes=evicted_bytes)
                    log.debug(
                        "restore cache %s: evicted %d chunk(s), %d bytes",
                        self.directory,
                        evicted,
                        evicted_bytes,
                    )
            finally:
                os.close(lock)
        except OSError as exc:
            self._fail("evict from", exc, reads=False)
        finally:
            self._trim_lock.release()

    # -- internals -----------------------------------------------------------------------------------------
    def _root(self) -> int | None:
        if self._opened:
            return self._fd
        with self._lock:
            if not self._opened:
                try:
                    self._fd = open_private_directory(self.directory)
                except OSError as exc:
                    self._reads = self._writes = False
                    log.warning(
                        "restore cache %s not used: %s; restoring without it (point [stateful] "
                        "restore_cache_dir, or STATEFUL_RESTORE_CACHE_DIR in a pod, at a directory of this "
                        "user's, or set it empty to turn the cache off)",
                        self.directory,
                        exc,
                    )
                self._opened = True
        return self._fd

    def _count(self, **increments: int) -> None:
        with self._lock:
            current = self._stats
            self._stats = CacheStats(
                **{
                    name: getattr(current, name) + increments.get(name, 0)
                    for name in CacheStats.__dataclass_fields__
                }
            )

    def _discard(self, folder: int, name: str, info: os.stat_result | None, why: str) -> None:
        """Delete a file that is not the chunk its name says, unless it was replaced meanwhile (by a whole,
        new file, which the next read verifies)."""
        self._discard_note(f"{name[:2]}/{name}", why)
        try:
            now = os.stat(name, dir_fd=folder, follow_symlinks=False)
            if info is None or (now.st_ino, now.st_dev) == (info.st_ino, info.st_dev):
                if stat.S_ISDIR(now.st_mode):
                    return  # a directory in a chunk's place: left alone (and never read)
                os.unlink(name, dir_fd=folder)
        except OSError:
            pass

    def _discard_note(self, what: str, why: str) -> None:
        self._count(discarded=1, misses=1)
        log.warning(
            "restore cache %s: %s is not that chunk (%s); deleted it, downloading", self.directory, what, why
        )

    @staticmethod
    def _evict(root: int, sub: str, name: str) -> bool:
        try:
            with fanout(root, sub) as folder:
                return folder is not None and unlink_quietly(name, folder)
        except OSError:
            return False

    def _fail(self, action: str, exc: OSError, *, reads: bool) -> None:
        """Stop writing (``reads``: and reading) after the first failure, with one warning."""
        with self._lock:
            was_on = self._reads if reads else self._writes
            if reads:
                self._reads = self._writes = False
            else:
                self._writes = False
        if was_on:
            log.warning(
                "restore cache %s: could not %s it (%s); going on without %s",
                self.directory,
                action,
                exc,
                "the cache" if reads else "adding to the cache",
            )


def restore_cache_for(settings: StatefulSettings) -> LocalChunkCache | None:
    """The worker's restore cache as ``[stateful] restore_cache_dir`` and ``restore_cache_max_bytes`` say;
    ``None`` when it is turned off (an empty directory or a cap of 0)."""
    if not settings.restore_cache_dir or settings.restore_cache_max_bytes <= 0:
        return None
    return LocalChunkCache(directory=settings.restore_cache_dir, max_bytes=settings.restore_cache_max_bytes)


def _offsets(chunks: tuple[ChunkRef, ...]) -> list[tuple[int, ChunkRef]]:
    out, offset = [], 0
    for chunk in chunks:
        out.append((offset, chunk))
        offset += chunk.size
    return out

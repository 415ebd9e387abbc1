"""Moving chunks in parallel with bounded memory: the upload of a checkpoint's files and their restore.

Uploading: files are cut into chunks (:mod:`airflow_stateful.core.data.chunking`), each chunk hashed (SHA-256)
and, unless the identity already holds it (a chunk of the checkpoint the writer started from), put to the
store by a pool of threads. The bytes in flight are capped, so memory stays bounded whatever the size or the
number of files. Restoring: every chunk of every file is fetched by the same kind of pool, checked against its
recorded SHA-256 and size, and written at its offset into a staging file.

Both run on one store object shared by the threads (boto3 clients are thread-safe). Errors stop the pool and
are raised on the calling thread; nothing made here is visible until the caller commits (upload) or moves the
staged files into place (restore).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from airflow_stateful.core.data.chunking import iter_chunks
from airflow_stateful.core.data.file_index import FileIndex, FileStatus
from airflow_stateful.core.data.files import LocalFile
from airflow_stateful.core.data.writeback import start_writeback
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    InvalidValueError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from airflow_stateful.core.records.trees import ChunkRef, TreeFile, chunk_key
from airflow_stateful.core.stores.base import ObjectStore, ProgressCallback

MAX_IN_FLIGHT = 12 * 1024 * 1024
"""Bytes of chunk data held by queued and running uploads at most (the RSS bound is built on it)."""
MAX_RESTORE_IN_FLIGHT = 32 * 1024 * 1024
"""The same for a restore. Each chunk is one GET, so fewer than ``parallelism`` of them in flight leave the
pool idle: with 2-4 MiB chunks, 12 MiB kept only 3 to 6 GETs going. A restore holds a chunk only from its
answer to its write, so this costs little more resident memory (tests/test_memory.py)."""
MAX_OPEN_FILES = 128
"""Staging files a restore holds open at once."""


class _Budget:
    """A byte semaphore: ``take(n)`` blocks while more than the cap is in flight (one oversize item may pass)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self.cond = threading.Condition()

    def take(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.cap)
            self.used += n

    def give(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


@dataclass
class UploadResult:
    """What an upload produced: the files as tree entries, and how much was really sent."""

    files: list[TreeFile]
    chunks_sent: int
    bytes_sent: int
    chunks_reused: int
    bytes_reused: int


def upload_files(
    store: ObjectStore,
    *,
    identity: str,
    files: Iterable[LocalFile],
    known: dict[str, ChunkRef],
    commit_id: str,
    workers: int,
    check: Callable[[], None] | None = None,
    progress: ProgressCallback | None = None,
    index: FileIndex | None = None,
    remember: Callable[[ChunkRef, bytes], None] | None = None,
) -> UploadResult:
    """Cut, hash and upload the chunks of ``files`` that ``known`` (sha256 -> chunk the identity keeps) lacks.

    A chunk whose plain name already holds an object nobody references (crash garbage that maintenance may be
    deleting right now) is never adopted: it is written again under a name of this commit's own.
    ``check`` runs before each upload (a writer that lost its lease stops here, before sending more).
    ``index``: the writer's :class:`~airflow_stateful.core.data.file_index.FileIndex`; a file whose status it
    knows, all of whose chunks are in ``known``, is not read at all. Updated when the upload succeeds.
    ``remember`` sees each chunk uploaded, with its bytes (the worker's restore cache): it must not raise.
    """
    budget = _Budget(MAX_IN_FLIGHT)
    placed: dict[str, ChunkRef] = dict(known)
    claimed = set(placed)  # placed, or being uploaded by one of the threads
    lock = threading.Lock()
    sent, reused = [0, 0], [0, 0]
    failures: list[BaseException] = []

    def process(data: bytes) -> str:
        """Hash one chunk and upload it unless the identity holds it or another thread is uploading it.

        Hashing runs here, on the pool (hashlib releases the GIL), while the calling thread cuts the next
        chunks: on two cores cutting and hashing overlap instead of adding up."""
        size = len(data)
        try:
            sha = hashlib.sha256(data).hexdigest()
            with lock:
                if sha in claimed:
                    reused[0] += 1
                    reused[1] += size
                    return sha
                claimed.add(sha)
            if check is not None:
                check()
            key = chunk_key(identity, sha)
            try:
                store.put(key, data, if_none_match=True, adopt_identical=False)
            except PreconditionFailedError:
                key = chunk_key(identity, sha, unique=commit_id)
                store.put(key, data, if_none_match=True)
            ref = ChunkRef(key=key, sha256=sha, size=size)
            with lock:
                placed[sha] = ref
                sent[0] += 1
                sent[1] += size
            if remember is not None:
                remember(ref, data)
            if progress:
                progress(size)
            return sha
        except BaseException as exc:
            failures.append(exc)
            raise
        finally:
            del data
            budget.give(size)

    # Per file: its chunks' futures (each gives the chunk's SHA-256) and sizes, and what the index needs.
    layouts: list[tuple[LocalFile, list[Future[str]] | None, list[tuple[str, int]]]] = []
    staged: list[tuple[str, FileStatus, FileStatus, int, int]] = []  # name, before, after, started, layout
    futures: list[Future[str]] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-up") as pool:
        try:
            for local in files:
                name = os.path.abspath(local.path)
                status = _status(name) if index is not None else None
                if index is not None and status is not None:
                    remembered = index.lookup(name, status)
                    if remembered is not None and all(sha in placed for sha, _ in remembered):
                        index.keep(name, status, remembered)
                        layouts.append((local, None, list(remembered)))
                        reused[0] += len(remembered)
                        reused[1] += sum(size for _, size in remembered)
                        if progress:
                            progress(local.size)
                        continue
                started = time.time_ns()
                mine: list[Future[str]] = []
                sizes: list[tuple[str, int]] = []
                try:
                    for data in iter_chunks(local.path, local.size):
                        if failures:
                            raise failures[0]
                        budget.take(len(data))
                        sizes.append(("", len(data)))
                        mine.append(pool.submit(process, data))
                        del data
                except FileNotFoundError:
                    raise InvalidValueError(
                        f"file {local.rel!r} disappeared while the checkpoint was being saved; nothing was "
                        "committed (the previous checkpoint is intact). Do not change the directory while it is "
                        "saved."
                    ) from None
                if sum(size for _, size in sizes) != local.size:
                    raise InvalidValueError(
                        f"file {local.rel!r} changed size while the checkpoint was being saved; nothing was "
                        "committed. Do not change the directory while it is saved."
                    )
                futures.extend(mine)
                if status is not None:
                    after = _status(name)
                    if after is not None:
                        staged.append((name, status, after, started, len(layouts)))
                layouts.append((local, mine, sizes))
            wait(futures, return_when=FIRST_EXCEPTION)
            if failures:
                raise failures[0]
        except BaseException:
            for future in futures:
                future.cancel()
            if index is not None:
                index.discard()
            raise
    resolved = [
        (
            local,
            [(f.result(), size) for f, (_, size) in zip(mine, sizes, strict=True)]
            if mine is not None
            else sizes,
        )
        for local, mine, sizes in layouts
    ]
    if index is not None:
        for name, before, after, started, n in staged:
            index.stage(name, before, after, tuple(resolved[n][1]), started)
        index.publish()
    tree_files = [
        TreeFile(
            path=local.rel, size=local.size, chunks=tuple(placed[sha] for sha, _ in pieces), mode=local.mode
        )
        for local, pieces in resolved
    ]
    return UploadResult(
        files=tree_files,
        chunks_sent=sent[0],
        bytes_sent=sent[1],
        chunks_reused=reused[0],
        bytes_reused=reused[1],
    )


def _status(path: str) -> FileStatus | None:
    try:
        return FileStatus.of(os.stat(path))
    except OSError:
        return None  # reading it will say what is wrong


def download_files(
    store: ObjectStore,
    *,
    files: Iterable[tuple[TreeFile, Path]],
    workers: int,
    cached: Callable[[ChunkRef], bytes | None] | None = None,
    remember: Callable[[ChunkRef, bytes], None] | None = None,
    progress: ProgressCallback | None = None,
) -> None:
    """Fetch every chunk of each ``(file, staging path)``, verified, written at its offset in the staging file.

    ``cached`` may supply a chunk's bytes from a local cache (they are verified like downloaded ones);
    ``remember`` sees every verified chunk (to fill that cache).
    """
    budget = _Budget(MAX_RESTORE_IN_FLIGHT)
    failures: list[BaseException] = []

    def fetch(chunk: ChunkRef, target: _Staged, offset: int) -> None:
        try:
            data = cached(chunk) if cached is not None else None
            if data is None or hashlib.sha256(data).hexdigest() != chunk.sha256:
                try:
                    data = store.get_chunk(chunk.key, size=chunk.size)
                except ObjectNotFoundError as exc:
                    raise CheckpointCorruptError(
                        f"chunk {chunk.key!r} is missing from {store.url}: {exc}. Nothing was restored."
                    ) from exc
                got = hashlib.sha256(data).hexdigest()
                if len(data) != chunk.size or got != chunk.sha256:
                    raise CheckpointCorruptError(
                        f"chunk {chunk.key!r} in {store.url} is corrupt: expected {chunk.size} bytes with SHA-256 "
                        f"{chunk.sha256}, read {len(data)} bytes with SHA-256 {got}. Nothing was restored; restore "
                        "an older checkpoint (see `airflow-stateful history`)."
                    )
                if remember is not None:
                    remember(chunk, data)
            os.pwrite(target.fd, data, offset)
            start_writeback(target.fd, offset, len(data))  # so the file's fsync has little left to wait for
            target.written()
            if progress:
                progress(len(data))
        except BaseException as exc:
            failures.append(exc)
            raise
        finally:
            budget.give(chunk.size)

    opened: list[_Staged] = []
    futures: list[Future[None]] = []
    parents: set[Path] = set()
    slots = threading.BoundedSemaphore(MAX_OPEN_FILES)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-down") as pool:
        try:
            for tree_file, staged in files:
                if failures:
                    raise failures[0]
                if staged.parent not in parents:
                    staged.parent.mkdir(parents=True, exist_ok=True)
                    parents.add(staged.parent)
                slots.acquire()  # released when the file is closed
                try:
                    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    # The recorded permission bits (owner-only when the tree has none), whatever the umask says;
                    # writing goes on through this descriptor even for a read-only mode.
                    os.fchmod(fd, tree_file.mode if tree_file.mode is not None else 0o600)
                except BaseException:
                    slots.release()
                    raise
                target = _Staged(fd, chunks=len(tree_file.chunks), slots=slots)
                opened.append(target)
                os.ftruncate(target.fd, tree_file.size)
                if not tree_file.chunks:
                    target.finish()
                offset = 0
                for chunk in tree_file.chunks:
                    budget.take(chunk.size)
                    futures.append(pool.submit(fetch, chunk, target, offset))
                    offset += chunk.size
            wait(futures, return_when=FIRST_EXCEPTION)
            if failures:
                raise failures[0]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            wait(futures)
            for target in opened:
                target.close()


class _Staged:
    """A staging file being restored: synced and closed by whichever thread writes its last chunk, so a
    restore of many files holds at most :data:`MAX_OPEN_FILES` open (a worker's default limit is often 1,024
    descriptors), and the fsyncs run on the pool, side by side (the file system commits them together)."""

    def __init__(self, fd: int, *, chunks: int, slots: threading.BoundedSemaphore) -> None:
        self.fd = fd
        self._left = chunks
        self._slots = slots
        self._lock = threading.Lock()

    def written(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.finish()

    def finish(self) -> None:
        os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            finally:
                self._slots.release()

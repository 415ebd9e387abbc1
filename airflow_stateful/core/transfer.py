"""Moving chunks in parallel with bounded memory: the upload of a checkpoint's files and their restore.

Uploading: files are cut into chunks (:mod:`airflow_stateful.core.chunking`), each chunk hashed (SHA-256)
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
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from airflow_stateful.core.chunking import iter_chunks
from airflow_stateful.core.errors import CheckpointCorruptError, ObjectNotFoundError, PreconditionFailedError
from airflow_stateful.core.files import LocalFile
from airflow_stateful.core.stores.base import ObjectStore, ProgressCallback
from airflow_stateful.core.trees import ChunkRef, TreeFile, chunk_key

MAX_IN_FLIGHT = 12 * 1024 * 1024
"""Bytes of chunk data held by queued and running transfers at most (the RSS bound is built on it)."""


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
) -> UploadResult:
    """Cut, hash and upload the chunks of ``files`` that ``known`` (sha256 -> chunk the identity keeps) lacks.

    A chunk whose plain name already holds an object nobody references (crash garbage that maintenance may be
    deleting right now) is never adopted: it is written again under a name of this commit's own.
    ``check`` runs before each upload (a writer that lost its lease stops here, before sending more).
    """
    budget = _Budget(MAX_IN_FLIGHT)
    placed: dict[str, ChunkRef] = dict(known)
    pending: dict[str, Future[ChunkRef]] = {}
    lock = threading.Lock()
    sent = [0, 0]

    def put(sha: str, data: bytes) -> ChunkRef:
        try:
            if check is not None:
                check()
            key = chunk_key(identity, sha)
            try:
                store.put(key, data, if_none_match=True, adopt_identical=False)
            except PreconditionFailedError:
                key = chunk_key(identity, sha, unique=commit_id)
                store.put(key, data, if_none_match=True)
            with lock:
                sent[0] += 1
                sent[1] += len(data)
            if progress:
                progress(len(data))
            return ChunkRef(key=key, sha256=sha, size=len(data))
        finally:
            budget.give(len(data))

    layouts: list[tuple[LocalFile, list[tuple[str, int]]]] = []
    reused = [0, 0]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-up") as pool:
        try:
            for local in files:
                pieces: list[tuple[str, int]] = []
                try:
                    for data in iter_chunks(local.path, local.size):
                        sha = hashlib.sha256(data).hexdigest()
                        pieces.append((sha, len(data)))
                        if sha in placed or sha in pending:
                            if sha in placed:
                                reused[0] += 1
                                reused[1] += len(data)
                            continue
                        budget.take(len(data))
                        pending[sha] = pool.submit(put, sha, data)
                        del data
                except FileNotFoundError:
                    from airflow_stateful.core.errors import InvalidValueError

                    raise InvalidValueError(
                        f"file {local.rel!r} disappeared while the checkpoint was being saved; nothing was "
                        "committed (the previous checkpoint is intact). Do not change the directory while it is "
                        "saved."
                    ) from None
                if sum(size for _, size in pieces) != local.size:
                    from airflow_stateful.core.errors import InvalidValueError

                    raise InvalidValueError(
                        f"file {local.rel!r} changed size while the checkpoint was being saved; nothing was "
                        "committed. Do not change the directory while it is saved."
                    )
                layouts.append((local, pieces))
                _raise_first_error(pending.values())
            done, _ = wait(pending.values(), return_when=FIRST_EXCEPTION)
            _raise_first_error(done)
        except BaseException:
            for future in pending.values():
                future.cancel()
            raise
    for sha, future in pending.items():
        placed[sha] = future.result()
    tree_files = [
        TreeFile(path=local.rel, size=local.size, chunks=tuple(placed[sha] for sha, _ in pieces))
        for local, pieces in layouts
    ]
    return UploadResult(
        files=tree_files,
        chunks_sent=sent[0],
        bytes_sent=sent[1],
        chunks_reused=reused[0],
        bytes_reused=reused[1],
    )


def _raise_first_error(futures: Iterable[Future[ChunkRef]]) -> None:
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]


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
    budget = _Budget(MAX_IN_FLIGHT)

    def fetch(chunk: ChunkRef, fd: int, offset: int) -> None:
        try:
            data = cached(chunk) if cached is not None else None
            if data is None or hashlib.sha256(data).hexdigest() != chunk.sha256:
                try:
                    data = store.get(chunk.key, max_bytes=chunk.size).data
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
            os.pwrite(fd, data, offset)
            if progress:
                progress(len(data))
        finally:
            budget.give(chunk.size)

    descriptors: list[int] = []
    futures: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-down") as pool:
        try:
            for tree_file, staged in files:
                staged.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                descriptors.append(fd)
                os.ftruncate(fd, tree_file.size)
                offset = 0
                for chunk in tree_file.chunks:
                    budget.take(chunk.size)
                    futures.append(pool.submit(fetch, chunk, fd, offset))
                    offset += chunk.size
                _raise_first_error(futures)  # type: ignore[arg-type]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            _raise_first_error(done)  # type: ignore[arg-type]
            for fd in descriptors:
                os.fsync(fd)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            wait(futures)
            for fd in descriptors:
                os.close(fd)

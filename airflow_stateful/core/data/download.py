"""Fetching a checkpoint's chunks into staging files: in parallel, verified, memory bounded.

A chunk that is an object of its own is one GET. Packed chunks (format 5) are grouped by pack and read with
ranged GETs that cover runs of neighbours (:func:`~airflow_stateful.core.data.packs.coalesce`), so a tree of
10,000 small files is restored with a handful of requests. Every chunk is checked against its size and
SHA-256 before a byte of it is written; one wrong chunk fails the restore, naming that chunk (its pack and
offset), and nothing is moved into place (the caller swaps the staging files in only when all are complete).

Each write opens its staging file, writes and closes it, so the files open at once are at most the pool's
threads, whatever the number of files or the order in which their chunks arrive. A file is created (its
recorded permission bits, whatever the umask) by whichever write comes first.

Durability: ``durable=True`` fsyncs every staged file once its last chunk is written (and starts the
write-back of each chunk early, so those fsyncs are short). A task's restore does not need it: the bucket
holds the durable copy, a power cut kills the task, and its retry restores every file again before anything
reads them (docs/adr/0006-packs.md). The restore journal is always fsynced (:mod:`.restore`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from airflow_stateful.core.data.budget import ByteBudget
from airflow_stateful.core.data.packs import coalesce
from airflow_stateful.core.data.writeback import start_writeback
from airflow_stateful.core.errors import CheckpointCorruptError, ObjectNotFoundError
from airflow_stateful.core.records.trees import ChunkRef, TreeFile
from airflow_stateful.core.stores.base import ObjectStore, ProgressCallback

MAX_RESTORE_IN_FLIGHT = 32 * 1024 * 1024
"""Bytes of chunk data held by queued and running downloads at most. Each loose chunk is one GET, so fewer
than ``parallelism`` of them in flight leave the pool idle: with 2-4 MiB chunks, 12 MiB kept only 3 to 6 GETs
going. A restore holds a chunk only from its answer to its write, so this costs little more resident memory
(tests/test_memory.py)."""
MAX_OPEN_FILES = 128
"""Staging files a restore holds open at once, at most (in fact no more than its threads: each write opens,
writes and closes its file)."""


class _Target:
    """One staging file: created by its first write, synced (if durable) by the write that completes it."""

    def __init__(self, path: Path, tree_file: TreeFile, *, durable: bool) -> None:
        self.path, self.size, self.durable = path, tree_file.size, durable
        # The recorded permission bits (owner-only when the tree has none); writing goes on through the
        # descriptor even for a read-only mode.
        self.mode = tree_file.mode if tree_file.mode is not None else 0o600
        self._left = len(tree_file.chunks)
        self._created = False
        self._lock = threading.Lock()

    def create_empty(self) -> None:
        fd = self._open()
        try:
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _open(self) -> int:
        """Open for writing; the first call creates the file (exclusively) and gives it its size and mode."""
        with self._lock:
            if self._created:
                return os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, self.mode)
                if self._left > 1:
                    os.ftruncate(fd, self.size)
            except BaseException:
                os.close(fd)
                raise
            self._created = True
            return fd

    def write(self, data: bytes | memoryview, offset: int) -> None:
        fd = self._open()
        try:
            os.pwrite(fd, data, offset)
            if self.durable:
                start_writeback(fd, offset, len(data))  # so the file's fsync has little left to wait for
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last and self.durable:
                os.fsync(fd)  # every write of the file is done: this covers them all
        finally:
            os.close(fd)


def _check(chunk: ChunkRef, data: bytes | memoryview, store: ObjectStore) -> None:
    got = hashlib.sha256(data).hexdigest()
    if len(data) != chunk.size or got != chunk.sha256:
        where = (
            f"chunk {chunk.sha256} at offset {chunk.offset} of pack {chunk.key!r}"
            if chunk.packed
            else (f"chunk {chunk.key!r}")
        )
        raise CheckpointCorruptError(
            f"{where} in {store.url} is corrupt: expected {chunk.size} bytes with SHA-256 {chunk.sha256}, read "
            f"{len(data)} bytes with SHA-256 {got}. Nothing was restored; restore an older checkpoint (see "
            "`airflow-stateful history`)."
        )


def download_files(
    store: ObjectStore,
    *,
    files: Iterable[tuple[TreeFile, Path]],
    workers: int,
    cached: Callable[[ChunkRef], bytes | None] | None = None,
    remember: Callable[[ChunkRef, bytes], None] | None = None,
    progress: ProgressCallback | None = None,
    durable: bool = False,
) -> None:
    """Fetch every chunk of each ``(file, staging path)``, verified, written at its offset in the staging file.

    ``cached`` may supply a chunk's bytes from a local cache (they are verified like downloaded ones);
    ``remember`` sees every verified chunk downloaded (to fill that cache). ``durable``: fsync each file.
    """
    budget = ByteBudget(MAX_RESTORE_IN_FLIGHT)
    failures: list[BaseException] = []

    def from_cache(chunk: ChunkRef) -> bytes | None:
        data = cached(chunk) if cached is not None else None
        return data if data is not None and hashlib.sha256(data).hexdigest() == chunk.sha256 else None

    def place(chunk: ChunkRef, data: bytes | memoryview, targets: list[tuple[_Target, int]]) -> None:
        for target, offset in targets:
            target.write(data, offset)
            if progress:
                progress(len(data))

    def fetch_loose(chunk: ChunkRef, targets: list[tuple[_Target, int]]) -> None:
        try:
            data = from_cache(chunk)
            if data is None:
                try:
                    data = store.get_chunk(chunk.key, size=chunk.size)
                except ObjectNotFoundError as exc:
                    raise CheckpointCorruptError(
                        f"chunk {chunk.key!r} is missing from {store.url}: {exc}. Nothing was restored."
                    ) from exc
                _check(chunk, data, store)
                if remember is not None:
                    remember(chunk, data)
            place(chunk, data, targets)
        except BaseException as exc:
            failures.append(exc)
            raise
        finally:
            budget.give(chunk.size)

    def fetch_range(key: str, members: list[tuple[ChunkRef, list[tuple[_Target, int]]]], held: int) -> None:
        try:
            missing = []
            for chunk, targets in members:
                data = from_cache(chunk)
                if data is None:
                    missing.append((chunk, targets))
                else:
                    place(chunk, data, targets)
            if missing:
                start = min(c.offset or 0 for c, _ in missing)
                end = max((c.offset or 0) + c.size for c, _ in missing)
                try:
                    blob = store.get_range(key, offset=start, length=end - start)
                except ObjectNotFoundError as exc:
                    raise CheckpointCorruptError(
                        f"pack {key!r} is missing from {store.url}: {exc}. Nothing was restored."
                    ) from exc
                # Slices of the one buffer the GET returned, never copies (the restore's memory bound counts
                # each range once); only the cache keeps a chunk's bytes of its own.
                with memoryview(blob) as view:
                    for chunk, targets in missing:
                        at = (chunk.offset or 0) - start
                        with view[at : at + chunk.size] as piece:
                            _check(chunk, piece, store)
                            if remember is not None:
                                remember(chunk, bytes(piece))
                            place(chunk, piece, targets)
                del blob
        except BaseException as exc:
            failures.append(exc)
            raise
        finally:
            budget.give(held)

    # Plan: which file (and offset in it) each distinct chunk goes to; the packed ones then by range.
    loose: dict[tuple[str, str], tuple[ChunkRef, list[tuple[_Target, int]]]] = {}
    packed: dict[tuple[str, int, str], tuple[ChunkRef, list[tuple[_Target, int]]]] = {}
    parents: set[Path] = set()
    for tree_file, staged in files:
        if staged.parent not in parents:
            staged.parent.mkdir(parents=True, exist_ok=True)
            parents.add(staged.parent)
        target = _Target(staged, tree_file, durable=durable)
        if not tree_file.chunks:
            target.create_empty()
            continue
        offset = 0
        for chunk in tree_file.chunks:
            if chunk.offset is not None:  # the same chunk in two files (or twice in one) is read once
                packed.setdefault((chunk.key, chunk.offset, chunk.sha256), (chunk, []))[1].append(
                    (target, offset)
                )
            else:
                loose.setdefault((chunk.key, chunk.sha256), (chunk, []))[1].append((target, offset))
            offset += chunk.size

    futures: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-down") as pool:
        try:
            for pack_range in coalesce(packed.values()):
                if failures:
                    raise failures[0]
                budget.take(pack_range.length)
                futures.append(
                    pool.submit(fetch_range, pack_range.key, pack_range.members, pack_range.length)
                )
            for chunk, targets in loose.values():
                if failures:
                    raise failures[0]
                budget.take(chunk.size)
                futures.append(pool.submit(fetch_loose, chunk, targets))
            wait(futures, return_when=FIRST_EXCEPTION)
            if failures:
                raise failures[0]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            wait(futures)

"""Uploading a checkpoint's files in parallel with bounded memory (their restore: :mod:`.download`).

Files are cut into chunks (:mod:`airflow_stateful.core.data.chunking`), each chunk hashed (SHA-256) and, unless
the identity already holds it (a chunk of the checkpoint the writer started from), stored by a pool of threads:
a file smaller than :data:`~airflow_stateful.core.data.packs.PACK_BELOW` (one chunk) is appended to the pack
being filled (format 5, :mod:`.packs`), which is uploaded once full; a larger file's chunks are put as objects of
their own. The bytes in flight (read, packed but not yet uploaded, or being uploaded) are capped, so memory
stays bounded whatever the size or the number of files.

It runs on one store object shared by the threads (boto3 clients are thread-safe). Errors stop the pool and are
raised on the calling thread; nothing made here is visible until the caller commits.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from airflow_stateful.core.data.budget import ByteBudget
from airflow_stateful.core.data.chunking import MAX_CHUNK, iter_chunks
from airflow_stateful.core.data.file_index import FileIndex, FileStatus, vouched
from airflow_stateful.core.data.files import LocalFile
from airflow_stateful.core.data.packs import PACK_BELOW, PACK_TARGET, PackBuilder, SealedPack
from airflow_stateful.core.errors import InvalidValueError, PreconditionFailedError
from airflow_stateful.core.records.trees import ChunkRef, TreeFile, chunk_key
from airflow_stateful.core.stores.base import ObjectStore, ProgressCallback

MAX_IN_FLIGHT = 12 * 1024 * 1024
"""Bytes of loose chunk data held by queued and running uploads at most (the RSS bound is built on it)."""
MAX_SAVE_IN_FLIGHT = 2 * PACK_TARGET + MAX_CHUNK
"""Bytes of chunk data a save holds at most, loose and packed together: room for the pack being filled, a
sealed one uploading and the chunks being hashed, so pack uploads overlap the filling of the next pack. Loose
chunks are held within :data:`MAX_IN_FLIGHT` of it, so a tree of large files buffers no more than before packs.
Together, not two budgets side by side: the save's memory bound (tests/test_memory.py) is this one figure."""
INLINE_BELOW = 64 * 1024
"""Files smaller than this (packed) are read, hashed and added to the pack on the calling thread: hashing a few
KiB takes microseconds, less than handing it to the pool and collecting the future (GIL included), so a tree of
many small files no longer pays a pool task per file. Larger packed files are hashed on the pool as before,
overlapping the reading of the next."""


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
    pack: bool = True,
    prior: Mapping[str, TreeFile] | None = None,
    while_packs_land: Callable[[list[TreeFile]], None] | None = None,
) -> UploadResult:
    """Cut, hash and upload the chunks of ``files`` that ``known`` (sha256 -> chunk the identity keeps) lacks.

    A chunk whose plain name already holds an object nobody references (crash garbage that maintenance may be
    deleting right now) is never adopted: it is written again under a name of this commit's own.
    ``check`` runs before each upload (a writer that lost its lease stops here, before sending more).
    ``index``: the writer's :class:`~airflow_stateful.core.data.file_index.FileIndex`; a file whose status it
    knows, all of whose chunks are in ``known``, is not read at all. Updated when the upload succeeds. With an
    index, each file that settled before it was read and did not change while read gets its status recorded in
    its tree entry (``seen``), and ``prior`` (the entries of the tree ``known`` comes from, by path) is trusted
    the same way: a file whose status and size equal its entry's ``seen`` is not read either, whichever process
    saved it (what restic does with its parent snapshot; docs/adr/0006-packs.md).
    ``remember`` sees each chunk uploaded, with its bytes (the worker's restore cache): it must not raise.
    ``pack``: put files below :data:`~airflow_stateful.core.data.packs.PACK_BELOW` into packs (format 5); off,
    every chunk is an object of its own (what releases before format 5 read).
    ``while_packs_land`` is given the tree's entries as soon as every chunk has its place, while the last packs
    are still being uploaded (the caller writes the tree meanwhile: a 10,000-file tree's PUT is as long as a
    pack's); if it raises, the save fails as if an upload had.
    """
    loose_budget = ByteBudget(MAX_IN_FLIGHT)
    save_budget = ByteBudget(MAX_SAVE_IN_FLIGHT)

    def take(size: int, packed: bool) -> None:
        """Hold a chunk's bytes before it is read on: a loose one in both budgets, a packed one in the save's."""
        if not packed:
            loose_budget.take(size)
        save_budget.take(size)

    def give(size: int, packed: bool) -> None:
        save_budget.give(size)
        if not packed:
            loose_budget.give(size)

    packs = PackBuilder(identity=identity, commit_id=commit_id) if pack else None
    pack_futures: list[Future[None]] = []
    placed: dict[str, ChunkRef] = dict(known)
    claimed = set(placed)  # placed, or being uploaded by one of the threads
    lock = threading.Lock()
    sent, reused = [0, 0], [0, 0]
    failures: list[BaseException] = []

    def upload_pack(sealed: SealedPack) -> None:
        """Put a full pack (its name is this commit's alone: never taken, never adopted)."""
        try:
            if check is not None:
                check()
            # The pack's mapping as it is (stores write any bytes-like object; boto3 reads it as a file),
            # never a copy.
            store.put(sealed.key, cast(bytes, sealed.data), if_none_match=True)
        except BaseException as exc:
            failures.append(exc)
            raise
        finally:
            give(len(sealed.data), True)
            sealed.close()

    def seal(sealed: SealedPack | None) -> None:
        if sealed is not None:
            with lock:
                pack_futures.append(pool.submit(upload_pack, sealed))

    def process(data: bytes, packed: bool) -> str:
        """Hash one chunk and store it unless the identity holds it or another thread is storing it.

        Hashing runs here, on the pool (hashlib releases the GIL), while the calling thread cuts the next
        chunks: on two cores cutting and hashing overlap instead of adding up. A small chunk goes into the
        pack being filled (``packed``) and its bytes stay counted against the budget until that pack is
        uploaded."""
        size = len(data)
        held = size  # given back here, unless the pack now holds them
        try:
            sha = hashlib.sha256(data).hexdigest()
            if packed:
                assert packs is not None
                with lock:  # one lock section per packed chunk: claimed, appended and placed at once
                    if sha in claimed:
                        reused[0] += 1
                        reused[1] += size
                        return sha
                    claimed.add(sha)
                    ref, sealed = packs.add(sha, data)
                    placed[sha] = ref
                    sent[0] += 1
                    sent[1] += size
                held = 0
                seal(sealed)
                if remember is not None:
                    remember(ref, data)
                if progress:
                    progress(size)
                return sha
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
            if held:
                give(held, packed)

    # Per file: its tree entry when the index gave it, else its chunks' futures (each gives the chunk's
    # SHA-256) and sizes; and what the index needs.
    layouts: list[TreeFile | tuple[LocalFile, list[Future[str]] | None, list[tuple[str, int]]]] = []
    staged: list[tuple[str, FileStatus, FileStatus, int, int]] = []  # name, before, after, started, layout
    futures: list[Future[str]] = []
    # Without a file this writer saved before, there is nothing to look up: no file is stat()ed for it.
    indexed = index is not None and len(index) > 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-up") as pool:
        try:
            for local in files:
                name = local.where
                if not os.path.isabs(name):  # a single file given by a relative path; a tree's are absolute
                    name = os.path.abspath(name)
                inline = packs is not None and local.size < INLINE_BELOW
                status = None
                if index is not None:
                    # The status the listing saw (before any reading), else a stat of our own.
                    status = local.status if local.status is not None else _status(name)
                if index is not None and status is not None:
                    entry = index.lookup(name, status) if indexed else None
                    if entry is None and prior is not None:
                        entry = prior.get(local.rel)
                        if entry is not None and (entry.seen is None or not _seen_as(entry, status)):
                            entry = None
                    if entry is not None and _still_held(entry, local, placed):
                        index.keep(name, status, entry)
                        layouts.append(entry)
                        reused[0] += len(entry.chunks)
                        reused[1] += entry.size
                        if progress:
                            progress(local.size)
                        continue
                started = time.time_ns()
                if inline:
                    if failures:
                        raise failures[0]
                    data, before, settled = _read_whole(local, status)
                    pieces: list[tuple[str, int]] = []
                    if data:
                        take(len(data), True)
                        pieces.append((process(data, True), len(data)))
                        del data
                    if index is not None:
                        staged.append((name, status or before, settled, started, len(layouts)))
                    layouts.append((local, None, pieces))
                    continue
                # A file smaller than PACK_BELOW is one chunk, and it goes into a pack; a larger file's chunks
                # (a few MiB each) stay objects of their own, as before packs.
                packed = packs is not None and local.size < PACK_BELOW
                mine: list[Future[str]] = []
                sizes: list[tuple[str, int]] = []
                try:
                    for data in iter_chunks(Path(local.where), local.size):
                        if failures:
                            raise failures[0]
                        take(len(data), packed)
                        sizes.append(("", len(data)))
                        mine.append(pool.submit(process, data, packed))
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
            if packs is not None:
                seal(packs.flush())  # every chunk is hashed: the last pack is complete
            tree_files = _tree_files(layouts, staged, placed)  # every chunk has its place
            if while_packs_land is not None:
                while_packs_land(tree_files)
            wait(pack_futures, return_when=FIRST_EXCEPTION)
            if failures:
                raise failures[0]
        except BaseException:
            for future in futures:
                future.cancel()
            for pack_future in pack_futures:
                pack_future.cancel()
            if index is not None:
                index.discard()
            raise
    if index is not None:
        for name, before, after, started, n in staged:
            index.stage(name, before, after, tree_files[n], started)
        index.publish()
    return UploadResult(
        files=tree_files,
        chunks_sent=sent[0],
        bytes_sent=sent[1],
        chunks_reused=reused[0],
        bytes_reused=reused[1],
    )


def _tree_files(
    layouts: list[TreeFile | tuple[LocalFile, list[Future[str]] | None, list[tuple[str, int]]]],
    staged: list[tuple[str, FileStatus, FileStatus, int, int]],
    placed: dict[str, ChunkRef],
) -> list[TreeFile]:
    """The tree's entries, in the files' order, once every chunk has its place (``placed``): each file's as the
    index gave it, or made of its chunks, with its status when it can be recorded."""
    # The files whose status can be recorded: settled before they were read and unchanged while read.
    seen = {
        n: (before.device, before.inode, before.mtime_ns, before.ctime_ns)
        for _, before, after, started, n in staged
        if vouched(before, after, started)
    }
    tree_files: list[TreeFile] = []
    for n, item in enumerate(layouts):
        if isinstance(item, TreeFile):
            tree_files.append(item)
            continue
        local, hashing, sizes = item
        shas = [f.result() for f in hashing] if hashing is not None else [sha for sha, _ in sizes]
        tree_files.append(
            TreeFile(
                path=local.rel,
                size=local.size,
                chunks=tuple([placed[sha] for sha in shas]),
                mode=local.mode,
                seen=seen.get(n),
            )
        )
    return tree_files


def _seen_as(entry: TreeFile, status: FileStatus) -> bool:
    """Whether the file of ``status`` is the one ``entry`` recorded as seen, unchanged since (see
    :mod:`.file_index` for why an equal status means equal bytes)."""
    return entry.size == status.size and entry.seen == (
        status.device,
        status.inode,
        status.mtime_ns,
        status.ctime_ns,
    )


def _still_held(entry: TreeFile, local: LocalFile, placed: dict[str, ChunkRef]) -> bool:
    """Whether the index's ``entry`` for ``local`` may go into the new tree as it is: it records the file under
    the same path and mode, and every chunk it names is, as named, in the tree the save deduplicates against
    (so kept by the identity; a chunk of a commit that failed, or of a checkpoint since dropped, is not)."""
    if entry.path != local.rel or entry.mode != local.mode or entry.size != local.size:
        return False
    for chunk in entry.chunks:
        held = placed.get(chunk.sha256)
        if held is not chunk and held != chunk:
            return False
    return True


def _read_whole(local: LocalFile, status: FileStatus | None) -> tuple[bytes, FileStatus, FileStatus]:
    """A small file's bytes, read on the calling thread, and its status before and after (of the file read).
    ``status``: the listing's, taken as before (a file replaced since has another inode, so the two differ).

    One open and a read or two instead of a buffered reader, a chunker and a pool task: for a tree of many
    small files this per-file machinery cost more than the bytes (docs/performance.md)."""
    try:
        fd = os.open(local.where, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InvalidValueError(
            f"file {local.rel!r} disappeared while the checkpoint was being saved; nothing was committed (the "
            "previous checkpoint is intact). Do not change the directory while it is saved."
        ) from None
    try:
        before = status if status is not None else FileStatus.of(os.fstat(fd))
        parts: list[bytes] = []
        got = 0
        while got <= local.size:  # one byte past the listed size tells a file that grew
            asked = local.size + 1 - got
            part = os.read(fd, asked)
            parts.append(part)
            got += len(part)
            if len(part) < asked:  # a short read of a regular file is its end: no second call to find it
                break
        after = FileStatus.of(os.fstat(fd))
    finally:
        os.close(fd)
    if got != local.size:
        raise InvalidValueError(
            f"file {local.rel!r} changed size while the checkpoint was being saved; nothing was committed. Do "
            "not change the directory while it is saved."
        )
    return (parts[0] if len(parts) == 1 else b"".join(parts)), before, after


def _status(path: str) -> FileStatus | None:
    try:
        return FileStatus.of(os.stat(path))
    except OSError:
        return None  # reading it will say what is wrong

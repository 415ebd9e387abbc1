"""Packs: many small chunks in one object, so a tree of small files costs a few PUTs and a few ranged GETs.

A save appends every file smaller than :data:`PACK_BELOW` (such a file is one chunk) to the pack it is filling; at
:data:`PACK_TARGET` bytes the pack is sealed and uploaded (in parallel with the next one being filled, and with
the hashing and reading of the files), under a name only this commit writes (``~packs/<commit_id>-<n>``), so
no other writer and no GC can ever hold that name. The tree records, per packed chunk, its pack, offset, size
and SHA-256 (docs/adr/0006-packs.md). A restore groups the packed chunks it needs by pack and reads
neighbouring ones with one ranged GET (:func:`coalesce`): skipping a gap smaller than :data:`MAX_GAP` costs
more in requests than reading it.

This module only builds packs and plans ranges; :mod:`~airflow_stateful.core.data.transfer` uploads them and
:mod:`~airflow_stateful.core.data.download` reads them.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from airflow_stateful.core.records.trees import ChunkRef, pack_key

MIB = 1024 * 1024
PACK_BELOW = 1 * MIB
"""Files smaller than this (each one chunk) go into packs. The chunks of larger files stay objects of their own:
one such chunk is already a request's worth of bytes (0.5-4 MiB), an object of its own is deleted the moment no
checkpoint needs it, and a large file then never holds a pack's worth of memory while it streams."""
PACK_TARGET = 8 * MIB
"""A pack is sealed once it holds this many bytes (docs/performance.md: the measurement behind it). Packs of
8 MiB keep a tree of 10,000 small files to a few objects; two of them in flight (one filling, one uploading)
keep a save within its 64 MiB memory bound on S3, where 16 MiB packs did not (peak RSS growth 72-96 MiB)."""


def mostly_small(count: int, total: int) -> bool:
    """Whether ``count`` files of ``total`` bytes average below :data:`PACK_BELOW` (a tree that goes into packs:
    a few records per file and little time per byte), which a save and a restore run with the cyclic garbage
    collector paused (:mod:`airflow_stateful.core.collector`); a tree of large files, mostly transfer time, not."""
    return count > 0 and total < count * PACK_BELOW


MAX_GAP = 256 * 1024
"""Neighbouring chunks of one pack closer than this are read by one GET (the gap's bytes are dropped)."""
MAX_RANGE = 4 * MIB
"""The longest ranged GET a restore sends: two or more per pack, so a restore of one pack still runs in
parallel, and a GET's buffer is no larger than a loose chunk's (the restore's memory bound)."""


@dataclass(frozen=True)
class SealedPack:
    """A full pack, ready to upload: its key, its bytes (an anonymous mapping: :meth:`close` it once
    uploaded) and how many chunks it holds."""

    key: str
    data: mmap.mmap
    chunks: int

    def close(self) -> None:
        """Give the pack's memory back (its bytes are gone after this)."""
        self.data.close()


class PackBuilder:
    """The pack a save is filling; thread-safe (the upload pool's threads add the chunks they hashed).

    :param identity: whose pack (its key is below it).
    :param commit_id: the commit that writes it: the name is that commit's alone.
    :param target: seal at this many bytes.
    """

    def __init__(self, *, identity: str, commit_id: str, target: int = PACK_TARGET) -> None:
        self._identity, self._commit_id, self._target = identity, commit_id, target
        self._lock = threading.Lock()
        self._n = 0
        self._buffer: mmap.mmap | None = None
        self._fill = 0
        self._chunks = 0

    def add(self, sha256: str, data: bytes) -> tuple[ChunkRef, SealedPack | None]:
        """Append a chunk (smaller than :data:`PACK_BELOW`); returns where it now lives, and the pack if this
        chunk filled it."""
        size = len(data)
        if size >= PACK_BELOW:
            raise ValueError(f"a chunk of {size} bytes is not packed (packs hold chunks below {PACK_BELOW})")
        with self._lock:
            if self._buffer is None:
                # An anonymous mapping of the pack's whole capacity, filled in place: its pages are touched only
                # as they are written and go back to the system the moment the uploaded pack is closed. A
                # bytearray grown by appending is reallocated as it grows, and the freed copies fragment the
                # heap: a save of 64 MiB of small files then grew peak RSS by 52-70 MiB (docs/adr/0006).
                self._buffer = mmap.mmap(-1, self._target + PACK_BELOW)
                # Huge pages where the system has them: filling 8 MiB of 4 KiB pages took a page fault per
                # small file, 3 µs each here, three times what the copy costs (docs/performance.md).
                advice = getattr(mmap, "MADV_HUGEPAGE", None)
                if advice is not None:
                    with contextlib.suppress(OSError):
                        self._buffer.madvise(advice)
            ref = ChunkRef(
                key=pack_key(self._identity, self._commit_id, self._n),
                sha256=sha256,
                size=size,
                offset=self._fill,
            )
            self._buffer[self._fill : self._fill + size] = data
            self._fill += size
            self._chunks += 1
            sealed = self._seal() if self._fill >= self._target else None
        return ref, sealed

    def flush(self) -> SealedPack | None:
        """Seal the pack being filled, if it holds anything (the end of a save)."""
        with self._lock:
            return self._seal() if self._chunks else None

    def _seal(self) -> SealedPack:
        # The buffer itself, not a copy: a second 8 MiB while the first is still referenced would cost the
        # save's memory bound a whole pack. Cut to its filled length in place; nothing writes to it after.
        buffer = self._buffer
        assert buffer is not None
        buffer.resize(self._fill)
        sealed = SealedPack(
            key=pack_key(self._identity, self._commit_id, self._n),
            data=buffer,
            chunks=self._chunks,
        )
        self._buffer = None
        self._fill = 0
        self._chunks = 0
        self._n += 1
        return sealed


T = TypeVar("T")


@dataclass
class PackRange(Generic[T]):
    """One ranged GET: ``length`` bytes of pack ``key`` from ``offset``, holding ``members`` (each a packed
    chunk and what the caller needs to place it)."""

    key: str
    offset: int
    length: int
    members: list[tuple[ChunkRef, T]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.offset + self.length


def coalesce(
    chunks: Iterable[tuple[ChunkRef, T]], *, max_gap: int = MAX_GAP, max_range: int = MAX_RANGE
) -> list[PackRange[T]]:
    """The ranged GETs that read every packed chunk of ``chunks``: per pack, in offset order, neighbours whose
    gap is below ``max_gap`` share a GET of at most ``max_range`` bytes (a longer chunk gets one of its own).
    Chunks that overlap or repeat (the same chunk in two files) are read once, with their neighbours."""
    by_pack: dict[str, list[tuple[ChunkRef, T]]] = {}
    for chunk, target in chunks:
        assert chunk.offset is not None, "only packed chunks are read by range"
        by_pack.setdefault(chunk.key, []).append((chunk, target))
    ranges: list[PackRange[T]] = []
    for key, members in by_pack.items():
        members.sort(key=lambda m: (m[0].offset or 0, m[0].size))
        current: PackRange[T] | None = None
        for chunk, target in members:
            start = chunk.offset or 0
            end = start + chunk.size
            if (
                current is not None
                and start - current.end <= max_gap
                and max(end, current.end) - current.offset <= max_range
            ):
                current.length = max(end, current.end) - current.offset
            else:
                current = PackRange(key=key, offset=start, length=chunk.size)
                ranges.append(current)
            current.members.append((chunk, target))
    return ranges

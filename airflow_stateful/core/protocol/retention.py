"""Retention policies: what an identity keeps, as small objects the commit path and GC share.

* :class:`KeepLast` — which committed checkpoints the head keeps (a commit applies it, and so can GC);
* :class:`IdleFor` — when a whole identity is unused long enough to delete;
* :class:`CrashGarbage` — which unreferenced objects (left by crashed or fenced commits, or failed retention
  deletes) may go, and which must stay because a lease holder's commit may still reference them.

They only decide; :mod:`airflow_stateful.core.fleet.gc` reads the store, applies them and deletes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Protocol

from airflow_stateful.core.records.formats import MANIFEST_DIR, MAX_KEPT
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
from airflow_stateful.core.records.trees import CHUNK_DIR, PACK_DIR, TREE_DIR, Tree, TreeRef
from airflow_stateful.core.settings import GC_MIN_AGE, LEASE_GRACE
from airflow_stateful.core.stores.base import ObjectInfo
from airflow_stateful.core.timestamps import parse_iso

STAMP_RESOLUTION = timedelta(seconds=1)
"""How coarse a store's last-modified stamps may be: S3 (and moto) stamp objects to the whole second, so an
object written 0.9 s after an acquisition can carry a stamp 0.1 s *before* it."""


class RetentionPolicy(Protocol):
    def split(
        self, entries: Sequence[CheckpointEntry]
    ) -> tuple[list[CheckpointEntry], list[CheckpointEntry]]:
        """Return ``(keep, drop)`` for entries ordered oldest first; the newest is always kept."""
        ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the newest ``n`` checkpoints (``n >= 1``), and every pinned one besides (they do not count in ``n``).

    A pinned checkpoint (:class:`~airflow_stateful.core.records.heads.PinRecord`) is the newer code's state that older
    code set aside during a deploy rollback: evicting it would lose what the rollforward resumes from.
    """

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_KEPT:
            raise ValueError(f"keep_last must be an integer from 1 to {MAX_KEPT}, not {self.n!r}")

    def split(
        self, entries: Sequence[CheckpointEntry]
    ) -> tuple[list[CheckpointEntry], list[CheckpointEntry]]:
        unpinned = [e for e in entries if e.pinned is None]
        cut = max(len(unpinned) - self.n, 0)
        dropped = {e.commit_id for e in unpinned[:cut]}
        return [e for e in entries if e.commit_id not in dropped], [
            e for e in entries if e.commit_id in dropped
        ]

    def due(self, entries: Sequence[CheckpointEntry]) -> bool:
        """Whether :meth:`split` would drop anything."""
        return sum(1 for e in entries if e.pinned is None) > self.n


@dataclass(frozen=True)
class IdleFor:
    """An identity whose head was not updated for longer than ``duration`` is idle (deleted whole by GC).

    A writer's lease renewals update the head, so an identity with a live writer is never idle.
    """

    duration: timedelta

    def due(self, head: HeadRecord, now: float) -> bool:
        return bool(head.updated_at) and now - parse_iso(head.updated_at) > self.duration.total_seconds()


@dataclass(frozen=True)
class References:
    """Every object the checkpoints a head keeps need: manifests, trees, chunks and packs (a pack is needed
    while one kept tree names one chunk in it).

    ``chunks_known`` is False when the trees were not read (a caller without store access): then no chunk
    counts as unreferenced, so nothing a kept checkpoint needs can be mistaken for garbage.
    """

    keys: frozenset[str] = frozenset()
    chunks_known: bool = True
    pack_live_bytes: dict[str, int] = field(default_factory=dict, compare=False)
    """Per pack a kept tree names, the bytes of its chunks some kept checkpoint still needs (each chunk once,
    however many files or checkpoints name it); the rest of the pack is dead until it is repacked."""


def references(head: HeadRecord | None, *, trees: Callable[[TreeRef], Tree] | None = None) -> References:
    """What ``head``'s kept checkpoints reference; ``trees`` reads (and verifies) a tree to name its chunks."""
    if head is None:
        return References()
    keys: set[str] = set()
    live: dict[str, set[tuple[int, int]]] = {}
    for entry in head.checkpoints:
        if entry.manifest is not None:
            keys.add(entry.manifest)
        for tree in (entry.tree, entry.outputs_tree):  # the checkpoint's files, and the outputs it carries
            if tree is not None:
                keys.add(tree.key)
                if trees is not None:
                    read = trees(tree)
                    keys.update(read.chunk_keys())
                    for chunk in (c for f in read.files for c in f.chunks if c.offset is not None):
                        live.setdefault(chunk.key, set()).add((chunk.offset or 0, chunk.size))
    return References(
        keys=frozenset(keys),
        chunks_known=trees is not None or not any(e.tree or e.outputs_tree for e in head.checkpoints),
        pack_live_bytes={key: sum(size for _, size in spans) for key, spans in live.items()},
    )


@dataclass(frozen=True)
class PackUsage:
    """An identity's packs as a listing and its kept trees see them: what ``du`` and ``gc --dry-run`` report.

    ``dead_bytes`` are bytes inside packs that are kept (a kept checkpoint needs one chunk in them) but that no
    kept checkpoint needs: the store bills them until those packs are repacked (docs/adr/0006-packs.md).
    """

    packs: int = 0
    bytes: int = 0
    live_bytes: int = 0

    @property
    def dead_bytes(self) -> int:
        return self.bytes - self.live_bytes


def pack_usage(identity_key: str, infos: Iterable[ObjectInfo], refs: References) -> PackUsage:
    """:class:`PackUsage` of the kept packs among ``infos`` (unreferenced ones are garbage, counted as such)."""
    packs = [
        i
        for i in infos
        if i.key[len(identity_key) + 1 :].partition("/")[0] == PACK_DIR and i.key in refs.pack_live_bytes
    ]
    return PackUsage(
        packs=len(packs),
        bytes=sum(i.size for i in packs),
        # Never more than the object's size (a tree naming bytes past a pack's end is refused when read).
        live_bytes=sum(min(refs.pack_live_bytes[i.key], i.size) for i in packs),
    )


def unreferenced(
    identity_key: str, infos: Iterable[ObjectInfo], head: HeadRecord | None, *, refs: References | None = None
) -> list[ObjectInfo]:
    """The objects of ``infos`` in ``identity_key``'s own folders (manifests, trees, chunks, packs) that no kept
    checkpoint references. The head itself and nested identities' objects never qualify, and neither does
    anything else: format 1's ``~data/`` objects in particular, whose references only a format-1 record could
    show (this version refuses those, docs/formats.md), so they are never taken for garbage.

    :param refs: the references, trees read (:func:`references` with ``trees``); default: from the head alone,
        which leaves every chunk alone.
    """
    refs = refs if refs is not None else references(head)
    found = []
    for info in infos:
        rest = info.key[len(identity_key) + 1 :]
        top = rest.partition("/")[0]
        if (top in (MANIFEST_DIR, TREE_DIR) and info.key not in refs.keys) or (
            top in (CHUNK_DIR, PACK_DIR) and refs.chunks_known and info.key not in refs.keys
        ):
            found.append(info)
    return found


@dataclass(frozen=True)
class CrashGarbage:
    """Unreferenced objects older than ``min_age``, minus what a lease holder's commit may still reference.

    A lease holder only ever references objects it uploaded itself (all written after it took the lease) and
    data its newest checkpoint already references. So every unreferenced object written before the holder's
    acquisition is garbage forever, while the holder's own uploads are protected for as long as its lease
    stands: ``last_modified >= acquired_at - grace - 1 s`` (``grace`` absorbs clock skew between the holder,
    which stamps ``acquired_at``, and the store, which stamps ``last_modified``; the second absorbs the store's
    :data:`STAMP_RESOLUTION`). Only once the lease is broken (dead past ttl + grace, see
    :mod:`airflow_stateful.core.protocol.lease`) are those uploads garbage too.

    :param min_age: leave younger objects alone whatever the lease (an extra margin; 0 disables it).
    :param grace: the lease grace, in seconds.
    """

    min_age: timedelta = GC_MIN_AGE
    grace: float = LEASE_GRACE

    def protected_after(self, head: HeadRecord | None) -> datetime | None:
        """Objects modified at or after this may belong to the lease holder's commit (``None``: no lease)."""
        if head is None or head.lease is None:
            return None
        acquired = datetime.fromtimestamp(parse_iso(head.lease.acquired_at), tz=timezone.utc)
        return acquired - timedelta(seconds=self.grace) - STAMP_RESOLUTION

    def split(
        self,
        identity_key: str,
        infos: Iterable[ObjectInfo],
        head: HeadRecord | None,
        *,
        refs: References | None = None,
        wall_now: datetime | None = None,
    ) -> tuple[list[ObjectInfo], list[ObjectInfo]]:
        """``(garbage, held)``: old unreferenced objects, and those of them the current lease protects."""
        cutoff = (wall_now or datetime.now(tz=timezone.utc)) - self.min_age
        protected_after = self.protected_after(head)
        garbage, held = [], []
        for info in unreferenced(identity_key, infos, head, refs=refs):
            if info.last_modified > cutoff:
                continue
            if protected_after is not None and info.last_modified >= protected_after:
                held.append(info)
            else:
                garbage.append(info)
        return garbage, held

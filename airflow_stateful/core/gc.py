"""Garbage collection of one identity: objects no committed checkpoint references.

Garbage comes from commits that crashed or were fenced after uploading data but before (or instead of)
advancing the head, and from retention deletes that failed. It is never referenced by the head, so removing
it can never damage a checkpoint a reader can see.

The one danger is a *slow* writer whose lease expired while it was still uploading: its objects look like
garbage, and if GC removed them and the writer then advanced the head, the head would point at missing data.
So GC never touches an identity under a live lease, and before deleting anything under an expired lease it
breaks that lease (raising the epoch). The slow writer's commit then fails with FencedError instead.
Objects younger than ``min_age`` are also left alone, as a margin for in-flight commits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.records import DATA_DIR, MANIFEST_DIR, HeadRecord
from airflow_stateful.core.stores.base import ObjectInfo

log = logging.getLogger("airflow_stateful")

DEFAULT_MIN_AGE = timedelta(hours=1)


@dataclass
class GarbageReport:
    """What a GC pass found (and, unless it was a dry run, deleted)."""

    identity: str
    deleted: list[str] = field(default_factory=list)
    bytes: int = 0
    skipped_reason: str | None = None


def _referenced(head: HeadRecord | None) -> tuple[set[str], set[str]]:
    if head is None:
        return set(), set()
    return {e.manifest for e in head.checkpoints}, {ref for e in head.checkpoints for ref in e.data_refs}


def unreferenced(
    identity_key: str, infos: Iterable[ObjectInfo], head: HeadRecord | None, cutoff: datetime
) -> list[ObjectInfo]:
    """The objects of ``infos`` under ``identity_key`` that ``head`` does not reference, modified at or before
    ``cutoff``. Shared by :func:`collect_garbage` and the store-wide planner, so both judge garbage alike.

    The head itself and objects of nested identities (anything outside ``~manifests/`` and ``~data/``) are
    never candidates.
    """
    manifests, commits = _referenced(head)
    found = []
    for info in infos:
        rest = info.key[len(identity_key) + 1 :]
        top, _, tail = rest.partition("/")
        ours = (top == MANIFEST_DIR and info.key not in manifests) or (
            top == DATA_DIR and tail.partition("/")[0] not in commits
        )
        if ours and info.last_modified <= cutoff:
            found.append(info)
    return found


def collect_garbage(
    checkpoints: CheckpointStore,
    *,
    min_age: timedelta = DEFAULT_MIN_AGE,
    dry_run: bool = False,
) -> GarbageReport:
    """Delete this identity's unreferenced objects older than ``min_age``."""
    identity = checkpoints.identity
    store = checkpoints.store
    report = GarbageReport(identity=identity.key)
    head = checkpoints.head()
    now = checkpoints.clock()
    if head is not None and head.lease is not None and not head.lease.expired(now):
        report.skipped_reason = (
            f"live lease held by {head.lease.holder.describe()} until {head.lease.expires_at}"
        )
        return report

    # Object ages are judged on the wall clock, the store's own time domain (last-modified stamps).
    cutoff = datetime.now(tz=timezone.utc) - min_age
    manifests, commits = _referenced(head)
    candidates = unreferenced(identity.key, store.list_objects(f"{identity.key}/"), head, cutoff)
    if not candidates:
        return report
    report.deleted = [c.key for c in candidates]
    report.bytes = sum(c.size for c in candidates)
    if dry_run:
        return report

    if head is not None and head.lease is not None:
        # Expired lease: fence its holder before its objects can disappear under it.
        fenced = checkpoints.break_lease()
        if fenced is None or _referenced(fenced) != (manifests, commits):
            report.deleted, report.bytes = [], 0
            report.skipped_reason = "the head changed during GC; run it again"
            return report
    store.delete_many(report.deleted)
    log.info(
        "gc %s: deleted %d unreferenced object(s), %d bytes", identity, len(report.deleted), report.bytes
    )
    return report

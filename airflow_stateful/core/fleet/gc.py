"""Garbage collection and retention for a whole store (or one identity): a plan, then an apply.

Why a plan: an operator must be able to see what a GC pass *would* delete (``--dry-run``) and trust that the
real pass deletes that list and nothing else. :func:`plan_gc` only reads; :func:`apply_gc` deletes only keys
of the plan, after re-checking each identity's head. Objects that appeared after the plan are left for the
next pass. :func:`collect_garbage` is the same engine on one identity, for crash garbage only.

What is due, per identity (one listing of the store grouped by identity, plus one head read each), with the
policies of :mod:`airflow_stateful.core.protocol.retention`:

``idle``
    the identity's lifetime ended by age (:mod:`airflow_stateful.core.fleet.lifetimes`: not updated for longer than
    ``idle_for``, and neither able to run again nor failed within ``keep_failed_for``): every object of the
    identity goes, head first.
``released``
    per-run state of a task that succeeded longer than ``release_after_success`` ago: the same.
``retention``
    more than ``keep_last`` checkpoints are kept: the oldest are dropped from the head by compare-and-swap,
    then their manifests and the data no kept checkpoint refers to.
``crash-garbage``
    objects under ``~manifests/``, ``~trees/`` and ``~chunks/`` the head does not reference, older than
    ``min_age``.
``orphan``
    objects of an identity folder with no head at all, older than ``min_age`` (a purge that crashed half-way).
``expired-state``
    task/asset state store documents whose ``expires_at`` passed.

**Maintenance never fences or robs a live writer** (docs/adr/0003-lease-renewal-and-maintenance.md). A lease
is *held* until it has gone unrenewed for longer than its ttl plus ``grace``; writers renew theirs in the
background, so a healthy writer's lease is always held. Under a held lease GC changes nothing in the head (no
retention, no idle deletion: the writer applies its own ``keep_last`` at every commit) and deletes only crash
garbage written before the holder took the lease, which no commit of the holder can reference. A lease that
is *dead* (unrenewed past ttl + grace) is broken — inside a compare-and-swap that re-checks it is still
that same, still dead lease, so a renewal that lands first wins — before any object its holder wrote is
deleted; its holder's next commit then fails with FencedError instead of pointing at missing data.

**GC never deletes what it cannot see is unreferenced.** An identity whose head this version refuses with
FormatVersionError (format 1, written by pre-release builds, or a newer release's format) is kept whole and
reported (``skipped``, with the error), and the pass goes on with the rest of the store. Format 1's ``~data/``
objects are never collected as garbage or by retention; they go only with their whole identity (one whose head
this version reads, which therefore references none of them) or with an orphan.

Two clocks: ``now`` (seconds since the epoch) judges head times (``updated_at``, lease expiry) and state
document expiry, the writers' time domain; object ages (``min_age``) and the lease-acquisition cutoff are
compared with the store's own last-modified stamps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    FormatVersionError,
    LeaseHeldError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StatefulError,
)
from airflow_stateful.core.fleet.gc_plan import (
    DEFAULT_MIN_AGE,
    EXPIRED,
    EXPIRED_STATE,
    GARBAGE,
    IDLE,
    ORPHAN,
    RELEASED,
    REPACK,
    RETENTION,
    WHOLE,
    GcPlan,
    IdentityPlan,
    Progress,
    group_by_identity,
    plan_gc,
    plan_identity,
    references_of,
)
from airflow_stateful.core.fleet.repack import rewrite
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.lease import Lease, check_holder
from airflow_stateful.core.protocol.marks import MarkStore, RolledBackError
from airflow_stateful.core.protocol.retention import (
    CrashGarbage,
    unreferenced,
)
from airflow_stateful.core.protocol.state_documents import MAX_DOCUMENT_BYTES, StateDocument
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.settings import LEASE_GRACE
from airflow_stateful.core.stores.base import ObjectStore

log = logging.getLogger("airflow_stateful")

__all__ = [
    "DEFAULT_MIN_AGE",
    "EXPIRED",
    "EXPIRED_STATE",
    "GARBAGE",
    "IDLE",
    "ORPHAN",
    "RELEASED",
    "REPACK",
    "RETENTION",
    "GarbageReport",
    "GcPlan",
    "GcResult",
    "IdentityPlan",
    "Progress",
    "apply_gc",
    "collect_garbage",
    "group_by_identity",
    "plan_gc",
]


class _Changed(StatefulError):
    """The head moved since the plan; the identity is skipped."""


@dataclass
class GcResult:
    """What :func:`apply_gc` deleted, and which identities it skipped because they changed."""

    deleted: list[str] = field(default_factory=list)
    bytes: int = 0
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"deleted": sorted(self.deleted), "bytes": self.bytes, "skipped": dict(self.skipped)}


@dataclass
class GarbageReport:
    """What :func:`collect_garbage` found in one identity (and, unless it was a dry run, deleted)."""

    identity: str
    deleted: list[str] = field(default_factory=list)
    bytes: int = 0
    skipped_reason: str | None = None


def apply_gc(plan: GcPlan, *, progress: Progress | None = None) -> GcResult:
    """Delete exactly the keys of ``plan``, re-validating each identity first; changed ones are skipped."""
    result = GcResult()
    store = plan.store
    for item in plan.identities:
        if item.reasons:
            try:
                if item.identity == EXPIRED_STATE:
                    deleted = _delete_expired(store, item.reasons[EXPIRED], plan.now)
                    note = None
                else:
                    deleted, note = _apply_identity(
                        store, item, grace=plan.grace, signer=plan.signer, marks=plan.marks
                    )
                    if note:
                        result.skipped[item.identity] = note
            except (_Changed, LeaseHeldError, FormatVersionError, RolledBackError) as exc:  # its head changed
                result.skipped[item.identity] = str(exc)
                log.info("gc: skipped %s: %s", item.identity, exc)
            else:
                result.deleted.extend(deleted)
                result.bytes += sum(item.objects[k].size for k in deleted if k in item.objects)
        if progress:
            progress(1)
    if result.deleted:
        log.info("gc: deleted %d object(s) from %s", len(result.deleted), store.url)
    return result


def _same(a: HeadRecord | None, b: HeadRecord | None) -> bool:
    """Whether two heads hold the same checkpoints under the same lease (renewals and ``updated_at`` aside)."""
    if a is None or b is None:
        return a is b
    token = (a.lease.token if a.lease else None, b.lease.token if b.lease else None)
    return (a.epoch, a.next_seq, a.checkpoints, token[0]) == (b.epoch, b.next_seq, b.checkpoints, token[1])


def _apply_identity(
    store: ObjectStore,
    item: IdentityPlan,
    *,
    grace: float,
    signer: HeadSigner | None,
    marks: MarkStore | None,
) -> tuple[list[str], str | None]:
    """The keys deleted, and what was left undone and why (a repack that could not be done)."""
    identity = Identity.parse(item.identity)
    cs = CheckpointStore(store=store, identity=identity, signer=signer, marks=marks, clock=time.time)
    if ORPHAN in item.reasons:
        if cs.head() is not None:
            raise _Changed("it got a head since the plan; run GC again")
        store.delete_many(item.reasons[ORPHAN])  # new objects (a new writer's) are not in the plan
        return list(item.reasons[ORPHAN]), None
    if any(reason in item.reasons for reason in WHOLE):
        return _delete_identity(cs, item, grace=grace), None
    deleted: list[str] = []
    if RETENTION in item.reasons:
        keep = set(item.keep)

        def decide(head: HeadRecord | None) -> HeadRecord:
            if not _same(head, item.head):
                raise _Changed("its head changed since the plan; run GC again")
            assert head is not None
            if head.lease is not None and not head.lease.dead(cs.clock(), grace=grace):
                raise LeaseHeldError(f"{cs.identity} was leased by {head.lease.holder.describe()} meanwhile")
            return head.evolve(checkpoints=tuple(e for e in head.checkpoints if e.commit_id in keep))

        cs.heads.update(decide)
        store.delete_many(item.reasons[RETENTION])
        deleted += item.reasons[RETENTION]
    if GARBAGE in item.reasons:
        deleted += _delete_garbage(cs, item, grace=grace)
    if REPACK in item.reasons:
        try:
            deleted += _repack(cs, item, grace=grace)
        except (_Changed, CheckpointCorruptError) as exc:
            # What is done is done (retention, garbage); the packs stay as they are, whole and named.
            log.warning("gc %s: %s", cs.identity, exc)
            return deleted, f"packs not repacked: {exc}"
    return deleted, None


def _repack(cs: CheckpointStore, item: IdentityPlan, *, grace: float) -> list[str]:
    """Rewrite the planned packs, swap the head to name the copies, then delete what it no longer names.

    Only while the head keeps exactly the checkpoints planned (after this pass's retention) and no lease
    stands: a dead one is broken first (its holder's next commit is fenced), a held one skips the identity.
    See :mod:`airflow_stateful.core.fleet.repack` for why a kill at any point loses nothing.
    """
    assert item.head is not None and item.repack is not None
    keep = set(item.keep) if RETENTION in item.reasons else {e.commit_id for e in item.head.checkpoints}
    planned = tuple(e for e in item.head.checkpoints if e.commit_id in keep)
    head = cs.head()
    if head is not None and head.lease is not None:
        try:
            head = cs.break_lease(grace=grace, token=head.lease.token)
        except LeaseHeldError as exc:
            raise _Changed(f"not repacked: {exc}") from exc
    if head is None or head.checkpoints != planned:
        raise _Changed("its checkpoints changed since the plan; not repacked, run GC again")
    before = head
    rewritten = rewrite(cs, before, set(item.repack.packs))

    def decide(current: HeadRecord | None) -> HeadRecord:
        if (
            current is None
            or current.lease is not None
            or (current.epoch, current.next_seq, current.checkpoints)
            != (before.epoch, before.next_seq, before.checkpoints)
        ):
            raise _Changed("a writer took the identity while it was being repacked; run GC again")
        swapped = current.evolve(checkpoints=rewritten.checkpoints)
        return swapped.evolve(format=swapped.written_format)

    after = cs.heads.update(decide)
    log.info(
        "gc %s: repacked %d pack(s) into %d (%d bytes copied, %d dead bytes freed)",
        cs.identity,
        len(item.repack.packs),
        rewritten.packs_written,
        rewritten.bytes_copied,
        item.repack.dead_bytes,
    )
    planned_keys = item.reasons[REPACK]
    infos = [item.objects[k] for k in planned_keys if k in item.objects]
    gone = {i.key for i in unreferenced(item.identity, infos, after, refs=references_of(cs, after, []))}
    keys = [k for k in planned_keys if k in gone]
    cs.store.delete_many(keys)
    return keys


def _delete_garbage(cs: CheckpointStore, item: IdentityPlan, *, grace: float) -> list[str]:
    """Delete the planned garbage that is still garbage under the head as it is now.

    A planned dead lease is broken first (only if it is still that lease, still dead). Then every candidate
    is re-checked against a fresh head: not referenced, and older than the current lease's acquisition.
    """
    if item.break_token is not None:
        try:
            cs.break_lease(grace=grace, token=item.break_token)
        except LeaseHeldError as exc:
            log.info("gc %s: not breaking the lease: %s", cs.identity, exc)
    head = cs.head()
    candidates = [item.objects[k] for k in item.reasons[GARBAGE]]
    still = {
        i.key
        for i in unreferenced(
            item.identity, candidates, head, refs=references_of(cs, head, []) if head else None
        )
    }
    protected_after = CrashGarbage(grace=grace).protected_after(head)
    keys = []
    for info in candidates:
        if info.key not in still:
            log.error("gc %s: %s became referenced after the plan; it is kept", cs.identity, info.key)
            continue
        if protected_after is not None and info.last_modified >= protected_after:
            continue  # written under the lease that stands now: its holder's commit may use it
        keys.append(info.key)
    cs.store.delete_many(keys)
    return keys


def _delete_identity(cs: CheckpointStore, item: IdentityPlan, *, grace: float) -> list[str]:
    """Take the lease (never stealing a held one), then delete the head conditionally and the planned objects.

    Not :meth:`CheckpointStore.purge`: purge deletes whatever a fresh listing shows, while GC must delete
    exactly the planned keys (objects that appeared since are left for the next pass).
    """
    lease: Lease = cs.acquire(
        holder=WriterInfo.current(task_id="airflow-stateful gc"), steal=False, grace=grace
    )
    head, etag = cs.heads.load()
    try:
        head = check_holder(head, lease, action="delete the state of")
    except StatefulError as exc:
        raise _Changed(str(exc)) from exc
    assert item.head is not None and etag is not None
    if (head.next_seq, head.checkpoints, head.outcome) != (
        item.head.next_seq,
        item.head.checkpoints,
        item.head.outcome,
    ):
        cs.release(lease)
        raise _Changed("its head changed since the plan (a new try?); run GC again")
    try:
        cs.store.delete(cs.heads.key, if_match=etag)
    except PreconditionFailedError as exc:
        raise _Changed("its head changed while it was being deleted") from exc
    reason = next(r for r in WHOLE if r in item.reasons)
    rest = [k for k in item.reasons[reason] if k != cs.heads.key]
    cs.store.delete_many(rest)
    log.info("gc: deleted %s identity %s (%d objects): %s", reason, cs.identity, len(rest) + 1, item.why)
    return list(item.reasons[reason])


def _delete_expired(store: ObjectStore, keys: list[str], now: float) -> list[str]:
    """Delete the planned state documents that are still expired, each conditional on the ETag judged."""
    when = datetime.fromtimestamp(now, tz=timezone.utc)
    deleted = []
    for key in keys:
        try:
            blob = store.get(key, max_bytes=MAX_DOCUMENT_BYTES)
            doc = StateDocument.from_bytes(blob.data, where=f"{key!r} in {store.url}")
        except (ObjectNotFoundError, CheckpointCorruptError, FormatVersionError):
            continue
        if not doc.expired(when):
            continue
        try:
            store.delete(key, if_match=blob.etag)
        except PreconditionFailedError:
            continue
        deleted.append(key)
    return deleted


def collect_garbage(
    checkpoints: CheckpointStore,
    *,
    min_age: timedelta = DEFAULT_MIN_AGE,
    grace: float = LEASE_GRACE,
    dry_run: bool = False,
) -> GarbageReport:
    """Delete one identity's crash garbage older than ``min_age`` (never what a held lease may still use)."""
    identity = checkpoints.identity
    infos = list(checkpoints.store.list_objects(f"{identity.key}/"))
    item = plan_identity(
        checkpoints.store,
        identity.key,
        [i for i in infos if i.key.startswith(f"{identity.key}/~")],
        now=checkpoints.clock(),
        lives=None,
        keep_last=None,
        garbage=CrashGarbage(min_age=min_age, grace=grace),
        signer=checkpoints.signer,
    )
    report = GarbageReport(identity=identity.key, skipped_reason=item.skipped)
    planned = item.reasons.get(GARBAGE, [])
    if dry_run or not planned:
        report.deleted = list(planned)
    else:
        cs = CheckpointStore(
            store=checkpoints.store, identity=identity, signer=checkpoints.signer, clock=checkpoints.clock
        )
        report.deleted = _delete_garbage(cs, item, grace=grace)
        log.info("gc %s: deleted %d unreferenced object(s)", identity, len(report.deleted))
    report.bytes = sum(item.objects[k].size for k in report.deleted)
    return report

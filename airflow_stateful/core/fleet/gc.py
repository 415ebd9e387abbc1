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
    objects under ``~manifests/`` and ``~data/`` the head does not reference, older than ``min_age``.
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

Two clocks: ``now`` (seconds since the epoch) judges head times (``updated_at``, lease expiry) and state
document expiry, the writers' time domain; object ages (``min_age``) and the lease-acquisition cutoff are
compared with the store's own last-modified stamps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
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
from airflow_stateful.core.fleet import lifetimes
from airflow_stateful.core.fleet.catalog import HEAD_READERS, ordered_map
from airflow_stateful.core.fleet.lifetimes import Lifetimes, RunStates, Verdict, lifetime_of
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.lease import Lease, check_holder
from airflow_stateful.core.protocol.retention import (
    CrashGarbage,
    IdleFor,
    KeepLast,
    References,
    references,
    unreferenced,
)
from airflow_stateful.core.protocol.state_documents import MAX_DOCUMENT_BYTES, StateDocument, collect_expired
from airflow_stateful.core.records.formats import DATA_DIR, HEAD_NAME, MANIFEST_DIR
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.trees import CHUNK_DIR, TREE_DIR
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.settings import GC_MIN_AGE, KEEP_FAILED_FOR, LEASE_GRACE
from airflow_stateful.core.stores.base import ObjectInfo, ObjectStore

log = logging.getLogger("airflow_stateful")

IDLE, RETENTION, GARBAGE, ORPHAN, EXPIRED = "idle", "retention", "crash-garbage", "orphan", "expired-state"
RELEASED = lifetimes.RELEASED
WHOLE = (IDLE, RELEASED)
"""Reasons that delete a whole identity, head first."""
EXPIRED_STATE = "~state-store"
"""The pseudo-identity under which expired task/asset state documents are reported."""
DEFAULT_MIN_AGE = GC_MIN_AGE

Progress = Callable[[int], None]


class _Changed(StatefulError):
    """The head moved since the plan; the identity is skipped."""


@dataclass
class IdentityPlan:
    """What GC will do to one identity (or, for ``EXPIRED_STATE``, to the state store documents)."""

    identity: str
    reasons: dict[str, list[str]] = field(default_factory=dict)
    """Keys to delete, by reason (``idle``, ``retention``, ``crash-garbage``, ``orphan``, ``expired-state``)."""
    bytes: int = 0
    skipped: str | None = None
    """What is left alone and why (a held lease)."""
    head: HeadRecord | None = None
    keep: tuple[str, ...] = ()
    """For ``retention``: commit ids of the checkpoints the head keeps."""
    break_token: str | None = None
    """For ``crash-garbage``: the dead lease to break before its holder's objects are deleted."""
    objects: dict[str, ObjectInfo] = field(default_factory=dict, repr=False)
    lifetime: Verdict | None = None
    """The lifetime verdict on the whole identity (why it is kept or deleted); ``None`` for an orphan."""

    @property
    def keys(self) -> list[str]:
        return [k for keys in self.reasons.values() for k in keys]

    def action(self, *, dry_run: bool, skipped: str | None = None) -> str:
        """What a pass did (or would do) to this identity, for people: ``deleted``, ``skipped: why``, ...

        :param skipped: why :func:`apply_gc` skipped the identity, if it did.
        """
        if skipped:
            return f"skipped: {skipped}"
        if not self.reasons:
            return f"skipped: {self.skipped}"
        verb = "would delete" if dry_run else "deleted"
        return f"{verb} ({self.skipped})" if self.skipped else verb

    @property
    def why(self) -> str:
        """One line for people: why the identity is deleted or kept as a whole."""
        if ORPHAN in self.reasons:
            return "orphan: objects without a head (a purge that stopped half-way)"
        if self.identity == EXPIRED_STATE:
            return "expired task/asset state documents"
        return self.lifetime.reason if self.lifetime is not None else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "identity": self.identity,
            "reasons": {r: list(k) for r, k in self.reasons.items()},
            "objects": len(self.keys),
            "bytes": self.bytes,
            "skipped": self.skipped,
            "lifetime": self.why,
        }


@dataclass
class GcPlan:
    """The result of :func:`plan_gc`: per identity, the exact keys a real pass deletes."""

    store: ObjectStore
    now: float
    grace: float = LEASE_GRACE
    identities: list[IdentityPlan] = field(default_factory=list)
    """Identities the pass changes (or leaves alone for a stated reason: ``skipped``)."""
    kept: list[IdentityPlan] = field(default_factory=list)
    """Every other identity, each with the lifetime verdict that keeps it (``gc --dry-run`` shows why)."""
    airflow: str | None = None
    """Where Airflow was asked whether runs are finished, or why it was not (for the report)."""

    @property
    def keys(self) -> list[str]:
        return sorted(k for p in self.identities for k in p.keys)

    @property
    def everything(self) -> list[IdentityPlan]:
        """Acted-on and kept identities, in key order."""
        return sorted([*self.identities, *self.kept], key=lambda p: p.identity)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store.url,
            "now": self.now,
            "airflow": self.airflow,
            "identities": [p.to_json() for p in self.identities],
            "kept": [{"identity": p.identity, "lifetime": p.why} for p in self.kept],
        }


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


def group_by_identity(store: ObjectStore, prefix: str = "") -> dict[str, list[ObjectInfo]]:
    """One listing of the store, grouped by identity key; the library's ``~...`` top folders are left out.

    ``~`` cannot occur in an identity segment, so the first ``/~`` of a key ends its identity.
    """
    groups: dict[str, list[ObjectInfo]] = {}
    for info in store.list_objects(prefix):
        cut = info.key.find("/~")
        if info.key.startswith("~") or cut < 0:
            continue
        key = info.key[:cut]
        rest = info.key[cut + 1 :]
        if rest != HEAD_NAME and rest.partition("/")[0] not in (MANIFEST_DIR, DATA_DIR, TREE_DIR, CHUNK_DIR):
            continue
        try:
            Identity.parse(key)
        except ValueError:
            continue
        groups.setdefault(key, []).append(info)
    return groups


def _describe_lease(head: HeadRecord) -> str:
    lease = head.lease
    assert lease is not None
    return f"{lease.holder.describe()}, renewed {lease.last_renewed}, until {lease.expires_at}"


def _plan_identity(
    store: ObjectStore,
    key: str,
    infos: list[ObjectInfo],
    *,
    now: float,
    lives: Lifetimes | None,
    keep_last: KeepLast | None,
    garbage: CrashGarbage,
    airflow: RunStates | None = None,
) -> IdentityPlan:
    item = IdentityPlan(identity=key, objects={i.key: i for i in infos})
    identity = Identity.parse(key)
    cs = CheckpointStore(store=store, identity=identity)
    head = cs.head() if cs.heads.key in item.objects else None
    item.head = head
    cutoff = datetime.now(tz=timezone.utc) - garbage.min_age
    if head is None:
        # No head: a purge that crashed after deleting it (or a head deleted since the listing).
        old = [i.key for i in infos if i.key != cs.heads.key and i.last_modified <= cutoff]
        if old:
            item.reasons[ORPHAN] = old
        return item
    held = head.lease is not None and not head.lease.dead(now, grace=garbage.grace)
    notes: list[str] = []
    if lives is not None:
        item.lifetime = lifetime_of(
            head, identity, now=now, lives=lives, grace=garbage.grace, airflow=airflow
        )
    if held:
        # The writer is alive (or may be): its head is its own. Only garbage from before its lease goes.
        idle = IdleFor(lives.idle_for) if lives is not None and lives.idle_for is not None else None
        if idle is not None and idle.due(head, now):
            notes.append("idle, but a held lease is never broken")
        elif keep_last is not None and keep_last.due(head.checkpoints):
            notes.append("retention is left to its writer")
    elif item.lifetime is not None and item.lifetime.delete:
        item.reasons[item.lifetime.action] = [i.key for i in infos]
        return item
    refs = _references(cs, head, notes)
    if not held and keep_last is not None and keep_last.due(head.checkpoints):
        keep, _drop = keep_last.split(list(head.checkpoints))
        kept_head = head.evolve(checkpoints=tuple(keep))
        freed = unreferenced(key, infos, kept_head, refs=_references(cs, kept_head, notes))
        already = {i.key for i in unreferenced(key, infos, head, refs=refs)}
        item.keep = tuple(e.commit_id for e in keep)
        item.reasons[RETENTION] = [i.key for i in freed if i.key not in already]
    stale, holders = garbage.split(key, infos, head, refs=refs)
    if holders and held:
        notes.append(f"{len(holders)} unreferenced object(s) written under it are kept")
        holders = []
    elif holders:
        assert head.lease is not None
        item.break_token = head.lease.token  # dead past its grace: break it, then its uploads are garbage
    planned = set(item.keys)
    found = [i.key for i in (*stale, *holders) if i.key not in planned]
    if found:
        item.reasons[GARBAGE] = found
    if notes:
        who = f"live lease held by {_describe_lease(head)}" if held else "partly skipped"
        item.skipped = f"{who}: {'; '.join(notes)}"
    return item


def _references(cs: CheckpointStore, head: HeadRecord, notes: list[str]) -> References:
    """What ``head``'s kept checkpoints need, their trees read; if a tree cannot be read, chunks are left alone."""
    try:
        return references(head, trees=cs.content.tree_of)
    except StatefulError as exc:
        notes.append(f"its chunks are left alone: {exc}")
        return references(head)


def plan_gc(
    store: ObjectStore,
    *,
    now: float | None = None,
    idle_for: timedelta | None = None,
    release_after_success: timedelta | None = None,
    keep_failed_for: timedelta | None = KEEP_FAILED_FOR,
    airflow: RunStates | None = None,
    keep_last: int | None = None,
    min_age: timedelta = DEFAULT_MIN_AGE,
    grace: float = LEASE_GRACE,
    prefix: str = "",
    expired_state: bool = True,
    progress: Progress | None = None,
    groups: dict[str, list[ObjectInfo]] | None = None,
) -> GcPlan:
    """Read the store and decide what a GC pass deletes, changing nothing.

    :param now: seconds since the epoch for head times and state expiry (default: the wall clock).
    :param idle_for: delete identities whose head was not updated for this long (default: never), unless their
        task can still run or failed within ``keep_failed_for`` (:mod:`airflow_stateful.core.fleet.lifetimes`).
    :param release_after_success: delete per-run state this long after its task succeeded (default: by age).
    :param keep_failed_for: keep per-run state of a task that failed for good at least this long.
    :param airflow: where to ask whether a run is finished before deleting its state (default: not asked;
        the heads' recorded outcomes decide alone).
    :param keep_last: keep at most this many checkpoints per identity (default: leave history alone).
    :param min_age: unreferenced objects younger than this are left alone.
    :param grace: seconds past its expiry before a lease counts as dead (``[stateful] lease_grace``).
    :param prefix: only identities whose key starts with this.
    :param expired_state: also plan the deletion of expired task/asset state documents (whole store).
    :param progress: called once per identity planned.
    :param groups: a listing already grouped by :func:`group_by_identity` (saves a listing).
    """
    now = time.time() if now is None else now
    retention = KeepLast(keep_last) if keep_last is not None else None
    lives = Lifetimes(
        idle_for=idle_for, release_after_success=release_after_success, keep_failed_for=keep_failed_for
    )
    garbage = CrashGarbage(min_age=min_age, grace=grace)
    plan = GcPlan(store=store, now=now, grace=grace)
    if groups is None:
        groups = group_by_identity(store, prefix)
    listed = groups

    def plan_identity(key: str) -> IdentityPlan:
        return _plan_identity(
            store,
            key,
            listed[key],
            now=now,
            lives=lives,
            keep_last=retention,
            garbage=garbage,
            airflow=airflow,
        )

    # The identities' heads (and what their planning reads with them) are read HEAD_READERS at a time; the
    # plans come back in key order, and the first that fails raises as the serial loop did.
    for item in ordered_map(plan_identity, sorted(groups), workers=HEAD_READERS):
        item.bytes = sum(item.objects[k].size for k in item.keys if k in item.objects)
        if item.reasons or item.skipped:
            plan.identities.append(item)
        else:
            plan.kept.append(item)
        if progress:
            progress(1)
    if expired_state and not prefix:
        report = collect_expired(store, now=datetime.fromtimestamp(now, tz=timezone.utc), dry_run=True)
        if report.deleted:
            plan.identities.append(IdentityPlan(identity=EXPIRED_STATE, reasons={EXPIRED: report.deleted}))
    return plan


def apply_gc(plan: GcPlan, *, progress: Progress | None = None) -> GcResult:
    """Delete exactly the keys of ``plan``, re-validating each identity first; changed ones are skipped."""
    result = GcResult()
    store = plan.store
    for item in plan.identities:
        if item.reasons:
            try:
                if item.identity == EXPIRED_STATE:
                    deleted = _delete_expired(store, item.reasons[EXPIRED], plan.now)
                else:
                    deleted = _apply_identity(store, item, grace=plan.grace)
            except (_Changed, LeaseHeldError) as exc:
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


def _apply_identity(store: ObjectStore, item: IdentityPlan, *, grace: float) -> list[str]:
    cs = CheckpointStore(store=store, identity=Identity.parse(item.identity), clock=time.time)
    if ORPHAN in item.reasons:
        if cs.head() is not None:
            raise _Changed("it got a head since the plan; run GC again")
        store.delete_many(item.reasons[ORPHAN])  # new objects (a new writer's) are not in the plan
        return list(item.reasons[ORPHAN])
    if any(reason in item.reasons for reason in WHOLE):
        return _delete_identity(cs, item, grace=grace)
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
    return deleted


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
            item.identity, candidates, head, refs=_references(cs, head, []) if head else None
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
    item = _plan_identity(
        checkpoints.store,
        identity.key,
        [i for i in infos if i.key.startswith(f"{identity.key}/~")],
        now=checkpoints.clock(),
        lives=None,
        keep_last=None,
        garbage=CrashGarbage(min_age=min_age, grace=grace),
    )
    report = GarbageReport(identity=identity.key, skipped_reason=item.skipped)
    planned = item.reasons.get(GARBAGE, [])
    if dry_run or not planned:
        report.deleted = list(planned)
    else:
        cs = CheckpointStore(store=checkpoints.store, identity=identity, clock=checkpoints.clock)
        report.deleted = _delete_garbage(cs, item, grace=grace)
        log.info("gc %s: deleted %d unreferenced object(s)", identity, len(report.deleted))
    report.bytes = sum(item.objects[k].size for k in report.deleted)
    return report

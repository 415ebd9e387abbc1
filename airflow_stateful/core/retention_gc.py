"""Store-wide retention and garbage collection as a plan, then an apply that deletes exactly the plan.

Why a plan: an operator must be able to see what a GC pass *would* delete (``--dry-run``) and trust that the
real pass deletes that list and nothing else. So :func:`plan_gc` only reads, and :func:`apply_gc` deletes
only the keys of the plan, after re-checking each identity's head: if anything changed since the plan (a
writer committed, took a lease, an orphan got a head), that identity is skipped and reported, never
re-planned on the fly. Objects that appeared after the plan are left for the next pass.

Policies, per identity (one listing of the whole store, grouped by identity, plus one head read each):

``idle``
    the head was last updated longer than ``idle_for`` ago: every object of the identity goes, head first.
    Apply takes the lease *without stealing* (a live lease refuses), which fences any expired holder, then
    deletes the head conditionally and the rest.
``retention``
    more than ``keep_last`` checkpoints are kept: the oldest are dropped from the head by compare-and-swap
    (exactly like a commit's retention), then their manifests and the data no kept checkpoint refers to.
``crash-garbage``
    objects under ``~manifests/`` and ``~data/`` the head does not reference, older than ``min_age``
    (left by crashed or fenced commits; see :mod:`airflow_stateful.core.gc`).
``orphan``
    objects of an identity folder with no head at all, older than ``min_age``: an ``on_success="delete"``
    purge (which deletes the head first) that crashed half-way.
``expired-state``
    task/asset state store documents whose ``expires_at`` passed (:func:`~airflow_stateful.core.kv.collect_expired`).

Nothing is ever deleted under a live lease. An expired lease is removed (and its epoch raised, fencing its
holder) before anything of that identity is deleted. Touching the head this way updates its ``updated_at``,
so an identity GC had to prune or unlock counts as used again for ``idle_for``.

Two clocks: ``now`` (seconds since the epoch) judges head times (``updated_at``, lease expiry) and state
document expiry, the writers' time domain; object ages (``min_age``) are judged on the wall clock against
the store's own last-modified stamps, as :func:`~airflow_stateful.core.gc.collect_garbage` does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    FormatVersionError,
    LeaseHeldError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StatefulError,
)
from airflow_stateful.core.gc import DEFAULT_MIN_AGE, unreferenced
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.kv import StateDocument, collect_expired
from airflow_stateful.core.lease import Lease, check_holder
from airflow_stateful.core.records import DATA_DIR, HEAD_NAME, MANIFEST_DIR, HeadRecord, WriterInfo, parse_iso
from airflow_stateful.core.retention import KeepLast
from airflow_stateful.core.stores.base import ObjectInfo, ObjectStore

log = logging.getLogger("airflow_stateful")

IDLE, RETENTION, GARBAGE, ORPHAN, EXPIRED = "idle", "retention", "crash-garbage", "orphan", "expired-state"
EXPIRED_STATE = "~state-store"
"""The pseudo-identity under which expired task/asset state documents are reported."""

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
    """Why nothing is planned although something might be due (a live lease)."""
    head: HeadRecord | None = None
    keep: tuple[str, ...] = ()
    """For ``retention``: commit ids of the checkpoints the head keeps."""

    @property
    def keys(self) -> list[str]:
        return [k for keys in self.reasons.values() for k in keys]

    def to_json(self) -> dict[str, Any]:
        return {
            "identity": self.identity,
            "reasons": {r: list(k) for r, k in self.reasons.items()},
            "objects": len(self.keys),
            "bytes": self.bytes,
            "skipped": self.skipped,
        }


@dataclass
class GcPlan:
    """The result of :func:`plan_gc`: per identity, the exact keys a real pass deletes."""

    store: ObjectStore
    now: float
    identities: list[IdentityPlan] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return sorted(k for p in self.identities for k in p.keys)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store.url,
            "now": self.now,
            "identities": [p.to_json() for p in self.identities],
        }


@dataclass
class GcResult:
    """What :func:`apply_gc` deleted, and which identities it skipped because they changed."""

    deleted: list[str] = field(default_factory=list)
    bytes: int = 0
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"deleted": sorted(self.deleted), "bytes": self.bytes, "skipped": dict(self.skipped)}


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
        if rest != HEAD_NAME and rest.partition("/")[0] not in (MANIFEST_DIR, DATA_DIR):
            continue
        try:
            Identity.parse(key)
        except ValueError:
            continue
        groups.setdefault(key, []).append(info)
    return groups


def plan_gc(
    store: ObjectStore,
    *,
    now: float | None = None,
    idle_for: timedelta | None = None,
    keep_last: int | None = None,
    min_age: timedelta = DEFAULT_MIN_AGE,
    prefix: str = "",
    expired_state: bool = True,
    progress: Progress | None = None,
    groups: dict[str, list[ObjectInfo]] | None = None,
) -> GcPlan:
    """Read the store and decide what a GC pass deletes, changing nothing.

    :param now: seconds since the epoch for head times and state expiry (default: the wall clock).
    :param idle_for: delete identities whose head was not updated for this long (default: never).
    :param keep_last: keep at most this many checkpoints per identity (default: leave history alone).
    :param min_age: unreferenced objects younger than this are left alone (in-flight commits).
    :param prefix: only identities whose key starts with this.
    :param expired_state: also plan the deletion of expired task/asset state documents (whole store).
    :param progress: called once per identity planned.
    :param groups: a listing already grouped by :func:`group_by_identity` (saves a listing).
    """
    now = time.time() if now is None else now
    if keep_last is not None:
        KeepLast(keep_last)  # validates
    cutoff = datetime.now(tz=timezone.utc) - min_age
    plan = GcPlan(store=store, now=now)
    if groups is None:
        groups = group_by_identity(store, prefix)
    for key in sorted(groups):
        infos = groups[key]
        sizes = {i.key: i.size for i in infos}
        item = IdentityPlan(identity=key)
        cs = CheckpointStore(store=store, identity=Identity.parse(key))
        has_head = any(i.key == cs.heads.key for i in infos)
        head = cs.head() if has_head else None
        item.head = head
        if head is None:
            # No head: a purge that crashed after deleting it (or a head deleted since the listing).
            old = [i.key for i in infos if i.key != cs.heads.key and i.last_modified <= cutoff]
            if old:
                item.reasons[ORPHAN] = old
        elif head.lease is not None and not head.lease.expired(now):
            item.skipped = f"live lease held by {head.lease.holder.describe()} until {head.lease.expires_at}"
        elif (
            idle_for is not None
            and head.updated_at
            and now - parse_iso(head.updated_at) > idle_for.total_seconds()
        ):
            item.reasons[IDLE] = [i.key for i in infos]
        else:
            if keep_last is not None and len(head.checkpoints) > keep_last:
                keep, drop = KeepLast(keep_last).split(list(head.checkpoints))
                protected = {ref for e in keep for ref in e.data_refs}
                dropped_refs = {ref for e in drop for ref in e.data_refs} - protected
                keys = [e.manifest for e in drop if e.manifest in sizes]
                keys += [
                    i.key
                    for i in infos
                    if i.key.startswith(f"{key}/{DATA_DIR}/")
                    and i.key[len(key) + len(DATA_DIR) + 2 :].partition("/")[0] in dropped_refs
                ]
                item.keep = tuple(e.commit_id for e in keep)
                item.reasons[RETENTION] = keys
            garbage = [i.key for i in unreferenced(key, infos, head, cutoff)]
            if garbage:
                item.reasons[GARBAGE] = garbage
        item.bytes = sum(sizes.get(k, 0) for k in item.keys)
        if item.reasons or item.skipped:
            plan.identities.append(item)
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
                    deleted = _apply_identity(store, item)
            except (_Changed, LeaseHeldError) as exc:
                result.skipped[item.identity] = str(exc)
                log.info("gc: skipped %s: %s", item.identity, exc)
            else:
                result.deleted.extend(deleted)
                result.bytes += item.bytes if len(deleted) == len(item.keys) else 0
        if progress:
            progress(1)
    if result.deleted:
        log.info("gc: deleted %d object(s) from %s", len(result.deleted), store.url)
    return result


def _same(a: HeadRecord | None, b: HeadRecord | None) -> bool:
    """Whether two heads describe the same state and lease (``updated_at`` aside)."""
    if a is None or b is None:
        return a is b
    return (a.epoch, a.next_seq, a.checkpoints, a.lease) == (b.epoch, b.next_seq, b.checkpoints, b.lease)


def _apply_identity(store: ObjectStore, item: IdentityPlan) -> list[str]:
    cs = CheckpointStore(store=store, identity=Identity.parse(item.identity), clock=time.time)
    current = cs.head()
    if not _same(current, item.head):
        raise _Changed("its head changed since the plan; run GC again")
    if ORPHAN in item.reasons:
        store.delete_many(item.reasons[ORPHAN])  # new objects (a new writer's) are not in the plan
        return list(item.reasons[ORPHAN])
    assert current is not None
    if IDLE in item.reasons:
        return _delete_identity(cs, item)
    if RETENTION in item.reasons or current.lease is not None:
        # Drop the planned entries (and any expired lease, raising the epoch to fence its holder) by CAS.
        keep = set(item.keep) if RETENTION in item.reasons else {e.commit_id for e in current.checkpoints}

        def decide(head: HeadRecord | None) -> HeadRecord:
            if not _same(head, item.head):
                raise _Changed("its head changed since the plan; run GC again")
            assert head is not None
            if head.lease is not None and not head.lease.expired(cs.clock()):
                raise LeaseHeldError(f"{cs.identity} was leased by {head.lease.holder.describe()} meanwhile")
            return head.evolve(
                checkpoints=tuple(e for e in head.checkpoints if e.commit_id in keep),
                lease=None,
                epoch=head.epoch + (1 if head.lease is not None else 0),
            )

        cs.heads.update(decide)
    keys = item.keys
    store.delete_many(keys)
    return keys


def _delete_identity(cs: CheckpointStore, item: IdentityPlan) -> list[str]:
    """Take the lease (never stealing), then delete the head conditionally and the planned objects.

    Not :meth:`CheckpointStore.purge`: purge deletes whatever a fresh listing shows, while GC must delete
    exactly the planned keys (objects that appeared since are left for the next pass).
    """
    lease: Lease = cs.acquire(holder=WriterInfo.current(task_id="airflow-stateful gc"), steal=False)
    head, etag = cs.heads.load()
    try:
        head = check_holder(head, lease, action="delete the state of")
    except StatefulError as exc:
        raise _Changed(str(exc)) from exc
    assert item.head is not None and etag is not None
    if (head.next_seq, head.checkpoints, head.epoch) != (
        item.head.next_seq,
        item.head.checkpoints,
        lease.epoch,
    ):
        cs.release(lease)
        raise _Changed("its head changed since the plan; run GC again")
    try:
        store = cs.store
        store.delete(cs.heads.key, if_match=etag)
    except PreconditionFailedError as exc:
        raise _Changed("its head changed while it was being deleted") from exc
    rest = [k for k in item.reasons[IDLE] if k != cs.heads.key]
    store.delete_many(rest)
    log.info("gc: deleted idle identity %s (%d objects)", cs.identity, len(rest) + 1)
    return list(item.reasons[IDLE])


def _delete_expired(store: ObjectStore, keys: list[str], now: float) -> list[str]:
    """Delete the planned state documents that are still expired, each conditional on the ETag judged."""
    when = datetime.fromtimestamp(now, tz=timezone.utc)
    deleted = []
    for key in keys:
        try:
            blob = store.get(key)
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

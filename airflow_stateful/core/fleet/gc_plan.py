"""Planning garbage collection: what is due in each identity of a store, and why, without changing anything.

:func:`plan_gc` only reads (one listing of the store grouped by identity, plus one head read each) and returns
a :class:`GcPlan` that ``--dry-run`` prints and :func:`~airflow_stateful.core.fleet.gc.apply_gc` carries out;
:mod:`airflow_stateful.core.fleet.gc` explains the reasons (``idle``, ``released``, ``retention``,
``crash-garbage``, ``orphan``, ``expired-state``) and why maintenance never robs a live writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_stateful.core.errors import FormatVersionError, StatefulError
from airflow_stateful.core.fleet import lifetimes
from airflow_stateful.core.fleet.catalog import HEAD_READERS, ordered_map
from airflow_stateful.core.fleet.lifetimes import Lifetimes, RunStates, Verdict, lifetime_of
from airflow_stateful.core.fleet.repack import REPACK_DEAD_FRACTION, RepackPlan, plan_repack
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.marks import MarkStore, RolledBackError
from airflow_stateful.core.protocol.retention import (
    CrashGarbage,
    IdleFor,
    KeepLast,
    PackUsage,
    References,
    pack_usage,
    references,
    unreferenced,
)
from airflow_stateful.core.protocol.state_documents import collect_expired
from airflow_stateful.core.records.formats import HEAD_NAME, MANIFEST_DIR
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.trees import CHUNK_DIR, PACK_DIR, TREE_DIR
from airflow_stateful.core.settings import GC_MIN_AGE, KEEP_FAILED_FOR, LEASE_GRACE
from airflow_stateful.core.stores.base import ObjectInfo, ObjectStore

log = logging.getLogger("airflow_stateful")

IDLE, RETENTION, GARBAGE, ORPHAN, EXPIRED = "idle", "retention", "crash-garbage", "orphan", "expired-state"
REPACK = "repack"
"""Mostly-dead packs rewritten (their live chunks copied into new packs), then deleted with the trees and
manifest objects that named them (:mod:`airflow_stateful.core.fleet.repack`)."""
RELEASED = lifetimes.RELEASED
WHOLE = (IDLE, RELEASED)
"""Reasons that delete a whole identity, head first."""
FORMAT_1_DATA_DIR = "~data"
"""Where format 1 (pre-release builds, no longer read) kept whole-file objects. Listed with their identity, so
that ``du`` counts what the store bills and an identity deleted whole (or an orphan) goes with them; never
collected on their own (:func:`~airflow_stateful.core.protocol.retention.unreferenced` passes them over). An
identity whose head still references them is refused (FormatVersionError) and kept whole (:func:`plan_identity`).
"""
IDENTITY_DIRS = (MANIFEST_DIR, TREE_DIR, CHUNK_DIR, PACK_DIR, FORMAT_1_DATA_DIR)
"""The folders of an identity that GC lists (beside its head)."""
EXPIRED_STATE = "~state-store"
"""The pseudo-identity under which expired task/asset state documents are reported."""
DEFAULT_MIN_AGE = GC_MIN_AGE

Progress = Callable[[int], None]


@dataclass
class IdentityPlan:
    """What GC will do to one identity (or, for ``EXPIRED_STATE``, to the state store documents)."""

    identity: str
    reasons: dict[str, list[str]] = field(default_factory=dict)
    """Keys to delete, by reason (``idle``, ``retention``, ``crash-garbage``, ``repack``, ``orphan``,
    ``expired-state``)."""
    bytes: int = 0
    skipped: str | None = None
    """What is left alone and why (a held lease, a head this version cannot read)."""
    head: HeadRecord | None = None
    keep: tuple[str, ...] = ()
    """For ``retention``: commit ids of the checkpoints the head keeps."""
    break_token: str | None = None
    """For ``crash-garbage``: the dead lease to break before its holder's objects are deleted."""
    objects: dict[str, ObjectInfo] = field(default_factory=dict, repr=False)
    lifetime: Verdict | None = None
    """The lifetime verdict on the whole identity (why it is kept or deleted); ``None`` for an orphan."""
    packs: PackUsage = field(default_factory=PackUsage)
    """Its packs once this pass is done (repacking aside): the dead bytes in packs it keeps (ADR 0006)."""
    repack: RepackPlan | None = None
    """For ``repack``: the packs rewritten, and the trees and manifests written again (their keys: the reason's)."""

    @property
    def keys(self) -> list[str]:
        return [k for keys in self.reasons.values() for k in keys]

    def packs_after(self, *, repacked: bool) -> PackUsage:
        """Its packs once the pass is done: ``packs`` as they are, or with the planned repack done."""
        if not repacked or self.repack is None:
            return self.packs
        plan = self.repack
        return PackUsage(
            packs=self.packs.packs - len(plan.packs) + plan.new_packs,
            bytes=self.packs.bytes - plan.pack_bytes + plan.live_bytes,
            live_bytes=self.packs.live_bytes - plan.old_live_bytes + plan.live_bytes,
        )

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
    signer: HeadSigner | None = None
    """The head signing policy the plan read the heads with; a real pass writes and re-reads with it too."""
    marks: MarkStore | None = None
    """The high-water marks the plan checked the heads against; a real pass checks them again."""
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


def group_by_identity(store: ObjectStore, prefix: str = "") -> dict[str, list[ObjectInfo]]:
    """One listing of the store, grouped by identity key; the library's ``~...`` top folders are left out.

    ``~`` cannot occur in an identity segment, so the first ``/~`` of a key ends its identity. Only the head and
    the folders of :data:`IDENTITY_DIRS` count: anything else under ``<identity>/~`` is never listed, so never
    deleted.
    """
    groups: dict[str, list[ObjectInfo]] = {}
    for info in store.list_objects(prefix):
        cut = info.key.find("/~")
        if info.key.startswith("~") or cut < 0:
            continue
        key = info.key[:cut]
        rest = info.key[cut + 1 :]
        if rest != HEAD_NAME and rest.partition("/")[0] not in IDENTITY_DIRS:
            continue
        try:
            Identity.parse(key)
        except ValueError:
            continue
        groups.setdefault(key, []).append(info)
    return groups


def describe_lease(head: HeadRecord) -> str:
    lease = head.lease
    assert lease is not None
    return f"{lease.holder.describe()}, renewed {lease.last_renewed}, until {lease.expires_at}"


def plan_identity(
    store: ObjectStore,
    key: str,
    infos: list[ObjectInfo],
    *,
    now: float,
    lives: Lifetimes | None,
    keep_last: KeepLast | None,
    garbage: CrashGarbage,
    airflow: RunStates | None = None,
    signer: HeadSigner | None = None,
    marks: MarkStore | None = None,
    repack: float | None = None,
) -> IdentityPlan:
    """What GC does to one identity (``repack``: repack packs at least this share dead; ``None``: never)."""
    item = IdentityPlan(identity=key, objects={i.key: i for i in infos})
    identity = Identity.parse(key)
    cs = CheckpointStore(store=store, identity=identity, signer=signer, marks=marks)
    try:
        head = cs.head() if cs.heads.key in item.objects else None
    except FormatVersionError as exc:
        # Format 1 (a pre-release build's) or a newer release's: what its checkpoints reference cannot be seen,
        # so nothing of the identity may go. It is kept whole, and the report says why; the rest of the store
        # is collected as usual.
        log.warning("gc: %s is kept whole: %s", key, exc)
        item.skipped = f"kept whole, its head is in a format this version does not read: {exc}"
        return item
    except RolledBackError as exc:
        # An older head written back: the newer checkpoints' objects look unreferenced, and collecting them
        # would make the rollback permanent. Nothing of the identity goes.
        log.warning("gc: %s is kept whole: %s", key, exc)
        item.skipped = f"kept whole, its head was written back: {exc}"
        return item
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
    refs = references_of(cs, head, notes)
    kept_refs = refs  # what the head keeps once this pass is done (retention may drop checkpoints)
    kept_head = head
    if not held and keep_last is not None and keep_last.due(head.checkpoints):
        keep, _drop = keep_last.split(list(head.checkpoints))
        kept_head = head.evolve(checkpoints=tuple(keep))
        kept_refs = references_of(cs, kept_head, notes)
        freed = unreferenced(key, infos, kept_head, refs=kept_refs)
        already = {i.key for i in unreferenced(key, infos, head, refs=refs)}
        item.keep = tuple(e.commit_id for e in keep)
        item.reasons[RETENTION] = [i.key for i in freed if i.key not in already]
    item.packs = pack_usage(key, infos, kept_refs)
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
    if not held and repack is not None and kept_refs.chunks_known and item.packs.dead_bytes:
        # Never under a held lease: the holder dedups against the trees it read, which a repack replaces.
        try:
            item.repack = plan_repack(cs, kept_head, infos, kept_refs, dead_fraction=repack)
        except StatefulError as exc:
            notes.append(f"its packs are not repacked: {exc}")
        if item.repack is not None:
            item.reasons[REPACK] = item.repack.keys
    if notes:
        who = f"live lease held by {describe_lease(head)}" if held else "partly skipped"
        item.skipped = f"{who}: {'; '.join(notes)}"
    return item


def references_of(cs: CheckpointStore, head: HeadRecord, notes: list[str]) -> References:
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
    signer: HeadSigner | None = None,
    marks: MarkStore | None = None,
    repack: float | None = REPACK_DEAD_FRACTION,
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
    :param signer: the deployment's head signing policy (a forged head is then reported, never acted on).
    :param marks: the identities' high-water marks (a head written back is then kept whole and reported).
    :param repack: repack the packs of which at least this share is dead (:mod:`.repack`; ``None``: never).
    """
    now = time.time() if now is None else now
    retention = KeepLast(keep_last) if keep_last is not None else None
    lives = Lifetimes(
        idle_for=idle_for, release_after_success=release_after_success, keep_failed_for=keep_failed_for
    )
    garbage = CrashGarbage(min_age=min_age, grace=grace)
    plan = GcPlan(store=store, now=now, grace=grace, signer=signer, marks=marks)
    if groups is None:
        groups = group_by_identity(store, prefix)
    listed = groups

    def plan_one(key: str) -> IdentityPlan:
        return plan_identity(
            store,
            key,
            listed[key],
            now=now,
            lives=lives,
            keep_last=retention,
            garbage=garbage,
            airflow=airflow,
            signer=signer,
            marks=marks,
            repack=repack,
        )

    # The identities' heads (and what their planning reads with them) are read HEAD_READERS at a time; the
    # plans come back in key order, and the first that fails raises as the serial loop did.
    for item in ordered_map(plan_one, sorted(groups), workers=HEAD_READERS):
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

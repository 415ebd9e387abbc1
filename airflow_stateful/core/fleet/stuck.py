"""The fleet's work status, and the stuck check built on it: one listing for ``airflow-stateful ls``/``stuck``
and ``StatefulStuckCheckOperator``.

:func:`identity_statuses` lists the identities under a prefix (one delimited listing, the heads read a few at a
time: :mod:`.catalog`) and judges each head with :func:`~airflow_stateful.core.fleet.status.work_status` at the moment
it was read. :func:`find_stuck` collects what a stuck check reports: the stuck identities (a live lease whose
holder committed nothing for longer than its expected interval), the dead ones (a lease that expired: its
holder is gone, Airflow retries it; never counted as stuck) and the heads that could not be read (the check is
incomplete for those). Only metadata is read; this module imports no Airflow.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from airflow_stateful.core.fleet.catalog import HEAD_READERS, list_identities, read_heads
from airflow_stateful.core.fleet.status import STATUSES, WorkStatus, work_status
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.settings import EXPECTED_CHECKPOINT_INTERVAL
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import utcnow_iso


@dataclass(frozen=True)
class IdentityStatus:
    """One identity as judged: its head and :class:`WorkStatus`, or the ``error`` that kept its head from being
    read (then ``head`` and ``status`` are ``None``)."""

    identity: Identity
    head: HeadRecord | None = None
    status: WorkStatus | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The identity, its status with the figures behind it, and the lease's holder and times (never the
        lease token)."""
        lease = self.head.lease if self.head is not None else None
        body: dict[str, Any] = {"identity": self.identity.key}
        body.update(self.status.to_json() if self.status is not None else {"status": None})
        body.update(
            holder=lease.holder.describe() if lease else None,
            lease_epoch=lease.epoch if lease else None,
            lease_acquired_at=lease.acquired_at if lease else None,
            lease_renewed_at=lease.last_renewed if lease else None,
            lease_expires_at=lease.expires_at if lease else None,
        )
        if self.error is not None:
            body["error"] = self.error
        return body


def identity_statuses(
    store: ObjectStore,
    prefix: str = "",
    *,
    default_interval: timedelta | None = None,
    clock: Callable[[], float] = time.time,
    readers: int = HEAD_READERS,
    signer: HeadSigner | None = None,
) -> Iterator[IdentityStatus]:
    """Every identity under ``prefix`` with a head (or an unreadable one), in key order, as its head is read.

    Each head is judged at ``clock()`` taken right after it was read, so a long listing never judges a head
    against a moment before it was read. Identities whose objects have no head (an orphan, a purge in progress)
    are skipped: there is no work to judge. ``default_interval`` applies to leases whose holder declared none.
    """
    for read in read_heads(store, list_identities(store, prefix), signer=signer, readers=readers):
        if read.error is not None:
            error = f"{type(read.error).__name__}: {read.error}"
            yield IdentityStatus(identity=read.identity, error=error)
        elif read.head is not None:
            status = work_status(read.head, now=clock(), default_interval=default_interval)
            yield IdentityStatus(identity=read.identity, head=read.head, status=status)


@dataclass(frozen=True)
class StuckReport:
    """What one stuck check found under ``prefix`` of ``store``.

    :param checked: identities whose head was read and judged.
    :param counts: how many of those had each status (every status of :data:`STATUSES`, zeros included).
    :param stuck: the stuck ones: the alert.
    :param dead: the dead ones (lease expired): listed for people, never counted as stuck.
    :param errors: identities whose head could not be read: the check says nothing about them.
    """

    store: str
    prefix: str
    default_interval: float
    checked_at: str
    checked: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    stuck: tuple[IdentityStatus, ...] = ()
    dead: tuple[IdentityStatus, ...] = ()
    errors: tuple[IdentityStatus, ...] = ()

    @property
    def stuck_identities(self) -> list[str]:
        return [s.identity.key for s in self.stuck]

    def summary(self) -> str:
        """One line: how many identities were checked and what was found."""
        text = (
            f"checked {self.checked} {'identity' if self.checked == 1 else 'identities'} in {self.store}"
            + (f" under {self.prefix!r}" if self.prefix else "")
            + ": "
            + ", ".join(f"{self.counts.get(s, 0)} {s}" for s in STATUSES)
        )
        if self.errors:
            text += f"; {len(self.errors)} head(s) could not be read"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "prefix": self.prefix,
            "checked_at": self.checked_at,
            "default_interval_seconds": self.default_interval,
            "checked": self.checked,
            "counts": dict(self.counts),
            "stuck": [s.to_json() for s in self.stuck],
            "dead": [s.to_json() for s in self.dead],
            "errors": [s.to_json() for s in self.errors],
        }


def find_stuck(
    store: ObjectStore,
    prefix: str = "",
    *,
    default_interval: timedelta | None = None,
    clock: Callable[[], float] = time.time,
    readers: int = HEAD_READERS,
    signer: HeadSigner | None = None,
) -> StuckReport:
    """Judge every identity under ``prefix`` (:func:`identity_statuses`) and keep what a stuck check reports.

    Memory holds only the stuck, dead and unreadable identities, not the whole fleet. A listing that fails
    raises (the store's error): a check that could not list must not pass for one that found nothing.
    """
    checked_at = utcnow_iso(clock())
    counts: Counter[str] = Counter({s: 0 for s in STATUSES})
    stuck: list[IdentityStatus] = []
    dead: list[IdentityStatus] = []
    errors: list[IdentityStatus] = []
    for item in identity_statuses(
        store, prefix, default_interval=default_interval, clock=clock, readers=readers, signer=signer
    ):
        if item.status is None:
            errors.append(item)
            continue
        counts[item.status.status] += 1
        if item.status.status == "stuck":
            stuck.append(item)
        elif item.status.status == "dead":
            dead.append(item)
    return StuckReport(
        store=store.url,
        prefix=prefix,
        default_interval=(default_interval or EXPECTED_CHECKPOINT_INTERVAL).total_seconds(),
        checked_at=checked_at,
        checked=sum(counts.values()),
        counts=dict(counts),
        stuck=tuple(stuck),
        dead=tuple(dead),
        errors=tuple(errors),
    )

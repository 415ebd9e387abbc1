"""Leases and epochs: how a newer writer fences every older one.

Taking a lease raises the identity's ``epoch`` in the head record (by compare-and-swap). Every commit is a
compare-and-swap that succeeds only while the head still carries the writer's epoch and lease token, so a
writer whose lease was taken over (a zombie try, a pod left behind by a restarted worker) gets
:class:`FencedError` on its next commit and can never overwrite newer state.

Leases expire after their TTL so a crashed holder does not block the identity forever; a live lease is
respected unless the caller steals it (a retry, which knows the earlier try is over) or breaks it
explicitly (an operator's ``unlock``). Expiry is judged on the caller's clock: keep clocks in sync (NTP).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from airflow_stateful.core.errors import FencedError, LeaseHeldError
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.records import HeadRecord, LeaseRecord, WriterInfo, parse_iso, utcnow_iso


@dataclass(frozen=True)
class Lease:
    """What a writer keeps after taking the lease: its epoch and token, which every commit presents."""

    identity: Identity
    epoch: int
    token: str
    holder: WriterInfo
    expires_at: str


def new_lease_record(
    *, epoch: int, holder: WriterInfo, now: float, ttl: float, token: str | None = None
) -> LeaseRecord:
    return LeaseRecord(
        token=token or uuid.uuid4().hex,
        epoch=epoch,
        holder=holder,
        acquired_at=utcnow_iso(now),
        expires_at=utcnow_iso(now + ttl),
    )


def check_holder(head: HeadRecord | None, lease: Lease, *, action: str) -> HeadRecord:
    """Raise FencedError unless ``lease`` is still the identity's current lease."""
    if head is None:
        raise FencedError(
            f"cannot {action} identity {lease.identity}: its head record is gone (the state was deleted). "
            "This writer's epoch no longer exists; stop it."
        )
    current = head.lease
    if head.epoch != lease.epoch or current is None or current.token != lease.token:
        if head.epoch != lease.epoch and current is not None:
            by = f"taken by {current.holder.describe()} at {current.acquired_at}"
        elif head.epoch != lease.epoch:
            by = "broken explicitly"
        else:
            by = "released"
        raise FencedError(
            f"cannot {action} identity {lease.identity}: this writer holds epoch {lease.epoch}, but the "
            f"identity is at epoch {head.epoch} (the lease was {by}). A newer try or pod owns this state; "
            "nothing of this writer was made visible. Stop this writer."
        )
    return head


def acquire_decision(
    head: HeadRecord | None,
    *,
    identity: Identity,
    holder: WriterInfo,
    now: float,
    ttl: float,
    steal: bool,
    token: str,
) -> HeadRecord:
    """The head after ``holder`` takes the lease, or LeaseHeldError if a live lease stands and ``steal`` is off.

    ``token`` is chosen once per acquire, so a retried attempt recognises its own lease in the head.
    """
    if head is not None and head.lease is not None and head.lease.token == token:
        return head
    base = head or HeadRecord(identity=identity.key)
    if base.lease is not None and not base.lease.expired(now) and not steal:
        lease = base.lease
        raise LeaseHeldError(
            f"identity {identity} is leased by {lease.holder.describe()} (epoch {lease.epoch}) until "
            f"{lease.expires_at}. Wait for it to finish or expire, or break it with "
            f"`airflow-stateful unlock {identity}`."
        )
    epoch = base.epoch + 1
    record = new_lease_record(epoch=epoch, holder=holder, now=now, ttl=ttl, token=token)
    return base.evolve(epoch=epoch, lease=record)


def seconds_left(lease: LeaseRecord, now: float) -> float:
    return parse_iso(lease.expires_at) - now

"""Leases and epochs: how a newer writer fences every older one.

Taking a lease raises the identity's ``epoch`` in the head record (by compare-and-swap). Every commit is a
compare-and-swap that succeeds only while the head still carries the writer's epoch and lease token, so a
writer whose lease was taken over (a zombie try, a pod left behind by a restarted worker) gets
:class:`FencedError` on its next commit and can never overwrite newer state.

A lease lives as long as its holder renews it (:class:`~airflow_stateful.core.protocol.session.WriterSession` does so
in the background at about a third of the ttl; every commit renews it too). A crashed holder stops renewing
and its lease expires one ttl after the last renewal. Then:

* another writer may take it without stealing (a retry always steals: it knows the earlier try is over);
* maintenance (GC) may *break* it only once it has been expired for a further ``grace`` period, which
  absorbs clock skew between the renewing host and the judging one.

Every decision below is a pure function of the current head, run inside the compare-and-swap, so it is
always judged on the head as it is when the write lands. See docs/adr/0003-lease-renewal-and-maintenance.md.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from airflow_stateful.core.errors import FencedError, InvalidValueError, LeaseHeldError
from airflow_stateful.core.records.formats import MAX_EXPECTED_INTERVAL
from airflow_stateful.core.records.heads import HeadRecord, LeaseRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.outcomes import TryOutcome
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.timestamps import utcnow_iso


@dataclass(frozen=True)
class Lease:
    """What a writer keeps after taking the lease: its epoch and token, which every commit presents."""

    identity: Identity
    epoch: int
    token: str
    holder: WriterInfo
    expires_at: str
    acquired_at: str = ""


def new_lease_record(
    *,
    epoch: int,
    holder: WriterInfo,
    now: float,
    ttl: float,
    token: str | None = None,
    expected_interval: float | None = None,
) -> LeaseRecord:
    return LeaseRecord(
        token=token or uuid.uuid4().hex,
        epoch=epoch,
        holder=holder,
        acquired_at=utcnow_iso(now),
        expires_at=utcnow_iso(now + ttl),
        expected_interval=expected_interval,
    )


def lease_of(identity: Identity, record: LeaseRecord) -> Lease:
    """The writer's view of a lease record (to adopt a lease someone else took for this writer)."""
    return Lease(
        identity=identity,
        epoch=record.epoch,
        token=record.token,
        holder=record.holder,
        expires_at=record.expires_at,
        acquired_at=record.acquired_at,
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


def renewed(head: HeadRecord, *, now: float, ttl: float) -> HeadRecord:
    """``head`` with its lease extended to ``now + ttl`` (the holder was checked by the caller)."""
    assert head.lease is not None
    lease = replace(head.lease, expires_at=utcnow_iso(now + ttl), renewed_at=utcnow_iso(now))
    return head.evolve(lease=lease)


def acquire_decision(
    head: HeadRecord | None,
    *,
    identity: Identity,
    holder: WriterInfo,
    now: float,
    ttl: float,
    steal: bool,
    token: str,
    grace: float = 0.0,
    expected_interval: float | None = None,
    outcome: TryOutcome | None = None,
    epoch_floor: int = 0,
) -> HeadRecord:
    """The head after ``holder`` takes the lease, or LeaseHeldError if a live lease stands and ``steal`` is off.

    ``token`` is chosen once per acquire, so a retried attempt recognises its own lease in the head.
    ``grace``: how long past its expiry a lease still counts as held (maintenance passes the lease grace).
    ``expected_interval``: how often the holder means to commit, recorded for stuck-work detection.
    ``outcome``: the try's ``running`` outcome, recorded with the lease (else the head's outcome stays).
    ``epoch_floor``: where the epochs of an identity without a head go on from (its high-water mark's).
    """
    if head is not None and head.lease is not None and head.lease.token == token:
        return head
    base = head or HeadRecord(identity=identity.key, epoch=epoch_floor)
    if base.lease is not None and not base.lease.dead(now, grace=grace) and not steal:
        lease = base.lease
        raise LeaseHeldError(
            f"identity {identity} is leased by {lease.holder.describe()} (epoch {lease.epoch}, last renewed "
            f"{lease.last_renewed}) until {lease.expires_at}. Wait for it to finish or expire, or break it "
            f"with `airflow-stateful unlock {identity}`."
        )
    epoch = base.epoch + 1
    record = new_lease_record(
        epoch=epoch, holder=holder, now=now, ttl=ttl, token=token, expected_interval=expected_interval
    )
    return base.evolve(epoch=epoch, lease=record, outcome=outcome or base.outcome)


def break_decision(
    head: HeadRecord | None,
    *,
    identity: Identity,
    now: float,
    grace: float | None,
    token: str | None = None,
) -> HeadRecord:
    """The head without its lease and with a raised epoch, which fences the holder.

    :param grace: ``None`` breaks any lease (an explicit ``unlock --force``); a number breaks only a lease
        unrenewed for longer than its ttl plus ``grace``, and raises LeaseHeldError otherwise.
    :param token: break only this lease; LeaseHeldError if another one (a newer acquisition) stands.
    """
    if head is None:
        raise LeaseHeldError(f"identity {identity} has no head record; there is no lease to break")
    lease = head.lease
    if lease is not None and grace is not None:
        if token is not None and lease.token != token:
            raise LeaseHeldError(
                f"identity {identity} was leased anew by {lease.holder.describe()} (epoch {lease.epoch})"
            )
        if not lease.dead(now, grace=grace):
            raise LeaseHeldError(
                f"identity {identity} is leased by {lease.holder.describe()} (epoch {lease.epoch}), last "
                f"renewed {lease.last_renewed}, until {lease.expires_at}; a renewed lease is live and is "
                f"never broken by maintenance (grace {grace:g} s)."
            )
    return head.evolve(epoch=head.epoch + 1, lease=None)


def checked_expected_interval(value: object) -> float | None:
    """``expected_checkpoint_interval`` as seconds (``None``: not declared), once it is from 1 s to a year."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 1 <= value <= MAX_EXPECTED_INTERVAL
    ):
        raise InvalidValueError(
            f"expected_checkpoint_interval must be from 1 second to a year, not {value!r}"
        )
    return float(value)

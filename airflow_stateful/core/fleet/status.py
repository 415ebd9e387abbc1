"""Is the work on an identity progressing, stuck or dead? Judged from its head record alone.

A lease says a writer is *alive*: its heartbeat renews it while the process runs, whatever the task's code is
doing. So a task blocked on a lock, a hung network read or an endless loop keeps a live lease and never
commits. Distributed schedulers call that *stuck*, as distinct from *dead* (the process is gone and the lease
expired), and they alert on both differently: a dead writer is retried by Airflow, a stuck one holds its slot
until a person looks.

The head carries everything needed to tell them apart: the lease (when it was taken, until when it was renewed,
and the ``expected_checkpoint_interval`` its holder declared) and the kept checkpoints (when the newest was
committed, under which epoch). This module only decides; the CLI (``ls``, ``stuck``), the UI, the sensor and the
writer's own heartbeat (which reports the ``stateful.stuck`` metric) all call :func:`work_status`.

Statuses:

* ``active``: a live lease whose holder committed within its expected interval (or took the lease within it);
* ``stuck``: a live lease whose holder has committed nothing for longer than its expected interval;
* ``dead``: a lease past its expiry (its holder stopped renewing: killed, lost its node, or partitioned);
* ``idle``: no lease (the last writer finished and released it, or nothing ever wrote).

"Committed nothing" is measured from the holder's own newest checkpoint, or from its acquisition when it has
not committed yet: a retry that just took over is not stuck because its predecessor was.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.settings import EXPECTED_CHECKPOINT_INTERVAL
from airflow_stateful.core.timestamps import parse_iso

Status = Literal["active", "stuck", "dead", "idle"]
STATUSES: tuple[Status, ...] = ("active", "stuck", "dead", "idle")


@dataclass(frozen=True)
class WorkStatus:
    """The judgement on one head at one moment, with the figures behind it (all in seconds).

    :param status: one of :data:`STATUSES`.
    :param since_progress: seconds since the holder's last commit (or its acquisition); ``None`` without a lease.
    :param checkpoint_age: seconds since the newest kept checkpoint was committed, by anyone; ``None`` if none.
    :param expected_interval: the interval the judgement used: the holder's declared one, or the default.
    :param reason: one sentence a person can act on.
    """

    status: Status
    since_progress: float | None
    checkpoint_age: float | None
    expected_interval: float | None
    reason: str

    @property
    def stuck(self) -> bool:
        return self.status == "stuck"

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "since_progress_seconds": _rounded(self.since_progress),
            "checkpoint_age_seconds": _rounded(self.checkpoint_age),
            "expected_interval_seconds": _rounded(self.expected_interval),
            "reason": self.reason,
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=int(max(seconds, 0))))


def work_status(
    head: HeadRecord | None,
    *,
    now: float,
    default_interval: timedelta | None = None,
) -> WorkStatus:
    """Judge ``head`` at ``now`` (seconds since the epoch). ``default_interval`` applies to a lease whose holder
    declared none (a writer of an older release, the CLI's rollback); ``None``: the built-in default (1 h)."""
    default_interval = default_interval or EXPECTED_CHECKPOINT_INTERVAL
    newest = head.latest if head is not None else None
    checkpoint_age = now - parse_iso(newest.created_at) if newest is not None else None
    lease = head.lease if head is not None else None
    if lease is None:
        return WorkStatus("idle", None, checkpoint_age, None, "no writer holds the lease")
    expected = lease.expected_interval or default_interval.total_seconds()
    own = [e for e in head.checkpoints if e.epoch == lease.epoch] if head is not None else []
    progress_at = parse_iso(own[-1].created_at) if own else parse_iso(lease.acquired_at)
    since = now - progress_at
    holder = lease.holder.describe()
    if lease.expired(now):
        return WorkStatus(
            "dead",
            since,
            checkpoint_age,
            expected,
            f"the lease of {holder} expired at {lease.expires_at} (not renewed: the writer is gone); "
            "Airflow retries the task, or `airflow-stateful unlock` frees it",
        )
    if since > expected:
        what = "its last checkpoint" if own else "it took the lease"
        return WorkStatus(
            "stuck",
            since,
            checkpoint_age,
            expected,
            f"{holder} is alive (lease renewed {lease.last_renewed}) but committed nothing for "
            f"{_duration(since)} since {what}, longer than the expected {_duration(expected)}: look at its log",
        )
    return WorkStatus("active", since, checkpoint_age, expected, f"{holder} is committing")

"""The cells of the Checkpoints tabs built from a head's records: the lease, the status and a copy's lineage.

Apart from :mod:`.task` (which reads what the tab shows, within bounds) because these only say what is read:
strings built with the types checked, so a record that parses but holds something unexpected fails on its own
identity's section, and never in the template (which escapes every one of them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from airflow_stateful.core.fleet.status import WorkStatus
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.lineage import CopyOf
from airflow_stateful.plugins.view.rows import human_age, when


def lineage_cells(copy_of: CopyOf | None, head: HeadRecord) -> dict[str, str]:
    """``copy of seq 2`` (a rollback's copy) and, on hover, the original's commit id and whether it is kept."""
    if copy_of is None:
        return {"copy_of": "", "copy_title": ""}
    kept = any(e.commit_id == copy_of.commit_id for e in head.checkpoints)
    gone = "" if kept else "; no longer kept"
    return {
        "copy_of": copy_of.describe(),
        "copy_title": f"committed again from commit {copy_of.commit_id}{gone}",
    }


def lease_json(head: HeadRecord, now: float) -> dict[str, Any] | None:
    lease = head.lease
    if lease is None:
        return None
    return {
        "holder": lease.holder.to_json(),
        "described": lease.holder.describe(),
        "epoch": lease.epoch,
        "acquired_at": lease.acquired_at,
        "renewed_at": lease.last_renewed,
        "expires_at": lease.expires_at,
        "expired": lease.expired(now),
        "expected_checkpoint_interval": lease.expected_interval,
    }


def status_cells(status: WorkStatus) -> dict[str, str]:
    return {"name": status.status, "reason": status.reason}


def lease_cells(head: HeadRecord, status: WorkStatus, now: float, *, run_id: str) -> dict[str, str] | None:
    lease = head.lease
    if lease is None:
        return None
    interval = status.expected_interval or 0.0
    declared = "declared by the holder" if lease.expected_interval is not None else "[stateful] default"
    since = status.since_progress
    holder = lease.holder
    return {
        "state": "expired" if lease.expired(now) else "held",
        # who, without what the page says already (its run) or "Where" says (host, pod, node)
        "by": replace(
            holder, run_id=None if holder.run_id == run_id else holder.run_id, host=None, pod=None, node=None
        ).describe(),
        "where": ", ".join(
            f"{label} {value}"
            for label, value in (("host", holder.host), ("pod", holder.pod), ("node", holder.node))
            if value
        )
        or "—",
        "epoch": str(lease.epoch),
        "acquired": when(lease.acquired_at),
        "renewed": when(lease.last_renewed),
        "until": when(lease.expires_at),
        "interval": f"{human_age(interval)} ({declared})",
        "since": "—" if since is None else human_age(since),
    }

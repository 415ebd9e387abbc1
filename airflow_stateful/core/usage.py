"""Storage used per identity, and what it costs: the numbers behind ``airflow-stateful du``.

Bytes come from a listing (what the store bills), not from the head's ``total_size`` sums: a checkpoint
that keeps an earlier one's files shares their data, and crash garbage is billed although no head lists it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.gc import Progress, group_by_identity
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.records import parse_iso
from airflow_stateful.core.retention import unreferenced
from airflow_stateful.core.stores.base import ObjectStore

GB = 1024**3
DEFAULT_PRICE_PER_GB_MONTH = 0.023
"""S3 Standard, us-east-1, first 50 TB (USD per GB-month)."""


@dataclass(frozen=True)
class Usage:
    """One identity's footprint. ``idle_seconds`` is ``None`` for an identity with no head (an orphan)."""

    identity: str
    objects: int
    bytes: int
    garbage_bytes: int
    checkpoints: int
    idle_seconds: float | None

    def monthly_cost(self, price_per_gb_month: float) -> float:
        return self.bytes / GB * price_per_gb_month


def disk_usage(
    store: ObjectStore, *, prefix: str = "", now: float | None = None, progress: Progress | None = None
) -> list[Usage]:
    """Usage of every identity under ``prefix``, in key order (one listing plus one head read each)."""
    now = time.time() if now is None else now
    rows = []
    groups = group_by_identity(store, prefix)
    for key in sorted(groups):
        infos = groups[key]
        cs = CheckpointStore(store=store, identity=Identity.parse(key))
        head = cs.head() if any(i.key == cs.heads.key for i in infos) else None
        garbage = unreferenced(key, infos, head)
        rows.append(
            Usage(
                identity=key,
                objects=len(infos),
                bytes=sum(i.size for i in infos),
                garbage_bytes=sum(i.size for i in garbage),
                checkpoints=len(head.checkpoints) if head else 0,
                idle_seconds=max(now - parse_iso(head.updated_at), 0.0) if head and head.updated_at else None,
            )
        )
        if progress:
            progress(1)
    return rows

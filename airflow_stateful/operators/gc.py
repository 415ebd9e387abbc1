"""StatefulGCOperator: the store-wide retention and garbage collection of ``airflow-stateful gc``, as a task.

The maintenance DAG (:func:`airflow_stateful.maintenance.stateful_maintenance_dag`) runs it daily, so crash
garbage, orphans of crashed purges, idle identities and expired task state documents do not pile up in the
bucket unnoticed. The policy engine is :mod:`airflow_stateful.core.fleet.gc`; this operator only opens the store through
:class:`~airflow_stateful.hooks.state.StateHook` and logs progress (a task log is not a terminal, so
progress is a few log lines).

After planning it sends the store's garbage backlog and idle footprint as gauges, and after a real run what it
deleted as counters (:mod:`airflow_stateful.metrics`; docs/observability.md has the alerts built on them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from airflow_stateful import metrics
from airflow_stateful.core.durations import parse_duration
from airflow_stateful.core.fleet.gc import (
    DEFAULT_MIN_AGE,
    GARBAGE,
    ORPHAN,
    GcPlan,
    apply_gc,
    group_by_identity,
    plan_gc,
)
from airflow_stateful.core.fleet.lifetimes import Lifetimes
from airflow_stateful.core.fleet.usage import DEFAULT_PRICE_PER_GB_MONTH, GB
from airflow_stateful.core.fleet.walk_progress import ItemProgress
from airflow_stateful.core.protocol.retention import IdleFor
from airflow_stateful.hooks.airflow_api import AirflowApiHook
from airflow_stateful.hooks.state import StateHook

log = logging.getLogger("airflow_stateful")

KEPT_IN_REPORT = 100
"""Kept identities listed with their reason in the XCom report (it must stay small); the log lists every one."""
GARBAGE_REASONS = (GARBAGE, ORPHAN)
"""Plan reasons that are garbage (objects nothing references: crashed commits, half-done purges), as opposed
to policy (``retention``, ``idle``, ``expired-state``): what ``stateful.gc.garbage_*`` count."""


def garbage_backlog(plan: GcPlan) -> tuple[int, int]:
    """Objects and bytes of the plan's garbage (:data:`GARBAGE_REASONS`), older than ``min_age``."""
    objects = size = 0
    for item in plan.identities:
        for reason in GARBAGE_REASONS:
            keys = item.reasons.get(reason, ())
            objects += len(keys)
            size += sum(item.objects[k].size for k in keys if k in item.objects)
    return objects, size


def idle_footprint(plan: GcPlan, idle_for: timedelta) -> tuple[int, int]:
    """Identities whose head was not updated for longer than ``idle_for``, and every byte they hold.

    Counts those a held lease keeps from deletion too: they are billed all the same.
    """
    idle = IdleFor(idle_for)
    identities = size = 0
    for item in plan.identities:
        if item.head is not None and idle.due(item.head, plan.now):
            identities += 1
            size += sum(info.size for info in item.objects.values())
    return identities, size


class StatefulGCOperator(BaseOperator):
    """Apply retention and delete garbage in the ``[stateful]`` backend; return the report (JSON) as XCom.

    Never deletes anything under a live lease. With ``dry_run`` nothing changes and the report lists what a
    real run would delete. The XCom holds, per identity, the reasons with their object counts and bytes (not
    every key, to keep XCom small); the task log names every deleted identity.

    :param idle_for: delete identities whose head was not updated for this long (``"30d"``; templated), unless
        their task can still run (a retry pending, rescheduled, deferred) or failed within ``keep_failed_for``.
    :param release_after_success: delete per-run state this long after its task succeeded (default
        ``[stateful] release_after_success``; unset: by ``idle_for``).
    :param keep_failed_for: keep per-run state of a task that failed for good at least this long (default
        ``[stateful] keep_failed_for``, 30 days; ``"0"``: no minimum).
    :param airflow_conn_id: a connection to Airflow's REST API (default ``[stateful] airflow_conn_id``): before
        deleting a run's state, GC asks Airflow whether the task instance is finished, and keeps the state when
        Airflow says it can still run or cannot be asked. Empty: the heads' recorded outcomes decide alone.
    :param keep_last: keep at most this many checkpoints per identity (default: leave history alone).
    :param min_age: leave unreferenced objects younger than this (in-flight commits; default 1h).
    :param dry_run: only report.
    :param backend_url: the store, default ``[stateful] backend_url`` (templated).
    :param conn_id: Airflow connection with S3 credentials, default ``[stateful] conn_id``.
    :param prefix: only identities whose key starts with this, e.g. ``"my_dag/"`` (templated). Expired task
        state documents are only collected when ``prefix`` is empty.
    :param price_per_gb_month: storage price for ``stateful.idle_monthly_cost`` and the report's
        ``idle_monthly_cost`` (default 0.023, S3 Standard in USD).

    Metrics (Airflow ``Stats``, no tags: they describe the store, or the part under ``prefix``): after
    planning, ``stateful.gc.garbage_objects``/``garbage_bytes`` (unreferenced objects older than ``min_age``:
    crash garbage and orphans, what this pass deletes unless a live lease or a change since the plan stops it)
    and, when ``idle_for`` is set, ``stateful.idle_bytes``/``idle_monthly_cost`` (every byte of identities idle
    longer than ``idle_for``); after a real run, ``stateful.gc.deleted_objects``/``deleted_bytes`` (counters).
    The report holds the same numbers.
    """

    template_fields: Sequence[str] = (
        "idle_for",
        "prefix",
        "backend_url",
        "release_after_success",
        "keep_failed_for",
    )

    def __init__(
        self,
        *,
        idle_for: timedelta | str | None = None,
        keep_last: int | None = None,
        min_age: timedelta | str = DEFAULT_MIN_AGE,
        dry_run: bool = False,
        backend_url: str | None = None,
        conn_id: str | None = None,
        prefix: str = "",
        price_per_gb_month: float = DEFAULT_PRICE_PER_GB_MONTH,
        release_after_success: timedelta | str | None = None,
        keep_failed_for: timedelta | str | None = None,
        airflow_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not price_per_gb_month >= 0:
            raise ValueError(f"price_per_gb_month must be a number >= 0, not {price_per_gb_month!r}")
        self.idle_for = idle_for
        self.keep_last = keep_last
        self.min_age = min_age
        self.only_report = dry_run  # BaseOperator already has a dry_run() method
        self.backend_url = backend_url
        self.conn_id = conn_id
        self.prefix = prefix
        self.price_per_gb_month = float(price_per_gb_month)
        self.release_after_success = release_after_success
        self.keep_failed_for = keep_failed_for
        self.airflow_conn_id = airflow_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        hook = StateHook(backend_url=self.backend_url, conn_id=self.conn_id)
        store = hook.get_store()
        groups = group_by_identity(store, self.prefix or "")
        settings = hook.settings
        lives = Lifetimes.configured(
            settings,
            idle_for=self.idle_for,
            release_after_success=self.release_after_success,
            keep_failed_for=self.keep_failed_for,
        )
        idle_for = lives.idle_for
        conn_id = self.airflow_conn_id if self.airflow_conn_id is not None else settings.airflow_conn_id
        airflow = AirflowApiHook(airflow_conn_id=conn_id).run_states() if conn_id else None
        if airflow is None:
            log.info(
                "gc: Airflow is not asked whether runs are finished (no airflow_conn_id): the outcomes the heads "
                "record decide"
            )
        else:
            log.info("gc: asking Airflow's REST API at %s whether runs are finished", airflow.base_url)
        progress = ItemProgress(label="gc: planning", total=len(groups), logger=log)
        plan = plan_gc(
            store,
            idle_for=idle_for,
            release_after_success=lives.release_after_success,
            keep_failed_for=lives.keep_failed_for,
            airflow=airflow,
            keep_last=self.keep_last,
            min_age=parse_duration(self.min_age, what="min_age"),
            grace=hook.lease_grace,
            prefix=self.prefix or "",
            progress=progress,
            groups=groups,
            signer=hook.get_signer(),
            marks=hook.get_marks(),
        )
        progress.finish()
        footprint = self._send_plan_metrics(plan, idle_for)
        skipped: dict[str, str] = {}
        deleted_objects = deleted_bytes = 0
        if not self.only_report:
            progress = ItemProgress(label="gc: deleting", total=len(plan.identities), logger=log)
            result = apply_gc(plan, progress=progress)
            progress.finish()
            skipped = result.skipped
            deleted_objects, deleted_bytes = len(result.deleted), result.bytes
            metrics.incr("stateful.gc.deleted_objects", deleted_objects)
            metrics.incr("stateful.gc.deleted_bytes", deleted_bytes)
        identities: list[dict[str, Any]] = []
        for item in plan.identities:
            action = item.action(dry_run=self.only_report, skipped=skipped.get(item.identity))
            identities.append(
                {
                    "identity": item.identity,
                    "reasons": {r: len(keys) for r, keys in item.reasons.items()},
                    "objects": len(item.keys),
                    "bytes": item.bytes,
                    "action": action,
                    "lifetime": item.why,
                }
            )
            log.info("gc %s: %s %s: %s", item.identity, action, identities[-1]["reasons"], item.why)
        for item in plan.kept:  # the task log says why each identity is kept (the XCom only counts them)
            log.info("gc %s: %s", item.identity, item.why)
        done = [i for i in identities if not str(i["action"]).startswith("skipped")]
        return {
            "store": store.url,
            "dry_run": self.only_report,
            "objects": sum(i["objects"] for i in done),
            "bytes": sum(i["bytes"] for i in done),
            **footprint,
            "deleted_objects": deleted_objects,
            "deleted_bytes": deleted_bytes,
            "identities": identities,
            "kept_identities": len(plan.kept),
            # Why each is kept, for the first KEPT_IN_REPORT (the task log names them all).
            "kept": [{"identity": p.identity, "lifetime": p.why} for p in plan.kept[:KEPT_IN_REPORT]],
            "airflow": airflow.base_url if airflow is not None else None,
        }

    def _send_plan_metrics(self, plan: GcPlan, idle_for: timedelta | None) -> dict[str, Any]:
        """Send the backlog and idle gauges of ``plan``; the same numbers for the report."""
        garbage_objects, garbage_bytes = garbage_backlog(plan)
        metrics.gauge("stateful.gc.garbage_objects", garbage_objects)
        metrics.gauge("stateful.gc.garbage_bytes", garbage_bytes)
        footprint: dict[str, Any] = {"garbage_objects": garbage_objects, "garbage_bytes": garbage_bytes}
        if idle_for is None:
            # Not judged: a 0 would read as "nothing idle" on a dashboard, so the idle gauges are not sent.
            footprint.update(idle_identities=None, idle_bytes=None, idle_monthly_cost=None)
        else:
            idle_identities, idle_bytes = idle_footprint(plan, idle_for)
            cost = idle_bytes / GB * self.price_per_gb_month
            metrics.gauge("stateful.idle_bytes", idle_bytes)
            metrics.gauge("stateful.idle_monthly_cost", cost)
            footprint.update(
                idle_identities=idle_identities, idle_bytes=idle_bytes, idle_monthly_cost=round(cost, 6)
            )
        footprint["price_per_gb_month"] = self.price_per_gb_month
        log.info(
            "gc: garbage %d object(s), %d bytes; idle %s bytes (%s per month)",
            garbage_objects,
            garbage_bytes,
            footprint["idle_bytes"],
            footprint["idle_monthly_cost"],
        )
        return footprint

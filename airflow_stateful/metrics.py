"""Airflow metrics for checkpoints: translates the core's events into Airflow ``Stats`` calls.

Metrics go wherever Airflow's ``[metrics]`` section sends them (StatsD, Datadog, OpenTelemetry); this
module only names them. Tags carry ``dag_id`` and ``task_id`` when the identity is a task's, never the run
id or the identity key (unbounded cardinality). Backends without tags (plain StatsD) drop them.

:data:`METRICS` is the one list of every metric this package emits. docs/observability.md describes each one
(and its StatsD and Prometheus names); ``deploy/`` builds its Prometheus rules and Grafana dashboard on them,
and tests/test_alert_rules.py checks that they reference nothing else and miss none. Writers emit the per-task ones; the GC operator and the stuck check emit the
fleet-wide gauges (``stateful.gc.*``, ``stateful.idle_*``, ``stateful.stuck_identities``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from airflow_stateful.core import events
from airflow_stateful.core.records.identity import Identity

PREFIX = "stateful"


@dataclass(frozen=True)
class Metric:
    """One metric: its name (under Airflow's own ``[metrics] statsd_prefix``), kind, tags and meaning."""

    name: str
    kind: str  # "counter", "gauge" or "timer"
    meaning: str
    tags: tuple[str, ...] = ("dag_id", "task_id")


METRICS: tuple[Metric, ...] = (
    Metric("stateful.commits", "counter", "checkpoints committed"),
    Metric("stateful.bytes_committed", "counter", "bytes of files in committed checkpoints"),
    Metric("stateful.commit_duration", "timer", "upload + manifest + head compare-and-swap"),
    Metric("stateful.commit_failures", "counter", "commits that failed for any reason but fencing"),
    Metric("stateful.restores", "counter", "checkpoints whose files were restored"),
    Metric("stateful.bytes_restored", "counter", "bytes of files restored"),
    Metric("stateful.restore_duration", "timer", "download + verify + move into place"),
    Metric("stateful.resumes", "counter", "tasks that resumed from a checkpoint"),
    Metric("stateful.fenced_writes", "counter", "writes refused because a newer try or pod took the lease"),
    Metric("stateful.outputs_published", "counter", "outputs made visible by a commit"),
    Metric(
        "stateful.checkpoint_age",
        "gauge",
        "seconds since the running writer last committed (or took the lease), sent at every lease renewal",
    ),
    Metric(
        "stateful.stuck",
        "gauge",
        "1 while the running writer is alive but past its expected checkpoint interval",
    ),
    Metric("stateful.stuck_identities", "gauge", "identities found stuck by the last stuck check", tags=()),
    Metric("stateful.gc.garbage_objects", "gauge", "unreferenced objects GC found (its backlog)", tags=()),
    Metric("stateful.gc.garbage_bytes", "gauge", "bytes of unreferenced objects GC found", tags=()),
    Metric("stateful.gc.deleted_objects", "counter", "objects GC deleted", tags=()),
    Metric("stateful.gc.deleted_bytes", "counter", "bytes GC deleted", tags=()),
    Metric(
        "stateful.idle_bytes", "gauge", "bytes held by identities idle longer than the GC's idle_for", tags=()
    ),
    Metric(
        "stateful.idle_monthly_cost",
        "gauge",
        "what the idle bytes cost per month at the GC's price per GB-month (USD by default)",
        tags=(),
    ),
)
"""Every metric this package emits, by the name it is sent under (before Airflow's ``statsd_prefix``)."""
METRIC_NAMES = frozenset(m.name for m in METRICS)


def _stats(name: str) -> Any:
    """Airflow's ``Stats``, once ``name`` is known to be in :data:`METRICS`: every metric this package sends goes
    through here, so the registry that ``deploy/`` and its tests are built on cannot miss one."""
    if name not in METRIC_NAMES:
        raise ValueError(f"{name!r} is not a metric of this package (see airflow_stateful.metrics.METRICS)")
    from airflow_stateful.compat import stats

    return stats()


def gauge(name: str, value: float, *, tags: Mapping[str, str] | None = None) -> None:
    """Send gauge ``name`` through Airflow's ``Stats``."""
    _stats(name).gauge(name, value, tags=dict(tags or {}))


def incr(name: str, count: int = 1, *, tags: Mapping[str, str] | None = None) -> None:
    """Add ``count`` to counter ``name``."""
    _stats(name).incr(name, count=count, tags=dict(tags or {}))


def timing(name: str, seconds: float, *, tags: Mapping[str, str] | None = None) -> None:
    """Send timer ``name`` (a duration in seconds)."""
    _stats(name).timing(name, timedelta(seconds=seconds), tags=dict(tags or {}))


def identity_tags(key: Any) -> dict[str, str]:
    """``dag_id``/``task_id`` tags of a task identity; ``{}`` for any other key."""
    try:
        parts = Identity.parse(str(key)).task_parts
    except ValueError:
        return {}
    if not parts:
        return {}
    return {"dag_id": str(parts["dag_id"]), "task_id": str(parts["task_id"])}


class StatsListener:
    """An :mod:`airflow_stateful.core.events` listener that reports to Airflow's ``Stats``.

    ``Stats`` is imported when the first event arrives, not at import time, so importing this module
    never loads Airflow's configuration: Airflow imports this package while its configuration is still
    loading, and an eager import there fails every Airflow command with a circular import.
    """

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StatsListener)  # one per process: install() stays idempotent

    def __hash__(self) -> int:
        return hash(StatsListener)

    def __call__(self, name: str, fields: Mapping[str, Any]) -> None:
        tags = identity_tags(fields.get("identity"))
        if name in (events.COMMIT, events.RESTORE):
            noun, past = ("commit", "committed") if name == events.COMMIT else ("restore", "restored")
            incr(f"{PREFIX}.{noun}s", tags=tags)
            size = int(fields.get("bytes") or 0)
            if size:
                incr(f"{PREFIX}.bytes_{past}", size, tags=tags)
            if fields.get("duration") is not None:
                timing(f"{PREFIX}.{noun}_duration", float(fields["duration"]), tags=tags)
        elif name == events.RESUME:
            incr(f"{PREFIX}.resumes", tags=tags)
        elif name == events.FENCED:
            incr(f"{PREFIX}.fenced_writes", tags=tags)
        elif name == events.COMMIT_FAILED:
            incr(f"{PREFIX}.commit_failures", tags=tags)
        elif name == events.PUBLISHED:
            incr(f"{PREFIX}.outputs_published", int(fields.get("outputs") or 0), tags=tags)
        elif name == events.PROGRESS:
            gauge(f"{PREFIX}.checkpoint_age", float(fields.get("since_progress") or 0.0), tags=tags)
            gauge(f"{PREFIX}.stuck", 1 if fields.get("stuck") else 0, tags=tags)


def install() -> StatsListener:
    """Register the :class:`StatsListener` (idempotent); called by :class:`StateHook`."""
    listener = StatsListener()
    events.add_listener(listener)
    return listener


def uninstall() -> None:
    events.remove_listener(StatsListener())

"""Airflow metrics for checkpoints: translates the core's events into Airflow ``Stats`` calls.

Metrics go wherever Airflow's ``[metrics]`` section sends them (StatsD, Datadog, OpenTelemetry); this
module only names them. Tags carry ``dag_id`` and ``task_id`` when the identity is a task's, never the run
id or the identity key (unbounded cardinality). Backends without tags (plain StatsD) drop them.

============================  =========  ==========================================================
name                          type       meaning
============================  =========  ==========================================================
``stateful.commits``          counter    checkpoints committed
``stateful.bytes_committed``  counter    bytes of files in committed checkpoints
``stateful.commit_duration``  timer      upload + manifest + head compare-and-swap
``stateful.restores``         counter    checkpoints whose files were restored
``stateful.bytes_restored``   counter    bytes of files restored
``stateful.restore_duration`` timer      download + verify + move into place
``stateful.resumes``          counter    tasks that resumed from a checkpoint
``stateful.fenced_writes``    counter    writes refused because a newer try or pod took the lease
============================  =========  ==========================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from airflow_stateful.core import events
from airflow_stateful.core.identity import Identity

PREFIX = "stateful"


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
        from airflow_stateful.compat import stats

        Stats = stats()

        tags = identity_tags(fields.get("identity"))
        if name in (events.COMMIT, events.RESTORE):
            noun, past = ("commit", "committed") if name == events.COMMIT else ("restore", "restored")
            Stats.incr(f"{PREFIX}.{noun}s", tags=tags)
            size = int(fields.get("bytes") or 0)
            if size:
                Stats.incr(f"{PREFIX}.bytes_{past}", count=size, tags=tags)
            if fields.get("duration") is not None:
                Stats.timing(
                    f"{PREFIX}.{noun}_duration", timedelta(seconds=float(fields["duration"])), tags=tags
                )
        elif name == events.RESUME:
            Stats.incr(f"{PREFIX}.resumes", tags=tags)
        elif name == events.FENCED:
            Stats.incr(f"{PREFIX}.fenced_writes", tags=tags)


def install() -> StatsListener:
    """Register the :class:`StatsListener` (idempotent); called by :class:`StateHook`."""
    listener = StatsListener()
    events.add_listener(listener)
    return listener


def uninstall() -> None:
    events.remove_listener(StatsListener())

"""StatefulGCOperator: the store-wide retention and garbage collection of ``airflow-stateful gc``, as a task.

A maintenance DAG (``dags/stateful_maintenance.py``) runs it daily, so crash garbage, orphans of crashed
purges, idle identities and expired task state documents do not pile up in the bucket unnoticed. The
policy engine is :mod:`airflow_stateful.core.gc`; this operator only opens the store through
:class:`~airflow_stateful.hooks.state.StateHook` and logs progress (a task log is not a terminal, so
progress is a few log lines).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from airflow_stateful.core.durations import parse_duration
from airflow_stateful.core.gc import DEFAULT_MIN_AGE, apply_gc, group_by_identity, plan_gc
from airflow_stateful.core.item_progress import ItemProgress
from airflow_stateful.hooks.state import StateHook

log = logging.getLogger("airflow_stateful")


class StatefulGCOperator(BaseOperator):
    """Apply retention and delete garbage in the ``[stateful]`` backend; return the report (JSON) as XCom.

    Never deletes anything under a live lease. With ``dry_run`` nothing changes and the report lists what a
    real run would delete. The XCom holds, per identity, the reasons with their object counts and bytes (not
    every key, to keep XCom small); the task log names every deleted identity.

    :param idle_for: delete identities whose head was not updated for this long (``"30d"``; templated).
    :param keep_last: keep at most this many checkpoints per identity (default: leave history alone).
    :param min_age: leave unreferenced objects younger than this (in-flight commits; default 1h).
    :param dry_run: only report.
    :param backend_url: the store, default ``[stateful] backend_url`` (templated).
    :param conn_id: Airflow connection with S3 credentials, default ``[stateful] conn_id``.
    :param prefix: only identities whose key starts with this, e.g. ``"my_dag/"`` (templated). Expired task
        state documents are only collected when ``prefix`` is empty.
    """

    template_fields: Sequence[str] = ("idle_for", "prefix", "backend_url")

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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.idle_for = idle_for
        self.keep_last = keep_last
        self.min_age = min_age
        self.only_report = dry_run  # BaseOperator already has a dry_run() method
        self.backend_url = backend_url
        self.conn_id = conn_id
        self.prefix = prefix

    def execute(self, context: Any) -> dict[str, Any]:
        hook = StateHook(backend_url=self.backend_url, conn_id=self.conn_id)
        store = hook.get_store()
        groups = group_by_identity(store, self.prefix or "")
        progress = ItemProgress(label="gc: planning", total=len(groups), logger=log)
        plan = plan_gc(
            store,
            idle_for=parse_duration(self.idle_for, what="idle_for") if self.idle_for is not None else None,
            keep_last=self.keep_last,
            min_age=parse_duration(self.min_age, what="min_age"),
            grace=hook.lease_grace,
            prefix=self.prefix or "",
            progress=progress,
            groups=groups,
        )
        progress.finish()
        skipped: dict[str, str] = {}
        if not self.only_report:
            progress = ItemProgress(label="gc: deleting", total=len(plan.identities), logger=log)
            skipped = apply_gc(plan, progress=progress).skipped
            progress.finish()
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
                }
            )
            log.info("gc %s: %s %s", item.identity, action, identities[-1]["reasons"])
        done = [i for i in identities if not str(i["action"]).startswith("skipped")]
        return {
            "store": store.url,
            "dry_run": self.only_report,
            "objects": sum(i["objects"] for i in done),
            "bytes": sum(i["bytes"] for i in done),
            "identities": identities,
        }

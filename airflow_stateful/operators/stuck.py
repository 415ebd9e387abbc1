"""StatefulStuckCheckOperator: ``airflow-stateful stuck`` as a task, failing when a writer is stuck.

A writer is *stuck* when its lease is live (its heartbeat renews it) but it has committed nothing for longer
than its declared ``expected_checkpoint_interval``: Airflow sees a running task and never retries it, so it
holds its slot until a person looks. A *dead* writer (lease expired) is Airflow's business (it retries the
task) and is never reported as stuck. The listing is :func:`airflow_stateful.core.fleet.stuck.find_stuck`, the same
code the CLI runs; the maintenance DAG (:mod:`airflow_stateful.maintenance`) runs this operator next to the GC.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from airflow_stateful import metrics
from airflow_stateful.compat import AirflowFailException
from airflow_stateful.core.durations import positive_duration
from airflow_stateful.core.fleet.stuck import find_stuck
from airflow_stateful.hooks.state import StateHook

log = logging.getLogger("airflow_stateful")

SHOWN_IN_ERROR = 20
"""Stuck identities named in the failure message (the log and the report name them all)."""


class StatefulStuckCheckOperator(BaseOperator):
    """Find stuck identities in the ``[stateful]`` backend; fail naming them; return the report (JSON) as XCom.

    Every stuck identity is logged with its holder and the reason (how long since its last commit, against
    which interval); dead ones (lease expired) and heads that could not be read are logged too, but never fail
    the task. The gauge ``stateful.stuck_identities`` (no tags) is sent with the number found, also when it is
    0, so an alert clears once the writers recover. The report (``store``, ``prefix``, ``checked``, ``counts``
    per status, ``stuck``, ``dead``, ``errors``) is the task's ``return_value`` XCom, pushed before the task
    fails, so a downstream task with ``trigger_rule="one_failed"`` can notify with it.

    :param prefix: only identities whose key starts with this, e.g. ``"my_dag/"`` (templated).
    :param backend_url: the store, default ``[stateful] backend_url`` (templated).
    :param conn_id: Airflow connection with S3 credentials, default ``[stateful] conn_id``.
    :param default_interval: how long a live lease may go without a commit before it counts as stuck, for
        leases that record no ``expected_checkpoint_interval`` (stateful tasks always record theirs, or their
        worker's ``[stateful]`` value; a lease written by the core directly or by an older release may not).
        A ``timedelta`` or text such as ``"30m"`` (templated). Default: ``[stateful]
        expected_checkpoint_interval`` (1 hour).
    :param fail_on_stuck: raise ``AirflowFailException`` (no retries: the next scheduled check looks again)
        naming the stuck identities; ``False`` only reports.

    Example::

        StatefulStuckCheckOperator(task_id="stuck_check", prefix="etl/", default_interval="30m")
    """

    template_fields: Sequence[str] = ("prefix", "backend_url", "default_interval")

    def __init__(
        self,
        *,
        prefix: str = "",
        backend_url: str | None = None,
        conn_id: str | None = None,
        default_interval: timedelta | str | None = None,
        fail_on_stuck: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.prefix = prefix
        self.backend_url = backend_url
        self.conn_id = conn_id
        self.default_interval = default_interval
        self.fail_on_stuck = fail_on_stuck

    def execute(self, context: Any) -> dict[str, Any]:
        hook = StateHook(backend_url=self.backend_url, conn_id=self.conn_id)
        if self.default_interval is None:
            interval = timedelta(seconds=hook.settings.expected_checkpoint_interval)
        else:
            interval = positive_duration(self.default_interval, what="default_interval")
        store = hook.get_store()
        try:
            report = find_stuck(store, self.prefix or "", default_interval=interval, signer=hook.get_signer())
        finally:
            store.close()
        for item in report.stuck:
            assert item.status is not None
            log.warning("STUCK %s: %s", item.identity.key, item.status.reason)
        for item in report.dead:
            assert item.status is not None
            log.info("dead, not stuck: %s: %s", item.identity.key, item.status.reason)
        for item in report.errors:
            log.warning("could not judge %s (its head could not be read): %s", item.identity.key, item.error)
        log.info("%s", report.summary())
        metrics.gauge("stateful.stuck_identities", len(report.stuck))
        result = report.to_json()
        if report.stuck and self.fail_on_stuck:
            context["ti"].xcom_push(key="return_value", value=result)
            names = report.stuck_identities
            shown = ", ".join(names[:SHOWN_IN_ERROR])
            more = (
                f" and {len(names) - SHOWN_IN_ERROR} more (see the log)"
                if len(names) > SHOWN_IN_ERROR
                else ""
            )
            raise AirflowFailException(
                f"{len(names)} stuck {'identity' if len(names) == 1 else 'identities'} (alive, renewing the "
                f"lease, but no checkpoint within the expected interval): {shown}{more}. "
                "`airflow-stateful stuck` lists them with their holders; look at those tasks' logs."
            )
        return result

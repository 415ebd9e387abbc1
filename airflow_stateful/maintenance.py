"""The maintenance DAG, shipped in the package so that every installation can have it: without it state is
never deleted. A DAG folder holds only the file that calls :func:`stateful_maintenance_dag` (README, "Install").

A daily GC of the checkpoint store, so it never grows without bound, and a stuck check.

``StatefulGCOperator`` applies the store-wide policies of ``airflow-stateful gc`` to the ``[stateful]`` backend:
identities idle for 30 days are deleted unless their task can still run (a retry pending, rescheduled, deferred)
or failed for good less than ``[stateful] keep_failed_for`` ago (30 days), succeeded per-run state is released
after ``[stateful] release_after_success`` if that is set, history is pruned to the newest 5 checkpoints (pinned
ones kept), objects left by crashed commits or half-done purges (older than an hour) and expired task state
documents are removed. Identities under a live lease are never touched. With ``[stateful] airflow_conn_id`` (a
connection to Airflow's REST API) it asks Airflow whether a run is finished before deleting the run's state, and
keeps it when Airflow says it can still run or cannot be asked. It returns a JSON report (XCom) that says why each
identity was kept or deleted (docs/stateful-tasks.md, "How long state lives").

``StatefulStuckCheckOperator`` runs ``airflow-stateful stuck``: it fails, naming them, when a writer holds a live
lease but has committed nothing for longer than its ``expected_checkpoint_interval`` (else ``[stateful]
expected_checkpoint_interval``, 1 hour). Dead writers (lease expired) are Airflow's to retry and never fail it.
It sends ``stateful.stuck_identities`` and returns its report (XCom). The two tasks are independent: a failed
check never holds up the GC. A daily check finds a writer stuck at that moment; to be told within the hour, run
the same operator in a DAG of its own with ``schedule="@hourly"`` (it only reads heads: one listing and one small
GET per identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG

from airflow_stateful.operators.gc import StatefulGCOperator
from airflow_stateful.operators.stuck import StatefulStuckCheckOperator

__all__ = ["stateful_maintenance_dag"]


def stateful_maintenance_dag(
    *,
    dag_id: str = "stateful_maintenance",
    schedule: str | None = "@daily",
    start_date: datetime = datetime(2026, 1, 1),
    idle_for: timedelta | str = "30d",
    keep_last: int | None = 5,
    min_age: timedelta | str = timedelta(hours=1),
    dry_run: bool = False,
    stuck_prefix: str = "",
    fail_on_stuck: bool = True,
    tags: Sequence[str] = ("stateful", "maintenance"),
    **dag_kwargs: Any,
) -> DAG:
    """The maintenance DAG: tasks ``gc`` and ``stuck_check`` (see the module's docstring for what each does).

    Called at the top level of a file in the DAG folder, which is how Airflow finds the DAG it returns::

        from airflow_stateful.maintenance import stateful_maintenance_dag

        dag_object = stateful_maintenance_dag()

    The defaults are the policy the docs describe; each argument exists so that a deployment can change one
    part of it without writing its own DAG.

    :param dag_id: the DAG's id.
    :param schedule: how often both tasks run.
    :param start_date: the DAG's start date (``catchup`` is off: only the latest interval runs).
    :param idle_for: GC deletes identities idle for longer than this (``StatefulGCOperator``'s ``idle_for``).
    :param keep_last: GC keeps at most this many checkpoints per identity; ``None`` leaves history alone.
    :param min_age: GC leaves unreferenced objects younger than this (commits in flight).
    :param dry_run: GC only reports, deleting nothing.
    :param stuck_prefix: the stuck check looks only at identities under this key prefix, e.g. ``"my_dag/"``.
    :param fail_on_stuck: the stuck check fails when it finds a stuck writer; ``False`` only reports.
    :param tags: the DAG's tags.
    :param dag_kwargs: any other ``DAG`` argument (``default_args``, ``doc_md``, ...).
    """
    with DAG(
        dag_id=dag_id,
        schedule=schedule,
        start_date=start_date,
        catchup=False,
        max_active_runs=1,
        tags=list(tags),
        **dag_kwargs,
    ) as dag:
        # [START stateful_maintenance]
        StatefulGCOperator(
            task_id="gc",
            idle_for=idle_for,
            keep_last=keep_last,
            min_age=min_age,
            dry_run=dry_run,
        )
        # [END stateful_maintenance]
        # [START stateful_stuck_check]
        StatefulStuckCheckOperator(
            task_id="stuck_check",
            prefix=stuck_prefix,  # templated
            fail_on_stuck=fail_on_stuck,
        )
        # [END stateful_stuck_check]
    return dag

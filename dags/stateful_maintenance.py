"""Stateful maintenance: a daily GC of the checkpoint store, so it never grows without bound, and a stuck check.

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

Run it alone (state in ``$AIRFLOW_HOME/stateful`` unless configured)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/stateful_maintenance.py
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag

from airflow_stateful.operators.gc import StatefulGCOperator
from airflow_stateful.operators.stuck import StatefulStuckCheckOperator


@dag(
    dag_id="stateful_maintenance",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["stateful", "maintenance"],
)
def stateful_maintenance() -> None:
    # [START stateful_maintenance]
    StatefulGCOperator(
        task_id="gc",
        idle_for="30d",
        keep_last=5,
        min_age=timedelta(hours=1),
        dry_run=False,
    )
    # [END stateful_maintenance]
    # [START stateful_stuck_check]
    StatefulStuckCheckOperator(
        task_id="stuck_check",
        prefix="",  # or "my_dag/" (templated)
        fail_on_stuck=True,
    )
    # [END stateful_stuck_check]


dag_object = stateful_maintenance()


if __name__ == "__main__":
    dag_object.test()

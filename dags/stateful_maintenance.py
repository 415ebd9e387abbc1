"""Stateful maintenance: a daily GC of the checkpoint store, so it never grows without bound.

One ``StatefulGCOperator`` task applies the store-wide policies of ``airflow-stateful gc`` to the
``[stateful]`` backend: identities idle for 30 days are deleted, history is pruned to the newest 5
checkpoints, objects left by crashed commits or half-done purges (older than an hour) and expired task
state documents are removed. Identities under a live lease are never touched. The task returns a JSON
report (XCom). Run it alone (state in ``$AIRFLOW_HOME/stateful`` unless configured)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/stateful_maintenance.py
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag

from airflow_stateful.operators.gc import StatefulGCOperator


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


dag_object = stateful_maintenance()


if __name__ == "__main__":
    dag_object.test()

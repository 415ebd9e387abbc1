"""Checkpoint sensors: start work on a producer's durable state as soon as it is far enough along.

``export_orders`` is an incremental export whose state lives across DAG runs
(``@stateful_task(identity="orders-export")``): every run exports the orders that arrived since the last
one, in batches, and commits ``{"run_id", "batches", "rows", "total_rows"}`` after every batch.

``wait_for_first_rows`` (a :class:`~airflow_stateful.sensors.checkpoint.CheckpointSensor`) runs *beside*
the export, not after it: it succeeds once this run's export has committed at least 300 rows, so
``preview_report`` can start on the first rows while the export goes on. A plain dependency could only wait
for the whole export. ``newer_than="{{ dag_run.start_date }}"`` ignores the checkpoints of earlier runs
(the state is shared by every run). It waits in ``reschedule`` mode, so it holds no worker slot between
checks.

The second DAG, ``checkpoint_sensor_maintenance``, removes the export's unreferenced objects (garbage of
crashed commits). GC must not race a running writer, so a
:class:`~airflow_stateful.sensors.checkpoint.LeaseReleasedSensor` first waits, in the triggerer
(``deferrable=True``), until no export holds the identity's lease.

Run it alone (state in ``$AIRFLOW_HOME/stateful`` unless ``[stateful] backend_url`` says otherwise)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/checkpoint_sensor.py
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag, get_current_context, task

from airflow_stateful import TaskState, stateful_task
from airflow_stateful.sensors.checkpoint import CheckpointSensor, LeaseReleasedSensor

log = logging.getLogger(__name__)

BATCHES = 6
BATCH_ROWS = 100
STATE_NAME = "orders-export"


@dag(
    dag_id="checkpoint_sensor",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,  # the export's state is shared by every run: runs must not overlap
    tags=["stateful", "example"],
)
def checkpoint_sensor() -> None:
    @stateful_task(identity=STATE_NAME, retries=2, retry_delay=timedelta(seconds=0))
    def export_orders(state: TaskState) -> dict[str, Any]:
        run_id = get_current_context()["dag_run"].run_id
        previous = state.value or {"run_id": None, "batches": 0, "rows": 0, "total_rows": 0}
        if previous["run_id"] == run_id:
            progress = previous  # a retry of this run: continue after its last batch
        else:
            progress = {"run_id": run_id, "batches": 0, "rows": 0, "total_rows": previous["total_rows"]}
        for batch in range(progress["batches"], BATCHES):
            time.sleep(0.2)  # the real work: export BATCH_ROWS orders
            progress = {
                "run_id": run_id,
                "batches": batch + 1,
                "rows": progress["rows"] + BATCH_ROWS,
                "total_rows": progress["total_rows"] + BATCH_ROWS,
            }
            state.save(progress)
        return progress

    # [START checkpoint_sensor]
    wait_for_first_rows = CheckpointSensor(
        task_id="wait_for_first_rows",
        external_task_id="export_orders",  # external_dag_id defaults to this DAG
        name="orders-export",  # the identity= of the @stateful_task
        newer_than="{{ dag_run.start_date }}",  # a checkpoint of this run, not of an earlier one
        field="rows",
        op=">=",
        value=300,
        mode="reschedule",
        poke_interval=timedelta(seconds=5),  # short for the demo; minutes in production
        timeout=timedelta(hours=2),
    )
    # [END checkpoint_sensor]

    @task
    def preview_report(seen: dict[str, Any]) -> dict[str, Any]:
        """Work on the rows exported so far; the sensor returned which checkpoint met its condition."""
        from airflow_stateful import Identity, StateHook

        latest = StateHook().checkpoint_store(Identity.parse(seen["identity"])).latest()
        assert latest is not None and latest.seq >= seen["seq"]
        log.info("preview of %d rows (checkpoint %d)", latest.value["rows"], latest.seq)
        return {"sensor_seq": seen["seq"], "rows_at_least": latest.value["rows"]}

    export_orders()
    preview_report(wait_for_first_rows.output)


@dag(
    dag_id="checkpoint_sensor_maintenance",
    schedule="@weekly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["stateful", "example"],
)
def checkpoint_sensor_maintenance() -> None:
    # [START lease_released_sensor]
    export_idle = LeaseReleasedSensor(
        task_id="export_idle",
        external_dag_id="checkpoint_sensor",
        external_task_id="export_orders",
        name="orders-export",
        deferrable=True,  # waits in the triggerer, polling the head record with backoff
        poke_interval=timedelta(seconds=10),
        max_wait=timedelta(minutes=5),
        timeout=timedelta(hours=6),
    )
    # [END lease_released_sensor]

    @task
    def collect_export_garbage(idle: dict[str, Any]) -> dict[str, Any]:
        """Remove objects of crashed commits while no export runs (GC would otherwise skip a live lease)."""
        from airflow_stateful import Identity, StateHook
        from airflow_stateful.core import collect_garbage

        checkpoints = StateHook().checkpoint_store(Identity.parse(idle["identity"]))
        report = collect_garbage(checkpoints)
        return {"epoch": idle["epoch"], "deleted": len(report.deleted), "skipped": report.skipped_reason}

    collect_export_garbage(export_idle.output)


dag_object = checkpoint_sensor()
maintenance_dag = checkpoint_sensor_maintenance()


if __name__ == "__main__":
    dag_object.test()
    maintenance_dag.test()

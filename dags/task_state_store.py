"""Task state store (Airflow 3.3+): a retry reattaches to the job its first try submitted.

The pattern of Airflow's own ``example_task_state_store``: ``run_job`` submits a long-running external job,
keeps its id in ``context["task_state_store"]`` and "crashes"; the retry finds the id there and reattaches
instead of submitting a duplicate. ``count_rows`` is mapped: each map index has its own keys. Keys may hold
``/`` (``job/submitted_on_try``), as on Airflow's own backends.

It runs on any state store backend: Airflow's default (the metadata database), or
``airflow_stateful.state_store.S3StateStoreBackend``, which keeps every key as a conditionally written
document in S3 (docs/state-store.md). Every submission is appended to a ledger file, so a test can count
them. Run it alone::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/task_state_store.py
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import NEVER_EXPIRE, dag, task

TABLES = ["orders", "customers"]


def ledger_path() -> Path:
    """Where submissions are recorded: ``STATEFUL_DEMO_LEDGER`` or a file in AIRFLOW_HOME."""
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / "task_state_store.ledger"
    return Path(os.environ.get("STATEFUL_DEMO_LEDGER", default))


def submit_job(try_number: int) -> str:
    """Submit the external job (here: a line in the ledger) and return its id."""
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    with open(ledger_path(), "a") as ledger:
        ledger.write(f"{try_number},{job_id}\n")
    return job_id


@dag(
    dag_id="task_state_store",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["stateful", "example", "task-state-store"],
)
def task_state_store_job() -> None:
    # [START task_state_store]
    @task(retries=2, retry_delay=timedelta(seconds=0))
    def run_job(task_state_store: Any = None, ti: Any = None) -> dict[str, Any]:
        job_id = task_state_store.get("job_id")
        if job_id is None:
            job_id = submit_job(ti.try_number)
            # NEVER_EXPIRE: the id must outlive every retry, whatever [state_store] default_retention_days says.
            task_state_store.set("job_id", job_id, retention=NEVER_EXPIRE)
            task_state_store.set("job/submitted_on_try", ti.try_number)
            task_state_store.set("job/submitted_at", datetime.now(tz=timezone.utc).isoformat())
            raise RuntimeError(f"simulated crash after submitting {job_id}; the retry reattaches to it")
        task_state_store.set("status", "complete")
        result = {
            "job_id": job_id,
            "submitted_on_try": task_state_store.get("job/submitted_on_try"),
            "finished_on_try": ti.try_number,
        }
        task_state_store.set("result", result)
        return result

    @task
    def count_rows(table: str, task_state_store: Any = None) -> int:
        rows = len(table) * 100  # stands for the real count
        task_state_store.set("rows", {"table": table, "rows": rows})  # one key per map index
        return rows

    # [END task_state_store]
    run_job()
    count_rows.expand(table=TABLES)


dag_object = task_state_store_job()


if __name__ == "__main__":
    run = dag_object.test()
    print(f"DAG run state: {run.state}; submissions: {ledger_path().read_text().split()}")

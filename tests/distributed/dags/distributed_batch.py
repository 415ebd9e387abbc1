"""Distributed batch: a stateful task that checkpoints after every item and says where each try ran.

Used by ``tests/test_distributed.py`` on the Celery cluster of ``tests/distributed/cluster.py``. The task
handles ``items`` items, ``item_seconds`` each (run parameters), and commits a checkpoint after every item.

The checkpoint value records, besides the running total, every *execution* of the task (a try, or the same
try again after a reschedule): its try number, the worker that ran it (``STATEFUL_DIST_WORKER``, set per
worker by the cluster), its pid, and ``resumed_at``, the number of items already done when it started. A
ledger file (``STATEFUL_DIST_LEDGER``) gets one ``run_id,try,pid,worker,event`` row per execution start
(``start:<resumed_at>``) and per finished item (the item's number), so a test sees work a killed execution
did after its last checkpoint, which the checkpoint cannot show.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task


def _ledger(row: str) -> None:
    path = os.environ.get("STATEFUL_DIST_LEDGER")
    if path:
        with open(path, "a") as f:  # one short append per row: rows from many processes do not mix
            f.write(row + "\n")


@dag(
    dag_id="distributed_batch",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=16,
    params={"items": 40, "item_seconds": 0.25},
    tags=["stateful", "test"],
)
def distributed_batch() -> None:
    @stateful_task(
        retries=2,
        retry_delay=timedelta(seconds=0),
        checkpoint_every=1,
        keep_last=1000,  # keep every checkpoint: the tests read the whole history
        reschedule_delay=timedelta(seconds=1),
    )
    def crunch(state: TaskState) -> dict[str, Any]:
        context = get_current_context()
        ti, run_id = context["ti"], context["dag_run"].run_id
        items = int(context["params"]["items"])
        item_seconds = float(context["params"]["item_seconds"])
        worker = os.environ.get("STATEFUL_DIST_WORKER") or socket.gethostname()
        value = state.value or {"total": 0, "done": 0, "executions": []}
        execution = {"try": ti.try_number, "worker": worker, "pid": os.getpid(), "resumed_at": value["done"]}
        state.value = {**value, "executions": [*value["executions"], execution]}
        who = f"{run_id},{ti.try_number},{os.getpid()},{worker}"
        _ledger(f"{who},start:{value['done']}")
        for item in state.resume(range(items)):
            done = state.value["done"]
            if item != done:  # the position and the value are committed together: they must agree
                raise RuntimeError(f"resume() yielded item {item} but the value says {done} are done")
            time.sleep(item_seconds)
            state.value = {**state.value, "total": state.value["total"] + item * item, "done": item + 1}
            _ledger(f"{who},{item}")
        return dict(state.value)

    crunch()


dag_object = distributed_batch()

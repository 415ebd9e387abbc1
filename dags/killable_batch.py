"""Killable batch: a slow task that can be killed without warning (SIGKILL) and resumes on retry.

A ``@stateful_task`` handles ``ITEMS`` items, ``item_seconds`` each, and checkpoints every ``CHECKPOINT_EVERY``.
Unlike ``resumable_batch`` it never fails on its own: kill its process (an OOM kill, a lost node, ``kill -9``)
and Airflow counts a failed try; the retry resumes from the last committed checkpoint.

Two run parameters (``airflow dags trigger killable_batch --conf '{...}'``):

* ``item_seconds`` (default 0.5): how long one item takes, so there is time to kill the task part-way;
* ``kill_at_item`` (default -1: never): on try 1 the task SIGKILLs its own process when it reaches this
  item, which makes the demo one command (``docker compose`` in the README uses 37).

Side effects a person or a test can check, in ``AIRFLOW_HOME`` unless the environment says otherwise:

* ledger (``STATEFUL_DEMO_LEDGER``, default ``killable_batch.ledger``): one ``try_number,item`` row per
  handled item;
* pid file (``STATEFUL_DEMO_PIDFILE``, default ``killable_batch.pid``): one ``try_number,pid`` row per try,
  so whoever wants to kill the task process knows which one it is.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

log = logging.getLogger(__name__)

ITEMS = 100
CHECKPOINT_EVERY = 10


def _home_file(env: str, name: str) -> Path:
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / name
    return Path(os.environ.get(env, default))


def ledger_path() -> Path:
    return _home_file("STATEFUL_DEMO_LEDGER", "killable_batch.ledger")


def pid_path() -> Path:
    return _home_file("STATEFUL_DEMO_PIDFILE", "killable_batch.pid")


def _append(path: Path, row: str) -> None:
    with open(path, "a") as f:
        f.write(row + "\n")
        f.flush()


@dag(
    dag_id="killable_batch",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params={"item_seconds": 0.5, "kill_at_item": -1},
    tags=["stateful", "example"],
)
def killable_batch() -> None:
    @stateful_task(retries=2, retry_delay=timedelta(seconds=0), checkpoint_every=CHECKPOINT_EVERY)
    def crunch(state: TaskState) -> dict[str, int]:
        context = get_current_context()
        try_number = context["ti"].try_number
        item_seconds = float(context["params"]["item_seconds"])
        kill_at_item = int(context["params"]["kill_at_item"])
        _append(pid_path(), f"{try_number},{os.getpid()}")
        state.value = state.value or {"total": 0}
        for item in state.resume(range(ITEMS)):  # skips the items earlier tries finished
            if try_number == 1 and item == kill_at_item:
                log.warning("try %d: SIGKILL to my own process at item %d", try_number, item)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(item_seconds)
            _append(ledger_path(), f"{try_number},{item}")
            state.value = {"total": state.value["total"] + item * item}
        log.info("done: %d items, total %d", ITEMS, state.value["total"])
        return state.value

    crunch()


dag_object = killable_batch()

if __name__ == "__main__":
    dag_object.test(run_conf={"item_seconds": 0.0})

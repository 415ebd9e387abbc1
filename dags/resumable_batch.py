"""Resumable batch: a task that dies part-way resumes from its last checkpoint on retry.

A ``@stateful_task`` handles 100 items and checkpoints every 10. On its first try it "loses its spot instance" after
item 37; the retry resumes from the checkpoint written after item 30 and handles only items 30..99.
Every handled item is appended to a ledger file, so the work each try really did can be counted.

Run it alone (``make demo`` does this on SQLite and a local state directory)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/resumable_batch.py
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task
from airflow_stateful.hooks.state import StateHook

log = logging.getLogger(__name__)

ITEMS = 100
CHECKPOINT_EVERY = 10
FAIL_AFTER_ITEM = 37


def ledger_path() -> Path:
    """Where handled items are recorded: ``STATEFUL_DEMO_LEDGER`` or a file in AIRFLOW_HOME."""
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / "resumable_batch.ledger"
    return Path(os.environ.get("STATEFUL_DEMO_LEDGER", default))


def handle(item: int, try_number: int) -> int:
    """The real work of one item (here: a square), with a side effect a test can count."""
    with open(ledger_path(), "a") as ledger:
        ledger.write(f"{try_number},{item}\n")
    return item * item


@dag(
    dag_id="resumable_batch",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["stateful", "example"],
)
def resumable_batch() -> None:
    # [START resumable_batch]
    @stateful_task(retries=2, retry_delay=timedelta(seconds=0), checkpoint_every=CHECKPOINT_EVERY)
    def crunch(state: TaskState) -> dict[str, int]:
        try_number = get_current_context()["ti"].try_number
        state.value = state.value or {"total": 0}
        for item in state.resume(range(ITEMS)):  # skips the items earlier tries finished
            if try_number == 1 and item == FAIL_AFTER_ITEM:
                raise RuntimeError(f"simulated spot-instance loss at item {item} on try {try_number}")
            state.value = {"total": state.value["total"] + handle(item, try_number)}
        log.info("done: %d items, total %d", ITEMS, state.value["total"])
        return state.value

    # [END resumable_batch]
    crunch()


dag_object = resumable_batch()


def _demo() -> None:
    """Run the DAG once with ``dag.test()`` and tell what each try did (``make demo``)."""
    import re
    import sys

    ledger_path().unlink(missing_ok=True)
    log_file = Path(os.environ.get("AIRFLOW_HOME", ".")) / "resumable_batch.log"
    # Airflow's own log lines are many: send everything written to fds 1 and 2 to a file meanwhile.
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_file, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            run = dag_object.test()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    story = re.compile(
        r"RuntimeError: simulated|took the lease|resuming from|skipping|starting fresh|committed checkpoint|done:"
    )
    identity = StateHook.identity_for({"ti": run.get_task_instances()[0], "dag_run": run}).key
    print(f"Task log, abridged (identity {identity}; full log: {log_file}):")
    for line in log_file.read_text().splitlines():
        if story.search(line):
            line = re.sub(r"^\S+ \[\w+\s*\] ", "", line).replace(identity, "<identity>")
            print("  " + re.split(r"\s+\[[\w.]+\]", line)[0][:150])
    tries: dict[int, list[int]] = {}
    for row in ledger_path().read_text().split():
        try_number, item = (int(x) for x in row.split(","))
        tries.setdefault(try_number, []).append(item)
    print("\nWhat happened:")
    for try_number, items in sorted(tries.items()):
        print(f"  try {try_number}: handled items {items[0]}..{items[-1]} ({len(items)} items)")
    redone = sum(len(v) for v in tries.values()) - ITEMS
    print(
        f"  the retry resumed from the last checkpoint: {redone} items were handled twice instead of {FAIL_AFTER_ITEM}"
    )
    print(f"  DAG run state: {run.state}")
    if run.state != "success" or sorted(tries) != [1, 2] or tries[2][0] == 0:
        raise SystemExit("demo FAILED: the retry did not resume from a checkpoint")


if __name__ == "__main__":
    _demo()

"""Durable watermark: an incremental job whose state lives across DAG runs, not just across tries.

A nightly job copies the rows a source table gained since the last run. Its watermark (the timestamp
and id of the newest row it has loaded) is the state of a ``@stateful_task(identity="nightly-watermark")``:
with a name, the state belongs to the task, not to one DAG run, so every run starts from where the
previous run (or the previous try of this run) stopped. Its checkpoints live under the identity
``durable_watermark/load_new_rows/name=nightly-watermark/map=-1``.

Each run loads the rows newer than the watermark up to the end of its data interval, in batches, and
saves the new watermark after every batch. Rows are loaded in watermark order, so the watermark is itself
the resume cursor: a try that dies part-way is retried from its last batch, and the next night's run
starts after the last row any run loaded. (Do not use ``state.resume()`` over "the new rows" here: its
cursor counts positions in an iterable, and the new rows of the next run are a different iterable.)

The source table is simulated: one row every 3 hours from 2026-01-01 00:00 UTC. Every loaded row is
appended to a ledger file, so what each run really loaded can be counted.

Named state is shared by every run of the task, so runs of this DAG must not overlap
(``max_active_runs=1``): each try takes the identity's lease from whoever holds it, which fences an
overlapping run (its next save fails with ``FencedError``) instead of letting both move the watermark.

Run it alone (state in ``$AIRFLOW_HOME/stateful`` unless ``[stateful] backend_url`` says otherwise)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/durable_watermark.py
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

log = logging.getLogger(__name__)

SOURCE_START = datetime(2026, 1, 1, tzinfo=timezone.utc)
ROW_EVERY = timedelta(hours=3)
BATCH_SIZE = 4


@dataclass(frozen=True)
class Row:
    id: int
    ts: datetime


def source_rows(until: datetime) -> Iterator[Row]:
    """The simulated source table: one row every ``ROW_EVERY``, ids from 0, up to ``until`` inclusive."""
    n = 0
    while SOURCE_START + n * ROW_EVERY <= until:
        yield Row(id=n, ts=SOURCE_START + n * ROW_EVERY)
        n += 1


def ledger_path() -> Path:
    """Where loaded rows are recorded: ``STATEFUL_DEMO_LEDGER`` or a file in AIRFLOW_HOME."""
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / "durable_watermark.ledger"
    return Path(os.environ.get("STATEFUL_DEMO_LEDGER", default))


def load(row: Row, *, try_number: int, run_id: str) -> None:
    """The real work: copy one row to the warehouse (here: a ledger line ``try,row_id,run_id``)."""
    with open(ledger_path(), "a") as ledger:
        ledger.write(f"{try_number},{row.id},{run_id}\n")


def batches(rows: list[Row], size: int) -> Iterator[list[Row]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


@dag(
    dag_id="durable_watermark",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["stateful", "example"],
)
def durable_watermark() -> None:
    # [START durable_watermark]
    @stateful_task(identity="nightly-watermark", retries=2, retry_delay=timedelta(seconds=0))
    def load_new_rows(state: TaskState) -> dict[str, Any]:
        context = get_current_context()
        until = context["data_interval_end"] or context["logical_date"] or datetime.now(tz=timezone.utc)
        mark = state.value or {"watermark": None, "last_id": None, "loaded": 0}
        since = datetime.fromisoformat(mark["watermark"]) if mark["watermark"] else None
        new_rows = [row for row in source_rows(until) if since is None or row.ts > since]
        log.info("watermark %s: %d new row(s) up to %s", mark["watermark"], len(new_rows), until)
        for batch in batches(new_rows, BATCH_SIZE):
            for row in batch:
                load(row, try_number=context["ti"].try_number, run_id=context["dag_run"].run_id)
            mark = {
                "watermark": batch[-1].ts.isoformat(),
                "last_id": batch[-1].id,
                "loaded": mark["loaded"] + len(batch),
            }
            state.save(mark)  # the new watermark: the next try or run starts after this batch
        return {"started_after": since.isoformat() if since else None, "rows": len(new_rows), **mark}

    # [END durable_watermark]
    load_new_rows()


dag_object = durable_watermark()


if __name__ == "__main__":
    dag_object.test()

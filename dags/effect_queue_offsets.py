"""Effect keys, pattern 3: queue messages applied exactly once, the consumer's offset kept in the checkpoint.

The queue is an append-only file of JSON messages, one a line, its line number being the message's offset (a
Kafka partition in miniature): ``STATEFUL_DEMO_QUEUE``, default ``effect_queue.jsonl`` in AIRFLOW_HOME. A
``@stateful_task(identity="queue-consumer")`` consumes it: with a name, its state belongs to the task, not to
one DAG run (as in ``durable_watermark``), so each run and each try starts at the committed offset, the
``next_offset`` of the checkpoint's value, committed every 4 messages together with a running total. A retry
therefore gets again the messages consumed after the last commit (at-least-once delivery, as with any
consumer committing after processing). Each message's side effect, a row in a results table (SQLite,
``STATEFUL_DEMO_DB``), is keyed by ``state.effect_key(f"offset-{n}")`` and inserted with ``ON CONFLICT DO
NOTHING``: a message delivered again finds its row and is dropped, so every message is applied exactly once.
The key is the same in every run too (named identity), as the offset's effect must be. Every delivery is
appended to a ledger (``STATEFUL_DEMO_LEDGER``: ``try,offset,applied``) so a test can count them. Runs must
not overlap (``max_active_runs=1``): they share the consumer's state.

On Kafka: turn off the consumer group's auto-commit, keep the partitions' offsets in the checkpoint value and
``seek()`` to them when a try starts, and key each effect by its message,
``state.effect_key(f"{topic}-{partition}-{offset}")``. A transactional producer writing results to a topic
takes its ``transactional.id`` (or the prefix of its ids) from ``state.effect_key("producer")``: every try
uses the same id, so the retry's ``init_transactions()`` fences the crashed try's producer and aborts its
open transaction.

Run parameter ``fail_at_item`` (default -1: never): on try 1 the task crashes right after applying the message
at that offset, before the next commit. Run it alone (it publishes 10 messages to an empty queue first)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/effect_queue_offsets.py
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

log = logging.getLogger(__name__)

CHECKPOINT_EVERY = 4

CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS results (
    effect_key TEXT PRIMARY KEY,  -- one row per message of this task instance, whatever the try
    queue_offset INTEGER NOT NULL,
    account TEXT NOT NULL,
    cents INTEGER NOT NULL
)"""
INSERT = "INSERT INTO results VALUES (?, ?, ?, ?) ON CONFLICT (effect_key) DO NOTHING"


def _home_file(env: str, name: str) -> Path:
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / name
    return Path(os.environ.get(env, default))


def queue_path() -> Path:
    return _home_file("STATEFUL_DEMO_QUEUE", "effect_queue.jsonl")


def db_path() -> Path:
    return _home_file("STATEFUL_DEMO_DB", "effect_queue_offsets.db")


def ledger_path() -> Path:
    return _home_file("STATEFUL_DEMO_LEDGER", "effect_queue_offsets.ledger")


def publish(messages: list[dict[str, Any]]) -> None:
    """The producer: append messages to the queue (the next offsets)."""
    with open(queue_path(), "a") as queue:
        queue.writelines(json.dumps(message) + "\n" for message in messages)


def read_queue(start: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The consumer: ``(offset, message)`` from offset ``start`` on, in order."""
    if not queue_path().exists():
        return
    with open(queue_path()) as queue:
        for offset, line in enumerate(queue):
            if offset >= start:  # a real queue seeks; a file of lines is read from the top
                yield offset, json.loads(line)


@dag(
    dag_id="effect_queue_offsets",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    params={"fail_at_item": -1},
    tags=["stateful", "example"],
)
def effect_queue_offsets() -> None:
    # [START effect_queue_offsets]
    @stateful_task(identity="queue-consumer", retries=1, retry_delay=timedelta(0))
    def consume(state: TaskState) -> dict[str, int]:
        context = get_current_context()
        try_number, fail_at_item = context["ti"].try_number, int(context["params"]["fail_at_item"])
        # Autocommit (isolation_level=None): each row is durable once written, as in any external system.
        with closing(sqlite3.connect(db_path(), isolation_level=None)) as db:
            db.execute(CREATE_TABLE)
            position = state.value or {"next_offset": 0, "total_cents": 0}  # as last committed
            for offset, message in read_queue(start=position["next_offset"]):  # tries and runs start here
                row = (state.effect_key(f"offset-{offset}"), offset, message["account"], message["cents"])
                applied = db.execute(INSERT, row).rowcount == 1  # 0: applied by an earlier try, dropped
                with open(ledger_path(), "a") as ledger:
                    ledger.write(f"{try_number},{offset},{int(applied)}\n")
                if not applied:
                    log.info("offset %d: delivered again after a retry, already applied: dropped", offset)
                if try_number == 1 and offset == fail_at_item:
                    raise RuntimeError(f"simulated crash after applying offset {offset}, before the commit")
                position = {
                    "next_offset": offset + 1,
                    "total_cents": position["total_cents"] + message["cents"],
                }
                if position["next_offset"] % CHECKPOINT_EVERY == 0:
                    state.save(position)  # commit the offset, and the total with it
            if position != state.value:
                state.save(position)  # the offsets consumed since the last commit
        return position

    # [END effect_queue_offsets]
    consume()


dag_object = effect_queue_offsets()

if __name__ == "__main__":
    if not queue_path().exists():
        publish([{"account": f"acct-{n % 3}", "cents": 100 * (n + 1)} for n in range(10)])
    dag_object.test(run_conf={"fail_at_item": 6})

"""Effect keys, pattern 1: rows upserted by effect key, so a retry's repeated writes land on the same row.

A ``@stateful_task`` writes one row per order into a database table and checkpoints every 4 orders. A retry
resumes from the last checkpoint, so it writes the orders written after that checkpoint a second time. The
table's primary key is the order's effect key, ``state.effect_key(f"order-{n}")``, the same in both tries:
the second write updates the row the first one left (``INSERT ... ON CONFLICT (effect_key) DO UPDATE``)
instead of adding another. Keyed by an auto-increment id instead, every redone order would be there twice.

The database is SQLite through Python's ``sqlite3`` (file ``STATEFUL_DEMO_DB``, default ``effect_upsert.db``
in AIRFLOW_HOME), so the example needs nothing installed; ``SqliteHook`` of apache-airflow-providers-sqlite
runs the same statement. On PostgreSQL the same statement works (with ``%s`` placeholders) through
``PostgresHook``, a ``DbApiHook`` of the common SQL provider, the effect key being the table's primary key
(or a UNIQUE column)::

    PostgresHook(postgres_conn_id="warehouse").run(
        "INSERT INTO orders (effect_key, order_id, cents) VALUES (%s, %s, %s) "
        "ON CONFLICT (effect_key) DO UPDATE SET cents = excluded.cents",
        parameters=(state.effect_key(f"order-{n}"), n, price(n)),
    )

Run parameter ``fail_at_item`` (default -1: never): on try 1 the task crashes right after writing that order,
before the next checkpoint. Run it alone (try 1 crashes after order 6; the retry rewrites orders 4, 5, 6)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/effect_upsert.py
"""

from __future__ import annotations

import logging
import os
import sqlite3
from contextlib import closing
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

log = logging.getLogger(__name__)

ORDERS = 10
CHECKPOINT_EVERY = 4

CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS orders (
    effect_key TEXT PRIMARY KEY,       -- one row per order of this task instance, whatever the try
    order_id INTEGER NOT NULL,
    cents INTEGER NOT NULL,
    writes INTEGER NOT NULL DEFAULT 1  -- for the demo only: how many times the row was written
)"""
UPSERT = """
INSERT INTO orders (effect_key, order_id, cents) VALUES (?, ?, ?)
ON CONFLICT (effect_key) DO UPDATE SET cents = excluded.cents, writes = orders.writes + 1"""


def db_path() -> Path:
    """The database file: ``STATEFUL_DEMO_DB`` or ``effect_upsert.db`` in AIRFLOW_HOME."""
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / "effect_upsert.db"
    return Path(os.environ.get("STATEFUL_DEMO_DB", default))


def price(order_id: int) -> int:
    """The order's amount in cents (a real task would read it from its source)."""
    return 100 * (order_id + 1)


@dag(
    dag_id="effect_upsert",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params={"fail_at_item": -1},
    tags=["stateful", "example"],
)
def effect_upsert() -> None:
    # [START effect_upsert]
    @stateful_task(retries=1, retry_delay=timedelta(0), checkpoint_every=CHECKPOINT_EVERY)
    def load_orders(state: TaskState) -> dict[str, int]:
        context = get_current_context()
        try_number, fail_at_item = context["ti"].try_number, int(context["params"]["fail_at_item"])
        # Autocommit (isolation_level=None): each row is durable once written, as in any external system.
        with closing(sqlite3.connect(db_path(), isolation_level=None)) as db:
            db.execute(CREATE_TABLE)
            state.value = state.value or {"loaded": 0}
            for n in state.resume(range(ORDERS)):  # a retry starts at the last checkpoint, not at 0
                db.execute(UPSERT, (state.effect_key(f"order-{n}"), n, price(n)))
                if try_number == 1 and n == fail_at_item:
                    raise RuntimeError(f"simulated crash after writing order {n}, before the next checkpoint")
                state.value = {"loaded": state.value["loaded"] + 1}
        log.info("done: %d orders loaded", state.value["loaded"])
        return state.value

    # [END effect_upsert]
    load_orders()


dag_object = effect_upsert()

if __name__ == "__main__":
    dag_object.test(run_conf={"fail_at_item": 6})

"""Upgrade with migration: version 2 of a DAG whose state changed shape resumes from version 1's checkpoint.

Version 1 of this DAG billed invoices and kept the ids it had billed, ``{"done": [0, 1, ...]}`` (schema 1).
Version 2 keeps a cursor and running totals per currency instead, ``{"cursor": 10, "totals": {"EUR": ...}}``
(schema 2), and declares how to turn the old shape into the new one:
``schema_version=2, migrations={1: upgrade_v1_to_v2}``.

When version 2 is deployed while a run of version 1 is failed part-way (or between two of its tries), the
retry runs the new code. Before the task's code runs, StatefulOperator reads version 1's checkpoint,
applies ``upgrade_v1_to_v2`` and commits the result as a new checkpoint with schema 2, so the code below
only ever sees a schema 2 value and resumes at the first invoice version 1 had not checkpointed. Without a
migration for version 1 the task fails before running any code, with an error naming both versions, and
leaves version 1's checkpoint untouched (``on_incompatible="restart"`` would start afresh instead).

Every billed invoice is appended to a ledger file, so invoices billed twice can be counted.

Run it alone (with no earlier checkpoint it simply bills everything)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/upgrade_with_migration.py
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

log = logging.getLogger(__name__)

INVOICES = 20
CHECKPOINT_EVERY = 5
VERSION = "v2"


def invoice(n: int) -> tuple[str, int]:
    """The simulated source: invoice ``n``'s currency and amount in cents (the same in every version)."""
    return ("EUR", "USD", "GBP")[n % 3], 1000 + 37 * n


def ledger_path() -> Path:
    """Where billed invoices are recorded: ``STATEFUL_DEMO_LEDGER`` or a file in AIRFLOW_HOME."""
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / "upgrade_with_migration.ledger"
    return Path(os.environ.get("STATEFUL_DEMO_LEDGER", default))


def record(event: str, number: int) -> None:
    """A ledger line ``version,try,event,number``."""
    try_number = get_current_context()["ti"].try_number
    with open(ledger_path(), "a") as ledger:
        ledger.write(f"{VERSION},{try_number},{event},{number}\n")


def bill(n: int) -> tuple[str, int]:
    """The real work: bill invoice ``n`` (a side effect the ledger records)."""
    record("billed", n)
    return invoice(n)


# [START upgrade_with_migration_migration]
def upgrade_v1_to_v2(value: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 ``{"done": [ids]}`` -> schema 2 ``{"cursor": n, "totals": {currency: cents}}``."""
    done = sorted(value["done"])
    if done != list(range(len(done))):
        raise ValueError(f"version 1 billed {done}, not a prefix of the invoices: no cursor can say that")
    totals: dict[str, int] = {}
    for n in done:
        currency, cents = invoice(n)
        totals[currency] = totals.get(currency, 0) + cents
    return {"cursor": len(done), "totals": totals}


# [END upgrade_with_migration_migration]


@dag(
    dag_id="upgrade_with_migration",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["stateful", "example"],
)
def upgrade_with_migration() -> None:
    # [START upgrade_with_migration]
    @stateful_task(
        schema_version=2,
        migrations={1: upgrade_v1_to_v2},  # a schema 1 checkpoint is upgraded and committed first
        retries=2,
        retry_delay=timedelta(seconds=0),
    )
    def bill_invoices(state: TaskState) -> dict[str, Any]:
        # state.value is None (a fresh start) or a schema 2 value, never a schema 1 one.
        record("start", state.checkpoint.seq if state.checkpoint else 0)
        value = state.value or {"cursor": 0, "totals": {}}
        totals = dict(value["totals"])
        for n in range(value["cursor"], INVOICES):
            currency, cents = bill(n)
            totals[currency] = totals.get(currency, 0) + cents
            if (n + 1) % CHECKPOINT_EVERY == 0 or n + 1 == INVOICES:
                state.save({"cursor": n + 1, "totals": totals})
        log.info("billed up to invoice %d; totals %s", INVOICES - 1, totals)
        return state.value

    # [END upgrade_with_migration]
    bill_invoices()


dag_object = upgrade_with_migration()


if __name__ == "__main__":
    dag_object.test()

"""The effect-key example DAGs under real Airflow (``dag.test()`` on SQLite): a retry redoes, nothing doubles.

Each DAG crashes on try 1 right after the effect of item 6 (checkpoints every 4 items, so items 4, 5 and 6
are past the last checkpoint); try 2 resumes at item 4 and does the effects of 4, 5 and 6 again. The external
system (a SQLite table, a real HTTP server on loopback, a results table fed from a queue file) records every
attempt: it received 13 attempts for 10 keys, which without effect keys would have been 13 effects, and
applied each key once.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from dag_helpers import load_dag_module
from test_examples import checkpoint_store, ledger, returned, state_url

from airflow_stateful.core import Identity
from airflow_stateful.core.protocol.effects import effect_key

pytestmark = pytest.mark.airflow
__all__ = ["ledger", "state_url"]  # the fixtures of test_examples.py, used here (and so not unused imports)

ITEMS = 10
FAIL_AT = 6
REDONE = [4, 5, 6]  # after the checkpoint at 4 items, up to the crash


def keys_of(run: Any, task_id: str, prefix: str) -> dict[int, str]:
    """The effect keys the task instance of ``run`` must have used, item by item."""
    identity = Identity.for_task(dag_id=run.dag_id, task_id=task_id, run_id=run.run_id)
    return {n: effect_key(identity, f"{prefix}-{n}") for n in range(ITEMS)}


def run_with_crash(dags_folder: Path, name: str, **conf: Any) -> Any:
    """Run the DAG file ``name`` with try 1 crashing after item FAIL_AT; the DagRun, its task on try 2."""
    module = load_dag_module(dags_folder / f"{name}.py")
    run = module.dag_object.test(run_conf={"fail_at_item": FAIL_AT, **conf})
    assert run.state == "success"
    (ti,) = run.get_task_instances()
    assert (ti.state, ti.try_number) == ("success", 2), "try 1 crashed, try 2 finished"
    return run


# -- effect_upsert ------------------------------------------------------------------------------------------
def test_effect_upsert_retry_rewrites_rows_without_duplicating_them(
    dags_folder: Path, state_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "warehouse.db"
    monkeypatch.setenv("STATEFUL_DEMO_DB", str(db))
    run = run_with_crash(dags_folder, "effect_upsert")

    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT effect_key, order_id, cents, writes FROM orders").fetchall()
    keys = keys_of(run, "load_orders", "order")
    assert sum(writes for *_, writes in rows) == ITEMS + len(REDONE), "the retry wrote orders 4, 5, 6 again"
    assert {n: writes for _, n, _, writes in rows} == {n: 2 if n in REDONE else 1 for n in range(ITEMS)}
    assert sorted((key, n, cents) for key, n, cents, _ in rows) == sorted(
        (keys[n], n, 100 * (n + 1)) for n in range(ITEMS)
    ), "one row per order, keyed by its effect key: 13 writes, 10 rows"
    assert returned(run) == {"loaded": ITEMS}


# -- effect_http --------------------------------------------------------------------------------------------
@dataclass
class IdempotentApi:
    """What an API honouring ``Idempotency-Key`` saw: every request, and what it applied (once per key)."""

    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    applied: dict[str, tuple[dict[str, Any], dict[str, Any]]] = field(
        default_factory=dict
    )  # key: body, answer
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], bool]:
        """Status, answer and whether it is a replay, as Stripe does: a repeat gets the stored answer."""
        with self.lock:
            self.requests.append((key, body))
            if key in self.applied:
                first_body, answer = self.applied[key]
                if first_body != body:
                    return 422, {"error": "idempotency key reused with another request"}, False
                return 200, answer, True
            answer = {"id": f"ch_{len(self.applied) + 1}", "invoice": body["invoice"], "cents": body["cents"]}
            self.applied[key] = (body, answer)
            return 200, answer, False


@pytest.fixture
def payment_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, IdempotentApi]]:
    """A real HTTP server on 127.0.0.1 (a free port) in a thread: its charges URL and what it saw."""
    api = IdempotentApi()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            key = self.headers.get("Idempotency-Key")
            status, answer, replayed = api.handle(key, body) if key else (400, {"error": "no key"}, False)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if replayed:
                self.send_header("Idempotent-Replayed", "true")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # urllib must not send loopback calls to a configured proxy
    try:
        yield f"http://127.0.0.1:{server.server_port}/charges", api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_effect_http_retry_repeats_calls_the_api_applies_once(
    dags_folder: Path, state_url: str, payment_api: tuple[str, IdempotentApi]
) -> None:
    url, api = payment_api
    run = run_with_crash(dags_folder, "effect_http", endpoint=url)

    keys = keys_of(run, "charge_invoices", "charge")
    item_of = {key: n for n, key in keys.items()}
    assert len(api.requests) == ITEMS + len(REDONE), "the retry called for invoices 4, 5, 6 again"
    assert [item_of.get(key) for key, _ in api.requests] == [*range(FAIL_AT + 1), *range(REDONE[0], ITEMS)], (
        "try 1 called for invoices 0..6, try 2 again from 4: 13 requests"
    )
    assert len(api.applied) == ITEMS and set(api.applied) == set(keys.values()), "10 keys, each applied once"
    charged = sorted(body["invoice"] for body, _ in api.applied.values())
    assert charged == list(range(ITEMS)), "every invoice charged once, none missing"
    # The retry got the charge ids of try 1's calls replayed, lost answer included.
    charge_ids = [api.applied[keys[n]][1]["id"] for n in range(ITEMS)]
    assert returned(run) == {"charge_ids": charge_ids}
    assert len(set(charge_ids)) == ITEMS


# -- effect_queue_offsets -----------------------------------------------------------------------------------
def test_effect_queue_offsets_redelivered_messages_are_applied_once(
    dags_folder: Path, ledger: Path, state_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "results.db"
    monkeypatch.setenv("STATEFUL_DEMO_DB", str(db))
    monkeypatch.setenv("STATEFUL_DEMO_QUEUE", str(tmp_path / "queue.jsonl"))
    module = load_dag_module(dags_folder / "effect_queue_offsets.py")
    messages: list[dict[str, Any]] = [{"account": f"acct-{n % 3}", "cents": 100 * (n + 1)} for n in range(13)]
    module.publish(messages[:ITEMS])
    run_with_crash(dags_folder, "effect_queue_offsets")

    deliveries = [tuple(int(x) for x in line.split(",")) for line in ledger.read_text().splitlines()]
    assert deliveries == [
        *((1, n, 1) for n in range(FAIL_AT + 1)),
        *((2, n, int(n not in REDONE)) for n in range(REDONE[0], ITEMS)),
    ], "try 2 got offsets 4, 5, 6 again and dropped them: 13 deliveries, 10 applied"

    # The next run starts at the offset the first one committed: it consumes only the 3 new messages.
    module.publish(messages[ITEMS:])
    assert module.dag_object.test().state == "success"
    assert ledger.read_text().splitlines()[len(deliveries) :] == ["1,10,1", "1,11,1", "1,12,1"]

    # One row per message, keyed by the consumer's effect key of its offset (the same in every run and try).
    identity = Identity.for_task(dag_id="effect_queue_offsets", task_id="consume", name="queue-consumer")
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT effect_key, queue_offset, account, cents FROM results").fetchall()
    assert sorted(rows, key=lambda row: row[1]) == [
        (effect_key(identity, f"offset-{n}"), n, m["account"], m["cents"]) for n, m in enumerate(messages)
    ], "every message applied once, none missing"

    # The offset and the running total were committed together: the total counts offsets 4, 5, 6 once.
    latest = checkpoint_store(state_url, identity.key).latest()
    assert latest is not None
    assert latest.value == {"next_offset": 13, "total_cents": sum(m["cents"] for m in messages)}

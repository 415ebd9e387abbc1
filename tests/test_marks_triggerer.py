"""A deferred CheckpointSensor in a real triggerer refuses a signed head written back below its high-water mark.

The stack is the one a deployment runs, as subprocesses on loopback (tests/airflow_stack.py: api-server,
scheduler, dag-processor, triggerer, SQLite). Heads are signed; the identity's mark is an Airflow Variable in
the stack's metadata database, set through its REST API as a writer's task would have set it. The sensor
defers, so the head is read by the trigger in the triggerer process, whose only way to the marks is the Task
SDK channel the triggerer gives triggers. Once it waits, the head of an older checkpoint is written back: the
trigger must refuse it, failing the sensor, instead of judging its condition on the older state.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.protocol.marks import HighWaterMark
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.testing.s3_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
psutil = pytest.importorskip("psutil")

from airflow_stack import Stack, base_env, start_stack, stop_stack, wait_for  # noqa: E402

KEY = "0123456789abcdef-this-deployment"
IDENTITY = Identity.for_task(dag_id="producer", task_id="export", name="orders")
DAG_ID = "mk_wait"
DAG = f"""
from datetime import datetime

from airflow.sdk import DAG

from airflow_stateful.sensors.checkpoint import CheckpointSensor

with DAG(dag_id="{DAG_ID}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    CheckpointSensor(
        task_id="wait", identity="{IDENTITY.key}", min_seq=5, deferrable=True, poke_interval=1, timeout=120
    )
"""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    home, dags, logs = tmp_path / "home", tmp_path / "dags", tmp_path / "component-logs"
    for d in (home, dags, logs):
        d.mkdir()
    (dags / f"{DAG_ID}.py").write_text(DAG)
    port = free_port()
    env = base_env(home, dags, port)
    env.update(
        AIRFLOW__STATEFUL__BACKEND_URL=(home / "state").as_uri(),
        AIRFLOW__STATEFUL__SIGNING_CONN_ID="stateful_signing",
        AIRFLOW__STATEFUL__REQUIRE_SIGNED_HEADS="true",
        AIRFLOW_CONN_STATEFUL_SIGNING=json.dumps(
            {"conn_type": "generic", "password": KEY, "extra": {"key_id": "prod-1"}}
        ),
    )
    stack = Stack(home=home, env=env, port=port, logs=logs)
    try:
        start_stack(stack)
        yield stack
    finally:
        stop_stack(stack)
        shutil.rmtree(home / "state", ignore_errors=True)


def test_a_deferred_sensor_refuses_a_head_written_back_below_its_mark(stack: Stack) -> None:
    from airflow_stateful.marks import variable_key

    store = LocalObjectStore(root=stack.home / "state")
    writer = CheckpointStore(
        store=store, identity=IDENTITY, signer=HeadSigner(key=KEY.encode(), key_id="prod-1")
    )
    lease = writer.acquire()
    writer.commit(lease, {"rows": 1})
    head_key = f"{IDENTITY.key}/~head.json"
    kept = store.get(head_key).data
    writer.commit(lease, {"rows": 2})
    head = writer.head()
    assert head is not None
    mark = HighWaterMark.of(head)
    wait_for("the api-server", lambda: stack.request("GET", "/version"), timeout=120, stack=stack)
    stack.request(
        "POST",
        "/variables",
        {"key": variable_key(IDENTITY), "value": json.dumps(mark.to_json(IDENTITY)), "description": "a mark"},
    )
    wait_for(
        f"{DAG_ID} to be parsed", lambda: stack.request("GET", f"/dags/{DAG_ID}"), timeout=120, stack=stack
    )
    stack.request("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
    run_id = str(stack.request("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None})["dag_run_id"])

    def ti_state(*states: str) -> dict[str, Any] | None:
        ti = stack.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/wait")
        return ti if ti.get("state") in states else None

    wait_for("the sensor to defer", lambda: ti_state("deferred"), timeout=180, stack=stack)
    store.put(head_key, kept)  # written back: signed by this deployment, but older than the mark
    ti = wait_for("the sensor to fail", lambda: ti_state("failed", "success"), timeout=180, stack=stack)
    assert ti["state"] == "failed", f"the trigger accepted the written-back head:\n{stack.diagnostics()}"
    logs = "\n".join(p.read_text(errors="replace") for p in (stack.home / "logs").rglob("*.log"))
    logs += "\n".join(p.read_text(errors="replace") for p in stack.logs.rglob("*") if p.is_file())
    assert "below the newest this deployment wrote" in logs, stack.diagnostics()

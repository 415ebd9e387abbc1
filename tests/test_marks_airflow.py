"""High-water marks in Airflow's metadata database, on real Airflow (``dag.test()`` on the session's SQLite).

A deployment that signs heads also records, per identity, the newest head position it wrote, as an Airflow
Variable the task writes through the Task SDK (the execution API). A signed head written back to the bucket
afterwards (kept by someone who can write it, or restored from the bucket's versions) is refused by the next
task: it does not resume from the older state (issue 23, MEDIUM 1). The core's behaviour with a mark store is
tested in tests/test_untrusted_records.py; this is the Airflow side of it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_stateful_tasks import run_dag, task_instance, write_dag

from airflow_stateful.core import CheckpointStore, Identity, store_from_url

pytestmark = pytest.mark.airflow

KEY = "0123456789abcdef-this-deployment"

LEDGER_TASK = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(identity="ledger")
    def count(state: TaskState):
        n = (state.value or {}).get("n", 0) + 1
        record(current_ti().try_number, n)
        state.save({"n": n})
        return n

    count()


dag_object = the_dag()
"""


@pytest.fixture
def signing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "state").as_uri())
    monkeypatch.setenv("AIRFLOW__STATEFUL__SIGNING_CONN_ID", "stateful_signing")
    monkeypatch.setenv("AIRFLOW__STATEFUL__REQUIRE_SIGNED_HEADS", "true")
    monkeypatch.setenv(
        "AIRFLOW_CONN_STATEFUL_SIGNING",
        json.dumps({"conn_type": "generic", "password": KEY, "extra": {"key_id": "prod-1"}}),
    )


def test_a_task_refuses_a_signed_head_written_back_after_a_newer_run(
    signing: None, dags_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from airflow.models import Variable

    from airflow_stateful.marks import variable_key

    dag_file = write_dag(dags_folder, tmp_path, LEDGER_TASK)
    identity = Identity.for_task(dag_id=dag_file.dag_id, task_id="count", name="ledger")
    store = store_from_url(os.environ["AIRFLOW__STATEFUL__BACKEND_URL"])
    head_key = f"{identity.key}/~head.json"

    _, first = run_dag(dag_file)
    assert first.state == "success"
    kept = store.get(head_key).data  # what someone who can write the bucket keeps
    _, second = run_dag(dag_file)
    assert second.state == "success"
    mark = json.loads(Variable.get(variable_key(identity)))
    assert mark["identity"] == identity.key and mark["seq"] == 2, "the task recorded its head's position"

    store.put(head_key, kept)  # written back: signed by this deployment, but older
    _, third = run_dag(dag_file)
    assert third.state == "failed", "the task did not resume from the written-back (older) state"
    assert task_instance(third, "count").try_number == 1
    assert [row[1] for row in dag_file.rows()] == [1, 2], "no try ran on the older state"
    assert store.get(head_key).data == kept, "nothing was committed on top of it"
    from airflow_stateful.core.protocol.marks import RolledBackError
    from airflow_stateful.hooks.state import StateHook

    with pytest.raises(RolledBackError, match="below the newest this deployment wrote"):
        StateHook().checkpoint_store(identity).latest()
    # The CLI, where Airflow's metadata database is (a scheduler host), checks the marks too.
    from airflow_stateful.cli.main import main

    assert main(["show", identity.key]) == 1
    assert "below the newest this deployment wrote" in capsys.readouterr().err
    # So does the UI (the api-server reads the marks from the metadata database): the row is an error row.
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from fastapi.testclient import TestClient

    from airflow_stateful.plugins.view.access import Viewer, current_viewer
    from airflow_stateful.plugins.view.app import create_app

    app = create_app()
    app.dependency_overrides[current_viewer] = lambda: Viewer(
        user=SimpleAuthManagerUser(username="admin", role="admin"),
        readable_dags=frozenset(),
        reads_every_dag=True,
        reads_configuration=True,
    )
    rows = {r["identity"]: r for r in TestClient(app).get("/api/identities").json()["identities"]}
    assert "RolledBackError" in rows[identity.key]["error"], rows[identity.key]
    # Without the marks the same head reads as the newest: what the marks are for.
    from airflow_stateful.core.records.integrity import HeadSigner

    unmarked = CheckpointStore(
        store=store, identity=identity, signer=HeadSigner(key=KEY.encode(), key_id="prod-1")
    )
    assert unmarked.latest().value == {"n": 1}  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["poke", "deferrable"])
def test_a_sensor_waiting_on_an_identity_refuses_a_head_written_back(
    mode: str, signing: None, dags_folder: Path, tmp_path: Path
) -> None:
    """A sensor (and, deferred, its trigger: through the Task SDK channel ``dag.test()``'s inline trigger run
    offers) fails on a written-back head instead of judging its condition on the older state."""
    from test_sensors import run_sensor_changing_the_head, task_state

    from airflow_stateful.hooks.state import StateHook

    identity = Identity.for_task(dag_id="producer", task_id="export", name=f"orders-{mode}")
    writer = StateHook().checkpoint_store(identity)  # signs, and raises the mark (the metadata database's)
    lease = writer.acquire()
    writer.commit(lease, {"rows": 1})
    store = writer.store
    head_key = f"{identity.key}/~head.json"
    kept = store.get(head_key).data
    writer.commit(lease, {"rows": 2})
    dag_file, run = run_sensor_changing_the_head(
        dags_folder,
        tmp_path,
        identity,
        mode,
        lambda: store.put(head_key, kept),  # written back
    )
    assert task_state(run, "wait") == "failed"
    [failure] = dag_file.failures()
    assert "below the newest this deployment wrote" in failure[2], failure

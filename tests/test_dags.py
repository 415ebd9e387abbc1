"""Every example DAG imports cleanly and runs under real Airflow (``dag.test()`` on SQLite)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dag_helpers import dagbag, import_errors_outside_33_examples, ledger_by_try, load_dag_module
from s3_endpoint import S3Endpoint

pytestmark = pytest.mark.airflow
DAGS = Path(__file__).resolve().parent.parent / "dags"


def test_every_dag_file_imports_cleanly(airflow_home: Path) -> None:
    bag = dagbag(DAGS)
    assert import_errors_outside_33_examples(bag) == {}
    assert "resumable_batch" in bag.dag_ids


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.csv"
    monkeypatch.setenv("STATEFUL_DEMO_LEDGER", str(path))
    return path


def run_resumable_batch() -> tuple[str, str]:
    module = load_dag_module(DAGS / "resumable_batch.py")
    run = module.dag_object.test()
    return str(run.state), run.run_id


def test_resumable_batch_retry_resumes_from_checkpoint_on_local_store(
    airflow_home: Path, ledger: Path
) -> None:
    state, run_id = run_resumable_batch()
    assert state == "success"
    tries = ledger_by_try(ledger)
    assert tries[1] == list(range(0, 37)), "try 1 handles items 0..36, then dies at item 37"
    assert tries[2] == list(range(30, 100)), "try 2 resumes from checkpoint next=30, not from 0"
    from airflow_stateful.core import CheckpointStore, Identity, store_from_url
    from airflow_stateful.core.records.cursors import cursor_position

    identity = Identity.for_task(dag_id="resumable_batch", task_id="crunch", run_id=run_id)
    store = store_from_url((airflow_home / "stateful").as_uri())
    latest = CheckpointStore(store=store, identity=identity).latest()
    assert latest is not None
    assert latest.value == {"total": sum(i * i for i in range(100))}, "items 30..36 are counted once"
    assert cursor_position(latest, "items") == 100
    assert latest.writer.try_number == 2 and latest.writer.dag_version_id


@pytest.mark.s3
def test_resumable_batch_on_s3_through_an_airflow_connection(
    airflow_home: Path,
    ledger: Path,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    s3_backend: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    state, run_id = run_resumable_batch()
    assert state == "success"
    tries = ledger_by_try(ledger)
    assert tries[2] == list(range(30, 100))
    # The checkpoints really are in the bucket, under the configured prefix, at the identity's key.
    from airflow_stateful.core import Identity

    identity = Identity.for_task(dag_id="resumable_batch", task_id="crunch", run_id=run_id)
    listed = s3_endpoint.client().list_objects_v2(
        Bucket=s3_endpoint.bucket, Prefix=f"{s3_prefix}/{identity.key}/"
    )
    keys = [o["Key"] for o in listed.get("Contents", [])]
    assert keys == [f"{s3_prefix}/{identity.key}/~head.json"], "small checkpoints ride inline in the head"
    out, err = capfd.readouterr()
    assert s3_backend not in out + err, "the connection's secret key leaked into the task log"


@pytest.mark.slow
def test_demo_entry_point_tells_the_resume_story(tmp_path: Path) -> None:
    """What `make demo` runs: the DAG file as a script, in its own AIRFLOW_HOME, printing what happened."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__DAGS_FOLDER=str(DAGS))
    for name in (
        "AIRFLOW__STATEFUL__BACKEND_URL",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        "STATEFUL_DEMO_LEDGER",
    ):
        env.pop(name, None)
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True
    )
    result = subprocess.run(
        [sys.executable, str(DAGS / "resumable_batch.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "try 1: handled items 0..36 (37 items)" in result.stdout
    assert "try 2: handled items 30..99 (70 items)" in result.stdout
    assert "resuming from checkpoint 3 (written by try 1" in result.stdout
    assert (tmp_path / "stateful").is_dir(), "state lives in the embedded default under AIRFLOW_HOME"

"""Published outputs under real Airflow (``dag.test()`` on SQLite): exactly once across a failed try, on two
stores in one run, listed in the asset event of a successful try only, and fetched by the consumer DAG.

``dags/published_outputs.py`` runs with ``interrupt="raise"``: try 1 of each task publishes part 1 and fails
before the save that would commit it; try 2 resumes from part 1. The kill -9 variant of the same scenario
(a real SIGKILL of the task process, on a real scheduler, with the consumer DAG scheduled by the asset) is in
tests/test_e2e_stack.py; the core-level kill between publish and commit is in tests/test_outputs.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from dag_helpers import find_dag, load_dag_module
from test_stateful_tasks import run_dag, write_dag

from airflow_stateful.core import CheckpointStore, Identity, store_from_url

pytestmark = pytest.mark.airflow
REPO_DAGS = Path(__file__).resolve().parent.parent / "dags"


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    urls = {
        "to_default_store": (tmp_path / "default-store").as_uri(),
        "to_local_store": (tmp_path / "local-store").as_uri(),
    }
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", urls["to_default_store"])
    monkeypatch.setenv("STATEFUL_DEMO_LOCAL_URL", urls["to_local_store"])
    monkeypatch.setenv("STATEFUL_DEMO_OUTPUTS_LEDGER", str(tmp_path / "consumed.ledger"))
    return urls


def asset_events(dag_id: str, run_id: str) -> list[Any]:
    from airflow import settings
    from airflow.models.asset import AssetEvent
    from sqlalchemy import select

    with settings.Session() as session:
        query = select(AssetEvent).where(
            AssetEvent.source_dag_id == dag_id, AssetEvent.source_run_id == run_id
        )
        events = list(session.scalars(query))
        for event in events:
            session.expunge(event)
        return events


def test_each_part_is_committed_once_and_the_asset_event_lists_only_committed_outputs(
    dags_folder: Path, stores: dict[str, str], tmp_path: Path
) -> None:
    module = load_dag_module(dags_folder / "published_outputs.py")
    run = find_dag(module, "published_outputs").test(run_conf={"interrupt": "raise"})
    assert run.state == "success"
    tis = {ti.task_id: ti for ti in run.get_task_instances()}
    assert {t: (ti.state, ti.try_number) for t, ti in tis.items()} == {
        "to_default_store": ("success", 2),
        "to_local_store": ("success", 2),
    }
    events = asset_events("published_outputs", run.run_id)
    assert len(events) == 2, "one asset event per successful task; the failed try 1 emits none"
    by_task = {e.source_task_id: e.extra["stateful_outputs"] for e in events}

    for task_id, url in stores.items():
        identity = Identity.for_task(dag_id="published_outputs", task_id=task_id, run_id=run.run_id)
        cs = CheckpointStore(store=store_from_url(url), identity=identity)
        outputs = cs.outputs()
        # Part 1 was published by try 1 but never committed: only try 2's part 1 exists, once.
        assert {n: o.try_number for n, o in outputs.items()} == {
            "part-0000": 1,
            "part-0001": 2,
            "part-0002": 2,
        }
        for name, info in outputs.items():
            (path,) = cs.restore_output(name, tmp_path / task_id)
            data = path.read_bytes()
            assert data.startswith(f"# written by try {info.try_number}\n".encode())
            assert hashlib.sha256(data).hexdigest() == info.sha256
        extra = by_task[task_id]
        assert extra["store"] == url and extra["identity"] == identity.key
        assert {n: o["sha256"] for n, o in extra["outputs"].items()} == {
            n: o.sha256 for n, o in outputs.items()
        }
        assert extra["seq"] == cs.latest().seq  # type: ignore[union-attr]

    # The consumer DAG's task, fed the real events (dag.test() does not schedule asset-triggered runs; the
    # e2e stack test does): it fetches every listed output through the store API and checks its SHA-256.
    consumer = find_dag(module, "consume_published_outputs")
    fetch = consumer.get_task("fetch").python_callable
    assert fetch(triggering_asset_events={"stateful-demo://published_outputs/report": events}) == 6
    rows = sorted(line.split(",")[:2] for line in (tmp_path / "consumed.ledger").read_text().split())
    assert rows == sorted([t, f"part-{n:04d}"] for t in stores for n in range(3))


STAGED_AT_RETURN = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0))
    def work(state: TaskState):
        ti = current_ti()
        out = Path(__LEDGER__).with_suffix(".data")
        out.mkdir(exist_ok=True)
        (out / "model.bin").write_bytes(b"weights" * 10_000)
        if ti.try_number == 1:
            state.save({"step": 1}, files=out)
            raise RuntimeError("crash after saving files")
        state.restore_files(out)
        (out / "summary.txt").write_text("done")
        state.publish("summary", out / "summary.txt")
        return "returned with an output still staged"

    work()


dag_object = the_dag()
"""


def test_outputs_staged_at_return_are_committed_and_a_retry_says_its_cache_is_warm(
    dags_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, library_log: list[str]
) -> None:
    url = (tmp_path / "state").as_uri()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", url)
    monkeypatch.setenv("AIRFLOW__STATEFUL__RESTORE_CACHE_DIR", str(tmp_path / "cache"))
    dag_file = write_dag(dags_folder, tmp_path, STAGED_AT_RETURN)
    _, run = run_dag(dag_file)
    assert run.state == "success"
    identity = Identity.for_task(dag_id=dag_file.dag_id, task_id="work", run_id=run.run_id)
    cs = CheckpointStore(store=store_from_url(url), identity=identity)
    assert list(cs.outputs()) == ["summary"], "an output staged when the task returned must be committed"
    assert cs.outputs()["summary"].size == 4
    warm = [
        m for m in library_log if m.startswith("restore cache warm: checkpoint 1 was written on this machine")
    ]
    assert len(warm) == 1, library_log

"""End to end: state lives exactly as long as Airflow needs it, on a real scheduler with the LocalExecutor.

One Airflow stack (tests/airflow_stack.py) runs four DAGs side by side, with checkpoints in a local directory
store and ``[stateful] airflow_conn_id`` pointing at the stack's own REST API:

* ``lt_retry``: try 1 commits a checkpoint at item 10 and fails; its retry waits ``RETRY_DELAY`` (far longer
  than the GC's ``idle_for`` of a few seconds). Two real GC runs happen in that wait: the CLI (which asks the
  metadata database) and the maintenance operator in a DAG run (which asks the REST API). Both keep the state;
  try 2 resumes at item 10.
* ``lt_failed``: no retries; try 1 commits at item 10 and fails for good. The GC keeps it (``keep_failed_for``);
  the test clears the task through the REST API and the new try resumes at item 10.
* ``lt_success``: succeeds; the GC with ``--release-after-success`` deletes its state, saying why.
* ``lt_bundle``, from a Git DAG bundle (tests/bundle_scenario.py, in a thread beside the rest): a retry runs
  its run's bundle version after the bundle moved on; a clear onto the latest version records and logs the change.
* ``lt_rollback``: a deploy rollback with real DAG file swaps while the task waits for its retries: schema-2 code
  commits 7 items and fails; the file is swapped to schema-1 code (``on_incompatible="restart"``), which starts
  fresh, pins the schema-2 checkpoint and commits five times (more than ``keep_last=3``) before failing; the file
  is swapped back and try 3 resumes from the pinned checkpoint at 7 items.

About two minutes after the stack is up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

psutil = pytest.importorskip("psutil")

import bundle_scenario  # noqa: E402
from airflow_stack import Stack, base_env, start_stack, stop_stack, wait_for  # noqa: E402

from airflow_stateful.testing.s3_server import free_port  # noqa: E402

RETRY_DELAY = 45  # seconds: both GC runs happen while lt_retry waits for its retry (measured: ~10 s)
SWAP_DELAY = 30  # seconds lt_rollback waits between tries: time to swap its file and let Airflow parse it

COMMON = """\
from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task


def record(*fields):
    with open(os.path.join(os.environ["AIRFLOW_HOME"], "ledger-__DAG_ID__.csv"), "a") as ledger:
        ledger.write(",".join(str(f) for f in fields) + "\\n")
"""

CRUNCH = """
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(task_id="crunch", retries=__RETRIES__, retry_delay=timedelta(seconds=__DELAY__), checkpoint_every=5)
    def crunch(state: TaskState):
        ti = get_current_context()["ti"]
        state.value = state.value or {"total": 0}
        for item in state.resume(range(20)):
            if ti.try_number == 1 and item == __FAIL_AT__:
                raise RuntimeError(f"try 1 fails at item {item}")
            record(ti.try_number, item)
            state.value = {"total": state.value["total"] + item}
        return state.value

    crunch()


the_dag()
"""

ROLLBACK = """
@dag(dag_id="lt_rollback", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(
        task_id="job",
        retries=2,
        retry_delay=timedelta(seconds=__DELAY__),
        schema_version=__SCHEMA__,
        on_incompatible="restart",
        keep_last=3,
    )
    def job(state: TaskState):
        ti = get_current_context()["ti"]
        value = state.value or {"schema": __SCHEMA__, "done": 0}
        record(ti.try_number, value["done"], __SCHEMA__)
        for _ in range(__SAVES__):
            value = {"schema": __SCHEMA__, "done": value["done"] + 1}
            state.save(value)
        if __FAILS__:
            raise RuntimeError(f"schema-__SCHEMA__ code fails on try {ti.try_number}")
        return value

    job()


the_dag()
"""

GC_DAG = """
from airflow_stateful.operators.gc import StatefulGCOperator


@dag(dag_id="lt_gc", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    StatefulGCOperator(task_id="gc", idle_for="5s", min_age=timedelta(0), keep_last=None)


the_dag()
"""


def crunch_dag(dag_id: str, *, retries: int, delay: int, fail_at: int) -> str:
    body = CRUNCH.replace("__RETRIES__", str(retries)).replace("__DELAY__", str(delay))
    return (COMMON + body.replace("__FAIL_AT__", str(fail_at))).replace("__DAG_ID__", dag_id)


def rollback_dag(*, schema: int, saves: int, fails: bool) -> str:
    body = ROLLBACK.replace("__SCHEMA__", str(schema)).replace("__SAVES__", str(saves))
    body = body.replace("__FAILS__", str(fails)).replace("__DELAY__", str(SWAP_DELAY))
    return (COMMON + body).replace("__DAG_ID__", "lt_rollback")


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str] | None:
    """The Git bundle's repository at its first commit, or None (with the reason printed) where git or the Git
    provider is missing: then only the DAG folder scenarios run."""
    why = bundle_scenario.missing()
    if why is not None:
        print(f"e2e lifetimes: the Git bundle scenario is skipped: {why}")
        return None
    repo = bundle_scenario.new_repo(tmp_path)
    return repo, bundle_scenario.commit_version(repo, "A")


@pytest.fixture
def stack(tmp_path: Path, repo: tuple[Path, str] | None) -> Iterator[Stack]:
    home, dags, logs = tmp_path / "home", tmp_path / "dags", tmp_path / "component-logs"
    for d in (home, dags, logs):
        d.mkdir()
    (dags / "lt_retry.py").write_text(crunch_dag("lt_retry", retries=1, delay=RETRY_DELAY, fail_at=12))
    (dags / "lt_failed.py").write_text(crunch_dag("lt_failed", retries=0, delay=0, fail_at=12))
    (dags / "lt_success.py").write_text(crunch_dag("lt_success", retries=0, delay=0, fail_at=-1))
    (dags / "lt_rollback.py").write_text(rollback_dag(schema=2, saves=7, fails=True))
    (dags / "lt_gc.py").write_text((COMMON + GC_DAG).replace("__DAG_ID__", "lt_gc"))
    port = free_port()
    env = base_env(home, dags, port)
    env.update(
        AIRFLOW__STATEFUL__BACKEND_URL=(home / "stateful").as_uri(),
        AIRFLOW__STATEFUL__AIRFLOW_CONN_ID="airflow_api",
        AIRFLOW_CONN_AIRFLOW_API=json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{port}"}),
        # A changed DAG file is parsed again within seconds (the default is 30 s).
        AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="2",
        **(bundle_scenario.bundle_env(home, repo[0], dags) if repo is not None else {}),
    )
    stack = Stack(home=home, env=env, port=port, logs=logs)
    try:
        start_stack(stack)
        yield stack
    finally:
        stop_stack(stack)


def ledger(stack: Stack, dag_id: str) -> dict[int, list[int]]:
    path = stack.home / f"ledger-{dag_id}.csv"
    tries: dict[int, list[int]] = {}
    for row in path.read_text().split() if path.exists() else []:
        try_number, item = (int(x) for x in row.split(",")[:2])
        tries.setdefault(try_number, []).append(item)
    return tries


def trigger(stack: Stack, dag_id: str) -> str:
    wait_for(
        f"{dag_id} to be parsed", lambda: stack.request("GET", f"/dags/{dag_id}"), timeout=120, stack=stack
    )
    stack.request("PATCH", f"/dags/{dag_id}", {"is_paused": False})
    return str(stack.request("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None})["dag_run_id"])


def ti_of(stack: Stack, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
    return stack.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")  # type: ignore[no-any-return]


def wait_ti(
    stack: Stack, dag_id: str, run_id: str, task_id: str, state: str, *, timeout: float = 180
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        ti = ti_of(stack, dag_id, run_id, task_id)
        return ti if ti["state"] == state else None

    return wait_for(f"{dag_id}.{task_id} to be {state}", probe, timeout=timeout, stack=stack)


def wait_run(stack: Stack, dag_id: str, run_id: str, state: str, *, timeout: float = 240) -> None:
    def probe() -> bool | None:
        now = stack.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
        if now != state and now in ("success", "failed"):
            pytest.fail(f"{dag_id} run {run_id} ended {now}, not {state}\n{stack.diagnostics()}")
        return True if now == state else None

    wait_for(f"{dag_id} run to be {state}", probe, timeout=timeout, stack=stack, interval=1)


def swap(stack: Stack, source: str) -> None:
    """Replace lt_rollback's file, as a deploy does. The DAG folder is an unversioned bundle: a worker parses the
    file when a try starts, so the next try runs what is on disk then. (Airflow makes no new DAG version for it:
    the serialized DAG does not include the task's callable or ``schema_version``, so it did not change.)"""
    (Path(stack.env["AIRFLOW__CORE__DAGS_FOLDER"]) / "lt_rollback.py").write_text(source)


def run_cli_gc(stack: Stack, *args: str) -> list[dict[str, Any]]:
    """``airflow-stateful gc --json ...`` as a deployment's admin runs it: the stack's environment, so it asks
    the stack's metadata database whether runs are finished."""
    result = subprocess.run(
        [sys.executable, "-m", "airflow_stateful", "gc", "--json", "--min-age", "0s", *args],
        env=stack.env,
        cwd=stack.home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"gc exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "asking Airflow's metadata database (sqlite)" in result.stderr, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def store_head(stack: Stack, dag_id: str, task_id: str, run_id: str) -> Any:
    from airflow_stateful.core import CheckpointStore, Identity
    from airflow_stateful.core.stores.local import LocalObjectStore

    identity = Identity.for_task(dag_id=dag_id, task_id=task_id, run_id=run_id)
    return CheckpointStore(store=LocalObjectStore(root=stack.home / "stateful"), identity=identity)


def test_state_follows_airflow_through_retries_clears_success_a_deploy_rollback_and_a_bundle_moving_on(
    stack: Stack, repo: tuple[Path, str] | None
) -> None:
    t0 = time.monotonic()
    wait_for("the api-server", lambda: stack.request("GET", "/version"), timeout=120, stack=stack)
    # The Git bundle scenario (tests/bundle_scenario.py) runs beside the others: both mostly wait for retries.
    pool = ThreadPoolExecutor(max_workers=1)
    bundle = pool.submit(bundle_scenario.run_bundle_scenario, stack, *repo) if repo is not None else None
    runs = {
        dag_id: trigger(stack, dag_id) for dag_id in ("lt_retry", "lt_failed", "lt_success", "lt_rollback")
    }
    retry_run, failed_run, success_run, rollback_run = (
        runs[d] for d in ("lt_retry", "lt_failed", "lt_success", "lt_rollback")
    )

    # The deploy rollback, part 1: schema-2 code failed after 7 items; before its retry the deploy is rolled back.
    wait_ti(stack, "lt_rollback", rollback_run, "job", "up_for_retry")
    swap(stack, rollback_dag(schema=1, saves=5, fails=True))

    wait_ti(stack, "lt_retry", retry_run, "crunch", "up_for_retry")
    wait_ti(stack, "lt_failed", failed_run, "crunch", "failed")
    wait_run(stack, "lt_success", success_run, "success")
    retry_cs = store_head(stack, "lt_retry", "crunch", retry_run)
    head = retry_cs.head()
    assert head.outcome.state == "up_for_retry" and head.outcome.try_number == 1, head.outcome
    assert head.outcome.retry_at is not None, "the earliest time the retry can run is recorded"
    code = retry_cs.latest().code
    assert code.bundle_name == "dags-folder" and code.dag_version_id, code
    time.sleep(6)  # everything is now idle for longer than the GC's idle_for of 5 s

    failed_at = time.monotonic()
    # GC 1: the CLI, asking the metadata database, releasing succeeded state after 3 s.
    rows = {r["identity"]: r for r in run_cli_gc(stack, "--idle-for", "5s", "--release-after-success", "3s")}
    success_key = store_head(stack, "lt_success", "crunch", success_run).identity.key
    failed_cs = store_head(stack, "lt_failed", "crunch", failed_run)
    assert rows[success_key]["action"] == "deleted" and rows[success_key]["why"].startswith("released:")
    assert rows[retry_cs.identity.key]["action"] == "kept"
    assert "up_for_retry" in rows[retry_cs.identity.key]["why"], rows[retry_cs.identity.key]
    assert rows[failed_cs.identity.key]["action"] == "kept"
    assert "keep_failed_for" in rows[failed_cs.identity.key]["why"]
    assert store_head(stack, "lt_success", "crunch", success_run).head() is None, "released"

    # GC 2: the maintenance operator in a DAG run, asking the REST API through [stateful] airflow_conn_id.
    gc_run = trigger(stack, "lt_gc")
    wait_run(stack, "lt_gc", gc_run, "success", timeout=120)
    report = stack.request("GET", f"/dags/lt_gc/dagRuns/{gc_run}/taskInstances/gc/xcomEntries/return_value")[
        "value"
    ]
    report = json.loads(report) if isinstance(report, str) else report
    assert report["airflow"] == f"http://127.0.0.1:{stack.port}"
    kept = {k["identity"]: k["lifetime"] for k in report["kept"]}
    assert "Airflow says the task instance is up_for_retry" in kept[retry_cs.identity.key], kept
    assert ti_of(stack, "lt_retry", retry_run, "crunch")["state"] == "up_for_retry", (
        "both GCs ran inside the delay"
    )
    assert retry_cs.head() is not None and failed_cs.head() is not None
    print(f"e2e lifetimes: both GC runs took {time.monotonic() - failed_at:.0f} s")

    # The deploy rollback, part 2: schema-1 code started fresh, pinned the schema-2 checkpoint, committed five
    # times (more than keep_last=3) and failed; before try 3 the deploy is rolled forward again.
    def try_2_failed() -> bool | None:
        ti = ti_of(stack, "lt_rollback", rollback_run, "job")
        return True if (ti["try_number"], ti["state"]) == (2, "up_for_retry") else None

    wait_for("lt_rollback try 2 (schema-1 code) to fail", try_2_failed, timeout=SWAP_DELAY + 120, stack=stack)
    rollback_cs = store_head(stack, "lt_rollback", "job", rollback_run)
    head = rollback_cs.head()
    pinned = [e for e in head.checkpoints if e.pinned is not None]
    assert [e.schema_version for e in pinned] == [2] and len(head.checkpoints) == 4, head.checkpoints
    swap(stack, rollback_dag(schema=2, saves=1, fails=False))

    # The retry comes, after a delay far longer than idle_for, and resumes from the checkpoint.
    wait_run(stack, "lt_retry", retry_run, "success", timeout=RETRY_DELAY + 120)
    tries = ledger(stack, "lt_retry")
    assert tries[1] == list(range(12)) and tries[2] == list(range(10, 20)), tries

    # The failed-for-good task is cleared (a person, days later in real life) and resumes within keep_failed_for.
    stack.request(
        "POST",
        "/dags/lt_failed/clearTaskInstances",
        {"dry_run": False, "dag_run_id": failed_run, "task_ids": ["crunch"], "only_failed": True},
    )
    wait_run(stack, "lt_failed", failed_run, "success")
    tries = ledger(stack, "lt_failed")
    assert tries[1] == list(range(12)) and tries[2] == list(range(10, 20)), tries

    # The rollforward: try 3 runs schema-2 code again and resumes from the pinned checkpoint, 7 items done.
    wait_run(stack, "lt_rollback", rollback_run, "success", timeout=SWAP_DELAY + 120)
    rows_by_try = {}
    for line in (stack.home / "ledger-lt_rollback.csv").read_text().split():
        try_number, done, schema = (int(x) for x in line.split(","))
        rows_by_try[try_number] = (done, schema)
    assert rows_by_try == {1: (0, 2), 2: (0, 1), 3: (7, 2)}, "try 3 resumed from the pinned schema-2 state"
    final = rollback_cs.latest()
    assert final.value == {"schema": 2, "done": 8}
    copy = rollback_cs.get(
        final.seq - 1
    )  # what try 3 committed before its code ran: the pinned state, copied
    assert copy.value == {"schema": 2, "done": 7} and copy.extra["resumed_from_pin"] == pinned[0].seq
    assert not rollback_cs.head().pinned, "the pin is released once its copy is the newest checkpoint"
    if bundle is not None:
        print(f"e2e lifetimes: bundle: {bundle.result(timeout=300)}")
    pool.shutdown()
    print(f"e2e lifetimes: done {time.monotonic() - t0:.0f} s after the stack started")

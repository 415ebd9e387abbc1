"""End to end: a real Airflow stack on loopback; the task process is SIGKILLed part-way and the retry resumes.

The stack is the one a deployment runs, as subprocesses: ``api-server`` (bound to 127.0.0.1 on a free port),
``scheduler`` (LocalExecutor), ``dag-processor`` and ``triggerer``, on SQLite in a temporary AIRFLOW_HOME, with
an S3 server as the checkpoint store (SeaweedFS, a real S3 server; ``make soak`` runs it on moto's too), reached
through an Airflow connection given by environment. The DAG
is ``dags/killable_batch.py`` (copied into a temporary DAG folder): it writes its pid on each try and a ledger
row per handled item. The test waits until try 1 committed a checkpoint past item 30, SIGKILLs the task
process (a descendant of the scheduler), and checks that try 2 starts at the last checkpoint's cursor and that
the run succeeds with the right result.

Every process is started with an explicit environment (not the pytest process's, which conftest changed) in
its own process group, and every one, with all descendants, is killed at teardown; the test then checks that
no process using its AIRFLOW_HOME is left. About a minute.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_endpoint import S3Endpoint, both_servers_when_long, started_endpoint

from airflow_stateful.testing.s3_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

psutil = pytest.importorskip("psutil")

from airflow_stack import Stack, base_env, start_stack, stop_stack, unpause_when_parsed, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DAG_ID = "killable_batch"
TASK_ID = "crunch"
ITEMS = 100
ITEM_SECONDS = 0.15  # try 1 has about 10 s of items left past the kill point: time enough to kill it mid-run
KILL_AFTER_CURSOR = 30  # SIGKILL once try 1 has committed a checkpoint at or past this cursor
PREFIX = "airflow"
REGION = "us-east-1"
CONN_ID = "stateful_e2e"


def stack_env(home: Path, dags: Path, port: int, endpoint: S3Endpoint) -> dict[str, str]:
    """The whole environment of every Airflow process: nothing is inherited from pytest but PATH and locale."""
    conn = {
        "conn_type": "aws",
        "login": endpoint.credentials["aws_access_key_id"],
        "password": endpoint.credentials["aws_secret_access_key"],
        "extra": {"endpoint_url": endpoint.endpoint_url, "region_name": REGION},
    }
    env = base_env(home, dags, port)
    env.update(
        AIRFLOW__STATEFUL__BACKEND_URL=f"s3://{endpoint.bucket}/{PREFIX}",
        AIRFLOW__STATEFUL__CONN_ID=CONN_ID,
        **{f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps(conn)},
        STATEFUL_DEMO_LEDGER=str(home / "ledger.csv"),
        STATEFUL_DEMO_PIDFILE=str(home / "pids.csv"),
        STATEFUL_DEMO_LOCAL_URL=(home / "stateful-local").as_uri(),
        STATEFUL_DEMO_OUTPUTS_LEDGER=str(home / "consumed.ledger"),
    )
    return env


def rows(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    return [(int(a), int(b)) for a, b in (line.split(",") for line in path.read_text().split())]


@pytest.fixture(params=both_servers_when_long())
def server(request: pytest.FixtureRequest) -> Iterator[S3Endpoint]:
    """A server of the test's own (a stack's components are killed at teardown, mid-request), with a bucket:
    SeaweedFS, and under ``make soak`` serialized moto for ``main`` too (unless the suite's endpoint is
    SeaweedFS)."""
    from s3_endpoint import main_kind

    kind = "seaweedfs" if request.param == "seaweedfs" or main_kind() == "seaweedfs" else "moto"
    with started_endpoint(kind) as endpoint:
        yield endpoint


@pytest.fixture
def stack(tmp_path: Path, server: S3Endpoint) -> Iterator[Stack]:
    home = tmp_path / "home"
    dags = tmp_path / "dags"
    logs = tmp_path / "component-logs"
    for d in (home, dags, logs):
        d.mkdir()
    shutil.copy(REPO / "dags" / f"{DAG_ID}.py", dags)
    shutil.copy(REPO / "dags" / f"{OUTPUTS_DAG}.py", dags)
    port = free_port()
    stack = Stack(home=home, env=stack_env(home, dags, port, server), port=port, logs=logs)
    try:
        start_stack(stack)
        yield stack
    finally:
        stop_stack(stack)


def test_sigkilled_task_resumes_from_its_checkpoint_on_a_real_stack(stack: Stack, server: S3Endpoint) -> None:
    from airflow_stateful.core import CheckpointStore, Identity
    from airflow_stateful.core.records.cursors import cursor_position

    t0 = time.monotonic()
    wait_for("the api-server to answer", lambda: stack.request("GET", "/version"), timeout=120, stack=stack)
    unpause_when_parsed(stack, DAG_ID)
    outputs_run = start_published_outputs(stack)
    run = stack.request(
        "POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": {"item_seconds": ITEM_SECONDS}}
    )
    run_id = run["dag_run_id"]
    run_path = f"/dags/{DAG_ID}/dagRuns/{run_id}"

    store = server.store(PREFIX)
    checkpoints = CheckpointStore(
        store=store, identity=Identity.for_task(dag_id=DAG_ID, task_id=TASK_ID, run_id=run_id)
    )

    def cursor_of_try_1() -> int | None:
        latest = checkpoints.latest()
        if latest is None or latest.writer.try_number != 1:
            return None
        cursor = cursor_position(latest, "items") or 0
        return cursor if cursor >= KILL_AFTER_CURSOR else None

    wait_for(
        f"try 1 to commit a checkpoint at cursor >= {KILL_AFTER_CURSOR}",
        cursor_of_try_1,
        timeout=180,
        stack=stack,
    )

    # The task process: the pid try 1 wrote, which must be a descendant of the scheduler (LocalExecutor).
    pids = dict(rows(stack.home / "pids.csv"))
    assert 1 in pids, f"try 1 wrote no pid file row\n{stack.diagnostics()}"
    task = psutil.Process(pids[1])
    scheduler = next(c for c in stack.components if c.name == "scheduler")
    assert scheduler.process.pid in [p.pid for p in task.parents()], (
        f"pid {task.pid} ({task.cmdline()}) is not a descendant of the scheduler {scheduler.process.pid}"
    )
    stack.remember_descendants()
    task.send_signal(signal.SIGKILL)
    task.wait(timeout=10)  # reaped by its parent (the task supervisor), or gone
    # Nothing of try 1 can commit any more: this is the checkpoint try 2 must resume from.
    after_kill = checkpoints.latest()
    assert after_kill is not None and after_kill.writer.try_number == 1, (
        f"the latest checkpoint right after the kill is not try 1's: {after_kill}"
    )
    resume_cursor = cursor_position(after_kill, "items")
    assert resume_cursor is not None, f"checkpoint {after_kill.seq} has no cursor 'items'"
    assert KILL_AFTER_CURSOR <= resume_cursor < ITEMS, f"killed too late: cursor {resume_cursor}"

    def finished_run() -> dict[str, Any] | None:
        state = stack.request("GET", run_path)["state"]
        if state == "failed":
            pytest.fail(f"the DAG run failed\n{stack.diagnostics()}")
        return {"state": state} if state == "success" else None

    wait_for("the DAG run to succeed", finished_run, timeout=240, stack=stack, interval=1)

    ti = stack.request("GET", f"{run_path}/taskInstances/{TASK_ID}")
    assert ti["state"] == "success" and ti["try_number"] == 2, (
        f"expected success on try 2 (SIGKILL uses a try): {ti}"
    )
    tries: dict[int, list[int]] = {}
    for try_number, item in rows(stack.home / "ledger.csv"):
        tries.setdefault(try_number, []).append(item)
    assert sorted(tries) == [1, 2], f"ledger shows tries {sorted(tries)}"
    killed_at = tries[1][-1]
    assert tries[1] == list(range(killed_at + 1)), "try 1 handled items 0..k in order until it was killed"
    assert resume_cursor <= killed_at + 1, "the checkpoint cannot be ahead of the work"
    assert tries[2] == list(range(resume_cursor, ITEMS)), (
        f"try 2 must resume at the last checkpoint's cursor {resume_cursor}, not at {tries[2][:1]}"
    )

    expected = {"total": sum(i * i for i in range(ITEMS))}  # items redone by try 2 are not counted twice
    xcom = stack.request("GET", f"{run_path}/taskInstances/{TASK_ID}/xcomEntries/return_value")
    value = xcom["value"]
    assert (json.loads(value) if isinstance(value, str) else value) == expected
    final = checkpoints.latest()
    assert final is not None and final.value == expected and cursor_position(final, "items") == ITEMS
    assert final.writer.try_number == 2
    check_published_outputs(stack, store, outputs_run)
    print(
        f"e2e: killed try 1 after item {killed_at}, try 2 resumed at {resume_cursor}; published outputs exactly "
        f"once on both stores; {time.monotonic() - t0:.0f} s after the stack started"
    )


OUTPUTS_DAG = "published_outputs"
CONSUMER_DAG = "consume_published_outputs"
OUTPUT_TASKS = ("to_default_store", "to_local_store")


def start_published_outputs(stack: Stack) -> str:
    """Trigger ``published_outputs`` with ``interrupt="sigkill"``: try 1 of each task kills its own process with
    part 1 staged but not committed. Runs beside the killable batch. Returns the run id."""
    for dag_id in (OUTPUTS_DAG, CONSUMER_DAG):
        unpause_when_parsed(stack, dag_id)
    run = stack.request(
        "POST", f"/dags/{OUTPUTS_DAG}/dagRuns", {"logical_date": None, "conf": {"interrupt": "sigkill"}}
    )
    return str(run["dag_run_id"])


def check_published_outputs(stack: Stack, s3: Any, run_id: str) -> None:
    """Both tasks were SIGKILLed between publish and commit, retried, and committed each part exactly once; the
    consumer DAG, scheduled by their asset events, fetched exactly the committed parts; nothing staged by the
    killed tries is left in either store."""
    from airflow_stateful.core import CheckpointStore, Identity
    from airflow_stateful.core.stores.local import LocalObjectStore

    def succeeded(dag_id: str, path: str) -> dict[str, Any] | None:
        run = stack.request("GET", path)
        if run["state"] == "failed":
            pytest.fail(f"the {dag_id} run failed\n{stack.diagnostics()}")
        return run if run["state"] == "success" else None

    wait_for(
        f"{OUTPUTS_DAG} to succeed",
        lambda: succeeded(OUTPUTS_DAG, f"/dags/{OUTPUTS_DAG}/dagRuns/{run_id}"),
        timeout=240,
        stack=stack,
        interval=1,
    )
    stores = {"to_default_store": s3, "to_local_store": LocalObjectStore(root=stack.home / "stateful-local")}
    expected: list[list[str]] = []
    committed: dict[str, dict[str, str]] = {}
    for task_id in OUTPUT_TASKS:
        ti = stack.request("GET", f"/dags/{OUTPUTS_DAG}/dagRuns/{run_id}/taskInstances/{task_id}")
        assert (ti["state"], ti["try_number"]) == ("success", 2), f"SIGKILL must use a try: {ti}"
        identity = Identity.for_task(dag_id=OUTPUTS_DAG, task_id=task_id, run_id=run_id)
        cs = CheckpointStore(store=stores[task_id], identity=identity)
        outputs = cs.outputs()
        assert {n: o.try_number for n, o in outputs.items()} == {
            "part-0000": 1,
            "part-0001": 2,
            "part-0002": 2,
        }, f"{task_id}: part-0001, staged by the killed try 1, must exist once, from try 2"
        head = cs.head()
        assert head is not None and head.lease is None  # released at the end of try 2, after its sweep
        kept = {
            k
            for e in head.checkpoints
            for k in (e.manifest, e.tree and e.tree.key, e.outputs_tree.key if e.outputs_tree else None)
            if k
        }
        chunks = {
            c.key
            for m in [cs.latest()]
            if m
            for n in m.outputs
            for f in cs.output_files(m, n)
            for c in f.chunks
        }
        left = {
            info.key
            for info in stores[task_id].list_objects(f"{identity.key}/~")
            if info.key not in kept | chunks and not info.key.endswith("/~head.json")
        }
        assert not left, f"{task_id}: objects staged by the killed try were not collected: {sorted(left)[:5]}"
        expected += [[task_id, name] for name in outputs]
        committed[task_id] = {name: o.sha256 for name, o in outputs.items()}

    # The asset events, as Airflow recorded them: one per task that succeeded (the killed tries emitted none),
    # each listing exactly the outputs that task committed.
    events = stack.request("GET", f"/assets/events?source_dag_id={OUTPUTS_DAG}")["asset_events"]
    listed = {
        e["source_task_id"]: {n: o["sha256"] for n, o in e["extra"]["stateful_outputs"]["outputs"].items()}
        for e in events
    }
    assert len(events) == 2 and listed == committed, f"asset events {events}"

    # The consumer runs the scheduler created from those events fetched exactly what the events they consumed list
    # (all committed, each verified by SHA-256 in the consumer). One run may consume both events, or one each.
    ledger = stack.home / "consumed.ledger"

    def consumed() -> tuple[list[list[str]], list[list[str]], int] | None:
        runs = stack.request("GET", f"/dags/{CONSUMER_DAG}/dagRuns")["dag_runs"]
        if any(r["state"] == "failed" for r in runs):
            pytest.fail(f"a {CONSUMER_DAG} run failed\n{stack.diagnostics()}")
        if not runs or any(r["state"] != "success" for r in runs):
            return None
        seen: list[list[str]] = []
        for run in runs:
            upstream = stack.request(
                "GET", f"/dags/{CONSUMER_DAG}/dagRuns/{run['dag_run_id']}/upstreamAssetEvents"
            )
            for event in upstream["asset_events"]:
                outputs = (event["extra"] or {}).get("stateful_outputs", {}).get("outputs", {})
                seen += [[str(event["source_task_id"]), name] for name in outputs]
        rows = sorted(line.split(",")[:2] for line in ledger.read_text().split()) if ledger.exists() else []
        return (rows, sorted(seen), len(runs)) if len(rows) >= len(seen) > 0 else None

    fetched, seen, runs = wait_for(
        f"{CONSUMER_DAG}, triggered by the asset events, to fetch what they list",
        consumed,
        timeout=180,
        stack=stack,
        interval=1,
    )
    assert fetched == seen and set(map(tuple, fetched)) <= set(map(tuple, expected)), (
        f"the consumer fetched {fetched}; the events it consumed list {seen}; committed: {expected}"
    )
    if fetched != sorted(expected):
        # Seen in 2 of 4 runs here. Airflow queues "asset A has news for DAG D" as one row per (asset, DAG) and, when
        # it creates the run, deletes that row by key; on SQLite `with_row_locks` locks nothing, so an event of the
        # same asset landing between the scheduler's read and its delete creates no run of its own (on PostgreSQL
        # the row lock should make that event queue a new row: not verified here). Airflow 3.3.2, scheduler_job_runner._create_dag_runs_asset_triggered.
        # What this test is about holds either way: the consumer sees committed outputs only.
        print(f"e2e: {runs} consumer run(s) consumed {len(fetched)} of the {len(expected)} committed outputs")

"""Long-running stateful tasks under real Airflow (``dag.test()``), on both stores, with maintenance running.

The lease ttl is shortened with ``AIRFLOW__STATEFUL__LEASE_TTL`` (and the grace with ``..._LEASE_GRACE``), the
way an operator would tune them, so "a training epoch longer than the ttl" takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dag_helpers import ledger_by_try
from maintenance import GcLoop, read_tree
from netproxy import PROXIES, TcpProxy
from s3_endpoint import S3Endpoint
from test_lease_renewal import start_killable_writer
from test_stateful_tasks import checkpoints, run_dag, task_instance, write_dag

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.protocol.retention import unreferenced
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

pytestmark = pytest.mark.airflow

TTL = 2


@pytest.fixture(params=["local", "s3"])
def store(
    request: pytest.FixtureRequest, airflow_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ObjectStore]:
    """``[stateful]`` pointed at a fresh local directory or S3 prefix, with a 2 s lease; the same store, opened
    directly, for the test to watch."""
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_TTL", str(TTL))
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_GRACE", "1")
    if request.param == "local":
        root = tmp_path / "state"
        monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", root.as_uri())
        with LocalObjectStore(root=root) as local:
            yield local
        return
    request.getfixturevalue("s3_backend")  # the connection and backend_url for S3
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    with endpoint.store(request.getfixturevalue("s3_prefix")) as s3:
        yield s3


# -- a try computing 4 x the ttl between saves ------------------------------------------------------------
LONG_EPOCH = """\
import os, time


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=2, retry_delay=timedelta(0), keep_last=2)
    def train(state: TaskState):
        ti = current_ti()
        work = Path(__WORK__)
        work.mkdir(parents=True, exist_ok=True)
        for epoch in range(3):
            (work / "weights.bin").write_bytes(os.urandom(8192))
            state.save({"epoch": epoch}, files=work)
            record(ti.try_number, epoch)
        time.sleep(__COMPUTE__)  # one epoch longer than the lease ttl, with no save
        state.save({"epoch": 3})  # keeps the last weights by reference
        record(ti.try_number, 3)
        return state.value

    train()


dag_object = the_dag()
"""


class CliGcLoop:
    """``airflow-stateful gc --min-age 0 --keep-last 1`` run again and again, as the issue's reproduction does
    with cron (each run is a new process configured by the same ``AIRFLOW__STATEFUL__*`` environment).

    The loop starts once the task has written its first object, as a cron job does once something is deployed:
    on the local store the state directory does not exist before that, and the CLI refuses a missing directory
    (exit 2, "nothing was ever written there, or backend_url is mistyped"), which is what it should do there.
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.codes: list[int] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        command = [
            str(Path(sys.executable).parent / "airflow-stateful"),
            "gc",
            "--min-age",
            "0s",
            "--keep-last",
            "1",
        ]
        while not self.stop.is_set() and next(iter(self.store.list_objects("")), None) is None:
            time.sleep(0.05)
        while not self.stop.is_set():
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))
            self.codes.append(done.returncode)
            if done.returncode:
                self.errors.append(done.stderr[-2000:])

    def __enter__(self) -> CliGcLoop:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=180)


def test_a_task_computing_4x_the_ttl_between_saves_succeeds_on_its_first_try_while_gc_runs(
    store: ObjectStore, dags_folder: Path, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    body = LONG_EPOCH.replace("__WORK__", repr(str(work))).replace("__COMPUTE__", str(4 * TTL))
    dag_file = write_dag(dags_folder, tmp_path, body)
    with GcLoop(store, keep_last=1, grace=1) as gc, CliGcLoop(store) as cli_gc:
        _, run = run_dag(dag_file)
    assert cli_gc.codes and set(cli_gc.codes) == {0}, (
        f"the CLI's GC failed beside the task: {cli_gc.errors[:1]}"
    )
    assert run.state == "success"
    assert ledger_by_try(dag_file.ledger) == {1: [0, 1, 2, 3]}, "one try, never fenced, never retried"
    assert task_instance(run, "train").try_number == 1
    assert gc.passes > 10 and gc.deletion_errors() == []
    assert len(gc.renewals) >= 3, "the task's lease was renewed while it computed"
    cs = CheckpointStore(
        store=store, identity=Identity.for_task(dag_id=dag_file.dag_id, task_id="train", run_id=run.run_id)
    )
    latest = cs.latest()
    assert latest is not None and latest.value == {"epoch": 3} and latest.epoch == 1
    restored = tmp_path / "restored"
    cs.restore_files(latest, restored)
    assert read_tree(restored) == read_tree(work), "nothing the checkpoint references was deleted"


# -- the store unreachable for longer than the ttl ---------------------------------------------------------
OUTAGE = """\
import time

from netproxy import PROXIES


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0))
    def train(state: TaskState):
        ti = current_ti()
        work = Path(__WORK__)
        work.mkdir(parents=True, exist_ok=True)
        if ti.try_number == 1:
            (work / "weights.bin").write_bytes(b"good weights")
            state.save({"epoch": 1}, files=work)
            record(1, 1)
            PROXIES["s3"].down()  # the network to S3 fails, for longer than the lease ttl
            try:
                time.sleep(__COMPUTE__)
                (work / "weights.bin").write_bytes(b"weights the store never sees" * 1000)
                state.save({"epoch": 2}, files=work)
                record(1, 2)
            except FencedError:
                record(1, -1)
                raise
            finally:
                PROXIES["s3"].up()
        record(ti.try_number, state.value["epoch"])
        state.save({"epoch": state.value["epoch"] + 1})
        return state.value

    train()


dag_object = the_dag()
"""


@pytest.mark.s3
def test_a_task_that_cannot_renew_for_longer_than_the_ttl_stops_before_uploading_and_its_retry_resumes(
    s3_backend: str,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    dags_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_TTL", str(TTL))
    with TcpProxy(str(s3_endpoint.endpoint_url)) as proxy:
        # The task reaches S3 through the proxy (the connection's endpoint_url), the test directly.
        conn = json.loads(os.environ["AIRFLOW_CONN_STATEFUL_TEST_S3"])
        conn["extra"]["endpoint_url"] = proxy.url
        monkeypatch.setenv("AIRFLOW_CONN_STATEFUL_TEST_S3", json.dumps(conn))
        PROXIES["s3"] = proxy
        work = tmp_path / "work"
        body = OUTAGE.replace("__WORK__", repr(str(work))).replace("__COMPUTE__", str(2 * TTL))
        dag_file = write_dag(dags_folder, tmp_path, body)
        try:
            _, run = run_dag(dag_file)
        finally:
            PROXIES.pop("s3", None)
        assert proxy.refused > 0, "the outage really cut the task's connections"
    assert run.state == "success"
    tries = ledger_by_try(dag_file.ledger)
    assert tries[1] == [1, -1], "try 1 saved once, then its save was refused: it had lost its lease"
    assert tries[2] == [1], "the retry resumed from the last good checkpoint"
    cs = checkpoints(dag_file.dag_id, "train", run_id=run.run_id, **s3_endpoint.options())
    history = cs.history()
    assert [cs.get(e.seq).value for e in history] == [{"epoch": 2}, {"epoch": 1}]
    stored = list(cs.store.list_objects(f"{cs.identity.key}/"))
    assert unreferenced(cs.identity.key, stored, cs.head()) == [], "the refused save uploaded nothing"
    restored = tmp_path / "restored"
    cs.restore_files(cs.get(1), restored)
    assert (restored / "weights.bin").read_bytes() == b"good weights"


# -- a writer killed with SIGKILL, then Airflow's retry ---------------------------------------------------
RESUME_NAMED = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(identity="sigkill-demo")
    def work(state: TaskState):
        ti = current_ti()
        record(ti.try_number, state.value["done"] if state.value else 0)
        state.save({"done": (state.value["done"] if state.value else 0) + 1})
        return state.value

    work()


dag_object = the_dag()
"""


def test_a_sigkilled_writer_is_fenced_by_the_next_airflow_try_which_resumes(
    store: ObjectStore, dags_folder: Path, tmp_path: Path
) -> None:
    dag_file = write_dag(dags_folder, tmp_path, RESUME_NAMED)
    identity = Identity.for_task(dag_id=dag_file.dag_id, task_id="work", name="sigkill-demo")
    url = os.environ["AIRFLOW__STATEFUL__BACKEND_URL"]
    env = {"AWS_DEFAULT_REGION": "us-east-1"}
    if url.startswith("s3://"):
        conn = json.loads(os.environ["AIRFLOW_CONN_STATEFUL_TEST_S3"])
        env.update(
            STATEFUL_S3_ENDPOINT_URL=conn["extra"]["endpoint_url"],
            AWS_ACCESS_KEY_ID=conn["login"],
            AWS_SECRET_ACCESS_KEY=conn["password"],
        )
    writer = start_killable_writer({"url": url, "env": env}, identity, float(TTL * 30))
    writer.send_signal(signal.SIGKILL)  # the worker is lost while its lease has ~60 s to live
    writer.wait(timeout=30)
    started = time.monotonic()
    _, run = run_dag(dag_file)
    assert run.state == "success"
    assert time.monotonic() - started < TTL * 30, "the retry did not wait for the dead writer's lease"
    assert ledger_by_try(dag_file.ledger) == {1: [10]}, "the new try resumed from the killed writer's state"
    cs = CheckpointStore(store=store, identity=identity)
    head = cs.head()
    assert head is not None and head.epoch == 2, "the new try raised the epoch: the killed writer is fenced"
    assert cs.latest().value == {"done": 11}  # type: ignore[union-attr]

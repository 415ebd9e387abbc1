"""CheckpointSensor, LeaseReleasedSensor and CheckpointTrigger: conditions, modes, errors, serialization.

The Airflow tests run each sensor under ``dag.test()`` (real Airflow on SQLite: poke mode, reschedule mode,
and deferrable mode with the trigger run inline) against the real S3 endpoint, while a thread of the test
writes the watched identity with the storage core, as another task or pod would. Sensors in the DAG files
are thin subclasses that append every poke, every trigger event and the final failure to a ledger (JSON
lines), so a test can tell what the sensor saw and when: the writer thread only starts committing after the
sensor's first poke found the condition unmet, so a sensor that never really waits cannot pass.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from dag_helpers import find_dag, load_dag_module
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity, store_from_url
from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.fleet.conditions import CheckpointCondition
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.records.writer import WriterInfo

REPO = Path(__file__).resolve().parent.parent
WAIT = 60.0  # seconds a helper waits for something that should take well under one


# -- helpers -------------------------------------------------------------------------------------------------


def wait_until(check: Callable[[], bool], *, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


class Background(threading.Thread):
    """A thread whose exception is re-raised by :meth:`finish`."""

    def __init__(self, target: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        self.join(WAIT)
        assert not self.is_alive(), "the writer thread is stuck"
        if self.error is not None:
            raise self.error


HEADER = """\
from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from airflow_stateful.sensors.checkpoint import CheckpointSensor, LeaseReleasedSensor

LEDGER = Path(__LEDGER__)


def record(*fields):
    with open(LEDGER, "a") as ledger:
        ledger.write(json.dumps(fields, default=str) + "\\n")


class Recorder:
    def poke(self, context):
        done = super().poke(context)
        record("poke", bool(done), context["dag_run"].run_id, context["task_reschedule_count"])
        return done

    def execute(self, context):
        try:
            return super().execute(context)
        except Exception as exc:  # (deferral and reschedule included: on_failure takes the last one)
            record("raised", type(exc).__name__, str(exc))
            raise

    def execute_complete(self, context, event):
        record("trigger", event["status"])
        try:
            return super().execute_complete(context, event)
        except Exception as exc:
            record("raised", type(exc).__name__, str(exc))
            raise


class RecordingCheckpointSensor(Recorder, CheckpointSensor):
    pass


class RecordingLeaseReleasedSensor(Recorder, LeaseReleasedSensor):
    pass


def on_failure(context):
    error = context.get("exception")
    if error is None:  # Airflow 3.1/3.2's dag.test() does not hand the callback the exception
        rows = [json.loads(line) for line in LEDGER.read_text().splitlines()]
        raised = [row for row in rows if row[0] == "raised"]
        if raised:
            record("failed", raised[-1][1], raised[-1][2])
            return
    record("failed", type(error).__name__, str(error))

"""


@dataclass
class SensorDag:
    path: Path
    dag_id: str
    ledger: Path

    def rows(self) -> list[list[Any]]:
        if not self.ledger.exists():
            return []
        return [json.loads(line) for line in self.ledger.read_text().splitlines() if line]

    def pokes(self) -> list[bool]:
        return [row[1] for row in self.rows() if row[0] == "poke"]

    def first_poke_run_id(self) -> str:
        wait_until(lambda: bool(self.pokes()), what="the sensor's first poke")
        return str(next(row[2] for row in self.rows() if row[0] == "poke"))

    def failures(self) -> list[list[Any]]:
        return [row for row in self.rows() if row[0] == "failed"]


def write_sensor_dag(folder: Path, tmp_path: Path, sensor: str) -> SensorDag:
    """A DAG file with one sensor task ``wait``; ``sensor`` is its constructor call (``__ARGS__`` filled in)."""
    dag_id = f"sn_{uuid.uuid4().hex[:10]}"
    ledger = tmp_path / f"{dag_id}.ledger"
    body = f"""
        with DAG(dag_id="{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag_object:
            {sensor}
        """
    source = HEADER.replace("__LEDGER__", repr(str(ledger))) + textwrap.dedent(body)
    path = folder / f"{dag_id}.py"
    path.write_text(source)
    return SensorDag(path=path, dag_id=dag_id, ledger=ledger)


def run_dag(dag_file: SensorDag) -> Any:
    dag = find_dag(load_dag_module(dag_file.path))
    assert dag.dag_id == dag_file.dag_id
    return dag.test()


def run_dag_while(dag_file: SensorDag, writer: Callable[[], None]) -> Any:
    """Run the DAG while ``writer`` commits checkpoints in another thread; re-raise the writer's error."""
    thread = Background(writer)
    thread.start()
    run = run_dag(dag_file)
    thread.finish()
    return run


def task_state(run: Any, task_id: str) -> str:
    [ti] = [t for t in run.get_task_instances() if t.task_id == task_id]
    return str(ti.state)


def returned(run: Any, task_id: str) -> Any:
    """What a task of the run returned, read back from Airflow's XCom table."""
    from airflow import settings
    from airflow.models.xcom import XComModel

    with settings.Session() as session:
        query = XComModel.get_many(
            run_id=run.run_id, dag_ids=run.dag_id, task_ids=task_id, key="return_value"
        )
        return XComModel.deserialize_value(session.scalars(query).one())


@pytest.fixture(scope="module", autouse=True)
def _airflow_imported_outside_capfd(airflow_home: Path) -> None:
    """Airflow binds its log handler to ``sys.stdout`` on first import; do that outside any capturing test."""
    import airflow  # noqa: F401


S3_CONN_ID = "stateful_sensor_s3"


@pytest.fixture
def s3_backend(s3_endpoint: S3Endpoint, s3_prefix: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``[stateful]`` on the S3 endpoint through an Airflow connection given by environment variable."""
    extra = {"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region}
    conn: dict[str, Any] = {"conn_type": "aws", "extra": extra}
    if s3_endpoint.credentials:
        conn["login"] = s3_endpoint.credentials["aws_access_key_id"]
        conn["password"] = s3_endpoint.credentials["aws_secret_access_key"]
    monkeypatch.setenv(f"AIRFLOW_CONN_{S3_CONN_ID.upper()}", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW__STATEFUL__CONN_ID", S3_CONN_ID)
    url = f"s3://{s3_endpoint.bucket}/{s3_prefix}"
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", url)
    return url


@pytest.fixture
def db_connection(s3_endpoint: S3Endpoint, s3_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``[stateful]`` on the S3 endpoint through a connection stored in the metadata database (no env var).

    A task reads it through the execution API; the trigger, run inline by dag.test(), must too.
    """
    from airflow.models.connection import Connection
    from airflow.utils.session import create_session

    conn_id = f"stateful_db_{uuid.uuid4().hex[:8]}"
    extra = {"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region}
    with create_session() as session:
        session.add(
            Connection(
                conn_id=conn_id,
                conn_type="aws",
                login=s3_endpoint.credentials.get("aws_access_key_id"),
                password=s3_endpoint.credentials.get("aws_secret_access_key"),
                extra=json.dumps(extra),
            )
        )
    monkeypatch.setenv("AIRFLOW__STATEFUL__CONN_ID", conn_id)
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", f"s3://{s3_endpoint.bucket}/{s3_prefix}")
    yield conn_id
    with create_session() as session:
        session.query(Connection).filter(Connection.conn_id == conn_id).delete()


def s3_checkpoints(s3_endpoint: S3Endpoint, s3_prefix: str, identity: Identity) -> CheckpointStore:
    """The watched identity opened with the storage core alone, as another task or pod would."""
    return CheckpointStore(store=s3_endpoint.store(s3_prefix), identity=identity)


def commit_values(checkpoints: CheckpointStore, values: list[Any], *, pause: float = 0.3) -> None:
    lease = checkpoints.acquire(holder=WriterInfo.current(dag_id="producer", try_number=1))
    for value in values:
        time.sleep(pause)
        checkpoints.commit(lease, value)
    checkpoints.release(lease)


def corrupt_head(s3_endpoint: S3Endpoint, s3_prefix: str, identity: Identity) -> None:
    """Change one field of the head record without fixing its checksum (a damaged or hand-edited head)."""
    client = s3_endpoint.client()
    key = f"{s3_prefix}/{identity.key}/{HEAD_NAME}"
    body = json.loads(client.get_object(Bucket=s3_endpoint.bucket, Key=key)["Body"].read())
    body["next_seq"] += 7
    client.put_object(Bucket=s3_endpoint.bucket, Key=key, Body=json.dumps(body).encode())


# -- 1. the condition, on a real local store -------------------------------------------------------------------


@pytest.fixture
def local_checkpoints(tmp_path: Path) -> CheckpointStore:
    identity = Identity.for_task(dag_id="producer", task_id="export", name="orders")
    return CheckpointStore(store=store_from_url((tmp_path / "state").as_uri()), identity=identity)


class CountingLoader:
    """``load_latest`` for evaluate(), counting how often the manifest was read."""

    def __init__(self, checkpoints: CheckpointStore) -> None:
        self.checkpoints = checkpoints
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.checkpoints.latest()


def check(condition: CheckpointCondition, cs: CheckpointStore, **kwargs: Any) -> Any:
    return condition.evaluate(cs.head(), cs.latest, now=time.time(), **kwargs)


def test_default_condition_waits_for_the_first_checkpoint_without_reading_the_manifest(
    local_checkpoints: CheckpointStore,
) -> None:
    cs, condition = local_checkpoints, CheckpointCondition()
    assert not check(condition, cs)
    lease = cs.acquire()
    assert not check(condition, cs), "a lease alone is not a checkpoint"
    cs.commit(lease, {"rows": 1})
    loader = CountingLoader(cs)
    verdict = condition.evaluate(cs.head(), loader, now=time.time())
    assert verdict and verdict.seq == 1 and verdict.epoch == 1
    assert loader.calls == 0, "existence, seq and time are judged on the head record alone"
    assert verdict.result(cs.identity.key) == {
        "identity": cs.identity.key,
        "seq": 1,
        "created_at": cs.head().latest.created_at,  # type: ignore[union-attr]
        "epoch": 1,
    }


def test_min_seq_and_newer_than(local_checkpoints: CheckpointStore) -> None:
    cs = local_checkpoints
    lease = cs.acquire()
    cs.commit(lease, {"rows": 1})
    between = datetime.now(tz=timezone.utc).isoformat()
    assert not check(CheckpointCondition(min_seq=2), cs)
    assert not check(CheckpointCondition(newer_than=between), cs)
    cs.commit(lease, {"rows": 2})
    assert check(CheckpointCondition(min_seq=2, newer_than=between), cs).seq == 2
    assert not check(CheckpointCondition(min_seq=3, newer_than=between), cs), "all conditions must hold"
    assert check(CheckpointCondition(newer_than=between.replace("+00:00", "Z")), cs)


def test_field_comparisons_read_the_value(local_checkpoints: CheckpointStore) -> None:
    cs = local_checkpoints
    lease = cs.acquire()
    cs.commit(lease, {"stats": {"rows": 250, "files": ["a", "b"]}, "state": "running", "error": None})
    cases: list[tuple[str, str, Any, bool]] = [
        ("stats.rows", ">=", 200, True),
        ("stats.rows", ">", 250, False),
        ("stats.rows", "<=", 250, True),
        ("stats.rows", "<", 250, False),
        ("state", "==", "running", True),
        ("state", "!=", "running", False),
        ("stats.files.1", "==", "b", True),
        ("error", "==", None, True),
        ("", "==", {"state": "running"}, False),  # "" is the whole value
    ]
    for field, op, value, expected in cases:
        loader = CountingLoader(cs)
        verdict = CheckpointCondition(field=field, op=op, value=value).evaluate(
            cs.head(), loader, now=time.time()
        )
        assert bool(verdict) is expected, (field, op, value, verdict.reason)
        assert loader.calls == 1
    missing = check(CheckpointCondition(field="stats.bytes", op=">", value=0), cs)
    assert not missing and "does not exist yet" in missing.reason
    mismatched = check(CheckpointCondition(field="state", op=">", value=3), cs)
    assert not mismatched and "cannot be compared" in mismatched.reason
    assert check(CheckpointCondition(), cs, predicate=lambda v: v["stats"]["rows"] == 250)
    assert not check(CheckpointCondition(), cs, predicate=lambda v: v["state"] == "done")


def test_a_pickled_value_is_refused_not_unpickled(local_checkpoints: CheckpointStore) -> None:
    cs = local_checkpoints
    cs.commit(cs.acquire(), {"rows": 1}, value_codec="pickle")
    assert check(CheckpointCondition(min_seq=1), cs), "seq and time still work"
    with pytest.raises(InvalidValueError, match="JSON values only"):
        check(CheckpointCondition(field="rows", op="==", value=1), cs)


def test_lease_released_condition(tmp_path: Path) -> None:
    now = [1_000_000.0]
    identity = Identity.parse("jobs/export")
    cs = CheckpointStore(
        store=store_from_url((tmp_path / "state").as_uri()),
        identity=identity,
        lease_ttl=60,
        clock=lambda: now[0],
    )
    released = CheckpointCondition(kind="lease_released")
    assert released.evaluate(None, cs.latest, now=now[0]), "a never-used identity holds no lease"
    lease = cs.acquire(holder=WriterInfo(try_number=4, run_id="r1", host="h1"))
    held = released.evaluate(cs.head(), cs.latest, now=now[0])
    assert not held and "try 4, run r1, host h1" in held.reason and held.epoch == 1
    assert released.evaluate(cs.head(), cs.latest, now=now[0] + 61), "an expired lease holds nothing"
    cs.release(lease)
    verdict = released.evaluate(cs.head(), cs.latest, now=now[0])
    assert verdict and verdict.epoch == 1


def test_condition_round_trips_and_refuses_bad_input() -> None:
    condition = CheckpointCondition(
        min_seq=2, newer_than="2026-01-01T00:00:00+00:00", field="a.b", op=">=", value=[1, "x"]
    )
    assert CheckpointCondition.from_dict(json.loads(json.dumps(condition.to_dict()))) == condition
    bad: list[dict[str, Any]] = [
        {"op": "=~"},
        {"min_seq": 0},
        {"min_seq": True},
        {"newer_than": "2026-01-01T00:00:00"},  # no timezone
        {"newer_than": "yesterday"},
        {"field": "a..b", "value": 1},
        {"field": "a", "value": float("nan")},
        {"field": "a", "value": object()},
        {"kind": "lease_released", "min_seq": 1},
        {"kind": "gone"},
    ]
    for kwargs in bad:
        with pytest.raises(InvalidValueError):
            CheckpointCondition(**kwargs)
    with pytest.raises(InvalidValueError, match="unknown condition parameter"):
        CheckpointCondition.from_dict({"min_seq": 1, "max_seq": 3})


# -- 2. the trigger, on its own ---------------------------------------------------------------------------------


def first_event(trigger: Any) -> Any:
    async def run() -> Any:
        return await anext(trigger.run(), None)

    return asyncio.run(run())


@pytest.mark.airflow
def test_trigger_serialize_round_trips_and_holds_no_credentials() -> None:
    try:
        from airflow.sdk._shared.module_loading import import_string
        from airflow.sdk.serde import deserialize, serialize
    except ImportError:  # Airflow 3.1
        from airflow.serialization.serde import deserialize, serialize  # type: ignore[no-redef,unused-ignore]
        from airflow.utils.module_loading import import_string

    from airflow_stateful.triggers.checkpoint import CheckpointTrigger

    condition = CheckpointCondition(
        min_seq=3, newer_than="2026-01-01T00:00:00+00:00", field="stats.rows", op=">", value={"n": [1, 2]}
    )
    trigger = CheckpointTrigger(
        identity="producer/export/name=orders/map=-1",
        condition=condition.to_dict(),
        backend_url="s3://stateful-bucket/state",
        conn_id=S3_CONN_ID,
        poll_interval=0.25,
        max_poll_interval=4,
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_stateful.triggers.checkpoint.CheckpointTrigger"
    assert set(kwargs) == {
        "identity",
        "condition",
        "backend_url",
        "conn_id",
        "poll_interval",
        "max_poll_interval",
    }, "only the connection id travels, never its secrets"
    # As the metadata database stores them, and as the triggerer rebuilds the trigger.
    stored = deserialize(serialize(kwargs))
    rebuilt = import_string(classpath)(**stored)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert CheckpointCondition.from_dict(rebuilt.serialize()[1]["condition"]) == condition

    class Custom(CheckpointTrigger):
        pass

    custom_path, custom_kwargs = Custom(**kwargs).serialize()
    assert custom_path == f"{__name__}.{Custom.__qualname__}", "a subclass serializes as itself"
    assert custom_kwargs == kwargs
    with pytest.raises(ValueError, match="poll_interval"):
        CheckpointTrigger(identity="a/b", condition={}, poll_interval=0)
    with pytest.raises(InvalidValueError):
        CheckpointTrigger(identity="a/b", condition={"op": "=~"})


@pytest.mark.airflow
@pytest.mark.s3
def test_trigger_reports_a_missing_bucket_as_an_error_event(s3_backend: str, s3_endpoint: S3Endpoint) -> None:
    from airflow_stateful.triggers.checkpoint import CheckpointTrigger

    bucket = f"stateful-missing-{uuid.uuid4().hex[:8]}"
    trigger = CheckpointTrigger(
        identity="producer/export/name=orders/map=-1",
        condition=CheckpointCondition().to_dict(),
        backend_url=f"s3://{bucket}/state",
        conn_id=S3_CONN_ID,
        poll_interval=0.1,
    )
    event = first_event(trigger)
    assert event.payload["status"] == "error"
    assert bucket in event.payload["message"] and "does not exist" in event.payload["message"]


@pytest.mark.airflow
@pytest.mark.s3
def test_trigger_fires_when_another_writer_commits(
    s3_backend: str, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    from airflow_stateful.triggers.checkpoint import CheckpointTrigger

    identity = Identity.for_task(dag_id="producer", task_id="export", name="orders")
    writer = Background(
        lambda: commit_values(
            s3_checkpoints(s3_endpoint, s3_prefix, identity), [{"rows": 10}, {"rows": 20}, {"rows": 30}]
        )
    )
    trigger = CheckpointTrigger(
        identity=identity.key,
        condition=CheckpointCondition(field="rows", op=">=", value=25).to_dict(),
        conn_id=S3_CONN_ID,  # backend_url: [stateful] backend_url, resolved inside the trigger
        poll_interval=0.05,
        max_poll_interval=0.2,
    )
    writer.start()
    event = first_event(trigger)
    writer.finish()
    assert event.payload["status"] == "success", event.payload
    assert event.payload["result"]["identity"] == identity.key
    assert event.payload["result"]["seq"] == 3


@pytest.mark.airflow
def test_trigger_backs_off_while_nothing_changes_and_looks_again_soon_after_a_change(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The delays the trigger logs: doubling up to the cap while the head stands still, reset by a commit."""
    from airflow_stateful.triggers.checkpoint import CheckpointTrigger

    url = (tmp_path / "state").as_uri()
    identity = Identity.for_task(dag_id="producer", task_id="export", name="orders")
    trigger = CheckpointTrigger(
        identity=identity.key,
        condition=CheckpointCondition(min_seq=99).to_dict(),  # never met
        backend_url=url,
        poll_interval=0.01,
        max_poll_interval=0.08,
    )
    checkpoints = CheckpointStore(store=store_from_url(url), identity=identity)
    writer = Background(lambda: (time.sleep(0.3), commit_values(checkpoints, [{"rows": 1}], pause=0)))

    async def watch() -> None:
        await asyncio.wait_for(anext(trigger.run()), timeout=1.5)

    capfd.readouterr()
    writer.start()
    with pytest.raises(TimeoutError):
        asyncio.run(watch())
    writer.finish()
    out = capfd.readouterr().out
    delays = [
        float(line.split("next check in ")[1].split(" s")[0])
        for line in out.splitlines()
        if "next check in" in line
    ]
    assert delays[:5] == [0.01, 0.02, 0.04, 0.08, 0.08], delays
    after_cap = delays[delays.index(0.08) :]
    assert 0.01 in after_cap, f"the writer changed the head, so the delay starts over: {delays}"
    last_reset = len(after_cap) - 1 - after_cap[::-1].index(0.01)
    assert after_cap[last_reset : last_reset + 4] == [0.01, 0.02, 0.04, 0.08], delays
    assert max(delays) == 0.08


# -- 3. sensors under dag.test() against S3 -------------------------------------------------------------------


@pytest.mark.airflow
@pytest.mark.s3
def test_poke_mode_waits_for_the_checkpoint_another_writer_commits(
    dags_folder: Path, tmp_path: Path, s3_backend: str, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    identity = Identity.for_task(dag_id="producer", task_id="export", name="orders")
    dag_file = write_sensor_dag(
        dags_folder,
        tmp_path,
        f"""RecordingCheckpointSensor(
                task_id="wait", identity="{identity.key}", min_seq=3, predicate=lambda value: value["done"],
                mode="poke", poke_interval=0.2, timeout=60, on_failure_callback=on_failure,
            )""",
    )
    values = [{"rows": 10, "done": False}, {"rows": 20, "done": False}]
    values += [{"rows": 30, "done": False}, {"rows": 40, "done": True}]

    def writer() -> None:
        dag_file.first_poke_run_id()
        commit_values(s3_checkpoints(s3_endpoint, s3_prefix, identity), values)

    run = run_dag_while(dag_file, writer)
    assert task_state(run, "wait") == "success", dag_file.rows()
    pokes = dag_file.pokes()
    assert pokes[0] is False and pokes[-1] is True and pokes.count(True) == 1
    result = returned(run, "wait")
    assert result["identity"] == identity.key
    assert result["seq"] == 4, "min_seq=3 held at seq 3, but the predicate only at seq 4"


@pytest.mark.airflow
@pytest.mark.s3
def test_reschedule_mode_frees_the_worker_between_pokes(
    dags_folder: Path, tmp_path: Path, s3_backend: str, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    identity = Identity.for_task(dag_id="producer", task_id="export", name="orders")
    checkpoints = s3_checkpoints(s3_endpoint, s3_prefix, identity)
    commit_values(checkpoints, [{"rows": 100}], pause=0)  # an old checkpoint that would match the field
    since = datetime.now(tz=timezone.utc).isoformat()
    dag_file = write_sensor_dag(
        dags_folder,
        tmp_path,
        f"""RecordingCheckpointSensor(
                task_id="wait", external_dag_id="producer", external_task_id="export", name="orders",
                newer_than="{since}", field="rows", op=">=", value=30,
                mode="reschedule", poke_interval=0.2, timeout=60, on_failure_callback=on_failure,
            )""",
    )

    def writer() -> None:
        dag_file.first_poke_run_id()
        commit_values(checkpoints, [{"rows": 10}, {"rows": 40}])

    run = run_dag_while(dag_file, writer)
    assert task_state(run, "wait") == "success", dag_file.rows()
    pokes = [row for row in dag_file.rows() if row[0] == "poke"]
    assert pokes[0][1] is False and pokes[-1][1] is True
    assert pokes[-1][3] >= 1, "the final poke ran after at least one reschedule"
    assert [p[3] for p in pokes] == sorted(p[3] for p in pokes)
    assert returned(run, "wait")["seq"] == 3, "seq 1 matched the field but is older than newer_than"


@pytest.mark.airflow
@pytest.mark.s3
@pytest.mark.parametrize("connection", ["env", "metadata-db"])
def test_deferrable_mode_waits_in_the_trigger(
    connection: str,
    request: pytest.FixtureRequest,
    dags_folder: Path,
    tmp_path: Path,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    request.getfixturevalue("s3_backend" if connection == "env" else "db_connection")
    dag_file = write_sensor_dag(
        dags_folder,
        tmp_path,
        """RecordingCheckpointSensor(
                task_id="wait", external_task_id="export", field="status", op="==", value="done",
                deferrable=True, poke_interval=0.2, timeout=60, on_failure_callback=on_failure,
            )""",
    )

    def writer() -> None:
        # The sensor watches the state of task "export" of its own DAG and run (the defaults).
        run_id = dag_file.first_poke_run_id()
        identity = Identity.for_task(dag_id=dag_file.dag_id, task_id="export", run_id=run_id)
        values = [{"status": "running"}, {"status": "running"}, {"status": "done"}]
        commit_values(s3_checkpoints(s3_endpoint, s3_prefix, identity), values)

    run = run_dag_while(dag_file, writer)
    assert task_state(run, "wait") == "success", dag_file.rows()
    assert dag_file.pokes() == [False], "one check on the worker, then the trigger"
    assert ["trigger", "success"] in dag_file.rows(), "execute_complete ran on the trigger's event"
    result = returned(run, "wait")
    assert result["seq"] == 3 and result["identity"].startswith(f"{dag_file.dag_id}/export/run=")


# -- 4. errors end the sensor with the library's message ------------------------------------------------------


@pytest.mark.airflow
@pytest.mark.s3
@pytest.mark.parametrize("mode", ["poke", "reschedule", "deferrable"])
def test_missing_bucket_fails_the_sensor_with_its_name(
    mode: str, dags_folder: Path, tmp_path: Path, s3_backend: str
) -> None:
    bucket = f"stateful-missing-{uuid.uuid4().hex[:8]}"
    how = "deferrable=True" if mode == "deferrable" else f'mode="{mode}"'
    dag_file = write_sensor_dag(
        dags_folder,
        tmp_path,
        f"""RecordingCheckpointSensor(
                task_id="wait", identity="producer/export", backend_url="s3://{bucket}/state",
                {how}, poke_interval=0.2, timeout=30, on_failure_callback=on_failure,
            )""",
    )
    run = run_dag(dag_file)
    assert task_state(run, "wait") == "failed"
    [failure] = dag_file.failures()
    assert failure[1] == "CheckpointSensorError", failure  # not AirflowSensorTimeout
    assert bucket in failure[2] and "does not exist" in failure[2] and "producer/export" in failure[2]
    assert dag_file.pokes() == [], "no poke ever answered"


def run_sensor_changing_the_head(
    folder: Path, tmp_path: Path, identity: Identity, mode: str, change: Callable[[], None]
) -> tuple[SensorDag, Any]:
    """Run a sensor waiting for seq 5 of ``identity`` (``mode``: ``poke`` or ``deferrable``); ``change`` runs
    in another thread once the sensor's first check has seen the head as it was. The DAG file and the run."""
    how = "deferrable=True" if mode == "deferrable" else 'mode="poke"'
    dag_file = write_sensor_dag(
        folder,
        tmp_path,
        f"""RecordingCheckpointSensor(
                task_id="wait", identity="{identity.key}", min_seq=5,
                {how}, poke_interval=0.2, timeout=30, on_failure_callback=on_failure,
            )""",
    )

    def after_the_first_check() -> None:
        dag_file.first_poke_run_id()
        change()

    thread = Background(after_the_first_check)
    thread.start()
    run = run_dag(dag_file)
    thread.finish()
    return dag_file, run


@pytest.mark.airflow
@pytest.mark.s3
@pytest.mark.parametrize("mode", ["poke", "deferrable"])
def test_corrupt_head_fails_the_sensor_clearly(
    mode: str, dags_folder: Path, tmp_path: Path, s3_backend: str, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    identity = Identity.for_task(dag_id="producer", task_id="export", name="orders")
    commit_values(s3_checkpoints(s3_endpoint, s3_prefix, identity), [{"rows": 1}], pause=0)
    dag_file, run = run_sensor_changing_the_head(
        dags_folder, tmp_path, identity, mode, lambda: corrupt_head(s3_endpoint, s3_prefix, identity)
    )
    assert task_state(run, "wait") == "failed"
    [failure] = dag_file.failures()
    assert failure[1] == "CheckpointSensorError", failure
    assert "does not match its checksum" in failure[2] and identity.key in failure[2]
    if mode == "deferrable":
        assert ["trigger", "error"] in dag_file.rows(), "the trigger reported the error as an event"


@pytest.fixture(scope="module")
def strict_s3() -> Iterator[str]:
    """A second moto server that checks credentials (it accepts any by default): its endpoint URL."""
    from airflow_stateful.testing.s3_server import MotoServer

    env = pytest.MonkeyPatch()
    env.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # read by the server process only
    try:
        server = MotoServer.start()
    finally:
        env.undo()
    with server:
        yield server.endpoint_url


@pytest.mark.airflow
@pytest.mark.s3
def test_bad_credentials_fail_the_sensor_and_the_trigger_without_leaking_them(
    dags_folder: Path, tmp_path: Path, strict_s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_stateful.triggers.checkpoint import CheckpointTrigger

    secret = f"not-a-valid-secret-{uuid.uuid4().hex}"
    conn = {"conn_type": "aws", "login": "AKIANOTAREALKEY00000", "password": secret}
    conn["extra"] = {"endpoint_url": strict_s3, "region_name": "us-east-1"}
    monkeypatch.setenv("AIRFLOW_CONN_STATEFUL_BAD_CREDS", json.dumps(conn))
    backend = "s3://stateful-guarded/state"
    dag_file = write_sensor_dag(
        dags_folder,
        tmp_path,
        f"""RecordingCheckpointSensor(
                task_id="wait", identity="producer/export", backend_url="{backend}",
                conn_id="stateful_bad_creds", poke_interval=0.2, timeout=30, on_failure_callback=on_failure,
            )""",
    )
    run = run_dag(dag_file)
    assert task_state(run, "wait") == "failed"
    [failure] = dag_file.failures()
    assert failure[1] == "CheckpointSensorError", failure
    assert "was denied (InvalidAccessKeyId)" in failure[2] and "check the credentials" in failure[2]
    assert secret not in failure[2]

    event = first_event(
        CheckpointTrigger(
            identity="producer/export",
            condition=CheckpointCondition().to_dict(),
            backend_url=backend,
            conn_id="stateful_bad_creds",
        )
    )
    assert event.payload["status"] == "error"
    assert "was denied (InvalidAccessKeyId)" in event.payload["message"]
    assert secret not in json.dumps(event.payload)


# -- 5. LeaseReleasedSensor -----------------------------------------------------------------------------------


@pytest.mark.airflow
@pytest.mark.s3
@pytest.mark.parametrize("mode", ["poke", "deferrable"])
def test_lease_released_sensor_waits_for_the_holder_to_let_go(
    mode: str, dags_folder: Path, tmp_path: Path, s3_backend: str, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    identity = Identity.for_task(dag_id="producer", task_id="export", name="orders")
    checkpoints = s3_checkpoints(s3_endpoint, s3_prefix, identity)
    lease = checkpoints.acquire(holder=WriterInfo.current(dag_id="producer", try_number=7))
    checkpoints.commit(lease, {"rows": 5})
    how = "deferrable=True" if mode == "deferrable" else 'mode="poke"'
    dag_file = write_sensor_dag(
        dags_folder,
        tmp_path,
        f"""RecordingLeaseReleasedSensor(
                task_id="wait", external_dag_id="producer", external_task_id="export", name="orders",
                {how}, poke_interval=0.2, timeout=60, on_failure_callback=on_failure,
            )""",
    )

    def holder() -> None:
        dag_file.first_poke_run_id()
        time.sleep(0.3)
        assert checkpoints.release(lease)

    thread = Background(holder)
    thread.start()
    run = run_dag(dag_file)
    thread.finish()
    assert task_state(run, "wait") == "success", dag_file.rows()
    assert dag_file.pokes()[0] is False, "the lease was live at the first check"
    if mode == "deferrable":
        assert ["trigger", "success"] in dag_file.rows()
    result = returned(run, "wait")
    assert result == {
        "identity": identity.key,
        "seq": 1,
        "created_at": checkpoints.head().latest.created_at,  # type: ignore[union-attr]
        "epoch": lease.epoch,
    }


# -- 6. arguments are checked when the DAG is parsed ---------------------------------------------------------


@pytest.mark.airflow
def test_sensor_arguments_are_checked_at_parse_time() -> None:
    from airflow_stateful.sensors.checkpoint import CheckpointSensor, LeaseReleasedSensor

    ok = CheckpointSensor(task_id="ok", identity="{{ params.key }}", newer_than="{{ data_interval_end }}")
    assert ok.identity == "{{ params.key }}", "templated values are left for rendering"
    LeaseReleasedSensor(task_id="ok2", external_task_id="export", name="orders")
    bad: dict[str, dict[str, Any]] = {
        "cannot run in the triggerer": {"identity": "a/b", "predicate": bool, "deferrable": True},
        "either identity": {"identity": "a/b", "name": "orders"},
        "say which state": {"min_seq": 1},
        "not both": {"external_task_id": "t", "name": "orders", "run_id": "r"},
        "go together": {"identity": "a/b", "field": "rows"},
        "op must be": {"identity": "a/b", "field": "rows", "op": "~", "value": 1},
        "escape its prefix": {"identity": "a/../b"},
        "identity name": {"external_task_id": "t", "name": "no spaces"},
        "no timezone": {"identity": "a/b", "newer_than": datetime(2026, 1, 1)},
        "integer >= 1": {"identity": "a/b", "min_seq": 0},
    }
    for message, kwargs in bad.items():
        with pytest.raises(ValueError, match=message):
            CheckpointSensor(task_id="bad", **kwargs)
    CheckpointSensor(task_id="aware", identity="a/b", newer_than=datetime(2026, 1, 1, tzinfo=timezone.utc))
    CheckpointSensor(task_id="poke_ok", identity="a/b", predicate=bool, deferrable=False)


# -- 7. the example DAG and its docs, the provider registration ---------------------------------------------


def snippet(path: Path, name: str) -> list[str]:
    lines = path.read_text().splitlines()
    stripped = [line.strip() for line in lines]
    start, end = stripped.index(f"# [START {name}]"), stripped.index(f"# [END {name}]")
    return [line.strip() for line in lines[start + 1 : end] if line.strip()]


@pytest.mark.airflow
def test_example_dag_runs_and_the_docs_quote_it(
    dags_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "state").as_uri())
    module = load_dag_module(dags_folder / "checkpoint_sensor.py")
    run = module.dag_object.test()
    assert str(run.state) == "success"
    seen = returned(run, "wait_for_first_rows")
    assert seen["identity"] == "checkpoint_sensor/export_orders/name=orders-export/map=-1"
    assert seen["seq"] >= 3, "300 rows are 3 batches of 100"
    assert returned(run, "preview_report")["rows_at_least"] >= 300
    maintenance = module.maintenance_dag.test()
    assert str(maintenance.state) == "success"
    assert returned(maintenance, "export_idle")["epoch"] == 1
    assert returned(maintenance, "collect_export_garbage")["skipped"] is None

    docs = (REPO / "docs" / "sensors.md").read_text()
    flat_docs = [line.strip() for line in docs.splitlines()]
    for name in ("checkpoint_sensor", "lease_released_sensor"):
        lines = snippet(REPO / "dags" / "checkpoint_sensor.py", name)
        assert lines, name
        start = flat_docs.index(lines[0])
        assert flat_docs[start : start + len(lines)] == lines, f"docs/sensors.md quotes {name} verbatim"


@pytest.mark.airflow
def test_provider_registers_the_sensors_and_the_trigger() -> None:
    import importlib

    from airflow.providers_manager import ProvidersManager

    from airflow_stateful.get_provider_info import get_provider_info

    info = get_provider_info()
    integrations = {i["integration-name"] for i in info["integrations"]}
    for section, names in (
        ("sensors", {"CheckpointSensor", "LeaseReleasedSensor"}),
        ("triggers", {"CheckpointTrigger"}),
    ):
        [entry] = info[section]
        assert entry["integration-name"] in integrations
        [module_name] = entry["python-modules"]
        assert names <= set(vars(importlib.import_module(module_name)))
    triggers = {t.trigger_class_name for t in ProvidersManager().trigger}
    assert "airflow_stateful.triggers.checkpoint" in triggers

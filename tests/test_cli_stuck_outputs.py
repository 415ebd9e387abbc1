"""Stuck and dead writers, and committed outputs: ``airflow-stateful ls``/``stuck``/``outputs``, the stuck check
operator in the maintenance DAG, and a real stateful task that is stuck while its heartbeat renews its lease.

The heads are written by the real core. A writer's clock (``CheckpointStore(clock=...)``) stands in for time
passing, so nothing sleeps except the one end-to-end task, whose heartbeat must really renew its lease:

* stuck: a live lease (long ttl) whose holder committed 100 s ago, declared it commits every second, and
  renewed the lease just now (alive, renewing, not committing);
* dead: the same silence, but its lease expired 990 s ago (not renewed: the writer is gone) - never stuck;
* idle: released; active: a live lease, committed just now;
* quiet: a live lease whose holder declared no interval and committed 120 s ago: active under the default
  interval (1 h), stuck under ``--default-interval 1m``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from dag_helpers import find_dag, load_dag_module
from test_cli import LS_HEADER, backend, cli  # noqa: F401 - `backend` is a fixture (a local directory and S3)

from airflow_stateful.cli.main import main
from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession, store_from_url
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.stores.base import ObjectStore

STUCK = Identity.for_task(dag_id="etl", task_id="stuck", run_id="r1")
DEAD = Identity.for_task(dag_id="etl", task_id="dead", run_id="r1")
IDLE = Identity.for_task(dag_id="etl", task_id="idle", run_id="r1")
ACTIVE = Identity.for_task(dag_id="etl", task_id="active", run_id="r1")
QUIET = Identity.for_task(dag_id="etl", task_id="quiet", run_id="r1")
PUBLISHER = Identity.for_task(dag_id="reports", task_id="publish", run_id="r1")


def open_store(url: str) -> ObjectStore:
    endpoint = os.environ.get("STATEFUL_S3_ENDPOINT_URL") if url.startswith("s3://") else None
    return store_from_url(url, **({"endpoint_url": endpoint} if endpoint else {}))


def writer(
    store: ObjectStore,
    identity: Identity,
    *,
    clock: Callable[[], float],
    lease_ttl: float = 3600,
    expected: float | None = None,
) -> WriterSession:
    """An open session (no heartbeat thread: the test drives the clock) that committed once."""
    cs = CheckpointStore(store=store, identity=identity, lease_ttl=lease_ttl, clock=clock)
    session = WriterSession(
        checkpoints=cs,
        writer=WriterInfo(try_number=1, run_id="r1", task_id=identity.key.split("/")[1]),
        heartbeat=False,
        expected_checkpoint_interval=expected,
    )
    session.open()
    session.commit({"n": 1})
    return session


def seed_stuck(store: ObjectStore, identity: Identity, now: float) -> None:
    """Committed 100 s ago, declared 1 s, renewed its lease just now: alive and renewing, not committing."""
    at = [now - 100]
    session = writer(store, identity, clock=lambda: at[0], expected=1)
    at[0] = now
    session.checkpoints.renew(session.lease)  # what its heartbeat does


def seed_dead(store: ObjectStore, identity: Identity, now: float) -> None:
    """The same silence as the stuck one, but its 10 s lease expired long ago: nobody renews it."""
    writer(store, identity, clock=lambda: now - 1000, lease_ttl=10, expected=1)


def seed_fleet(url: str) -> ObjectStore:
    store = open_store(url)
    now = time.time()
    seed_stuck(store, STUCK, now)
    seed_dead(store, DEAD, now)
    writer(store, IDLE, clock=time.time).close()  # released
    writer(store, ACTIVE, clock=time.time, expected=3600)
    quiet = [now - 120]
    session = writer(store, QUIET, clock=lambda: quiet[0])  # declares no interval: the default applies
    quiet[0] = now
    session.checkpoints.renew(session.lease)
    return store


@pytest.fixture
def fleet(backend: str) -> Iterator[ObjectStore]:  # noqa: F811
    store = seed_fleet(backend)
    yield store
    store.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A local store only: the listing is the one ``stuck`` runs on both stores; this keeps the suite short."""
    return (tmp_path / "state").as_uri()


# -- ls --------------------------------------------------------------------------------------------------
def test_ls_shows_each_identitys_status_and_filters_by_it(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    seed_fleet(url).close()
    code, out, _ = cli(capsys, url, "ls")
    assert code == 0
    header, *lines = out.splitlines()
    assert header.split() == LS_HEADER
    status_column = {line.split()[0]: line for line in lines}
    assert " stuck " in status_column[STUCK.key] and " dead " in status_column[DEAD.key]

    code, out, _ = cli(capsys, url, "ls", "--json")
    rows = {r["identity"]: r for r in json.loads(out)}
    assert {k: r["status"] for k, r in rows.items()} == {
        STUCK.key: "stuck",
        DEAD.key: "dead",
        IDLE.key: "idle",
        ACTIVE.key: "active",
        QUIET.key: "active",
    }
    assert rows[STUCK.key]["expected_interval_seconds"] == 1.0
    assert rows[STUCK.key]["since_progress_seconds"] >= 100
    assert "committed nothing" in rows[STUCK.key]["reason"]

    def listed(*args: str) -> set[str]:
        code, out, _ = cli(capsys, url, "ls", "--json", *args)
        assert code == 0
        return {r["identity"] for r in json.loads(out)}

    assert listed("--status", "stuck") == {STUCK.key}
    assert (
        listed("--status", "stuck,dead")
        == listed("--status", "stuck", "--status", "dead")
        == {
            STUCK.key,
            DEAD.key,
        }
    )
    assert listed("--status", "stuck", "--default-interval", "1m") == {STUCK.key, QUIET.key}
    with pytest.raises(SystemExit) as exc:
        main(["ls", "--status", "hung", "--url", url])
    assert exc.value.code == 2
    assert "choose from active, stuck, dead, idle" in capsys.readouterr().err


# -- stuck ------------------------------------------------------------------------------------------------
@pytest.mark.s3
def test_stuck_lists_the_stuck_exits_1_and_never_counts_the_dead(
    capsys: pytest.CaptureFixture[str],
    backend: str,  # noqa: F811
    fleet: ObjectStore,
) -> None:
    code, out, err = cli(capsys, backend, "stuck")
    assert code == 1
    header, *lines = out.splitlines()
    assert header.split() == ["IDENTITY", "HOLDER", "SINCE_PROGRESS", "EXPECTED", "RENEWED", "REASON"]
    assert [line.split()[0] for line in lines] == [STUCK.key]
    assert "0:00:01" in lines[0] and "try 1, run r1" in lines[0]
    assert "2 active, 1 stuck, 1 dead, 1 idle" in err
    assert "not stuck but dead" in err and DEAD.key in err

    code, out, _ = cli(capsys, backend, "stuck", "--json")
    report = json.loads(out)
    assert code == 1
    assert [s["identity"] for s in report["stuck"]] == [STUCK.key]
    assert [d["identity"] for d in report["dead"]] == [DEAD.key]
    assert report["counts"] == {"active": 2, "stuck": 1, "dead": 1, "idle": 1} and report["checked"] == 5
    [stuck] = report["stuck"]
    assert stuck["lease_renewed_at"] > stuck["lease_acquired_at"], "renewed after it last committed"
    assert "token" not in json.dumps(report), "the lease token never leaves the head"

    assert cli(capsys, backend, "stuck", "--prefix", "etl/dead/")[0] == 0, "dead alone: nothing stuck"
    assert cli(capsys, backend, "stuck", "etl/idle/")[0] == 0
    code, out, _ = cli(capsys, backend, "stuck", "--json", "--default-interval", "1m")
    assert code == 1 and {s["identity"] for s in json.loads(out)["stuck"]} == {STUCK.key, QUIET.key}


def test_stuck_exits_2_when_it_cannot_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = (tmp_path / "state").as_uri()
    store = seed_fleet(url)
    store.put(f"{Identity.for_task(dag_id='etl', task_id='zz', run_id='r1').key}/{HEAD_NAME}", b"{not json")

    code, out, err = cli(capsys, url, "stuck", "etl/zz")
    assert code == 2, "an unreadable head: the check is incomplete, and found nothing stuck"
    assert out.splitlines()[1].startswith("etl/zz/run=r1/map=-1  error: ")
    assert "1 head(s) could not be read" in err
    assert cli(capsys, url, "stuck")[0] == 1, "found stuck identities: that is the answer, errors or not"
    code, _, err = cli(capsys, "ftp://nowhere/state", "stuck")
    assert code == 2 and "ftp" in err

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the listing broke")

    monkeypatch.setattr("airflow_stateful.cli.commands.fleet.find_stuck", broken)
    code, _, err = cli(capsys, url, "stuck")
    assert code == 2 and "RuntimeError: the listing broke" in err, "never 1, which would read as 'stuck'"
    with pytest.raises(SystemExit) as exc:
        main(["stuck", "--default-interval", "0s", "--backend", url])
    assert exc.value.code == 2


# -- outputs -----------------------------------------------------------------------------------------------
def test_outputs_lists_and_downloads_committed_outputs(
    capsys: pytest.CaptureFixture[str], url: str, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "model" / "weights").mkdir(parents=True)
    (src / "model" / "weights" / "a.bin").write_bytes(os.urandom(70_000))
    (src / "model" / "config.json").write_text('{"layers": 2}')
    report = src / "report.csv"
    store = open_store(url)
    cs = CheckpointStore(store=store, identity=PUBLISHER)
    with WriterSession(
        checkpoints=cs, writer=WriterInfo(try_number=2, run_id="r1"), heartbeat=False
    ) as session:
        report.write_text("day,rows\n1,10\n")
        session.publish("report.csv", report)
        session.publish("model", src / "model")
        session.commit({"day": 1})
        report.write_text("day,rows\n1,10\n2,20\n")
        session.publish("report.csv", report)
        session.commit({"day": 2})

    code, out, _ = cli(capsys, url, "outputs", PUBLISHER.key)
    assert code == 0
    header, *lines = out.splitlines()
    assert header.split() == ["NAME", "KIND", "SIZE", "SHA256", "SEQ", "COMMITTED_AT", "TRY", "LOCATION"]
    assert [line.split()[:2] for line in lines] == [["model", "directory"], ["report.csv", "file"]]
    code, out, _ = cli(capsys, url, "outputs", PUBLISHER.key, "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert (rows["model"]["seq"], rows["report.csv"]["seq"]) == (1, 2), "model carried over from checkpoint 1"
    assert rows["report.csv"]["size"] == len(report.read_bytes()) and rows["report.csv"]["try_number"] == 2
    assert rows["model"]["file_count"] == 2 and rows["report.csv"]["location"].endswith("#report.csv")

    code, out, _ = cli(
        capsys, url, "outputs", PUBLISHER.key, "--get", "report.csv", "--to", str(tmp_path / "dl")
    )
    assert code == 0 and out.strip() == str(tmp_path / "dl" / "report.csv")
    assert (tmp_path / "dl" / "report.csv").read_text() == "day,rows\n1,10\n2,20\n"
    code, out, _ = cli(
        capsys,
        url,
        "outputs",
        PUBLISHER.key,
        "--seq",
        "1",
        "--get",
        "report.csv",
        "--to",
        str(tmp_path / "v1"),
    )
    assert code == 0 and (tmp_path / "v1" / "report.csv").read_text() == "day,rows\n1,10\n"
    code, out, _ = cli(
        capsys, url, "outputs", PUBLISHER.key, "--get", "model", "--to", str(tmp_path / "dl"), "--json"
    )
    got = json.loads(out)
    assert code == 0 and got["path"] == str(tmp_path / "dl" / "model") and got["files"] == 2
    for rel in ("weights/a.bin", "config.json"):
        assert (tmp_path / "dl" / "model" / rel).read_bytes() == (src / "model" / rel).read_bytes()

    for args, expected_code, says in (
        (["--get", "nope", "--to", str(tmp_path)], 4, "has no output 'nope'; its outputs: model, report.csv"),
        (["--get", "../escape", "--to", str(tmp_path)], 2, "output name '../escape' is not valid"),
        (["--get", "model"], 2, "--get NAME and --to DIR go together"),
        (["--seq", "9"], 4, "9"),
    ):
        code, _, err = cli(capsys, url, "outputs", PUBLISHER.key, *args)
        assert (code, says in err) == (expected_code, True), err
    code, _, err = cli(capsys, url, "outputs", "reports/none/run=r1/map=-1")
    assert code == 4 and "reports/none/run=r1/map=-1" in err
    code, _, err = cli(capsys, url, "outputs", "../escape")
    assert code == 2 and "../escape" in err
    assert not (tmp_path / "escape").exists()
    store.close()


# -- Airflow: the stuck check in the maintenance DAG, and a real stuck task ------------------------------------
@pytest.fixture
def gauges(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """Every gauge the package sends (still sent on to Airflow's Stats)."""
    from airflow_stateful import metrics

    sent: list[tuple[str, float]] = []
    real = metrics.gauge

    def record(name: str, value: float, *, tags: Any = None) -> None:
        sent.append((name, value))
        real(name, value, tags=tags)

    monkeypatch.setattr(metrics, "gauge", record)
    return sent


def task_outcome(run: Any, task_id: str) -> tuple[str, Any]:
    """A task's state and its ``return_value`` XCom (pushed by the stuck check before it fails, too)."""
    from airflow import settings
    from airflow.models.xcom import XComModel

    [ti] = [t for t in run.get_task_instances() if t.task_id == task_id]
    with settings.Session() as session:
        query = XComModel.get_many(
            run_id=run.run_id, dag_ids=run.dag_id, task_ids=task_id, key="return_value"
        )
        return str(ti.state), XComModel.deserialize_value(session.scalars(query).one())


@pytest.mark.airflow
def test_the_maintenance_dags_stuck_check_fails_on_a_stuck_writer_and_passes_on_a_dead_one(
    dags_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    library_log: list[str],
    gauges: list[tuple[str, float]],
) -> None:
    stuck_url, dead_url = (tmp_path / "stuck").as_uri(), (tmp_path / "dead").as_uri()
    seed_fleet(stuck_url).close()
    store = open_store(dead_url)
    seed_dead(store, DEAD, time.time())
    writer(store, IDLE, clock=time.time).close()

    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", stuck_url)
    run = load_dag_module(dags_folder / "stateful_maintenance.py").dag_object.test()
    state, report = task_outcome(run, "stuck_check")
    assert state == "failed" and task_outcome(run, "gc")[0] == "success", "a failed check never holds up GC"
    assert [s["identity"] for s in report["stuck"]] == [STUCK.key]
    assert [d["identity"] for d in report["dead"]] == [DEAD.key]
    [logged] = [m for m in library_log if m.startswith("STUCK ")]
    assert logged.startswith(f"STUCK {STUCK.key}: try 1, run r1 is alive") and "committed nothing" in logged
    assert [g for g in gauges if g[0] == "stateful.stuck_identities"] == [("stateful.stuck_identities", 1)]

    library_log.clear()
    gauges.clear()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", dead_url)
    run = load_dag_module(dags_folder / "stateful_maintenance.py").dag_object.test()
    state, report = task_outcome(run, "stuck_check")
    assert (str(run.state), state) == ("success", "success")
    assert report["stuck"] == [] and [d["identity"] for d in report["dead"]] == [DEAD.key]
    assert report["counts"] == {"active": 0, "stuck": 0, "dead": 1, "idle": 1}
    assert not [m for m in library_log if m.startswith("STUCK ")]
    assert any(m.startswith(f"dead, not stuck: {DEAD.key}") for m in library_log)
    sent = [g for g in gauges if g[0] == "stateful.stuck_identities"]
    assert sent == [("stateful.stuck_identities", 0)], "0 is sent too, so the alert clears"


@pytest.mark.airflow
def test_the_operator_raises_a_fail_exception_naming_the_stuck_identities(
    airflow_home: Path, tmp_path: Path
) -> None:
    from airflow_stateful.compat import AirflowFailException
    from airflow_stateful.operators.stuck import StatefulStuckCheckOperator

    url = (tmp_path / "state").as_uri()
    seed_fleet(url).close()
    pushed: dict[str, Any] = {}

    class TI:
        def xcom_push(self, key: str, value: Any) -> None:
            pushed[key] = value

    op = StatefulStuckCheckOperator(task_id="check", backend_url=url, default_interval="1m")
    with pytest.raises(AirflowFailException) as exc:
        op.execute({"ti": TI()})
    assert "2 stuck identities (alive, renewing the lease, but no checkpoint" in str(exc.value)
    assert STUCK.key in str(exc.value) and QUIET.key in str(exc.value) and DEAD.key not in str(exc.value)
    assert {s["identity"] for s in pushed["return_value"]["stuck"]} == {STUCK.key, QUIET.key}
    report = StatefulStuckCheckOperator(task_id="c2", backend_url=url, fail_on_stuck=False).execute({})
    assert [s["identity"] for s in report["stuck"]] == [STUCK.key], (
        "the default interval (1 h) applies to quiet"
    )


BLOCKED_DAG = """\
import json
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag

from airflow_stateful import TaskState, stateful_task
from airflow_stateful.core import store_from_url
from airflow_stateful.core.fleet.stuck import find_stuck

OUT = Path(__OUT__)
URL = __URL__


@dag(dag_id=__DAG_ID__, schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(expected_checkpoint_interval=timedelta(seconds=1))
    def blocked(state: TaskState):
        state.save({"step": 1})
        committed = time.time()
        time.sleep(3.2)  # "blocked": the heartbeat renews the lease about every second, nothing commits
        report = find_stuck(store_from_url(URL))  # what `airflow-stateful stuck` sees right now
        OUT.write_text(json.dumps({"identity": state.identity.key, "committed": committed, "report": report.to_json()}))

    blocked()


dag_object = the_dag()
"""


@pytest.mark.airflow
def test_a_real_task_that_renews_but_does_not_commit_is_stuck_and_a_dead_one_is_not(
    dags_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    library_log: list[str],
) -> None:
    url = (tmp_path / "state").as_uri()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", url)
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_TTL", "3")  # renewals about every second
    seed_dead(open_store(url), DEAD, time.time())
    dag_id = f"stuck_{uuid.uuid4().hex[:10]}"
    out = tmp_path / "seen.json"
    path = dags_folder / f"{dag_id}.py"
    path.write_text(
        BLOCKED_DAG.replace("__OUT__", repr(str(out)))
        .replace("__URL__", repr(url))
        .replace("__DAG_ID__", repr(dag_id))
    )
    try:
        run = find_dag(load_dag_module(path)).test()
    finally:
        path.unlink()
    assert str(run.state) == "success"
    seen = json.loads(out.read_text())
    report = seen["report"]
    [stuck] = report["stuck"]
    assert stuck["identity"] == seen["identity"] and stuck["status"] == "stuck"
    assert stuck["expected_interval_seconds"] == 1.0 and stuck["since_progress_seconds"] >= 3
    renewed = datetime.fromisoformat(stuck["lease_renewed_at"]).timestamp()
    assert renewed >= seen["committed"] + 0.5, "the heartbeat renewed the lease after the last commit"
    assert [d["identity"] for d in report["dead"]] == [DEAD.key], (
        "the dead writer is reported dead, not stuck"
    )
    assert any(m.startswith("STUCK?") for m in library_log), "the writer's own heartbeat noticed it too"
    # The task ended and released its lease: nothing is stuck any more.
    capsys.readouterr()  # what the run printed
    code, out_text, _ = cli(capsys, url, "stuck", "--json")
    assert code == 0 and json.loads(out_text)["counts"]["idle"] == 1

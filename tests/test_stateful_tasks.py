"""Acceptance tests of stateful tasks under real Airflow: ``dag.test()`` on SQLite, real side effects.

Every test writes its own small DAG file (a unique ``dag_id``) into the session's DAG folder, because
``dag.test()`` only runs DAGs whose file Airflow has parsed from there. Tasks append ``try_number,item,...``
rows to a ledger file (its path is written into the DAG file), so the work each try really did can be
counted; the checkpoints are read back from the configured store with the storage core alone.

DAG files that must fail when they are *defined* are written to a private folder instead: they are never
run, and a file with an import error must not sit in the shared DAG folder that every later ``dag.test()``
of the session parses.
"""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
from dag_helpers import dagbag, find_dag, ledger_by_try, load_dag_module
from s3_endpoint import S3Endpoint

from airflow_stateful.core.records.cursors import cursor_position

if TYPE_CHECKING:
    from airflow_stateful.core import CheckpointStore

pytestmark = pytest.mark.airflow

# -- helpers -------------------------------------------------------------------------------------------------

HEADER = """\
from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, dag, get_current_context, task

from airflow_stateful import (
    FencedError,
    InvalidValueError,
    StatefulPythonOperator,
    TaskState,
    stateful_task,
)

LEDGER = Path(__LEDGER__)


def record(*fields):
    with open(LEDGER, "a") as ledger:
        ledger.write(",".join(str(f) for f in fields) + "\\n")


def current_ti():
    return get_current_context()["ti"]

"""


@dataclass
class DagFile:
    path: Path
    dag_id: str
    ledger: Path

    def rows(self) -> list[list[int]]:
        """Every ledger row as a list of ints (``try_number, item, ...``)."""
        if not self.ledger.exists():
            return []
        return [[int(x) for x in row.split(",")] for row in self.ledger.read_text().split()]


def dag_source(body: str, *, dag_id: str, ledger: Path) -> str:
    source = HEADER + textwrap.dedent(body)
    return source.replace("__LEDGER__", repr(str(ledger))).replace("__DAG_ID__", dag_id)


def write_dag(folder: Path, tmp_path: Path, body: str, *, dag_id: str | None = None) -> DagFile:
    """Write a DAG file (``__DAG_ID__`` and the ledger path filled in) into ``folder``."""
    dag_id = dag_id or f"st_{uuid.uuid4().hex[:10]}"
    ledger = tmp_path / f"{dag_id}.ledger"
    path = folder / f"{dag_id}.py"
    path.write_text(dag_source(body, dag_id=dag_id, ledger=ledger))
    return DagFile(path=path, dag_id=dag_id, ledger=ledger)


def run_dag(dag_file: DagFile) -> tuple[ModuleType, Any]:
    """Import the DAG file fresh and run it once with ``dag.test()``; the module and the DagRun."""
    module = load_dag_module(dag_file.path)
    dag = find_dag(module)
    assert dag.dag_id == dag_file.dag_id
    return module, dag.test()


def checkpoints(
    dag_id: str,
    task_id: str,
    *,
    run_id: str | None = None,
    name: str | None = None,
    map_index: int = -1,
    **options: Any,
) -> CheckpointStore:
    """The checkpoint store of one task's identity, opened from ``[stateful] backend_url`` as configured."""
    from airflow_stateful.core import CheckpointStore, Identity, store_from_url

    identity = Identity.for_task(
        dag_id=dag_id, task_id=task_id, map_index=map_index, run_id=run_id, name=name
    )
    store = store_from_url(os.environ["AIRFLOW__STATEFUL__BACKEND_URL"], **options)
    return CheckpointStore(store=store, identity=identity)


def manifest_keys(cs: CheckpointStore) -> list[str]:
    """Every manifest object stored for the identity (committed or not)."""
    return sorted(info.key for info in cs.store.list_objects(f"{cs.identity.key}/~manifests/"))


@pytest.fixture(scope="module", autouse=True)
def _airflow_imported_outside_capfd(airflow_home: Path) -> None:
    """Airflow binds its stdlib log handler to ``sys.stdout`` when first imported; if that happened inside a
    test using ``capfd``, the handler would write to a stream closed after that test. Import it here."""
    import airflow  # noqa: F401


def task_instance(run: Any, task_id: str, map_index: int = -1) -> Any:
    [ti] = [t for t in run.get_task_instances() if t.task_id == task_id and t.map_index == map_index]
    return ti


# -- 1. a failed try resumes from its last checkpoint ------------------------------------------------------

CRUNCH = """\
def crunch(state: TaskState):
    ti = current_ti()
    state.value = state.value or {"total": 0, "count": 0}
    for item in state.resume(range(100)):
        if ti.try_number == 1 and item == 37:
            raise RuntimeError(f"simulated crash at item {item} on try {ti.try_number}")
        record(ti.try_number, item)
        state.value = {"total": state.value["total"] + item * item, "count": state.value["count"] + 1}
    return state.value
"""

RESUME_FORMS = {
    "stateful_task": """
        @dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
        def the_dag():
            @stateful_task(task_id="crunch", retries=1, retry_delay=timedelta(0), checkpoint_every=10)
            __CRUNCH__

            crunch()


        dag_object = the_dag()
        """,
    "task.stateful": """
        @dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
        def the_dag():
            @task.stateful(task_id="crunch", retries=1, retry_delay=timedelta(0), checkpoint_every=10)
            __CRUNCH__

            crunch()


        dag_object = the_dag()
        """,
    "StatefulPythonOperator": """
        __CRUNCH__

        with DAG(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag_object:
            StatefulPythonOperator(
                task_id="crunch", python_callable=crunch, retries=1, retry_delay=timedelta(0), checkpoint_every=10
            )
        """,
}


def resume_dag_body(form: str) -> str:
    template = textwrap.dedent(RESUME_FORMS[form])
    indent = "    " if form != "StatefulPythonOperator" else ""
    crunch = textwrap.indent(CRUNCH, indent).lstrip()
    return template.replace("__CRUNCH__", crunch)


def assert_resumed_from_checkpoint_30(dag_file: DagFile, run: Any, **store_options: Any) -> None:
    assert run.state == "success"
    tries = ledger_by_try(dag_file.ledger)
    assert tries[1] == list(range(0, 37)), "try 1 handles items 0..36 and dies at item 37"
    assert tries[2] == list(range(30, 100)), "try 2 resumes from the checkpoint after item 29, not from 0"
    assert sorted(tries) == [1, 2]
    ti = task_instance(run, "crunch")
    assert ti.state == "success" and ti.try_number == 2

    cs = checkpoints(dag_file.dag_id, "crunch", run_id=run.run_id, **store_options)
    latest = cs.latest()
    assert latest is not None
    # Items 30..36 were handled twice but counted once: try 2 started from the value checkpointed at 30.
    assert latest.value == {"total": sum(i * i for i in range(100)), "count": 100}
    assert cursor_position(latest, "items") == 100
    assert latest.writer.try_number == 2
    assert latest.writer.run_id == run.run_id and latest.writer.dag_version_id
    assert latest.value_codec == "json" and latest.schema_version == 1


@pytest.mark.parametrize("form", list(RESUME_FORMS))
def test_retry_resumes_from_the_last_checkpoint(
    form: str,
    dags_folder: Path,
    tmp_path: Path,
    library_log: list[str],
    capfd: pytest.CaptureFixture[str],
) -> None:
    dag_file = write_dag(dags_folder, tmp_path, resume_dag_body(form))
    _, run = run_dag(dag_file)
    assert_resumed_from_checkpoint_30(dag_file, run)
    assert "simulated crash at item 37 on try 1" in "".join(capfd.readouterr())
    assert any(m.startswith("resuming from checkpoint 3 (written by try 1, ") for m in library_log)
    assert "skipping 30 finished items (cursor 'items')" in library_log


def test_task_stateful_is_registered_through_the_provider() -> None:
    from airflow.sdk import task

    from airflow_stateful import stateful_task

    try:  # Airflow 3.3: the Task SDK's own provider registry
        from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime as Providers
    except ImportError:  # 3.1 and 3.2
        from airflow.providers_manager import ProvidersManager as Providers

    assert task.stateful is stateful_task
    assert Providers().taskflow_decorators["stateful"] is stateful_task


# -- 2. mapped tasks resume independently ---------------------------------------------------------------------

MAPPED = """\
FAIL_AT = {0: 6, 1: 13, 2: 23}


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0), checkpoint_every=4)
    def shard_work(shard: int, state: TaskState):
        ti = current_ti()
        state.value = state.value or {"shard": shard, "total": 0}
        for item in state.resume(range(30)):
            if ti.try_number == 1 and item == FAIL_AT[shard]:
                raise RuntimeError(f"shard {shard} crashed at item {item}")
            record(ti.try_number, item, ti.map_index, shard)
            state.value = {"shard": shard, "total": state.value["total"] + 1000 * shard + item}
        return state.value

    shard_work.expand(shard=[0, 1, 2])


dag_object = the_dag()
"""


def test_mapped_task_instances_resume_independently(dags_folder: Path, tmp_path: Path) -> None:
    dag_file = write_dag(dags_folder, tmp_path, MAPPED)
    _, run = run_dag(dag_file)
    assert run.state == "success"
    rows = dag_file.rows()
    # Fails at 6, 13, 23 on try 1; checkpoints every 4 items: resumes at 4, 12, 20 on try 2.
    for shard, fail_at, resume_at in [(0, 6, 4), (1, 13, 12), (2, 23, 20)]:
        mine = [r for r in rows if r[2] == shard]
        assert all(r[3] == shard for r in mine), "map index i got shard i"
        assert [r[1] for r in mine if r[0] == 1] == list(range(0, fail_at))
        assert [r[1] for r in mine if r[0] == 2] == list(range(resume_at, 30))
        assert {r[0] for r in mine} == {1, 2}
        ti = task_instance(run, "shard_work", shard)
        assert ti.state == "success" and ti.try_number == 2

        cs = checkpoints(dag_file.dag_id, "shard_work", run_id=run.run_id, map_index=shard)
        assert cs.identity.key.endswith(f"/map={shard}")
        latest = cs.latest()
        assert latest is not None
        assert latest.value == {"shard": shard, "total": sum(1000 * shard + i for i in range(30))}
        assert latest.writer.map_index == shard and latest.writer.try_number == 2
        assert cursor_position(latest, "items") == 30
    # One identity per map index, and none for the unmapped task.
    unmapped = checkpoints(dag_file.dag_id, "shard_work", run_id=run.run_id, map_index=-1)
    assert unmapped.head() is None
    task_root = unmapped.identity.key.rsplit("/", 1)[0]
    stored = {info.key.split("/")[3] for info in unmapped.store.list_objects(f"{task_root}/")}
    assert stored == {"map=0", "map=1", "map=2"}


# -- 3. a zombie try is fenced ----------------------------------------------------------------------------------

ZOMBIE = """\
# The zombie: try 1's TaskState, kept alive after try 1 "ended" (dag.test() runs every try in this process).
ZOMBIE = {}


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0))
    def work(state: TaskState):
        ti = current_ti()
        if ti.try_number == 1:
            ZOMBIE["state"] = state
            state.save({"owner": "try-1", "step": 1})
            record(1, 1)
            raise RuntimeError("try 1 lost its heartbeat (but its code keeps running)")
        # Try 2 holds the lease now; the zombie wakes up and tries to commit.
        try:
            ZOMBIE["state"].save({"owner": "zombie", "step": 99})
        except FencedError as exc:
            ZOMBIE["error"] = exc
        else:
            ZOMBIE["error"] = None
        record(2, state.value["step"])
        state.save({"owner": "try-2", "step": state.value["step"] + 1})
        return state.value

    work()


dag_object = the_dag()
"""


def test_zombie_try_is_fenced(dags_folder: Path, tmp_path: Path) -> None:
    """A zombie try (still running after Airflow gave up on it) cannot commit once the retry has started.

    The zombie is simulated in-process: ``dag.test()`` runs every try in this one process, one after the
    other, so try 1's code stashes its TaskState in a module-level dict and try 2 makes it call ``save()``
    after try 2 took the lease, exactly what a zombie process would do at its next checkpoint.
    """
    from airflow_stateful import FencedError

    dag_file = write_dag(dags_folder, tmp_path, ZOMBIE)
    module, run = run_dag(dag_file)
    assert run.state == "success"
    assert ledger_by_try(dag_file.ledger) == {1: [1], 2: [1]}, "try 2 resumed from try 1's checkpoint"

    error = module.ZOMBIE["error"]
    assert isinstance(error, FencedError), "the zombie's save must be refused"
    message = str(error)
    # The zombie holds epoch 1; try 2 took the lease at epoch 2. The message must say both, truthfully.
    assert "this writer holds epoch 1" in message
    assert "the identity is at epoch 2" in message

    cs = checkpoints(dag_file.dag_id, "work", run_id=run.run_id)
    latest = cs.latest()
    assert latest is not None
    assert latest.value == {"owner": "try-2", "step": 2}
    assert latest.writer.try_number == 2 and latest.epoch == 2
    history = cs.history()
    assert [e.seq for e in history] == [2, 1], "exactly one commit per try: nothing of the zombie's"
    assert [e.epoch for e in history] == [2, 1]
    values = [cs.get(e.seq).value for e in history]
    assert {"owner": "zombie", "step": 99} not in values
    assert all(v["owner"] != "zombie" for v in values)


# -- 4. SIGTERM drains the try, which is rescheduled without using a retry ----------------------------------

DRAIN = """\
import time


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=0, reschedule_delay=timedelta(seconds=1), checkpoint_every=50)
    def slow(state: TaskState):
        context = get_current_context()
        ti = context["ti"]
        state.value = state.value or {"total": 0, "count": 0}
        for item in state.resume(range(200)):
            time.sleep(0.02)
            record(ti.try_number, item, context["task_reschedule_count"])
            state.value = {"total": state.value["total"] + item, "count": state.value["count"] + 1}
        return state.value

    slow()


dag_object = the_dag()
"""


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    """Airflow's task runner installs its own SIGTERM handler in this process: put ours back afterwards."""
    saved = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_sigterm_drains_and_reschedules_without_using_a_retry(
    dags_folder: Path, tmp_path: Path, restore_sigterm: None, library_log: list[str]
) -> None:
    """SIGTERM -> on_kill -> the next resume step commits and the try ends by rescheduling.

    Under dag.test() the task runs in this process's main thread with Airflow's ``_on_term`` handler
    installed, so a SIGTERM sent to ourselves from another thread is what a worker's shutdown would send.
    """
    dag_file = write_dag(dags_folder, tmp_path, DRAIN)
    sent = threading.Event()
    done = threading.Event()

    def send_sigterm_after_60_items() -> None:
        while not done.is_set():
            if len(dag_file.rows()) >= 60:
                os.kill(os.getpid(), signal.SIGTERM)
                sent.set()
                return
            done.wait(0.005)

    killer = threading.Thread(target=send_sigterm_after_60_items, daemon=True)
    killer.start()
    try:
        _, run = run_dag(dag_file)
    finally:
        done.set()
        killer.join()
    assert sent.is_set(), "the task finished before the SIGTERM was sent"

    assert run.state == "success"
    ti = task_instance(run, "slow")
    assert ti.state == "success"
    assert ti.try_number == 1, "a drain does not use a retry (and retries=0 would have failed the task)"

    rows = dag_file.rows()
    assert {r[0] for r in rows} == {1}, "both executions are try 1"
    first = [r[1] for r in rows if r[2] == 0]
    second = [r[1] for r in rows if r[2] == 1]
    assert [r[2] for r in rows] == [0] * len(first) + [1] * len(second), "exactly one reschedule"
    stopped_after = len(first)
    assert 60 <= stopped_after < 200 and second, "the SIGTERM ended the first execution early"
    # on_kill only sets a flag: the item in flight finishes, then the next resume step commits the cursor
    # right after it and ends the try. So the second execution starts at the very next item: no item is
    # handled twice, none is skipped, and it did not fall back to the checkpoint after item 49.
    assert first == list(range(0, stopped_after))
    assert second == list(range(stopped_after, 200))

    cs = checkpoints(dag_file.dag_id, "slow", run_id=run.run_id)
    latest = cs.latest()
    assert latest is not None
    assert latest.value == {"total": sum(range(200)), "count": 200}
    assert latest.writer.try_number == 1
    assert "stop requested: the next checkpoint ends this try" in library_log
    [stop] = [m for m in library_log if "rescheduling at" in m]
    assert stop.startswith(f"stop requested after {stopped_after} items; progress saved in checkpoint ")
    assert stop.endswith("(this does not use a retry)")
    assert f"skipping {stopped_after} finished items (cursor 'items')" in library_log


# -- 5. bad input fails before anything is written, naming it ------------------------------------------------

NOT_JSON = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=0)
    def work(state: TaskState):
        state.save({"seen": [1, 2]})
        record(current_ti().try_number, 1)
        state.save({"seen": {1, 2, 3}})
        record(current_ti().try_number, 2)

    work()


dag_object = the_dag()
"""


def test_non_json_value_fails_the_task_before_anything_is_written(
    dags_folder: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dag_file = write_dag(dags_folder, tmp_path, NOT_JSON)
    _, run = run_dag(dag_file)
    assert run.state == "failed"
    assert dag_file.rows() == [[1, 1]], "the bad save raised: the code after it never ran"
    log = "".join(capfd.readouterr())
    assert "InvalidValueError" in log
    assert "checkpoint value is not JSON-serializable" in log
    assert "Object of type set is not JSON serializable" in log

    cs = checkpoints(dag_file.dag_id, "work", run_id=run.run_id)
    assert [e.seq for e in cs.history()] == [1]
    latest = cs.latest()
    assert latest is not None and latest.value == {"seen": [1, 2]}
    assert manifest_keys(cs) == [], "small checkpoints ride inline, and the refused value wrote nothing"
    assert [i.key for i in cs.store.list_objects(f"{cs.identity.key}/")] == [cs.heads.key]


DEFINITION_ERRORS = {
    "identity": (
        '@stateful_task(identity="bad name!")',
        "IdentityError",
        "identity name 'bad name!' is not valid",
    ),
    "schema_version": (
        "@stateful_task(schema_version=0)",
        "InvalidValueError",
        "schema_version must be an integer >= 1, not 0",
    ),
}


@pytest.mark.parametrize("case", list(DEFINITION_ERRORS))
def test_bad_arguments_fail_when_the_dag_is_defined(case: str, tmp_path: Path) -> None:
    decorator, error_name, expected = DEFINITION_ERRORS[case]
    body = f"""\
        @dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
        def the_dag():
            {decorator}
            def work(state: TaskState):
                record(current_ti().try_number, 1)

            work()


        dag_object = the_dag()
        """
    folder = tmp_path / "broken_dags"
    folder.mkdir()
    dag_file = write_dag(folder, tmp_path, body)
    with pytest.raises(Exception) as raised:
        load_dag_module(dag_file.path)
    assert type(raised.value).__name__ == error_name
    assert expected in str(raised.value)
    # What the DAG processor shows for the file: an import error naming the value.
    bag = dagbag(folder)
    assert dag_file.dag_id not in bag.dag_ids
    [message] = bag.import_errors.values()
    assert expected in message
    assert not dag_file.ledger.exists()


MIGRATION_V1 = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=0, identity="__NAME__", schema_version=1)
    def work(state: TaskState):
        record(current_ti().try_number, 1)
        state.save({"count": 5})
        raise RuntimeError("version 1 stops after its first checkpoint")

    work()


dag_object = the_dag()
"""

MIGRATION_V2 = """\
def forget(value):
    value["total"] = value.pop("count")  # forgets to return it


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=0, identity="__NAME__", schema_version=2, migrations={1: forget})
    def work(state: TaskState):
        record(current_ti().try_number, 2)
        state.save({"total": state.value["total"] + 1})

    work()


dag_object = the_dag()
"""


def test_migration_returning_none_fails_and_keeps_the_checkpoint(
    dags_folder: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    name = f"migr-{uuid.uuid4().hex[:8]}"
    v1 = write_dag(dags_folder, tmp_path, MIGRATION_V1.replace("__NAME__", name))
    _, run1 = run_dag(v1)
    assert run1.state == "failed"
    cs = checkpoints(v1.dag_id, "work", name=name)
    seeded = cs.latest()
    assert seeded is not None and seeded.value == {"count": 5} and seeded.schema_version == 1
    capfd.readouterr()

    # Deploy version 2 of the same file (same dag_id, task and identity name), whose migration is broken.
    v2 = write_dag(dags_folder, tmp_path, MIGRATION_V2.replace("__NAME__", name), dag_id=v1.dag_id)
    _, run2 = run_dag(v2)
    assert run2.state == "failed"
    assert ledger_by_try(v1.ledger) == {1: [1]}, "version 2's code never ran"
    log = "".join(capfd.readouterr())
    assert "MigrationError" in log
    assert "migration 1 -> 2 (forget) returned None" in log

    latest = cs.latest()
    assert latest is not None
    assert (latest.seq, latest.value, latest.schema_version) == (seeded.seq, {"count": 5}, 1)
    assert [e.seq for e in cs.history()] == [seeded.seq]
    assert manifest_keys(cs) == [], "the checkpoint rides inline; the failed migration wrote nothing"
    head = cs.head()
    assert head is not None and head.lease is None, "the failed try released its lease"


PICKLE_WRITER = """\
import fractions


EXPECTED = {"seen": {1, 2, 3}, "ratio": fractions.Fraction(1, 3), "raw": b"\\x00\\xff", "at": datetime(2026, 1, 2)}


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(task_id="work", retries=1, retry_delay=timedelta(0), identity="__NAME__", value_codec="pickle")
    def work(state: TaskState):
        ti = current_ti()
        if ti.try_number == 1:
            state.save(dict(EXPECTED))
            record(1, 0)
            raise RuntimeError("try 1 dies after saving a non-JSON value")
        record(2, int(state.value == EXPECTED and type(state.value["ratio"]) is fractions.Fraction))
        state.save({**state.value, "seen": state.value["seen"] | {4}})

    work()


dag_object = the_dag()
"""

PICKLE_READER = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(task_id="work", retries=0, identity="__NAME__")
    def work(state: TaskState):
        record(current_ti().try_number, 9)
        state.save({"read": str(state.value)})

    work()


dag_object = the_dag()
"""


def test_pickle_codec_round_trips_and_json_readers_refuse_it(
    dags_folder: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import datetime
    import fractions

    name = f"pickled-{uuid.uuid4().hex[:8]}"
    writer = write_dag(dags_folder, tmp_path, PICKLE_WRITER.replace("__NAME__", name))
    _, run = run_dag(writer)
    assert run.state == "success"
    assert ledger_by_try(writer.ledger) == {1: [0], 2: [1]}, "try 2 got back exactly what try 1 saved"

    # The manifest holds the value pickled (base64), marked as such; readers that opt in get it back.
    cs = checkpoints(writer.dag_id, "work", name=name)
    latest = cs.latest()
    assert latest is not None and latest.value_codec == "pickle" and isinstance(latest.value, str)
    from airflow_stateful.core.records.codecs import decode_value

    value = decode_value(latest.value, latest.value_codec, allowed="pickle", where="test")
    assert value == {
        "seen": {1, 2, 3, 4},
        "ratio": fractions.Fraction(1, 3),
        "raw": b"\x00\xff",
        "at": datetime.datetime(2026, 1, 2),
    }
    capfd.readouterr()

    # The same task, redeployed with the default (JSON) codec, refuses to unpickle what it finds.
    reader = write_dag(dags_folder, tmp_path, PICKLE_READER.replace("__NAME__", name), dag_id=writer.dag_id)
    _, run2 = run_dag(reader)
    assert run2.state == "failed"
    assert ledger_by_try(writer.ledger) == {1: [0], 2: [1]}, "the reader's code never ran"
    log = "".join(capfd.readouterr())
    assert "InvalidValueError" in log
    assert f"checkpoint {latest.seq} holds a pickled value" in log
    assert "Set value_codec='pickle' on the reading task" in log
    after = cs.latest()
    assert after is not None and (after.seq, after.value) == (latest.seq, latest.value)


# -- 6. the same resume, on S3 through an Airflow connection --------------------------------------------------


@pytest.mark.s3
def test_retry_resumes_from_the_last_checkpoint_on_s3(
    dags_folder: Path,
    tmp_path: Path,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    s3_backend: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    dag_file = write_dag(dags_folder, tmp_path, resume_dag_body("stateful_task"))
    _, run = run_dag(dag_file)
    assert_resumed_from_checkpoint_30(dag_file, run, **s3_endpoint.options())
    # The checkpoints really are in the bucket, under the configured prefix, and not on the local disk.
    from airflow_stateful.core import Identity

    identity = Identity.for_task(dag_id=dag_file.dag_id, task_id="crunch", run_id=run.run_id)
    listed = s3_endpoint.client().list_objects_v2(
        Bucket=s3_endpoint.bucket, Prefix=f"{s3_prefix}/{identity.key}/"
    )
    keys = [o["Key"] for o in listed.get("Contents", [])]
    assert keys == [f"{s3_prefix}/{identity.key}/~head.json"], "small checkpoints ride inline in the head"
    local_root = Path(os.environ["AIRFLOW_HOME"]) / "stateful" / dag_file.dag_id
    assert not local_root.exists()
    out, err = capfd.readouterr()
    assert s3_backend not in out + err, "the connection's secret key leaked into the task log"


# -- on_incompatible="restart" and on_success="delete" ------------------------------------------------------

LIFECYCLE = """
    @dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
    def the_dag():
        @stateful_task(task_id="job", identity="shared", schema_version=__SCHEMA__, __OPTIONS__)
        def job(state: TaskState):
            record(current_ti().try_number, 1 if state.resumed else 0, __SCHEMA__)
            state.save({"schema": __SCHEMA__, "seen": (state.value or {}).get("seen", 0) + 1})
            return state.value

        job()


    dag_object = the_dag()
    """


def lifecycle_dag(dags_folder: Path, tmp_path: Path, dag_id: str, schema: int, options: str) -> DagFile:
    body = LIFECYCLE.replace("__SCHEMA__", str(schema)).replace("__OPTIONS__", options)
    return write_dag(dags_folder, tmp_path, body, dag_id=dag_id)


def test_on_incompatible_restart_starts_fresh_and_keeps_the_old_checkpoint(
    dags_folder: Path, tmp_path: Path
) -> None:
    dag_id = f"st_{uuid.uuid4().hex[:10]}"
    newer = lifecycle_dag(dags_folder, tmp_path, dag_id, 3, "keep_last=5")
    _, run = run_dag(newer)
    assert run.state == "success"
    # The DAG is rolled back to code that knows only schema 1 and has no way to read schema 3.
    older = lifecycle_dag(dags_folder, tmp_path, dag_id, 1, "on_incompatible='restart', keep_last=5")
    _, run = run_dag(older)
    assert run.state == "success"
    assert older.rows()[-1] == [1, 0, 1], "the schema-1 code started fresh (state.resumed is False)"
    cs = checkpoints(dag_id, "job", name="shared")
    latest = cs.latest()
    assert latest is not None and latest.value == {"schema": 1, "seen": 1} and latest.schema_version == 1
    old = [cs.get(e.seq) for e in cs.history() if e.schema_version == 3]
    assert [m.value for m in old] == [{"schema": 3, "seen": 1}], "the newer checkpoint stays in history"


def test_on_success_delete_removes_the_state_after_success(dags_folder: Path, tmp_path: Path) -> None:
    dag_file = lifecycle_dag(dags_folder, tmp_path, f"st_{uuid.uuid4().hex[:10]}", 1, "on_success='delete'")
    _, run = run_dag(dag_file)
    assert run.state == "success"
    assert dag_file.rows() == [[1, 0, 1]]
    cs = checkpoints(dag_file.dag_id, "job", name="shared")
    assert cs.latest() is None
    assert list(cs.store.list_objects(f"{cs.identity.key}/")) == [], "no object of the identity is left"

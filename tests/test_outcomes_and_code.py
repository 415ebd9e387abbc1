"""What a stateful try records about itself under real Airflow (``dag.test()``): its outcome, the code that ran,
and what happens when the code behind a checkpoint changes or a deploy is rolled back and forward.

The DAG files are written into the session's DAG folder and replaced by other versions of the same ``dag_id``,
as a deployment replaces them. State that must span those runs uses a named identity (a per-run identity's
rollback with real retries is tests/test_e2e_lifetimes.py, on a real scheduler).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from test_cli import cli
from test_stateful_tasks import DagFile, checkpoints, run_dag, task_instance, write_dag

from airflow_stateful.core.records.formats import PINS_FORMAT
from airflow_stateful.version import __version__

pytestmark = pytest.mark.airflow


def new_dag_id() -> str:
    return f"oc_{uuid.uuid4().hex[:10]}"


OUTCOME = """
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    @dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
    def the_dag():
        @stateful_task(task_id="job", retries=__RETRIES__, retry_delay=timedelta(0))
        def job(state: TaskState):
            ti = current_ti()
            record(ti.try_number, 0)
            state.save({"try": ti.try_number})
            __END__

        job()


    dag_object = the_dag()
    """


@pytest.mark.parametrize(
    ("retries", "end", "run_state", "outcome", "tries"),
    [
        (0, "return 1", "success", "success", 1),
        (0, "raise RuntimeError('boom')", "failed", "failed", 1),
        (2, "raise AirflowFailException('no point retrying')", "failed", "failed", 1),
        (1, "raise AirflowSkipException('nothing to do')", "success", "skipped", 1),
        (1, "if ti.try_number == 1:\n                raise RuntimeError('once')", "success", "success", 2),
    ],
    ids=["success", "failed-no-retries", "fail-exception", "skipped", "retried-then-success"],
)
def test_each_try_records_how_it_ended_in_the_head(
    dags_folder: Path, tmp_path: Path, retries: int, end: str, run_state: str, outcome: str, tries: int
) -> None:
    body = OUTCOME.replace("__RETRIES__", str(retries)).replace("__END__", end)
    dag_file = write_dag(dags_folder, tmp_path, body, dag_id=new_dag_id())
    _, run = run_dag(dag_file)
    assert run.state == run_state
    head = checkpoints(dag_file.dag_id, "job", run_id=run.run_id).head()
    assert head is not None and head.lease is None and head.outcome is not None
    assert (head.outcome.state, head.outcome.try_number) == (outcome, tries), head.outcome
    assert head.outcome.run_id == run.run_id
    ti = task_instance(run, "job")
    assert ti.max_tries == head.outcome.max_tries == retries
    if outcome == "failed":
        assert head.outcome.reason in ("RuntimeError", "AirflowFailException")


def test_a_checkpoint_records_the_code_that_wrote_it(dags_folder: Path, tmp_path: Path) -> None:
    body = OUTCOME.replace("__RETRIES__", "0").replace("__END__", "return state.checkpoint.code.to_json()")
    dag_file = write_dag(dags_folder, tmp_path, body, dag_id=new_dag_id())
    _, run = run_dag(dag_file)
    assert run.state == "success"
    latest = checkpoints(dag_file.dag_id, "job", run_id=run.run_id).latest()
    assert latest is not None and latest.code is not None
    code = latest.code
    assert code.fingerprint and len(code.fingerprint) == 16
    # dag.test() runs the task in-process without loading a DAG bundle, so no bundle name is known here; a real
    # worker's try records "dags-folder" (tests/test_e2e_lifetimes.py) or a Git bundle and its commit.
    assert code.bundle_version is None, "the DAG folder is unversioned"
    assert code.provider_version == __version__
    ti = task_instance(run, "job")
    assert code.dag_version_id == str(ti.dag_version_id)
    assert ti.xcom_pull(task_ids="job") == code.to_json(), "state.checkpoint.code shows the task the same"


CODE = """
    @dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
    def the_dag():
        @stateful_task(task_id="job", identity="__NAME__", retries=2, retry_delay=timedelta(0), __OPTIONS__)
        def job(state: TaskState):
            record(current_ti().try_number, 1 if state.resumed else 0, __VARIANT__)
            state.save({"variant": __VARIANT__, "runs": (state.value or {}).get("runs", 0) + 1})

        job()


    dag_object = the_dag()
    """


def code_dag(
    dags_folder: Path, tmp_path: Path, dag_id: str, name: str, variant: int, options: str = ""
) -> DagFile:
    """Version ``variant`` of the task's code (another literal in its body), same dag_id, same file."""
    body = CODE.replace("__NAME__", name).replace("__VARIANT__", str(variant)).replace("__OPTIONS__", options)
    return write_dag(dags_folder, tmp_path, body, dag_id=dag_id)


def test_resuming_a_checkpoint_of_other_code_says_what_changed_and_obeys_on_code_change(
    dags_folder: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], library_log: list[str]
) -> None:
    dag_id, name = new_dag_id(), f"code-{uuid.uuid4().hex[:6]}"
    assert run_dag(code_dag(dags_folder, tmp_path, dag_id, name, 1))[1].state == "success"
    cs = checkpoints(dag_id, "job", name=name)
    before = cs.latest()
    assert before is not None and before.code is not None
    capfd.readouterr()

    # The task's code changed (another literal in its body), the schema did not: resumed, one line says so.
    _, run = run_dag(code_dag(dags_folder, tmp_path, dag_id, name, 2))
    assert run.state == "success"
    log = "\n".join(library_log)
    after = cs.latest()
    assert after is not None and after.value == {"variant": 2, "runs": 2}, "resumed (runs counted on)"
    assert after.code is not None and after.code.fingerprint != before.code.fingerprint
    line = f"task code {before.code.fingerprint} -> {after.code.fingerprint}"
    assert log.count(line) == 1 and "resuming from it" in log, log[-3000:]

    # on_code_change="fail": the task fails without a retry (retries=2), the checkpoint untouched.
    _, run = run_dag(code_dag(dags_folder, tmp_path, dag_id, name, 3, "on_code_change='fail'"))
    assert run.state == "failed"
    assert task_instance(run, "job").try_number == 1, "no retry: another try of this code fails the same way"
    assert f"cannot resume: checkpoint {after.seq}" in "".join(capfd.readouterr())
    unchanged = cs.latest()
    assert unchanged is not None and (unchanged.seq, unchanged.value) == (after.seq, after.value)
    head = cs.head()
    assert head is not None and head.outcome is not None and head.outcome.state == "failed"

    # on_code_change="restart": starts fresh; the checkpoint of the other code stays in history.
    _, run = run_dag(code_dag(dags_folder, tmp_path, dag_id, name, 4, "on_code_change='restart'"))
    assert run.state == "success"
    fresh = cs.latest()
    assert fresh is not None and fresh.value == {"variant": 4, "runs": 1}, "started fresh"
    assert after.seq in [e.seq for e in cs.history()]


ROLLBACK = """
    @dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
    def the_dag():
        @stateful_task(
            task_id="job",
            identity="__NAME__",
            schema_version=__SCHEMA__,
            migrations=__MIGRATIONS__,
            on_incompatible="restart",
            keep_last=3,
        )
        def job(state: TaskState):
            value = state.value or {"schema": __SCHEMA__, "done": 0}
            record(current_ti().try_number, value["done"], __SCHEMA__)
            for _ in range(__SAVES__):
                value = {**value, "schema": __SCHEMA__, "done": value["done"] + 1}
                state.save(value)
            return value

        job()


    dag_object = the_dag()
    """


def rollback_dag(
    dags_folder: Path,
    tmp_path: Path,
    dag_id: str,
    name: str,
    schema: int,
    saves: int,
    migrations: str = "None",
) -> DagFile:
    body = (
        ROLLBACK.replace("__NAME__", name)
        .replace("__SCHEMA__", str(schema))
        .replace("__SAVES__", str(saves))
        .replace("__MIGRATIONS__", migrations)
    )
    return write_dag(dags_folder, tmp_path, body, dag_id=dag_id)


def test_a_deploy_rollback_pins_the_newer_state_and_the_rollforward_resumes_from_it(
    dags_folder: Path, tmp_path: Path, library_log: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    dag_id, name = new_dag_id(), f"roll-{uuid.uuid4().hex[:6]}"
    # 1. schema-2 code: 7 items done.
    v2 = rollback_dag(dags_folder, tmp_path, dag_id, name, 2, 7)
    assert run_dag(v2)[1].state == "success"
    cs = checkpoints(dag_id, "job", name=name)
    newer = cs.latest()
    assert newer is not None and newer.value == {"schema": 2, "done": 7}

    # 2. Rolled back to schema-1 code: it cannot read schema 2, restarts fresh and commits five times: more than
    #    keep_last=3, which without the pin would have evicted the schema-2 checkpoint.
    assert run_dag(rollback_dag(dags_folder, tmp_path, dag_id, name, 1, 5))[1].state == "success"
    head = cs.head()
    assert head is not None
    pinned = [e for e in head.checkpoints if e.pinned is not None]
    assert [e.seq for e in pinned] == [newer.seq], "the schema-2 checkpoint is pinned"
    assert "schema 2 cannot be read by schema-1 code" in pinned[0].pinned.reason  # type: ignore[union-attr]
    assert len([e for e in head.checkpoints if e.pinned is None]) == 3, "keep_last still applies to the rest"
    assert head.format == PINS_FORMAT, (
        "releases that do not know pins refuse the head instead of dropping them"
    )
    older = cs.latest()
    assert older is not None and older.value == {"schema": 1, "done": 5}
    # The pin is shown where people look: show, history (and ls --json).
    backend = cs.store.url
    code, out, _ = cli(capsys, backend, "show", cs.identity.key)
    assert code == 0 and f"pinned:    checkpoint {newer.seq} (schema 2): schema 2 cannot be read" in out, out
    assert "outcome:   success (try 1" in out, out
    code, out, _ = cli(capsys, backend, "history", cs.identity.key, "--json")
    marks = {r["seq"]: r["pinned"] for r in json.loads(out)}
    assert marks[newer.seq] == "pinned" and [s for s, m in marks.items() if m] == [newer.seq], marks
    code, out, _ = cli(capsys, backend, "ls", "--json")
    assert {r["identity"]: r["pinned"] for r in json.loads(out)}[cs.identity.key] == [newer.seq]
    library_log.clear()

    # 3. schema-2 code deployed again (with a 1 -> 2 migration it could apply to the older code's state): it
    #    resumes from the pinned checkpoint, not from the migrated fresh start, and the pin is released.
    migrations = '{1: lambda v: {**v, "migrated": True}}'
    _, run = run_dag(rollback_dag(dags_folder, tmp_path, dag_id, name, 2, 1, migrations))
    assert run.state == "success"
    assert v2.rows()[-1] == [1, 7, 2], "resumed at 7 items done, the schema-2 progress"
    final = cs.latest()
    assert final is not None and final.value == {"schema": 2, "done": 8}
    head = cs.head()
    assert head is not None and not [e for e in head.checkpoints if e.pinned], "the pin is released"
    assert older.seq in [e.seq for e in head.checkpoints], "the older code's checkpoints stay in history"
    copy = cs.get(final.seq - 1)  # what the rollforward committed before its code ran: the pinned state
    lineage = copy.copy_of
    assert lineage is not None and (lineage.seq, lineage.commit_id) == (newer.seq, newer.commit_id)
    code, out, _ = cli(capsys, backend, "history", cs.identity.key)
    assert code == 0 and f"copy of seq {newer.seq}" in out, out
    log = "\n".join(library_log)
    assert f"resuming from pinned checkpoint {newer.seq}" in log, log[-3000:]

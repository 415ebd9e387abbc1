"""The Git DAG bundle scenario of tests/test_e2e_lifetimes.py: a versioned bundle moving on under a run.

The stack reads one DAG from a ``GitDagBundle`` (besides the DAG folder) whose repository is a git repository in the
test's temporary directory. Commit A has a stateful task that commits a checkpoint at item 10 and fails on try 1;
while its retry waits, commit B changes the task's code (same ``schema_version``) and the dag-processor picks it
up. What Airflow then does, and what the checkpoints say, measured with Airflow 3.3.2:

* the retry (try 2) runs on the bundle version its DAG run was created with (A): a versioned bundle pins a run to
  its version, so the retry resumes a checkpoint of its own code and nothing is logged as changed;
* the run is then cleared with ``run_on_latest_version=True``: try 3 runs commit B, its checkpoint records bundle
  version B (beside try 2's A) and its task log has the one line saying what changed (task code x -> y, bundle
  version A -> B) as it resumes.

It keeps its checkpoints in a store of its own (``backend_url`` on the task), so the lifetime scenario's GC
runs, which use ``[stateful] backend_url``, never touch them. :func:`run_bundle_scenario` runs in a thread
beside that scenario: most of both is waiting for retry delays.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from airflow_stack import Stack, wait_for

RETRY_DELAY = 20  # commit B is parsed within ~2 s (refresh_interval 1 s, no serialization throttle)
DAG_FILE = """\
from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task


@dag(dag_id="lt_bundle", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(
        task_id="crunch",
        retries=1,
        retry_delay=timedelta(seconds=__DELAY__),
        checkpoint_every=5,
        backend_url=os.environ["STATEFUL_BUNDLE_BACKEND_URL"],
    )
    def crunch(state: TaskState):
        ti = get_current_context()["ti"]
        state.value = state.value or {"total": 0}
        for item in state.resume(range(20)):
            if ti.try_number == 1 and item == 12:
                raise RuntimeError("try 1 fails at item 12")
            with open(os.path.join(os.environ["AIRFLOW_HOME"], "ledger-lt_bundle.csv"), "a") as ledger:
                ledger.write(f"{ti.try_number},{item},__VERSION__\\n")
            state.value = {"total": state.value["total"] + item}
        state.save(state.value)  # every try commits once more, so each try's checkpoint says which code ran
        return state.value

    crunch()


the_dag()
"""


def git(repo: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "test",
        "GIT_AUTHOR_EMAIL": "test@example.invalid",
        "GIT_COMMITTER_NAME": "test",
        "GIT_COMMITTER_EMAIL": "test@example.invalid",
        "HOME": str(repo.parent),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        ["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def commit_version(repo: Path, version: str) -> str:
    (repo / "dags").mkdir(exist_ok=True)
    source = DAG_FILE.replace("__DELAY__", str(RETRY_DELAY)).replace("__VERSION__", version)
    (repo / "dags" / "lt_bundle.py").write_text(source)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"version {version}")
    return git(repo, "rev-parse", "HEAD")


def missing() -> str | None:
    """Why the scenario cannot run here, or None."""
    import importlib.util

    if shutil.which("git") is None:
        return "git is not installed: the Git DAG bundle needs it"
    if importlib.util.find_spec("airflow.providers.git") is None:
        return "apache-airflow-providers-git is not installed"
    return None


def new_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    return repo


def bundle_env(home: Path, repo: Path, dags_folder: Path) -> dict[str, str]:
    """What the stack needs to read DAGs from the DAG folder and from ``repo`` (a Git bundle named ``repo``)."""
    bundles = [
        {
            "name": "dags-folder",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(dags_folder)},
        },
        {
            "name": "repo",
            "classpath": "airflow.providers.git.bundles.git.GitDagBundle",
            "kwargs": {"tracking_ref": "main", "subdir": "dags", "refresh_interval": 1},
        },
    ]
    return {
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
        # The repository through the Git provider's default connection (without one, every bundle object logs a
        # traceback saying git_default is not defined).
        "AIRFLOW_CONN_GIT_DEFAULT": json.dumps({"conn_type": "git", "host": repo.as_uri()}),
        # Clones and checkouts under this test's home: the default, /tmp/airflow/dag_bundles, is shared by every
        # Airflow on the machine, and another run's bundle of the same name would be found there.
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": str(home / "dag_bundles"),
        "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "1",
        # A new commit reaches the database at once, not up to 30 s later.
        "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "0",
        "STATEFUL_BUNDLE_BACKEND_URL": (home / "stateful-bundle").as_uri(),
    }


def task_log(stack: Stack, try_number: int) -> str:
    found = sorted((stack.home / "logs").rglob(f"attempt={try_number}*.log"))
    return "\n".join(p.read_text(errors="replace") for p in found if "lt_bundle" in str(p))


def run_bundle_scenario(stack: Stack, repo: Path, version_a: str) -> str:
    """The scenario (see the module's docstring) on a stack whose bundle ``repo`` is at commit ``version_a`` (made
    before the stack started: a Git bundle cannot clone an empty repository). Its assertions raise here; returns a
    line for the test's output."""
    from airflow_stateful.core import CheckpointStore, Identity
    from airflow_stateful.core.stores.local import LocalObjectStore

    dag = wait_for(
        "lt_bundle to be parsed", lambda: stack.request("GET", "/dags/lt_bundle"), timeout=180, stack=stack
    )
    assert dag["bundle_name"] == "repo" and dag["bundle_version"] == version_a, dag
    stack.request("PATCH", "/dags/lt_bundle", {"is_paused": False})
    run = stack.request("POST", "/dags/lt_bundle/dagRuns", {"logical_date": None})
    run_id, path = run["dag_run_id"], f"/dags/lt_bundle/dagRuns/{run['dag_run_id']}"
    assert run["bundle_version"] == version_a, run

    def ti_state() -> dict[str, Any]:
        return stack.request("GET", f"{path}/taskInstances/crunch")  # type: ignore[no-any-return]

    wait_for(
        "try 1 to fail",
        lambda: True if ti_state()["state"] == "up_for_retry" else None,
        timeout=180,
        stack=stack,
    )
    version_b = commit_version(repo, "B")  # the task's code changes; the schema does not
    wait_for(
        "the dag-processor to parse commit B",
        lambda: True if stack.request("GET", "/dags/lt_bundle")["bundle_version"] == version_b else None,
        timeout=RETRY_DELAY - 5,
        stack=stack,
    )
    cs = CheckpointStore(
        store=LocalObjectStore(root=stack.home / "stateful-bundle"),
        identity=Identity.for_task(dag_id="lt_bundle", task_id="crunch", run_id=run_id),
    )
    try_1 = cs.latest()
    assert try_1 is not None and try_1.code is not None
    assert (try_1.code.bundle_name, try_1.code.bundle_version) == ("repo", version_a), try_1.code

    def finished() -> bool | None:
        state = stack.request("GET", path)["state"]
        if state == "failed":
            pytest.fail(f"the run failed\n{stack.diagnostics()}")
        return True if state == "success" else None

    wait_for("the retry to succeed", finished, timeout=RETRY_DELAY + 180, stack=stack, interval=1)
    rows = [line.split(",") for line in (stack.home / "ledger-lt_bundle.csv").read_text().split()]
    assert {r[2] for r in rows if r[0] == "2"} == {"A"}, (
        "the retry ran commit A: the run is pinned to its version"
    )
    try_2 = cs.latest()
    assert try_2 is not None and try_2.code is not None and try_2.writer.try_number == 2
    assert try_2.code.bundle_version == version_a and try_2.code.fingerprint == try_1.code.fingerprint
    assert "was written by other code" not in task_log(stack, 2), "same code: nothing to report"

    # A person clears the task and asks for the latest bundle version.
    stack.request(
        "POST",
        "/dags/lt_bundle/clearTaskInstances",
        {
            "dry_run": False,
            "dag_run_id": run_id,
            "task_ids": ["crunch"],
            "only_failed": False,
            "run_on_latest_version": True,
        },
    )
    time.sleep(2)
    wait_for("the cleared task to succeed", finished, timeout=180, stack=stack, interval=1)
    try_3 = cs.latest()
    assert try_3 is not None and try_3.code is not None and try_3.writer.try_number == 3
    assert try_3.code.bundle_version == version_b, "the cleared task ran commit B"
    assert try_3.code.fingerprint != try_2.code.fingerprint
    log = task_log(stack, 3)
    lines = [line for line in log.splitlines() if "was written by other code" in line]
    assert len(lines) == 1, log[-4000:]
    assert f"task code {try_2.code.fingerprint} -> {try_3.code.fingerprint}" in lines[0], lines[0]
    assert f"bundle version {version_a} -> {version_b}" in lines[0], lines[0]
    return f"retry ran {version_a[:8]} (the run's version); the clear on the latest ran {version_b[:8]}"

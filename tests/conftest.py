"""Shared fixtures: a real S3 endpoint, temporary stores, and one temporary AIRFLOW_HOME per session.

Airflow reads its configuration when first imported, so the environment is set here, at import time,
before any test module imports Airflow. All Airflow tests of a session share this AIRFLOW_HOME and its
SQLite database (the first ``dag.test()`` in a process is slow; later ones are fast).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="stateful-airflow-home-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
# The DAG folder is a session copy of dags/, so tests can add DAG files (or swap one for a new version, as
# a deployment would) without touching the repository. dag.test() parses this folder.
_DAGS_FOLDER = _AIRFLOW_HOME / "dags"
shutil.copytree(REPO / "dags", _DAGS_FOLDER, ignore=shutil.ignore_patterns("__pycache__"))
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(_DAGS_FOLDER)
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_AIRFLOW_HOME}/airflow.db"
os.environ["AIRFLOW__STATEFUL__BACKEND_URL"] = (_AIRFLOW_HOME / "stateful").as_uri()
# Tasks keep restore-cache chunks in the session's home, not in the machine's real default cache
# (<temp dir>/airflow-stateful-cache-<uid>), which would keep growing up to its 2 GiB cap across runs.
os.environ["AIRFLOW__STATEFUL__RESTORE_CACHE_DIR"] = str(_AIRFLOW_HOME / "restore-cache")
os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "INFO")

from s3_endpoint import STARTED, S3Endpoint, s3_endpoint_from_env, started_endpoint  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def main_s3_endpoint() -> Iterator[S3Endpoint]:
    """The session's S3 endpoint: moto's server unless ``STATEFUL_TEST_S3_ENDPOINT`` names another."""
    with s3_endpoint_from_env() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(main_s3_endpoint: S3Endpoint) -> Iterator[S3Endpoint]:
    """SeaweedFS, a real S3 server the suite starts (once per worker, on first use): the main endpoint itself
    when that already is SeaweedFS."""
    if main_s3_endpoint.kind == "seaweedfs":
        yield main_s3_endpoint
        return
    with started_endpoint("seaweedfs") as endpoint:
        yield endpoint


@pytest.fixture
def s3_endpoint(main_s3_endpoint: S3Endpoint) -> S3Endpoint:
    """The endpoint an S3 test talks to. A module that must hold on every server overrides this fixture with
    :func:`s3_endpoint.both_servers` parameters (see tests/contract/test_s3_contract.py)."""
    return main_s3_endpoint


@pytest.fixture
def s3_prefix(s3_endpoint: S3Endpoint) -> Iterator[str]:
    """A fresh key prefix per test; objects under it are removed afterwards on endpoints we do not own."""
    prefix = s3_endpoint.new_prefix()
    yield prefix
    if s3_endpoint.kind not in STARTED:
        store = s3_endpoint.store(prefix)
        store.delete_many([info.key for info in store.list_objects("")])


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    """The session's AIRFLOW_HOME with a migrated SQLite database."""
    marker = _AIRFLOW_HOME / ".migrated"
    if not marker.exists():
        subprocess.run(
            [sys.executable, "-m", "airflow", "db", "migrate"],
            check=True,
            stdout=subprocess.DEVNULL,
            env=os.environ.copy(),
        )
        marker.touch()
    return _AIRFLOW_HOME


@pytest.fixture(scope="session")
def dags_folder(airflow_home: Path) -> Path:
    """The DAG folder Airflow parses in this session (a copy of dags/ plus what tests write)."""
    return _DAGS_FOLDER


@pytest.fixture
def s3_backend(s3_endpoint: S3Endpoint, s3_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Point ``[stateful]`` at the S3 endpoint through an Airflow connection given by environment.

    Yields the connection's password, so a test can assert it never shows in a task log: a recognisable
    made-up secret on moto (which accepts any), the server's own secret elsewhere (random on SeaweedFS).
    """
    secret = f"do-not-log-{uuid.uuid4().hex}"
    extra = {"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region}
    conn: dict[str, Any] = {"conn_type": "aws", "extra": extra}
    creds = s3_endpoint.credentials
    if creds:
        conn["login"] = creds["aws_access_key_id"]
        conn["password"] = secret = creds["aws_secret_access_key"] if s3_endpoint.kind != "moto" else secret
    monkeypatch.setenv("AIRFLOW_CONN_STATEFUL_TEST_S3", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW__STATEFUL__CONN_ID", "stateful_test_s3")
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", f"s3://{s3_endpoint.bucket}/{s3_prefix}")
    yield secret


@pytest.fixture
def library_log() -> Iterator[list[str]]:
    """The messages the library logs (logger ``airflow_stateful``) while the test runs.

    A handler on the logger itself, not ``caplog``: the CLI, run in-process by its tests, turns off
    propagation of that logger for good.
    """
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("airflow_stateful")
    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


STACK_MODULES = {
    "test_distributed.py",
    "test_e2e_stack.py",
    "test_e2e_lifetimes.py",
    "test_kill_demo.py",
    "test_marks_triggerer.py",
    "test_ui_auth.py",
}
"""Modules that start a whole Airflow deployment (api-server, schedulers, workers, PostgreSQL, Redis). Under
pytest-xdist (``make test`` runs three workers) they all go to one worker, one after the other and first, so that
two deployments never compete for the machine's cores while their timing-sensitive scenarios run; the other
workers meanwhile run the rest of the suite."""
STACKS = "stacks"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope`` (what ``make test`` passes): every module is one unit of work, run by one worker,
    so a module-scoped fixture (a server, a stack, a built wheel) is set up once, and the stack modules are one
    unit together, handed out first.

    Why not ``--dist loadgroup`` and ``xdist_group`` marks, as before: pytest-xdist 3.8 groups by renaming each
    marked test's ``item._nodeid``, and pytest 9.2 no longer reads that attribute (``Node.nodeid`` is built from
    ``_id``), so the marks did nothing. Every test was its own unit, a module's tests were spread over both
    workers, each worker set up the module's fixtures again (measured 2026-12-07: the CeleryExecutor cluster of
    tests/test_distributed.py twice, 28-30 s each, and tests/test_ui_auth.py's api-server twice, 13 s each) and
    two deployments ran side by side. This scheduler needs no marks: it groups by the test's file.
    """
    if config.getvalue("dist") not in ("loadscope", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return STACKS if Path(module).name in STACK_MODULES else module

        def _assign_work_unit(self, node: Any) -> None:
            # The longest unit goes first, never last (no worker idles at the end while another runs it).
            if STACKS in self.workqueue:
                self.workqueue.move_to_end(STACKS, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)

"""A real Airflow deployment on loopback for end-to-end tests: api-server, scheduler (LocalExecutor),
dag-processor and triggerer as subprocesses on SQLite in a temporary AIRFLOW_HOME.

Every process gets an explicit environment (nothing inherited from pytest but PATH and locale) and its own process
group; :meth:`Stack.stop` kills them all, descendants included, and :meth:`Stack.leftovers` finds any that
survived. Used by tests/test_e2e_stack.py (SIGKILL and resume, published outputs) and tests/test_e2e_lifetimes.py
(lifetimes, rollbacks, DAG bundles).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

T = TypeVar("T")
JWT_SECRET = "e2e-test-jwt-secret-not-a-real-secret"


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Stack:
    home: Path
    env: dict[str, str]
    port: int
    logs: Path
    components: list[Component] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v2"

    # -- processes -----------------------------------------------------------------------------------------
    def _popen_args(self, out: Any, *args: str) -> dict[str, Any]:
        return {
            "args": [sys.executable, "-m", "airflow", *args],
            "env": self.env,
            "cwd": self.home,
            "stdin": subprocess.DEVNULL,
            "stdout": out,
            "stderr": subprocess.STDOUT,
            "start_new_session": True,  # its own process group: teardown kills the whole group
        }

    def start(self, name: str, *args: str) -> Component:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(**self._popen_args(out, *args))
        component = Component(name, process, log)
        self.components.append(component)
        self.seen_pids.add(process.pid)
        return component

    def run_cli(self, name: str, *args: str, timeout: float = 120) -> None:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            result = subprocess.run(**self._popen_args(out, *args), timeout=timeout)
        if result.returncode != 0:
            pytest.fail(f"`airflow {' '.join(args)}` exited with {result.returncode}\n{tail(log, 60)}")

    def remember_descendants(self) -> None:
        """Record every descendant seen so far: teardown kills them even if their parent died first."""
        for component in self.components:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(component.process.pid).children(recursive=True):
                    self.seen_pids.add(child.pid)

    def check_alive(self) -> None:
        for component in self.components:
            if component.process.poll() is not None:
                pytest.fail(
                    f"{component.name} exited with code {component.process.returncode}\n{self.diagnostics()}"
                )

    def stop(self) -> None:
        self.remember_descendants()
        procs: list[Any] = []
        for pid in self.seen_pids:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        for component in self.components:  # SIGTERM to each group first: a clean shutdown if it is quick
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(component.process.pid, signal.SIGTERM)
        # A short wait, then SIGKILL: the test asserts nothing of a clean exit.
        _, alive = psutil.wait_procs(procs, timeout=3)
        for component in self.components:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(component.process.pid, signal.SIGKILL)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
        for component in self.components:
            with contextlib.suppress(subprocess.TimeoutExpired):
                component.process.wait(timeout=10)

    def leftovers(self) -> list[str]:
        """Processes still running that belong to this stack (by pid, or by AIRFLOW_HOME in their env)."""
        left = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if proc.pid == os.getpid():
                    continue
                ours = proc.pid in self.seen_pids and proc.status() != psutil.STATUS_ZOMBIE
                if not ours:
                    ours = proc.environ().get("AIRFLOW_HOME") == str(self.home)
                if ours:
                    left.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
        return left

    # -- REST API ------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        return rest_request(self.api, method, path, body)

    # -- diagnostics ---------------------------------------------------------------------------------------
    def diagnostics(self) -> str:
        parts = [f"--- {c.name} (exit {c.process.poll()}) ---\n{tail(c.log, 40)}" for c in self.components]
        for task_log in sorted((self.home / "logs").rglob("*.log"))[-3:]:
            parts.append(f"--- task log {task_log.relative_to(self.home)} ---\n{tail(task_log, 40)}")
        for name in ("ledger.csv", "pids.csv"):
            if (self.home / name).exists():
                parts.append(f"--- {name} ---\n{tail(self.home / name, 10)}")
        return "\n".join(parts)


class ApiError(Exception):
    """Airflow's REST API answered with an error; the message holds its body (what went wrong, server-side)."""


def rest_request(api: str, method: str, path: str, body: Any = None) -> Any:
    """One call of Airflow's REST API at ``api`` (``http://127.0.0.1:PORT/api/v2``), JSON both ways; no login
    (the stacks run with ``simple_auth_manager_all_admins`` on loopback)."""
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(1, 4):
        req = urllib.request.Request(
            api + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:2000].decode("utf-8", "replace")
            # SQLite under the scheduler's writes on a loaded machine: Airflow answers 500 and does not retry.
            if exc.code == 500 and "database is locked" in detail and attempt < 3:
                time.sleep(attempt)
                continue
            raise ApiError(f"{method} {path}: HTTP {exc.code} {exc.reason}: {detail}") from exc
    raise AssertionError("unreachable")  # pragma: no cover


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def wait_for(
    what: str, probe: Callable[[], T | None], *, timeout: float, stack: Stack, interval: float = 0.5
) -> T:
    """Poll ``probe`` until it returns something other than None (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        stack.check_alive()
        stack.remember_descendants()
        try:
            value = probe()
        except Exception as exc:
            last_error, value = exc, None
        if value is not None:
            return value
        time.sleep(interval)
    pytest.fail(
        f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error!r})\n"
        f"{stack.diagnostics()}"
    )


def base_env(home: Path, dags: Path, port: int) -> dict[str, str]:
    """The environment every process of a stack shares: SQLite in ``home``, LocalExecutor, the API on ``port``,
    no login needed on loopback. Callers add ``[stateful]`` settings and connections."""
    env = {key: os.environ[key] for key in ("PATH", "LANG", "LC_ALL", "TZ") if key in os.environ}
    env.update(
        HOME=str(home),
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__PARALLELISM="4",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",  # loopback only: the REST API needs no login
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__API_AUTH__JWT_SECRET=JWT_SECRET,
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
        AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_stack(stack: Stack) -> None:
    """Migrate the database and start the four components (the api-server bound to 127.0.0.1)."""
    stack.run_cli("db-migrate", "db", "migrate")
    port = str(stack.port)
    stack.start("api-server", "api-server", "--host", "127.0.0.1", "--port", port, "--workers", "1")
    stack.start("scheduler", "scheduler", "--skip-serve-logs")
    stack.start("dag-processor", "dag-processor")
    stack.start("triggerer", "triggerer", "--skip-serve-logs")


def stop_stack(stack: Stack) -> None:
    """Stop every process and fail if any of them (or a descendant) is left."""
    stack.stop()
    left = stack.leftovers()
    assert not left, "processes of the stack are still running after teardown:\n" + "\n".join(left)

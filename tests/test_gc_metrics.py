"""The GC operator's metrics, under real Airflow, from a real store.

A local store holds every kind of object GC judges: crash garbage and an orphan older than ``min_age`` (the
backlog), crash garbage younger than it (in-flight commits, not backlog), history that retention prunes, and an
identity idle for 40 days. ``StatefulGCOperator`` runs in a DAG with ``dag.test()``, and Airflow's own ``Stats``
sends to a StatsD socket on 127.0.0.1 (the fixture of tests/test_metrics.py): every gauge and counter must equal
what the store's listing says, before and after, and the XCom report must carry the same numbers.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dag_helpers import AIRFLOW_VERSION, find_dag, load_dag_module
from test_gc import _crash_garbage, _ident, _returned, _write, old_clock
from test_metrics import StatsdServer, statsd_server  # noqa: F401 - `statsd_server` is a fixture

from airflow_stateful.core import store_from_url
from airflow_stateful.core.fleet.usage import GB
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.operators.gc import StatefulGCOperator

pytestmark = [
    pytest.mark.airflow,
    pytest.mark.skipif(
        AIRFLOW_VERSION < (3, 3),
        reason="needs Airflow 3.3+: the statsd_server fixture re-initializes 3.3's Stats",
    ),
]

PRICE = 1000.0
"""USD per GB-month: high, so the idle cost of a few KiB is a number a float shows."""
GC_METRICS = (
    "stateful.gc.garbage_objects",
    "stateful.gc.garbage_bytes",
    "stateful.gc.deleted_objects",
    "stateful.gc.deleted_bytes",
    "stateful.idle_bytes",
    "stateful.idle_monthly_cost",
)

DAG_SOURCE = """\
from datetime import datetime

from airflow.sdk import dag

from airflow_stateful.operators.gc import StatefulGCOperator


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    StatefulGCOperator(task_id="gc", backend_url="__URL__", keep_last=2, price_per_gb_month=__PRICE__, __OPTIONS__)


dag_object = the_dag()
"""


@dataclass
class Layout:
    """What the store holds, by the role each key plays for GC."""

    store: LocalObjectStore
    backlog: list[str]
    """Crash garbage and an orphan's objects older than ``min_age``: what ``stateful.gc.garbage_*`` count."""
    young: list[str]
    """Crash garbage younger than ``min_age``: an in-flight commit's, never counted or deleted."""
    idle: list[str]
    """Every object of the identity idle for 40 days."""


def age(store: LocalObjectStore, keys: Iterable[str], seconds: float) -> None:
    """Make objects look ``seconds`` old to the store's own last-modified stamps."""
    then = time.time() - seconds
    for key in keys:
        os.utime(store.root / key, (then, then))


def sizes(store: ObjectStore) -> dict[str, int]:
    return {info.key: info.size for info in store.list_objects("")}


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    store = store_from_url((tmp_path / "state").as_uri())
    assert isinstance(store, LocalObjectStore)
    files = tmp_path / "files"
    files.mkdir()
    (files / "model.bin").write_bytes(os.urandom(5000))

    idle = _ident("idle", 1)
    _write(store, idle, commits=2, clock=old_clock(40), files=files)
    crashed = _ident("crashed", 2)
    _write(store, crashed, commits=1, clock=time.time)
    backlog = _crash_garbage(store, crashed.key)
    young = _crash_garbage(store, crashed.key)
    orphan = _ident("orphan", 3)
    cs = _write(store, orphan, commits=2, clock=time.time, files=files)
    store.delete(cs.heads.key)  # a purge that crashed right after deleting the head
    backlog += [info.key for info in store.list_objects(f"{orphan.key}/")]
    _write(store, _ident("history", 4), commits=4, clock=time.time)  # keep_last=2 prunes 2: retention
    age(store, backlog, 2 * 3600)
    return Layout(
        store=store,
        backlog=backlog,
        young=young,
        idle=[info.key for info in store.list_objects(f"{idle.key}/")],
    )


def run_gc(dags_folder: Path, layout: Layout, **options: Any) -> dict[str, Any]:
    """Run ``StatefulGCOperator(**options)`` on the layout's store in a DAG with ``dag.test()``; its report."""
    dag_id = f"gc_metrics_{uuid.uuid4().hex[:10]}"
    path = dags_folder / f"{dag_id}.py"
    path.write_text(
        DAG_SOURCE.replace("__DAG_ID__", dag_id)
        .replace("__URL__", layout.store.url)
        .replace("__PRICE__", repr(PRICE))
        .replace("__OPTIONS__", ", ".join(f"{k}={v!r}" for k, v in options.items()))
    )
    run = find_dag(load_dag_module(path)).test()
    assert str(run.state) == "success"
    report = _returned(run)
    assert isinstance(report, dict)
    return report


def received(server: StatsdServer) -> dict[str, list[str]]:
    """Every packet sent so far (all were sent before ``dag.test()`` returned), by metric name."""
    server.sock.setblocking(False)
    try:
        while True:
            server.lines.extend(server.sock.recv(65536).decode().splitlines())
    except BlockingIOError:
        pass
    finally:
        server.sock.settimeout(10)
    return {name: server.value(name) for name in GC_METRICS if server.value(name)}


def test_a_dry_run_sends_the_backlog_and_the_idle_footprint_and_deletes_nothing(
    statsd_server: StatsdServer,  # noqa: F811
    dags_folder: Path,
    layout: Layout,
) -> None:
    before = sizes(layout.store)
    backlog_bytes = sum(before[k] for k in layout.backlog)
    idle_bytes = sum(before[k] for k in layout.idle)

    report = run_gc(dags_folder, layout, idle_for="30d", dry_run=True)

    assert sizes(layout.store) == before
    cost = idle_bytes / GB * PRICE
    assert received(statsd_server) == {
        "stateful.gc.garbage_objects": [f"{len(layout.backlog)}|g"],
        "stateful.gc.garbage_bytes": [f"{backlog_bytes}|g"],
        "stateful.idle_bytes": [f"{idle_bytes}|g"],
        "stateful.idle_monthly_cost": [f"{cost}|g"],
    }, "a dry run deletes nothing, so it sends no deleted_* counters"
    assert len(layout.backlog) > 2 and backlog_bytes > 5000, "crash garbage and a whole orphan with a file"
    assert {
        k: report[k] for k in ("garbage_objects", "garbage_bytes", "deleted_objects", "deleted_bytes")
    } == {
        "garbage_objects": len(layout.backlog),
        "garbage_bytes": backlog_bytes,
        "deleted_objects": 0,
        "deleted_bytes": 0,
    }
    assert (report["idle_identities"], report["idle_bytes"]) == (1, idle_bytes)
    assert report["idle_monthly_cost"] == pytest.approx(cost, abs=1e-6)
    assert report["price_per_gb_month"] == PRICE
    assert report["dry_run"] is True


def test_a_real_run_counts_exactly_what_left_the_store(
    statsd_server: StatsdServer,  # noqa: F811
    dags_folder: Path,
    layout: Layout,
) -> None:
    before = sizes(layout.store)

    report = run_gc(dags_folder, layout, idle_for="30d")

    after = sizes(layout.store)
    gone = set(before) - set(after)
    assert set(layout.backlog) | set(layout.idle) <= gone, "the backlog and the idle identity were deleted"
    assert not set(layout.young) & gone, "garbage younger than min_age stays"
    assert len(gone) > len(layout.backlog) + len(layout.idle), "retention deleted too, and is counted"
    sent = received(statsd_server)
    assert sent["stateful.gc.deleted_objects"] == [f"{len(gone)}|c"]
    assert sent["stateful.gc.deleted_bytes"] == [f"{sum(before[k] for k in gone)}|c"]
    assert sent["stateful.gc.garbage_objects"] == [f"{len(layout.backlog)}|g"], "sent after planning"
    assert (report["deleted_objects"], report["deleted_bytes"]) == (len(gone), sum(before[k] for k in gone))
    assert report["objects"] == len(gone)


def test_without_idle_for_no_idle_gauge_is_sent(
    statsd_server: StatsdServer,  # noqa: F811
    dags_folder: Path,
    layout: Layout,
) -> None:
    """Idleness was not judged: a 0 would tell a dashboard that nothing is idle."""
    report = run_gc(dags_folder, layout, dry_run=True)

    assert sorted(received(statsd_server)) == ["stateful.gc.garbage_bytes", "stateful.gc.garbage_objects"]
    assert (report["idle_identities"], report["idle_bytes"], report["idle_monthly_cost"]) == (
        None,
        None,
        None,
    )


def test_a_negative_price_is_refused() -> None:
    with pytest.raises(ValueError, match="price_per_gb_month"):
        StatefulGCOperator(task_id="gc", price_per_gb_month=-1)

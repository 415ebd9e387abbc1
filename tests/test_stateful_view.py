"""The Stateful view: its JSON and HTML against real stores, Airflow's plugin loader, and a real browser.

The store is real (a local directory, and the S3 endpoint of conftest.py); FastAPI's TestClient drives the
app in-process. The browser check starts uvicorn on 127.0.0.1 in a subprocess and screenshots the page with
headless Chromium (skipped when ``chromium`` is not installed).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.records import WriterInfo, parse_iso
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.plugins.stateful_view import StatefulPlugin, create_app, human_age

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "artifacts"
RUN_ID = "scheduled__2026-11-30T00:00:00+00:00"
RUN_IDENTITY = Identity.for_task(dag_id="etl", task_id="load", run_id=RUN_ID)
NAMED_IDENTITY = Identity.for_task(dag_id="ingest", task_id="watermark", name="nightly-watermark")
MAPPED_IDENTITY = Identity.for_task(dag_id="train", task_id="fit", map_index=3, run_id="manual__1")


def populate(store: ObjectStore, tmp_path: Path) -> dict[str, float]:
    """Three task identities and one free-form one; returns each head's ``updated_at`` as a timestamp."""
    files = tmp_path / "files"
    files.mkdir(exist_ok=True)
    (files / "model.bin").write_bytes(b"m" * 5000)
    held = CheckpointStore(store=store, identity=RUN_IDENTITY, keep_last=3)
    lease = held.acquire(holder=WriterInfo(dag_id="etl", run_id=RUN_ID, try_number=2, pod="etl-load-0"))
    for step in range(4):
        held.commit(lease, {"step": step}, files=files if step == 3 else None)
    named = CheckpointStore(store=store, identity=NAMED_IDENTITY)
    named_lease = named.acquire(holder=WriterInfo(run_id="scheduled__x", try_number=1, host="worker-1"))
    named.commit(named_lease, {"watermark": "2026-11-29"})
    named.release(named_lease)
    mapped = CheckpointStore(store=store, identity=MAPPED_IDENTITY)
    mapped.acquire(holder=WriterInfo(try_number=1, host="worker-2"))  # a lease, no checkpoint yet
    other = CheckpointStore(store=store, identity=Identity.parse("team-a/custom-job"))
    other.commit(other.acquire(), {"x": 1})
    return {
        cs.identity.key: parse_iso(cs.head().updated_at)  # type: ignore[union-attr]
        for cs in (held, named, mapped, other)
    }


def check_identities_api(client: TestClient, updated: dict[str, float], now: float) -> None:
    body = client.get("/api/identities").json()
    rows = {row["identity"]: row for row in body["identities"]}
    assert set(rows) == set(updated)

    run = rows[RUN_IDENTITY.key]
    assert (run["dag_id"], run["task_id"], run["scope_kind"], run["scope"]) == ("etl", "load", "run", RUN_ID)
    assert run["last_checkpoint"]["seq"] == 4
    assert run["size"] == 5000
    assert run["checkpoints"] == 3  # keep_last
    assert run["lease"]["holder"]["pod"] == "etl-load-0"
    assert run["lease"]["holder"]["try_number"] == 2
    assert run["idle_seconds"] == pytest.approx(now - updated[RUN_IDENTITY.key], abs=0.01)
    assert run["links"]["run"] == "/dags/etl/runs/scheduled__2026-11-30T00%3A00%3A00%2B00%3A00"

    named = rows[NAMED_IDENTITY.key]
    assert named["lease"] is None
    assert named["links"] == {"dag": "/dags/ingest"}  # no run: state lives across runs, nobody holds it

    mapped = rows[MAPPED_IDENTITY.key]
    assert mapped["map_index"] == 3
    assert mapped["last_checkpoint"] is None
    assert mapped["lease"]["holder"]["host"] == "worker-2"

    assert rows["team-a/custom-job"]["links"] == {}
    assert rows["team-a/custom-job"]["dag_id"] is None


@pytest.fixture
def local_store(tmp_path: Path) -> ObjectStore:
    return LocalObjectStore(root=tmp_path / "state", fsync=False)


def test_identities_api_on_a_local_store(local_store: ObjectStore, tmp_path: Path) -> None:
    updated = populate(local_store, tmp_path)
    now = max(updated.values()) + 3600
    check_identities_api(TestClient(create_app(local_store, clock=lambda: now)), updated, now)


@pytest.mark.s3
def test_identities_api_on_s3(s3_endpoint, s3_prefix: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = s3_endpoint.store(s3_prefix)
    updated = populate(store, tmp_path)
    now = max(updated.values()) + 60
    client = TestClient(create_app(store, clock=lambda: now))
    check_identities_api(client, updated, now)
    history = client.get(f"/api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history").json()
    assert [e["seq"] for e in history["checkpoints"]] == [4, 3, 2]


def test_history_is_newest_first_and_unknown_or_invalid_keys_are_client_errors(
    local_store: ObjectStore, tmp_path: Path
) -> None:
    populate(local_store, tmp_path)
    client = TestClient(create_app(local_store))
    body = client.get(f"/api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history").json()
    assert body["identity"] == RUN_IDENTITY.key
    assert [e["seq"] for e in body["checkpoints"]] == [4, 3, 2]
    assert body["checkpoints"][0]["total_size"] == 5000
    assert client.get("/api/identities/etl/nothing/run=x/map=-1/history").status_code == 404
    assert client.get("/api/identities/etl/a%20b/history").status_code == 400  # not a valid key


def test_prefix_and_limit_narrow_the_listing(local_store: ObjectStore, tmp_path: Path) -> None:
    populate(local_store, tmp_path)
    client = TestClient(create_app(local_store))
    rows = client.get("/api/identities", params={"prefix": "etl/"}).json()["identities"]
    assert [r["identity"] for r in rows] == [RUN_IDENTITY.key]
    assert len(client.get("/api/identities", params={"limit": 2}).json()["identities"]) == 2


def test_a_corrupt_head_is_reported_on_its_row_without_hiding_the_others(
    local_store: ObjectStore, tmp_path: Path
) -> None:
    populate(local_store, tmp_path)
    local_store.put(f"{NAMED_IDENTITY.key}/~head.json", b"{not json")
    rows = {
        r["identity"]: r
        for r in TestClient(create_app(local_store)).get("/api/identities").json()["identities"]
    }
    assert "CheckpointCorruptError" in rows[NAMED_IDENTITY.key]["error"]
    assert rows[RUN_IDENTITY.key]["last_checkpoint"]["seq"] == 4


def test_page_lists_identities_escapes_names_and_links_runs_under_airflows_base_path(
    local_store: ObjectStore, tmp_path: Path
) -> None:
    populate(local_store, tmp_path)
    odd = CheckpointStore(
        store=local_store, identity=Identity.for_task(dag_id="x<b>y", task_id="t", run_id="r")
    )
    odd.commit(odd.acquire(), 1)
    # Mounted like Airflow's api-server does, here below a base path /airflow.
    outer = FastAPI()
    outer.mount("/airflow/stateful", create_app(local_store))
    page = TestClient(outer).get("/airflow/stateful/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "5 identities" in text
    assert 'href="/airflow/dags/etl/runs/scheduled__2026-11-30T00%3A00%3A00%2B00%3A00"' in text
    assert "try 2, run " in text and "pod etl-load-0" in text
    assert "x&lt;b&gt;y" in text and "x<b>y" not in text
    assert f"api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history" in text  # `%` escaped as %25


def test_an_empty_backend_says_so(local_store: ObjectStore) -> None:
    client = TestClient(create_app(local_store))
    assert "No identity holds state" in client.get("/").text
    assert client.get("/api/identities").json()["identities"] == []


def test_the_configured_backend_is_read_from_stateful_backend_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalObjectStore(root=tmp_path / "configured", fsync=False)
    populate(store, tmp_path)
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "configured").as_uri())
    monkeypatch.setenv("AIRFLOW__STATEFUL__CONN_ID", "")
    body = TestClient(create_app()).get("/api/identities").json()
    assert body["backend_url"].endswith("/configured")
    assert len(body["identities"]) == 4


def test_human_age() -> None:
    assert [human_age(s) for s in (5, 65, 3 * 3600 + 120, 2 * 86400 + 3600)] == [
        "5s",
        "1m 5s",
        "3h 2m",
        "2d 1h",
    ]


# -- Airflow's plugin loader -------------------------------------------------------------------------------


def _airflow_plugins(env: dict[str, str]) -> list[dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "plugins", "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout[out.stdout.index("[") :])  # type: ignore[no-any-return]


def test_airflow_accepts_the_plugin_from_a_plugins_folder(tmp_path: Path) -> None:
    """Airflow validates fastapi_apps and external_views when it loads a plugin; this is that load."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "stateful_plugin.py").write_text(
        "from airflow_stateful.plugins.stateful_view import StatefulPlugin  # noqa: F401\n"
    )
    plugins = _airflow_plugins({**os.environ, "AIRFLOW__CORE__PLUGINS_FOLDER": str(folder)})
    ours = [p for p in plugins if p["name"] == StatefulPlugin.name]
    assert ours, plugins
    assert ours[0]["fastapi_apps"] == [
        {"app": "fastapi.applications.FastAPI", "url_prefix": "/stateful", "name": "Stateful"}
    ]
    assert ours[0]["external_views"][0]["href"] == "/stateful/"  # type: ignore[index]


def test_the_plugin_is_registered_by_entry_point(tmp_path: Path) -> None:
    eps = [ep for ep in importlib.metadata.entry_points(group="airflow.plugins") if ep.name == "stateful"]
    if not eps:
        pytest.skip(
            'no "airflow.plugins" entry point named "stateful": add it to pyproject.toml and reinstall '
            "(pip install -e .)"
        )
    assert eps[0].load() is StatefulPlugin
    empty = tmp_path / "no-plugins"
    empty.mkdir()
    plugins = _airflow_plugins({**os.environ, "AIRFLOW__CORE__PLUGINS_FOLDER": str(empty)})
    assert [p["source"] for p in plugins if p["name"] == "stateful"], plugins


# -- a real browser ----------------------------------------------------------------------------------------

SERVER = r"""
import sys, uvicorn
from fastapi import FastAPI
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.plugins.stateful_view import create_app

outer = FastAPI()
outer.mount("/stateful", create_app(LocalObjectStore(root=sys.argv[1], fsync=False)))
uvicorn.run(outer, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def view_server(tmp_path: Path) -> Iterator[str]:
    """The view served by uvicorn on 127.0.0.1 in a subprocess, over a populated local store."""
    populate(LocalObjectStore(root=tmp_path / "state", fsync=False), tmp_path)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path / "state"), str(port)])
    url = f"http://127.0.0.1:{port}/stateful/"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"the view's server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                subprocess.run(["sleep", "0.1"], check=False)
        else:
            pytest.fail("the view's server never answered")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium(view_server: str, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not on PATH: skipping the browser check")
        pytest.skip("chromium is not on PATH (apt-get install chromium to run the browser check)")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "stateful-view.png"
    shot.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="stateful-chromium-") as profile:
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                "--window-size=1280,800",
                view_server,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000, f"a {len(data)}-byte screenshot is too small to show the table"

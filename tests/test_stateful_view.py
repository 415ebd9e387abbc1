"""The Stateful view: its JSON and HTML against real stores, Airflow's plugin loader, and a real browser.

The store is real (a local directory, and the S3 endpoint of conftest.py); FastAPI's TestClient drives the
app in-process, authenticated as Airflow authenticates: a JWT from this process's real simple auth manager
(Airflow's default), checked by Airflow's own ``get_user`` and DAG permission dependencies against the
session's migrated database. Who-sees-what between users is tested against a real api-server in
tests/test_ui_auth.py. The browser check starts uvicorn on 127.0.0.1 in a subprocess (behind Airflow's
all-admins middleware, as an api-server with ``simple_auth_manager_all_admins``) and screenshots the page
with headless Chromium (skipped when ``chromium`` is not installed).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from checkpoint_history import forge_head
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from view_server import chromium_or_skip, screenshot, serve_view

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.timestamps import parse_iso
from airflow_stateful.plugins import stateful_view
from airflow_stateful.plugins.stateful_view import StatefulPlugin
from airflow_stateful.plugins.view.app import WorkGate, create_app
from airflow_stateful.plugins.view.rows import Bounds, human_age

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


@pytest.fixture(scope="module")
def admin(airflow_home: Path) -> dict[str, str]:
    """The Authorization header of an admin, signed by this process's real simple auth manager."""
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    token = init_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def view(admin: dict[str, str]) -> Any:
    """``view(store, **create_app kwargs)``: a TestClient of the view app, logged in as admin."""

    def make(store: Any = None, **kwargs: Any) -> TestClient:
        return TestClient(create_app(store, **kwargs), headers=admin)

    return make


def test_identities_api_on_a_local_store(local_store: ObjectStore, tmp_path: Path, view: Any) -> None:
    updated = populate(local_store, tmp_path)
    now = max(updated.values()) + 3600
    check_identities_api(view(local_store, clock=lambda: now), updated, now)


@pytest.mark.s3
def test_identities_api_on_s3(s3_endpoint, s3_prefix: str, tmp_path: Path, view: Any) -> None:  # type: ignore[no-untyped-def]
    store = s3_endpoint.store(s3_prefix)
    updated = populate(store, tmp_path)
    now = max(updated.values()) + 60
    client = view(store, clock=lambda: now)
    check_identities_api(client, updated, now)
    history = client.get(f"/api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history").json()
    assert [e["seq"] for e in history["checkpoints"]] == [4, 3, 2]


def test_history_is_newest_first_and_unknown_or_invalid_keys_are_client_errors(
    local_store: ObjectStore, tmp_path: Path, view: Any
) -> None:
    populate(local_store, tmp_path)
    client = view(local_store)
    body = client.get(f"/api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history").json()
    assert body["identity"] == RUN_IDENTITY.key
    assert [e["seq"] for e in body["checkpoints"]] == [4, 3, 2]
    assert body["checkpoints"][0]["total_size"] == 5000
    assert client.get("/api/identities/etl/nothing/run=x/map=-1/history").status_code == 404
    invalid = client.get("/api/identities/etl/a%20b/history")
    assert invalid.status_code == 400 and "'etl/a b'" in invalid.json()["detail"]  # names the value


def test_prefix_and_limit_narrow_the_listing(local_store: ObjectStore, tmp_path: Path, view: Any) -> None:
    populate(local_store, tmp_path)
    client = view(local_store)
    for prefix in ("etl/", "etl", "et", "etl/load/run="):
        rows = client.get("/api/identities", params={"prefix": prefix}).json()["identities"]
        assert [r["identity"] for r in rows] == [RUN_IDENTITY.key], prefix
    body = client.get("/api/identities", params={"limit": 2}).json()
    assert len(body["identities"]) == 2
    assert "showed 2 identities (limit)" in body["truncated"]  # says the listing is incomplete
    assert client.get("/api/identities").json()["truncated"] is None


def test_a_corrupt_head_is_reported_on_its_row_without_hiding_the_others(
    local_store: ObjectStore, tmp_path: Path, view: Any
) -> None:
    populate(local_store, tmp_path)
    local_store.put(f"{NAMED_IDENTITY.key}/~head.json", b"{not json")
    rows = {r["identity"]: r for r in view(local_store).get("/api/identities").json()["identities"]}
    assert "CheckpointCorruptError" in rows[NAMED_IDENTITY.key]["error"]
    assert rows[RUN_IDENTITY.key]["last_checkpoint"]["seq"] == 4


def test_page_lists_identities_escapes_names_and_links_runs_under_airflows_base_path(
    local_store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    populate(local_store, tmp_path)
    odd = CheckpointStore(
        store=local_store, identity=Identity.for_task(dag_id="x<b>y", task_id="t", run_id="r")
    )
    odd.commit(odd.acquire(), 1)
    # Mounted like Airflow's api-server does, here below a base path /airflow.
    outer = FastAPI()
    outer.mount("/airflow/stateful", create_app(local_store))
    page = TestClient(outer, headers=admin).get("/airflow/stateful/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "5 identities" in text
    assert 'href="/airflow/dags/etl/runs/scheduled__2026-11-30T00%3A00%3A00%2B00%3A00"' in text
    assert "try 2, run " in text and "pod etl-load-0" in text
    assert "x&lt;b&gt;y" in text and "x<b>y" not in text
    assert f"api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history" in text  # `%` escaped as %25


def test_an_empty_backend_says_so(local_store: ObjectStore, view: Any) -> None:
    client = view(local_store)
    assert "No identity that you may read holds state" in client.get("/").text
    assert client.get("/api/identities").json()["identities"] == []


def test_the_configured_backend_is_read_from_stateful_backend_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, view: Any
) -> None:
    store = LocalObjectStore(root=tmp_path / "configured", fsync=False)
    populate(store, tmp_path)
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "configured").as_uri())
    monkeypatch.setenv("AIRFLOW__STATEFUL__CONN_ID", "")
    body = view().get("/api/identities").json()
    assert body["backend_url"].endswith("/configured")
    assert len(body["identities"]) == 4


def test_the_status_column_and_filter_follow_work_status(
    local_store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    updated = populate(local_store, tmp_path)
    # 60 s after the last write, with 30 s expected between commits: the lease holders are stuck
    soon = max(updated.values()) + 60
    app = create_app(local_store, clock=lambda: soon, default_interval=timedelta(seconds=30))
    client = TestClient(app, headers=admin)
    body = client.get("/api/identities").json()
    status = {row["identity"]: row["status"]["status"] for row in body["identities"]}
    assert status == {
        RUN_IDENTITY.key: "stuck",
        NAMED_IDENTITY.key: "idle",
        MAPPED_IDENTITY.key: "stuck",  # took the lease, never committed
        "team-a/custom-job": "stuck",
    }
    assert body["status_counts"] == {"active": 0, "stuck": 3, "dead": 0, "idle": 1}
    run = next(row for row in body["identities"] if row["identity"] == RUN_IDENTITY.key)
    assert "committed nothing for 0:01:" in run["status"]["reason"]
    assert run["status"]["expected_interval_seconds"] == 30
    idle = client.get("/api/identities", params={"status": "idle"}).json()["identities"]
    assert [row["identity"] for row in idle] == [NAMED_IDENTITY.key]
    both = client.get("/api/identities", params={"status": "idle, stuck"}).json()["identities"]
    assert len(both) == 4
    bad = client.get("/api/identities", params={"status": "stuck,<b>"})
    assert bad.status_code == 400 and "'stuck,<b>'" in bad.json()["detail"]
    page = client.get("/", params={"status": "idle"}).text
    assert "1 of 4 identities with status idle" in page
    assert '<span class="st st-idle" title="no writer holds the lease">idle</span>' in page
    assert '<a href="?status=stuck">stuck (3)</a>' in page and "<b>idle (1)</b>" in page
    assert 'href="api/identities?status=idle"' in page
    assert "etl-load-0" not in page  # the stuck run identity is filtered out
    # an hour later every lease has expired: dead, with the holder named in the reason (the title)
    later = TestClient(create_app(local_store, clock=lambda: soon + 3600), headers=admin)
    rows = later.get("/api/identities", params={"status": "dead"}).json()["identities"]
    assert {row["identity"] for row in rows} == {RUN_IDENTITY.key, MAPPED_IDENTITY.key, "team-a/custom-job"}
    text = later.get("/").text
    assert 'class="st st-dead" title="the lease of try 2, run ' in text
    # run identities link to their Checkpoints page
    assert f'href="/stateful/ti/etl/{quote(RUN_ID, safe="")}/load?map_index=-1">Checkpoints</a>' in text


def test_human_age() -> None:
    assert [human_age(s) for s in (5, 65, 3 * 3600 + 120, 2 * 86400 + 3600)] == [
        "5s",
        "1m 5s",
        "3h 2m",
        "2d 1h",
    ]


# -- authentication, hostile heads, hostile parameters, bounds -------------------------------------------


def test_without_a_token_every_route_is_401_and_reads_nothing(
    local_store: ObjectStore, tmp_path: Path
) -> None:
    populate(local_store, tmp_path)
    client = TestClient(create_app(local_store))
    for path in ("/", "/api/identities", f"/api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history"):
        response = client.get(path)
        assert response.status_code == 401, path
        assert "etl-load-0" not in response.text and "worker-" not in response.text
    forged = {"Authorization": "Bearer " + "e30.e30.c2ln"}  # {}.{}.sig: not signed by this deployment
    assert client.get("/api/identities", headers=forged).status_code in (401, 403)


def test_every_route_of_the_app_depends_on_the_auth_managers_viewer(local_store: ObjectStore) -> None:
    """The routes are methods of one object that create_app lists; each must still take the viewer, so a route
    added without it (and so outside Airflow's auth manager) fails here, not in production."""
    from fastapi.routing import APIRoute

    from airflow_stateful.plugins.view.access import current_viewer

    def calls(dependant: Any) -> set[Any]:
        return {dependant.call} | {c for d in dependant.dependencies for c in calls(d)}

    routes = [r for r in create_app(local_store).routes if isinstance(r, APIRoute)]
    assert [r.path for r in routes] == [
        "/",
        "/api/identities",
        "/ti/{path:path}",
        "/api/ti/{path:path}",
        "/run/{path:path}",
        "/api/run/{path:path}",
        "/api/identities/{key:path}/history",
    ]
    for route in routes:
        assert current_viewer in calls(route.dependant), route.path


SCRIPT = "<script>alert(1)</script>"


def test_a_crafted_head_never_puts_markup_in_the_page(
    local_store: ObjectStore, tmp_path: Path, view: Any
) -> None:
    populate(local_store, tmp_path)
    # Valid strings with markup in every free-text field a writer controls (holder host, pod, run id).
    hostile = CheckpointStore(
        store=local_store, identity=Identity.for_task(dag_id="x", task_id="t", name="n")
    )
    hostile.commit(
        hostile.acquire(
            holder=WriterInfo(host=SCRIPT, pod='"><img src=x onerror=alert(2)>', run_id="<b>run</b>")
        ),
        1,
    )

    # Typed fields holding markup: a string where the head has integers (seq, schema_version, size).
    def typed(body: dict[str, Any]) -> None:
        entry = body["checkpoints"][-1]
        entry.update(seq=SCRIPT, schema_version="<i>9</i>", total_size="<u>1</u>")

    forge_head(local_store, NAMED_IDENTITY, typed)
    page = view(local_store).get("/")
    assert page.status_code == 200
    text = page.text.lower()
    for markup in ("<script", "<img", "<b>run", "<i>9", "<u>1", "onerror=alert(2)>"):
        assert markup not in text, markup
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text  # shown, as text
    assert "&lt;b&gt;run&lt;/b&gt;" in page.text
    # The forged identity is an error row of its own; the others are still listed.
    rows = {r["identity"]: r for r in view(local_store).get("/api/identities").json()["identities"]}
    assert "error" in rows[NAMED_IDENTITY.key]
    assert rows[RUN_IDENTITY.key]["last_checkpoint"]["seq"] == 4
    assert "5 identities" in page.text and 'class="err"' in page.text


def test_responses_carry_their_type_a_strict_csp_nosniff_and_same_origin_framing(
    local_store: ObjectStore, tmp_path: Path, view: Any
) -> None:
    populate(local_store, tmp_path)
    client = view(local_store)
    page = client.get("/")
    api = client.get("/api/identities")
    history = client.get(f"/api/identities/{quote(RUN_IDENTITY.key, safe='/')}/history")
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert api.headers["content-type"] == history.headers["content-type"] == "application/json"
    for response in (page, api, history, client.get("/", params={"prefix": ".."})):
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'self'" in csp
        assert "script-src" not in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "SAMEORIGIN"
        assert response.headers["cache-control"] == "no-store"
    # The page's one inline stylesheet is allowed by its hash, and it has no script at all.
    css = re.search(r"<style>(.*?)</style>", page.text, re.S)
    assert css is not None
    digest = base64.b64encode(hashlib.sha256(css.group(1).encode()).digest()).decode()
    assert f"style-src 'sha256-{digest}'" in page.headers["content-security-policy"]
    assert "<script" not in page.text.lower()


@pytest.mark.parametrize(
    "prefix",
    ["../../..", "..", "/", "/etc", "etl/../..", "etl//load", "~task-state/", "etl/~data", "a\\b", "a\x00b"],
)
def test_a_prefix_that_is_not_the_start_of_an_identity_key_is_400_naming_it(
    prefix: str, local_store: ObjectStore, view: Any
) -> None:
    client = view(local_store)
    response = client.get("/api/identities", params={"prefix": prefix})
    assert response.status_code == 400
    assert repr(prefix) in response.json()["detail"]
    page = client.get("/", params={"prefix": prefix}, headers={"Accept": "text/html"})
    assert page.status_code == 400 and page.headers["content-type"].startswith("text/html")


def test_a_listing_stops_at_its_bounds_and_says_so(
    local_store: ObjectStore, tmp_path: Path, view: Any
) -> None:
    populate(local_store, tmp_path)  # the first object in key order is a data file of etl/..., then its head
    few = view(local_store, bounds=Bounds(max_scanned=1)).get("/api/identities").json()
    assert few["identities"] == [] and "listed 1 objects" in few["truncated"]
    slow = view(local_store, bounds=Bounds(seconds=0)).get("/")
    assert "Listing incomplete" in slow.text and "listed for 0 s" in slow.text


def test_the_leases_last_renewal_is_shown(local_store: ObjectStore, view: Any) -> None:
    now = [1_800_000_000.0]
    checkpoints = CheckpointStore(store=local_store, identity=RUN_IDENTITY, clock=lambda: now[0])
    lease = checkpoints.acquire(holder=WriterInfo(host="worker-1"))
    now[0] += 125
    checkpoints.renew(lease)
    client = view(local_store, clock=lambda: now[0])
    row = client.get("/api/identities").json()["identities"][0]
    assert parse_iso(row["lease"]["renewed_at"]) == pytest.approx(now[0])
    assert parse_iso(row["lease"]["acquired_at"]) == pytest.approx(now[0] - 125)
    assert "renewed 2027-01-15T08:02:05Z" in client.get("/").text


def test_a_user_of_some_dags_lists_only_their_folders() -> None:
    """A user who may read two DAGs makes the server list those two DAGs' folders, never the whole backend."""
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    from airflow_stateful.plugins.view.access import Viewer

    user = SimpleAuthManagerUser(username="v", role="viewer")
    some = Viewer(
        user=user, readable_dags=frozenset({"etl", "a b"}), reads_every_dag=False, reads_configuration=False
    )
    assert some.scan_prefixes("") == ["a%20b/", "etl/"]
    assert some.scan_prefixes("e") == ["etl/"]
    assert some.scan_prefixes("etl/load/") == ["etl/load/"]
    assert some.scan_prefixes("ingest/") == []
    assert not some.may_read(Identity.parse("etl/custom-job")) and some.may_read(RUN_IDENTITY)
    every = Viewer(user=user, readable_dags=frozenset(), reads_every_dag=True, reads_configuration=False)
    assert every.scan_prefixes("") == [""] and every.may_read(Identity.parse("etl/custom-job"))


def test_the_work_gate_refuses_at_once_when_full_and_frees_a_slot_when_work_ends() -> None:
    gate = WorkGate(workers=1, queue=1)
    release = threading.Event()

    async def scenario() -> list[Any]:
        first = asyncio.ensure_future(gate.run(release.wait, 10))
        second = asyncio.ensure_future(gate.run(lambda: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(HTTPException) as busy:
            await gate.run(lambda: "refused")
        release.set()
        return [busy.value.status_code, busy.value.headers, await first, await second, await gate.run(int)]

    assert asyncio.run(scenario()) == [503, {"Retry-After": "5"}, True, "queued", 0]


def test_the_plugin_module_is_light_and_its_app_serves_the_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, admin: dict[str, str]
) -> None:
    """Every process that loads plugins (task processes too) imports the plugin module: it must not pull in
    the api-server's security module; the app Airflow mounts builds the view on its first request."""
    probe = (
        "import sys, airflow_stateful.plugins.stateful_view\n"
        "print(sorted(m for m in ('airflow.api_fastapi.core_api.security',) if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
    populate(LocalObjectStore(root=tmp_path / "configured", fsync=False), tmp_path)
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "configured").as_uri())
    monkeypatch.setenv("AIRFLOW__STATEFUL__CONN_ID", "")
    shell = stateful_view.shell_app()
    assert TestClient(shell).get("/api/identities").status_code == 401
    assert len(TestClient(shell, headers=admin).get("/api/identities").json()["identities"]) == 4


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
    return json.loads(out.stdout[out.stdout.index("[") :])


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


@pytest.fixture
def view_server(tmp_path: Path, airflow_home: Path) -> Iterator[str]:
    """The view served by uvicorn on 127.0.0.1 in a subprocess, over a populated local store."""
    populate(LocalObjectStore(root=tmp_path / "state", fsync=False), tmp_path)
    with serve_view(tmp_path / "state") as base:
        yield f"{base}/"


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium(view_server: str, tmp_path: Path) -> None:
    chromium = chromium_or_skip("the browser check")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "stateful-view.png"
    data = screenshot(chromium, view_server, shot, window_size="1280,800", flags=["--disable-quic"])
    assert len(data) > 20_000, f"a {len(data)}-byte screenshot is too small to show the table"


def test_error_rows_name_no_store_location_to_a_user_who_may_not_read_the_configuration(
    tmp_path: Path, admin: dict[str, str]
) -> None:
    """``backend_url`` is hidden from users without the configuration permission; the errors on rows and in
    the history's 500 must not show it either (``file:///...``, ``s3://...``, the store's directory)."""
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    from airflow_stateful.plugins.view.access import Viewer, current_viewer

    root = tmp_path / "secret-location" / "state"
    store = LocalObjectStore(root=root, fsync=False)
    populate(store, tmp_path)
    store.put(
        f"{NAMED_IDENTITY.key}/~head.json", b" " * (3 * 1024 * 1024)
    )  # oversized: its error names the store
    app = create_app(store)
    seen = {}
    for who, reads_configuration in (("viewer", False), ("admin", True)):
        app.dependency_overrides[current_viewer] = lambda rc=reads_configuration: Viewer(
            user=SimpleAuthManagerUser(username="u", role="viewer"),
            readable_dags=frozenset(),
            reads_every_dag=True,
            reads_configuration=rc,
        )
        client = TestClient(app)
        rows = {r["identity"]: r for r in client.get("/api/identities").json()["identities"]}
        history = client.get(f"/api/identities/{quote(NAMED_IDENTITY.key, safe='/')}/history")
        page = client.get("/").text
        seen[who] = (rows[NAMED_IDENTITY.key]["error"], history.json()["detail"], page)
    for text in seen["admin"][:2]:
        assert str(root) in text, "an admin is shown where the object is"
    for text in seen["viewer"]:
        assert "secret-location" not in text and "file://" not in text, text[:300]
    assert "more than the 2097152 bytes" in seen["viewer"][0] and "<store>" in seen["viewer"][0]
    assert history.status_code == 500


@pytest.mark.s3
def test_the_redactor_hides_an_s3_store_bucket_prefix_and_endpoint(s3_endpoint: Any, s3_prefix: str) -> None:
    from airflow_stateful.plugins.view.redact import Redactor

    with s3_endpoint.store(s3_prefix) as store:
        redact = Redactor.of(store)
        endpoint = str(s3_endpoint.endpoint_url).rstrip("/")
        messages = [
            f"object 'etl/t/~head.json' in {store.url} is 3145728 bytes",
            f'Could not connect to the endpoint URL: "{endpoint}/{store.bucket}/etl/t/~head.json"',
            f"bucket '{store.bucket}' does not exist",
        ]
        shown = [redact.text(m) for m in messages]
    for text in shown:
        assert store.bucket not in text and endpoint not in text and "<store>" in text, text
    assert "etl/t/~head.json" in shown[0] and "3145728 bytes" in shown[0], "what went wrong is still said"

"""The Checkpoints tabs (task instance and DAG run) and the progress chart, against a real local store.

FastAPI's TestClient drives the view in-process, authenticated as Airflow authenticates (a JWT of this process's
real simple auth manager, checked by Airflow's own dependencies). A user who may read only some DAGs is the
view's own ``Viewer`` put in place of the dependency that builds it (the auth manager's side of that, multi-team
included, is tested against a real api-server in tests/test_ui_auth.py). The browser check screenshots both tabs
in light and dark mode with headless Chromium (skipped without ``chromium``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpoint_history import HOSTILE_HOST, HOSTILE_POD, forge_head, write_history, write_run
from fastapi import FastAPI
from fastapi.testclient import TestClient
from view_server import chromium_or_skip, screenshot, serve_view

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.plugins.stateful_view import StatefulPlugin
from airflow_stateful.plugins.view.access import Viewer, current_viewer
from airflow_stateful.plugins.view.app import create_app
from airflow_stateful.plugins.view.chart import LeaseMarks, Point, build_chart
from airflow_stateful.plugins.view.rows import Bounds

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "artifacts"
RUN = "scheduled__2027-01-15T08:00:00+00:00"
ENRICH = Identity.for_task(dag_id="etl", task_id="enrich", run_id=RUN)
NOW = 1_800_000_000.0 + 1500  # a little after write_history's last commit (START + 1350)


@pytest.fixture(scope="module")
def admin(airflow_home: Path) -> dict[str, str]:
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    token = init_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return LocalObjectStore(root=tmp_path / "state", fsync=False)


def ti_url(identity: Identity, map_index: str | None = None, api: bool = False) -> str:
    parts = identity.task_parts
    assert parts is not None
    from urllib.parse import quote

    path = "/".join(quote(str(parts[k]), safe="") for k in ("dag_id", "scope", "task_id"))
    index = str(parts["map_index"]) if map_index is None else map_index
    return f"{'/api' if api else ''}/ti/{path}?map_index={quote(index, safe='')}"


def client(store: ObjectStore, headers: dict[str, str], now: float = NOW, **kwargs: Any) -> TestClient:
    return TestClient(create_app(store, clock=lambda: now, **kwargs), headers=headers)


# -- the task instance tab ----------------------------------------------------------------------------------


def test_the_task_instance_tab_shows_status_lease_history_outputs_and_chart(
    store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    history = write_history(store, ENRICH, tmp_path / "files")
    view = client(store, admin, now=history.last_commit + 120)
    body = view.get(ti_url(ENRICH, api=True)).json()
    (ident,) = body["identities"]
    assert ident["identity"] == ENRICH.key and ident["matched_by"] == "its key names this run"
    assert ident["status"]["status"] == "active"
    assert ident["lease"]["epoch"] == 4 and ident["lease"]["expected_checkpoint_interval"] == 600
    assert ident["lease"]["holder"]["try_number"] == 4 and not ident["lease"]["expired"]
    rows = ident["checkpoints"]
    assert [r["seq"] for r in rows] == list(range(10, 0, -1))  # newest first
    assert [r["try_number"] for r in rows] == [4, 4, 4, 2, 2, 2, 1, 1, 1, 1]
    assert [r["items_done"] for r in rows] == list(range(1000, 0, -100))
    assert [r["seq"] for r in rows if r["resumed"]] == [8, 5]  # first kept checkpoint of each new lease
    assert {o["name"]: (o["seq"], o["try_number"]) for o in ident["outputs"]} == {
        "report.csv": (9, 4),
        "summary.json": (7, 2),
    }

    page = view.get(ti_url(ENRICH))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert 'class="st st-active"' in text and "is committing" in text
    assert "10m 0s (declared by the holder)" in text
    assert "2027-01-15T08:22:30Z" in text  # renewed at the last commit
    svg = re.search(r"<svg class=\"chart\".*?</svg>", text, re.S)
    assert svg is not None
    chart = svg.group(0)
    # one series per try (tries 1, 2 and 4; try 3 took the lease and left nothing), a resume line where tries 2
    # and 4 resumed, a cross on the last checkpoint of each superseded lease, and the epoch left without one
    assert re.findall(r'<g class="series (s\d)"><title>([^<]*)</title>', chart) == [
        ("s0", "try 1"),
        ("s1", "try 2"),
        ("s2", "try 4"),
    ]
    assert chart.count('<g class="v v-resume">') == 2
    assert ">try 2 resumed<" in chart and ">try 4 resumed<" in chart
    assert chart.count('<path class="fenced"') == 2
    assert "epoch 3 took the lease but left no kept checkpoint" in text
    assert "items done (sum of the resume() cursors)" in text
    assert re.search(r"<code title=\"[0-9a-f]{64}\">[0-9a-f]{12}</code>", text)  # short SHA, full on hover
    # the chart is drawn with classes of the one stylesheet: no style attribute for the CSP to refuse
    assert " style=" not in text and "<script" not in text.lower()
    assert "default-src 'none'" in page.headers["content-security-policy"]


def test_the_map_index_placeholder_of_an_unmapped_task_instance_reads_as_minus_one(
    store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    """Airflow's UI replaces {MAP_INDEX} only on a mapped task instance's page; elsewhere it stays as is."""
    write_history(store, ENRICH, tmp_path / "files")
    view = client(store, admin)
    expected = view.get(ti_url(ENRICH, api=True)).json()
    for index in ("{MAP_INDEX}", "", "-1"):
        assert view.get(ti_url(ENRICH, map_index=index, api=True)).json() == expected, index
    assert view.get(ti_url(ENRICH, map_index="{MAP_INDEX}")).status_code == 200
    for bad in ("x", "-2", "1e3", "{RUN_ID}"):
        response = view.get(ti_url(ENRICH, map_index=bad))
        assert response.status_code == 400 and repr(bad) in response.json()["detail"], bad


def test_a_task_instance_without_state_says_so(store: ObjectStore, admin: dict[str, str]) -> None:
    view = client(store, admin)
    page = view.get("/ti/etl/manual__1/plain_task?map_index=-1")
    assert page.status_code == 200 and "holds no state in this backend" in page.text
    assert view.get("/api/ti/etl/manual__1/plain_task").json()["identities"] == []


def test_run_ids_with_slashes_and_percent_signs_are_cut_from_the_raw_path(
    store: ObjectStore, admin: dict[str, str]
) -> None:
    odd_run = "manual__a/b%2Fc d"
    identity = Identity.for_task(dag_id="etl", task_id="t", run_id=odd_run)
    cs = CheckpointStore(store=store, identity=identity)
    cs.commit(cs.acquire(holder=WriterInfo(run_id=odd_run, try_number=1)), 1)
    view = client(store, admin)
    body = view.get(ti_url(identity, api=True)).json()
    assert body["run_id"] == odd_run and [i["identity"] for i in body["identities"]] == [identity.key]
    run = view.get(f"/api/run/etl/{'manual__a%2Fb%252Fc%20d'}").json()
    assert [r["identity"] for r in run["task_instances"]] == [identity.key]
    for path in ("/ti/etl/x", "/ti/etl/x/y/z", "/ti/etl//t", "/run/etl", "/run/etl/x/y"):
        assert view.get(path).status_code == 404, path
    invalid = view.get("/ti/etl/r%01/t")  # a control character: not a task instance
    assert invalid.status_code == 400 and "control character" in invalid.json()["detail"]


def test_named_state_shows_in_the_tab_of_the_run_that_holds_or_wrote_it(
    store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    ids = write_run(store, "etl", RUN, tmp_path / "files", now=NOW)
    view = client(store, admin)
    body = view.get(ti_url(Identity.for_task(dag_id="etl", task_id="watermark", run_id=RUN), api=True)).json()
    assert [(i["identity"], i["matched_by"]) for i in body["identities"]] == [
        (ids["watermark"].key, "its lease holder works on this run")
    ]
    # weekly was last written by another run: not this run's; after its holder released it, nightly would show
    # by its newest checkpoint's writer instead
    other = view.get(
        ti_url(Identity.for_task(dag_id="etl", task_id="watermark", run_id="manual__other"), api=True)
    ).json()
    assert [(i["identity"], i["matched_by"]) for i in other["identities"]] == [
        (ids["other-named"].key, "this run wrote its newest checkpoint")
    ]


def test_manifests_outside_the_head_are_verified_and_bounded(
    store: ObjectStore, admin: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values too big to ride in the head put the manifest in an object of its own: the view checks it against
    its entry, reads at most MAX_MANIFESTS of them per page (the newest first) and says what it did not read."""
    from airflow_stateful.plugins.view import budget

    cs = CheckpointStore(store=store, identity=ENRICH, keep_last=5)
    lease = cs.acquire(holder=WriterInfo(run_id=RUN, try_number=1, host="worker-1"))
    for n in range(1, 5):
        cs.commit(lease, {"pad": "x" * 20_000}, extra={"cursors": {"items": 10 * n}})
    head = cs.head()
    assert head is not None and all(e.inline is None and e.manifest for e in head.checkpoints)
    corrupt = head.checkpoints[2]  # seq 3
    assert corrupt.manifest is not None
    store.put(corrupt.manifest, store.get(corrupt.manifest).data.replace(b'"items":30', b'"items":99'))
    view = client(store, admin)
    rows = view.get(ti_url(ENRICH, api=True)).json()["identities"][0]["checkpoints"]
    assert [(r["seq"], r["items_done"]) for r in rows if r["manifest"] == "read"] == [
        (4, 40),
        (2, 20),
        (1, 10),
    ]
    assert re.search(
        r"of checkpoint 3 in \S+ is corrupt: expected \d+ bytes with SHA-256", rows[1]["manifest"]
    )
    monkeypatch.setattr(budget, "MAX_MANIFESTS", 2)
    rows = view.get(ti_url(ENRICH, api=True)).json()["identities"][0]["checkpoints"]
    assert [r["seq"] for r in rows if r["manifest"] == "read"] == [4]  # seq 3 took the other read, and failed
    assert rows[3]["manifest"] == "not read (2 manifests per page)"
    page = view.get(ti_url(ENRICH)).text
    assert "not read (2 manifests per page)" in page and "CheckpointCorruptError" in page
    monkeypatch.setattr(budget, "MANIFEST_MAX_BYTES", 1000)
    rows = view.get(ti_url(ENRICH, api=True)).json()["identities"][0]["checkpoints"]
    assert all(r["manifest"].startswith("manifest of ") and r["manifest"].endswith(" not read") for r in rows)
    # the page says the outputs are unknown rather than none
    assert "Not shown: the newest checkpoint's manifest was not read" in view.get(ti_url(ENRICH)).text


# -- the DAG run tab ----------------------------------------------------------------------------------------


def test_the_run_tab_lists_every_stateful_task_instance_of_the_run(
    store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    ids = write_run(store, "etl", RUN, tmp_path / "files", now=NOW)
    write_run(store, "other_dag", RUN, tmp_path / "other", now=NOW)  # same run id, another DAG
    outer = FastAPI()
    outer.mount("/airflow/stateful", create_app(store, clock=lambda: NOW))
    view = TestClient(outer, headers=admin)
    from urllib.parse import quote

    body = view.get(f"/airflow/stateful/api/run/etl/{quote(RUN, safe='')}").json()
    rows = {r["identity"]: r for r in body["task_instances"]}
    assert set(rows) == {
        ids[k].key for k in ("enrich", "score-0", "score-1", "score-2", "publish", "watermark")
    }
    status = {k: rows[ids[k].key]["status"]["status"] for k in ids if ids[k].key in rows}
    assert status == {
        "enrich": "active",
        "score-0": "active",
        "score-1": "stuck",
        "score-2": "dead",
        "publish": "idle",
        "watermark": "active",
    }
    assert rows[ids["enrich"].key]["outputs"] == 2 and rows[ids["enrich"].key]["newest_seq"] == 10
    assert rows[ids["score-1"].key]["map_index"] == 1
    assert (
        rows[ids["score-1"].key]["href"]
        == f"/airflow/stateful/ti/etl/{quote(RUN, safe='')}/score?map_index=1"
    )
    page = view.get(f"/airflow/stateful/run/etl/{quote(RUN, safe='')}")
    assert page.status_code == 200
    assert "6 stateful task instances" in page.text
    assert (
        'class="st st-stuck" title="try 1, run ' in page.text and "committed nothing for 0:40:00" in page.text
    )
    assert f'href="/airflow/stateful/ti/etl/{quote(RUN, safe="")}/score?map_index=2"' in page.text
    # the link opens the task instance's page in the same frame, and it answers
    assert view.get(f"/airflow/stateful/ti/etl/{quote(RUN, safe='')}/score?map_index=2").status_code == 200


def test_the_run_tab_stops_at_its_bounds_and_says_so(
    store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    write_run(store, "etl", RUN, tmp_path / "files", now=NOW)
    view = client(store, admin, bounds=Bounds(max_scanned=2))
    body = view.get(f"/api/run/etl/{RUN}").json()
    assert "listed 2 objects" in body["truncated"]
    assert "Incomplete: the listing stopped after it listed 2 objects" in view.get(f"/run/etl/{RUN}").text
    few = client(store, admin, bounds=Bounds(limit=2)).get(f"/api/run/etl/{RUN}").json()
    assert len(few["task_instances"]) >= 2 and "showed 2 identities (limit)" in few["truncated"]
    every = client(store, admin, bounds=Bounds(limit=6)).get(f"/api/run/etl/{RUN}").json()
    assert len(every["task_instances"]) == 6 and every["truncated"] is None  # exactly the limit: complete


# -- hostile records ----------------------------------------------------------------------------------------


def test_hostile_values_in_records_are_shown_as_text_never_as_markup(
    store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    write_history(store, ENRICH, tmp_path / "files", hostile=True)
    hostile_run = "<b>run</b>"
    odd = Identity.for_task(dag_id="etl", task_id="x", run_id=hostile_run)
    cs = CheckpointStore(store=store, identity=odd)
    lease = cs.acquire(holder=WriterInfo(run_id=hostile_run, host=HOSTILE_HOST, try_number=1))
    cs.commit(lease, 1, extra={"cursors": {"<i>items</i>": 5, "x": "<script>"}})
    broken = Identity.for_task(dag_id="etl", task_id="forged", run_id=RUN)
    cs = CheckpointStore(store=store, identity=broken)
    cs.commit(cs.acquire(), 1)

    def typed(body: dict[str, Any]) -> None:  # a string where the head has an integer
        body["checkpoints"][-1]["total_size"] = "<u>1</u>"

    forge_head(store, broken, typed)
    view = client(store, admin)
    from urllib.parse import quote

    pages = [
        view.get(ti_url(ENRICH)),
        view.get(ti_url(odd)),
        view.get(ti_url(broken)),
        view.get(f"/run/etl/{quote(RUN, safe='')}"),
        view.get(f"/run/etl/{quote(hostile_run, safe='')}"),
    ]
    for page in pages:
        assert page.status_code == 200, page.text[:300]
        lowered = page.text.lower()
        for markup in ("<script", "<img", "<b>run", "<u>1", "<i>items", "onerror=alert(2)>"):
            assert markup not in lowered, (markup, page.url)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages[0].text  # shown, as text (host, and in titles)
    assert "&#34;&gt;&lt;img src=x onerror=alert(2)&gt;" in pages[0].text  # the pod
    assert "&lt;b&gt;run&lt;/b&gt;" in pages[1].text
    assert "CheckpointCorruptError" in pages[2].text  # the forged head is an error of its own section
    assert "CheckpointCorruptError" in pages[3].text and "enrich" in pages[3].text  # and of its own row
    assert HOSTILE_POD not in pages[0].text


def test_each_kept_checkpoint_shows_its_cursors_names_positions_and_last_keys_as_escaped_capped_text(
    store: ObjectStore, admin: dict[str, str]
) -> None:
    """Cursors come from storage: a key like ``<script>`` is shown as text, long ones cut, bad ones named."""
    ident = Identity.for_task(dag_id="etl", task_id="rows", run_id=RUN)
    cs = CheckpointStore(store=store, identity=ident)
    lease = cs.acquire(holder=WriterInfo(run_id=RUN, try_number=1))
    cs.commit(
        lease, 1, extra={"cursors": {"items": 5}}
    )  # a checkpoint of an earlier version: a bare position
    long_key = "k" * 1000
    cursors = {
        "items": {"position": 30, "last_key": "<script>alert(3)</script>", "fingerprint": None},
        "<b>pages</b>": {"position": 2, "last_key": long_key, "fingerprint": None},
    }
    cs.commit(lease, 1, extra={"cursors": cursors})
    cs.commit(lease, 1, extra={"cursors": {"items": {"position": "<i>30</i>"}}})
    view = client(store, admin)
    body = view.get(ti_url(ident, api=True)).json()
    [found] = body["identities"]
    rows = found["checkpoints"]
    assert [r["items_done"] for r in rows] == [None, 32, 5], "the sum of the positions; none when unreadable"
    assert rows[1]["cursors"]["items"]["last_key"] == "<script>alert(3)</script>"  # JSON: whole, as stored
    assert rows[1]["cursors"]["<b>pages</b>"]["last_key"] == long_key
    assert rows[2]["cursors"] == {"items": {"position": 5, "last_key": None, "fingerprint": None}}

    text = view.get(ti_url(ident)).text
    lowered = text.lower()
    for markup in ("<script", "<b>pages", "<i>30"):
        assert markup not in lowered, markup
    assert "<code>items</code> 30 (last <code>&#39;&lt;script&gt;alert(3)&lt;/script&gt;&#39;</code>)" in text
    assert "<code>&lt;b&gt;pages&lt;/b&gt;</code> 2 (last <code>&#39;" + "k" * 78 + "…</code>)" in text
    assert long_key[:100] not in text, "a long key is cut on the page"
    assert "<code>items</code> 5</div>" in text
    assert "checkpoint 3: cursor &#39;items&#39;: field &#39;position&#39; must be an integer" in text


# -- who may read what --------------------------------------------------------------------------------------


class CountingStore:
    """A store factory that counts how often the view opens the store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store, self.calls = store, 0

    def __call__(self) -> ObjectStore:
        self.calls += 1
        return self.store


def test_a_user_gets_403_for_a_dag_they_may_not_read_and_the_store_is_not_read(
    store: ObjectStore, tmp_path: Path, admin: dict[str, str]
) -> None:
    write_run(store, "etl", RUN, tmp_path / "files", now=NOW)
    write_run(store, "ingest", RUN, tmp_path / "ingest", now=NOW)
    opened = CountingStore(store)
    app = create_app(opened, clock=lambda: NOW)
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    app.dependency_overrides[current_viewer] = lambda: Viewer(
        user=SimpleAuthManagerUser(username="viewer", role="viewer"),
        readable_dags=frozenset({"etl"}),
        reads_every_dag=False,
        reads_configuration=False,
    )
    view = TestClient(app)
    ingest = Identity.for_task(dag_id="ingest", task_id="enrich", run_id=RUN)
    for path in (
        ti_url(ingest),
        ti_url(ingest, api=True),
        f"/run/ingest/{RUN}",
        f"/api/run/ingest/{RUN}",
        f"/api/run/nonexistent/{RUN}",  # a DAG that does not exist answers the same
    ):
        response = view.get(path)
        assert response.status_code == 403, path
        assert "worker-" not in response.text and "enrich" not in response.text
    assert opened.calls == 0  # refused before the store was touched
    assert view.get(ti_url(Identity.for_task(dag_id="etl", task_id="enrich", run_id=RUN))).status_code == 200
    rows = view.get(f"/api/run/etl/{RUN}").json()["task_instances"]
    assert rows and all(r["identity"].startswith("etl/") for r in rows)


def test_without_a_token_the_tabs_are_401(store: ObjectStore, tmp_path: Path) -> None:
    write_history(store, ENRICH, tmp_path / "files")
    view = TestClient(create_app(store))
    for path in (ti_url(ENRICH), ti_url(ENRICH, api=True), f"/run/etl/{RUN}", f"/api/run/etl/{RUN}"):
        response = view.get(path)
        assert response.status_code == 401, path
        assert "worker-" not in response.text


def test_the_plugin_declares_the_two_tabs_with_airflows_placeholders() -> None:
    views = {v["destination"]: v for v in StatefulPlugin.external_views}
    assert views["task_instance"]["href"] == "/stateful/ti/{DAG_ID}/{RUN_ID}/{TASK_ID}?map_index={MAP_INDEX}"
    assert views["dag_run"]["href"] == "/stateful/run/{DAG_ID}/{RUN_ID}"
    routes = [v["url_route"] for v in StatefulPlugin.external_views]
    assert len(set(routes)) == len(routes)  # Airflow drops a view whose url_route is taken


# -- the chart ----------------------------------------------------------------------------------------------


def test_the_chart_without_cursors_plots_checkpoint_numbers_per_epoch_and_marks_the_new_lease() -> None:
    points = [
        Point(seq=n, at=1000.0 + 60 * n, epoch=1 if n < 3 else 3, try_number=None, items=None)
        for n in (1, 2, 3)
    ]
    lease = LeaseMarks(holder="host w", epoch=5, acquired_at=1400.0, expired_at=2200.0)
    chart = build_chart(points, lease=lease)
    assert chart is not None
    assert chart.y_caption.startswith("checkpoint number")
    assert [s.label for s in chart.series] == ["epoch 1 (no try number)", "epoch 3 (no try number)"]
    assert [v.kind for v in sorted(chart.lines, key=lambda v: float(v.x))] == ["resume", "lease", "expired"]
    assert len(chart.crosses) == 2  # epoch 1 -> 3, and epoch 3 -> the lease's 5
    assert chart.notes and "epoch 2, epoch 4 took the lease" in chart.notes[0]
    xs = [float(t.pos) for t in chart.x_ticks]
    assert xs == sorted(xs) and all(chart.left <= x <= chart.right for x in xs)
    assert build_chart([]) is None


def test_the_chart_draws_checkpoints_with_and_without_items_done_side_by_side() -> None:
    """A save() before the first resume() loop records no cursors: its mark has no items, the others do."""
    points = [
        Point(seq=1, at=1000.0, epoch=1, try_number=1, items=None),
        Point(seq=2, at=1060.0, epoch=1, try_number=1, items=40),
    ]
    chart = build_chart(points)
    assert chart is not None and chart.y_caption.startswith("items done")
    titles = [m.title for m in chart.series[0].markers]
    assert "items done" not in titles[0] and titles[1].endswith(", 40 items done")


def test_the_chart_of_a_single_checkpoint_has_room_around_it() -> None:
    chart = build_chart([Point(seq=1, at=5000.0, epoch=1, try_number=1, items=3)])
    assert chart is not None and len(chart.series) == 1 and not chart.lines and not chart.crosses
    marker = chart.series[0].markers[0]
    assert chart.left < float(marker.x) < chart.right and chart.top < float(marker.y) < chart.bottom


# -- a real browser -----------------------------------------------------------------------------------------


@pytest.fixture
def tab_server(tmp_path: Path, airflow_home: Path) -> Iterator[str]:
    write_run(LocalObjectStore(root=tmp_path / "state", fsync=False), "etl", RUN, tmp_path / "files", now=NOW)
    with serve_view(tmp_path / "state", now=NOW) as base:
        yield base


@pytest.mark.slow
def test_both_tabs_render_in_headless_chromium_in_light_and_dark_mode(tab_server: str) -> None:
    chromium = chromium_or_skip("the browser check of the Checkpoints tabs")
    from urllib.parse import quote

    ARTIFACTS.mkdir(exist_ok=True)
    pages = {
        "ti": (f"{tab_server}/ti/etl/{quote(RUN, safe='')}/enrich?map_index=%7BMAP_INDEX%7D", "1100,1250"),
        "run": (f"{tab_server}/run/etl/{quote(RUN, safe='')}", "1100,520"),
    }
    shots: dict[str, bytes] = {}
    for name, (url, size) in pages.items():
        for mode in ("light", "dark"):
            dark = ["--force-dark-mode"] if mode == "dark" else []
            data = screenshot(
                chromium,
                url,
                ARTIFACTS / f"checkpoints-{name}-{mode}.png",
                window_size=size,
                flags=["--hide-scrollbars", *dark],
            )
            assert len(data) > 20_000, f"a {len(data)}-byte screenshot of {name} is too small"
            shots[f"{name}-{mode}"] = data
    assert shots["ti-light"] != shots["ti-dark"] and shots["run-light"] != shots["run-dark"]
    print(f"screenshots in {ARTIFACTS}: " + ", ".join(f"checkpoints-{k}.png" for k in shots))


def test_the_tab_marks_pinned_checkpoints_and_says_how_the_newest_try_ended(
    store: ObjectStore, admin: dict[str, str]
) -> None:
    """A deploy rollback's pin and the newest try's outcome, as the head records them, on the page and in JSON;
    a pin's reason comes from storage, so it is shown as escaped text."""
    from airflow_stateful.core.records.outcomes import starting

    cs = CheckpointStore(store=store, identity=ENRICH, clock=lambda: NOW - 60)
    start = starting(now=NOW - 60, try_number=2, max_tries=3, run_id=RUN, will_retry=True, retry_delay=300)
    lease = cs.acquire(holder=WriterInfo(try_number=2, run_id=RUN), outcome=start)
    first = cs.commit(lease, {"n": 1}, schema_version=2)
    cs.pin(lease, first.seq, reason="schema 2 cannot be read by <b>schema-1</b> code", by="try 2")
    cs.commit(lease, {"n": 0}, schema_version=1)
    cs.release(
        lease, outcome=start.ended(state="up_for_retry", now=NOW - 30, retry_in=300, reason="RuntimeError")
    )
    view = client(store, admin)
    (ident,) = view.get(ti_url(ENRICH, api=True)).json()["identities"]
    assert ident["outcome"]["state"] == "up_for_retry" and ident["outcome"]["try_number"] == 2
    pins = {r["seq"]: r["pinned"] for r in ident["checkpoints"]}
    assert pins[first.seq]["reason"].startswith("schema 2 cannot be read") and pins[first.seq + 1] is None
    text = view.get(ti_url(ENRICH)).text
    assert "Newest try: up_for_retry (try 2 of 4, may run from" in text
    assert text.count(">pinned</span>") == 1
    assert "&lt;b&gt;schema-1&lt;/b&gt;" in text and "<b>schema-1</b>" not in text

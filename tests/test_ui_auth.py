"""The Stateful view behind a real ``airflow api-server``: who may see what, and whether it can starve Airflow.

The server runs as deployed: ``airflow api-server`` on 127.0.0.1, the plugin loaded through its entry point,
the simple auth manager (Airflow's default), a state store on the local disk. The simple auth manager has
roles only, so a viewer who may read *some* DAGs is made with the real mechanism Airflow 3.2+ offers for
that: multi-team mode. Two DAG bundles belong to two teams; ``viewer`` is a Viewer of ``team_a`` and may read
``etl`` and ``train`` (bundle_a) but not ``ingest`` (bundle_b); ``admin`` may read everything. The same
``/api/v2/dags`` answers are checked first, so the test shows the view agrees with Airflow's own API.

Tokens come from ``POST /auth/token``; the UI's way (the ``_token`` cookie its login page sets, which the
browser sends when the UI shows the view in its frame) is checked too, and, where ``chromium`` is
installed, in a real browser: the UI at ``/plugin/stateful`` with the viewer logged in.

The server is started once for the module (about 20 s) in its own process group and killed with all its
children at teardown; the test then checks none is left.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from checkpoint_history import write_run

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.testing.s3_server import free_port

pytestmark = [pytest.mark.slow]

psutil = pytest.importorskip("psutil")

JWT_SECRET = "ui-auth-test-jwt-secret-not-a-real-secret-0123456789abcdef0123456789abcdef"
ETL = Identity.for_task(dag_id="etl", task_id="load", run_id="manual__1")
TRAIN = Identity.for_task(dag_id="train", task_id="fit", map_index=2, run_id="manual__1")
INGEST = Identity.for_task(dag_id="ingest", task_id="watermark", name="nightly")
GHOST = Identity.for_task(dag_id="ghost", task_id="t", run_id="r")  # a DAG Airflow does not know
FREE = Identity.parse("team-a/custom-job")  # not a task identity
FREE_IN_ETL = Identity.parse("etl/custom-job")  # not a task identity either, though it starts like etl's
#: the state of run manual__1 of etl's other tasks (tests/checkpoint_history.py: a task instance in each status)
RUN_STATE = {
    "etl/enrich/run=manual__1/map=-1",
    *(f"etl/score/run=manual__1/map={n}" for n in range(3)),
    "etl/publish/run=manual__1/map=-1",
    "etl/watermark/name=nightly/map=-1",
    "etl/watermark/name=weekly/map=-1",
    "etl/load/run=manual__other/map=-1",
}
EVERY = {ETL.key, TRAIN.key, INGEST.key, GHOST.key, FREE.key, FREE_IN_ETL.key, *RUN_STATE}

DAG_FILES = {
    "team_a": (
        "from airflow.sdk import DAG, task\n"
        'with DAG("etl", schedule=None):\n'
        "    @task\n    def load(): pass\n"
        "    @task\n    def enrich(): pass\n"
        "    load() >> enrich()\n"
        'with DAG("train", schedule=None): pass\n'
    ),
    "team_b": 'from airflow.sdk import DAG\nwith DAG("ingest", schedule=None): pass\n',
}
API_SERVER = ("api-server", "--host", "127.0.0.1", "--workers", "1")
SETUP = """
from airflow.cli.cli_parser import get_parser
for argv in (["db", "migrate"], ["teams", "sync"], ["dags", "reserialize"]):
    args = get_parser().parse_args(argv)
    args.func(args)
"""


@dataclass
class Server:
    base: str
    home: Path
    state: Path
    tokens: dict[str, str]

    def get(
        self, path: str, *, user: str | None = None, cookie: str | None = None, accept: str = "*/*"
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {"Accept": accept}
        if user is not None:
            headers["Authorization"] = f"Bearer {self.tokens[user]}"
        if cookie is not None:
            headers["Cookie"] = f"_token={self.tokens[cookie]}"
        request = urllib.request.Request(self.base + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, _lower(response.headers.items()), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, _lower(exc.headers.items()), exc.read()

    def json(self, path: str, **kwargs: Any) -> Any:
        status, _, body = self.get(path, **kwargs)
        assert status == 200, (path, status, body[:500])
        return json.loads(body)


def _lower(headers: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in headers}


def history_path(identity: Identity) -> str:
    return f"/stateful/api/identities/{quote(identity.key, safe='/')}/history"


def _populate(state: Path) -> None:
    store = LocalObjectStore(root=state, fsync=False)
    for identity in (ETL, TRAIN, INGEST, GHOST, FREE, FREE_IN_ETL):
        checkpoints = CheckpointStore(store=store, identity=identity)
        lease = checkpoints.acquire(holder=WriterInfo(host="worker-7", pid=4242, run_id="manual__1"))
        checkpoints.commit(lease, {"n": 1})
    write_run(store, "etl", "manual__1", state.parent / "files", now=time.time())


def _environment(home: Path, state: Path, port: int) -> dict[str, str]:
    bundles = [
        {
            "name": f"bundle_{team[-1]}",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(home / team)},
            "team_name": team,
        }
        for team in DAG_FILES
    ]
    env = {key: os.environ[key] for key in ("PATH", "LANG", "LC_ALL", "TZ") if key in os.environ}
    env.update(
        HOME=str(home),
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__MULTI_TEAM="True",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin,viewer:viewer:team_a",
        AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST=json.dumps(bundles),
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__API_AUTH__JWT_SECRET=JWT_SECRET,
        AIRFLOW__STATEFUL__BACKEND_URL=state.as_uri(),
        AIRFLOW__STATEFUL__CONN_ID="",
        PYTHONUNBUFFERED="1",
    )
    return env


def _token(base: str, username: str, password: str) -> str:
    request = urllib.request.Request(
        f"{base}/auth/token",
        data=json.dumps({"username": username, "password": password}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["access_token"])


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 10 s, and reap."""
    pids = {process.pid}
    with contextlib.suppress(psutil.Error):
        pids |= {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.kill()
            proc.wait(timeout=5)


def _leftovers(home: Path) -> list[str]:
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get("AIRFLOW_HOME") == str(home):
                left.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
    return left


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    home = Path(tempfile.mkdtemp(prefix="stateful-ui-auth-"))
    state = home / "state"
    for team, source in DAG_FILES.items():
        (home / team).mkdir(parents=True)
        (home / team / "dags.py").write_text(source)
    _populate(state)
    port = free_port()
    env = _environment(home, state, port)
    log = home / "api-server.log"
    setup = subprocess.run(
        [sys.executable, "-c", SETUP], env=env, cwd=home, capture_output=True, text=True, timeout=180
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "airflow", *API_SERVER, "--port", str(port)],
            env=env,
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"api-server exited with {process.returncode}\n{log.read_text()[-3000:]}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{base}/api/v2/monitor/health", timeout=5),
            ):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"api-server did not answer in 120 s\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        passwords = json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())
        tokens = {user: _token(base, user, passwords[user]) for user in ("admin", "viewer")}
        yield Server(base=base, home=home, state=state, tokens=tokens)
    finally:
        _kill_group(process)
        left = _leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
        assert not left, "api-server processes left after teardown:\n" + "\n".join(left)


def test_airflows_own_api_restricts_the_viewer_to_team_a(server: Server) -> None:
    """The premise: Airflow itself (not this view) lets viewer read etl and train, and not ingest."""
    assert server.get("/api/v2/dags")[0] == 401
    assert {d["dag_id"] for d in server.json("/api/v2/dags", user="admin")["dags"]} == {
        "etl",
        "train",
        "ingest",
    }
    assert {d["dag_id"] for d in server.json("/api/v2/dags", user="viewer")["dags"]} == {"etl", "train"}
    assert server.get("/api/v2/dags/ingest", user="viewer")[0] == 403


def test_every_route_needs_a_login(server: Server) -> None:
    for path in ("/stateful/", "/stateful/api/identities", history_path(ETL), history_path(FREE)):
        status, headers, body = server.get(path)
        assert status == 401, (path, status, body[:300])
        assert b"manual__1" not in body and b"worker-7" not in body
        assert "nosniff" in headers.get("x-content-type-options", "")
    status, _, body = server.get("/stateful/", accept="text/html")
    assert status == 401 and b"Log in to Airflow" in body  # a browser gets a page with a login link
    bad = "x" + server.tokens["admin"][1:]
    request = urllib.request.Request(
        server.base + "/stateful/api/identities", headers={"Authorization": f"Bearer {bad}"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code in (401, 403)


def test_admin_sees_every_identity_and_the_backend(server: Server) -> None:
    body = server.json("/stateful/api/identities", user="admin")
    assert {row["identity"] for row in body["identities"]} == EVERY
    assert body["backend_url"] == server.state.as_uri()
    etl = next(row for row in body["identities"] if row["identity"] == ETL.key)
    assert etl["lease"]["holder"] == {"host": "worker-7", "pid": 4242, "run_id": "manual__1"}
    assert etl["lease"]["renewed_at"] >= etl["lease"]["acquired_at"]
    for identity in (ETL, INGEST, GHOST, FREE):
        assert server.json(history_path(identity), user="admin")["identity"] == identity.key


def test_viewer_sees_only_the_dags_airflow_lets_them_read(server: Server) -> None:
    body = server.json("/stateful/api/identities", user="viewer")
    assert {row["identity"] for row in body["identities"]} == {ETL.key, TRAIN.key, *RUN_STATE}
    # ingest/ is a DAG they may not read: an empty listing, not an error that confirms it exists
    assert server.json("/stateful/api/identities?prefix=ingest/", user="viewer")["identities"] == []
    starting_with_e = server.json("/stateful/api/identities?prefix=e", user="viewer")["identities"]
    assert {row["identity"] for row in starting_with_e} == {ETL.key, *RUN_STATE}
    status, _, page = server.get("/stateful/", user="viewer")
    assert status == 200
    assert b"etl" in page and b"train" in page
    for hidden in (b"ingest", b"ghost", b"custom-job"):  # custom-job: both free-form keys
        assert hidden not in page


def test_history_of_a_dag_the_viewer_may_not_read_is_403_whether_it_exists_or_not(server: Server) -> None:
    assert server.json(history_path(ETL), user="viewer")["identity"] == ETL.key
    forbidden = (
        INGEST,
        GHOST,
        FREE,
        FREE_IN_ETL,
        Identity.for_task(dag_id="ingest", task_id="n", run_id="x"),
    )
    for identity in forbidden:
        status, _, body = server.get(history_path(identity), user="viewer")
        assert status == 403, (identity.key, status, body)
    missing = Identity.for_task(dag_id="etl", task_id="none", run_id="x")
    assert server.get(history_path(missing), user="viewer")[0] == 404


TI_TAB = "/stateful/ti/{dag}/manual__1/{task}?map_index=-1"
RUN_TAB = "/stateful/run/{dag}/manual__1"


def test_the_checkpoints_tabs_need_a_login_and_read_access_to_the_dag(server: Server) -> None:
    etl_tabs = [TI_TAB.format(dag="etl", task="enrich"), RUN_TAB.format(dag="etl")]
    ingest_tabs = [TI_TAB.format(dag="ingest", task="watermark"), RUN_TAB.format(dag="ingest")]
    for path in etl_tabs + [p.replace("/stateful/", "/stateful/api/") for p in etl_tabs]:
        status, _, body = server.get(path)
        assert status == 401, (path, status, body[:300])
        assert b"worker-" not in body and b"enrich" not in body
    for path in ingest_tabs + [p.replace("/stateful/", "/stateful/api/") for p in ingest_tabs]:
        status, _, body = server.get(path, user="viewer")
        assert status == 403, (path, status, body[:300])  # whether the DAG or its state exists or not
        assert b"worker-" not in body and b"nightly" not in body
        assert server.get(path, user="admin")[0] == 200, path
    status, headers, page = server.get(etl_tabs[0], user="viewer")
    assert status == 200 and b"State of this run" in page and b"<svg" in page
    assert "frame-ancestors 'self'" in headers["content-security-policy"]
    rows = server.json(etl_tabs[1].replace("/stateful/", "/stateful/api/"), user="viewer")["task_instances"]
    not_of_this_run = {"etl/watermark/name=weekly/map=-1", "etl/load/run=manual__other/map=-1"}
    assert {row["identity"] for row in rows} == {ETL.key} | (RUN_STATE - not_of_this_run)
    assert server.get("/stateful/run/ingest/manual__1", cookie="viewer", accept="text/html")[0] == 403


def test_airflow_lists_the_tabs_among_the_plugins_external_views(server: Server) -> None:
    plugins = server.json("/api/v2/plugins", user="admin")["plugins"]
    (ours,) = [p for p in plugins if p["name"] == "stateful"]
    views = {view["destination"]: view for view in ours["external_views"]}
    assert views["task_instance"]["href"] == "/stateful/ti/{DAG_ID}/{RUN_ID}/{TASK_ID}?map_index={MAP_INDEX}"
    assert views["task_instance"]["url_route"] == "stateful-checkpoints"
    assert views["dag_run"]["href"] == "/stateful/run/{DAG_ID}/{RUN_ID}"
    assert views["dag_run"]["url_route"] == "stateful-run-checkpoints"
    assert views["nav"]["href"] == "/stateful/"


def test_the_uis_session_cookie_authenticates_like_a_bearer_token(server: Server) -> None:
    """What the browser sends when the UI frames /stateful/: the ``_token`` cookie, no Authorization."""
    status, headers, page = server.get("/stateful/", cookie="viewer", accept="text/html")
    assert status == 200, page[:500]
    assert b"etl" in page and b"ingest" not in page
    assert "frame-ancestors 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "SAMEORIGIN"
    rows = server.json("/stateful/api/identities", cookie="admin")["identities"]
    assert {row["identity"] for row in rows} == EVERY


def test_paths_outside_the_state_root_are_400_naming_the_value(server: Server) -> None:
    for prefix in ("../../..", "/etc", "etl/../..", "~task-state/", "a\\b"):
        status, _, body = server.get(f"/stateful/api/identities?prefix={quote(prefix)}", user="admin")
        assert status == 400, (prefix, status, body)
        assert repr(prefix) in json.loads(body)["detail"]
    status, _, body = server.get("/stateful/api/identities/etl/..%2F..%2Fx/history", user="admin")
    assert status in (400, 404), body  # never 200 and never a walk outside the root


def _health_while(server: Server, path: str, parallel: int) -> tuple[list[float], dict[int, int]]:
    """Health-check latencies sampled while ``parallel`` requests of ``path`` run, and their status codes."""
    codes: dict[int, int] = {}
    lock = threading.Lock()

    def hit() -> None:
        status = server.get(path, user="admin")[0]
        with lock:
            codes[status] = codes.get(status, 0) + 1

    threads = [threading.Thread(target=hit) for _ in range(parallel)]
    for thread in threads:
        thread.start()
    latencies: list[float] = []
    while any(t.is_alive() for t in threads) or len(latencies) < 5:
        started = time.monotonic()
        urllib.request.urlopen(f"{server.base}/api/v2/monitor/health", timeout=120).read()
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    return latencies, codes


def test_45_parallel_requests_do_not_starve_airflows_health_check(server: Server) -> None:
    """Before: 45 requests walking the host from ``prefix=../../..`` held the api-server's thread pool and
    the health check took up to 34 s here. Now: 400 at once; and 45 heavy legitimate listings run two at a
    time on the view's own threads (the rest wait or get 503), so the health check stays fast."""
    idle = [server.get("/api/v2/monitor/health")[0] for _ in range(3)]
    assert idle == [200, 200, 200]
    latencies, codes = _health_while(server, "/stateful/api/identities?prefix=../../..", 45)
    assert codes == {400: 45}
    assert max(latencies) < 2, latencies
    # A heavy but valid listing: one identity with 20,000 data objects to walk past.
    data = server.state / ETL.key / "~data"
    for n in range(200):
        folder = data / f"{n:032x}"
        folder.mkdir(parents=True)
        for part in range(100):
            (folder / str(part)).write_bytes(b"x")
    latencies, codes = _health_while(server, "/stateful/api/identities?prefix=etl/", 45)
    print(
        f"health under 45 heavy listings: median {statistics.median(latencies):.3f} s, "
        f"max {max(latencies):.3f} s; answers {codes}"
    )
    assert set(codes) <= {200, 503} and codes.get(200, 0) >= 2, codes
    assert max(latencies) < 2, latencies


# -- a real browser: the UI shows the view in its frame, authenticated by the UI's session cookie ----------


class DevTools:
    """Just enough of the Chrome DevTools Protocol: send a command, wait for its answer, keep the events."""

    def __init__(self, url: str) -> None:
        websocket = pytest.importorskip("websocket")
        # No Origin header: chromium 111+ refuses a DevTools websocket whose Origin it was not told to allow.
        self.ws = websocket.create_connection(url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def __call__(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return dict(message.get("result", {}))
            self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


@contextlib.contextmanager
def chromium_page() -> Iterator[DevTools]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not on PATH (apt-get install chromium to run the browser check)")
    with tempfile.TemporaryDirectory(prefix="stateful-chromium-") as profile:
        process = subprocess.Popen(
            [
                chromium,
                *("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"),
                *("--disable-background-networking", "--disable-component-update"),
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text().strip():
                assert time.monotonic() < deadline, "chromium did not open its DevTools port"
                time.sleep(0.1)
            port = int(port_file.read_text().split()[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as response:
                pages = [t for t in json.loads(response.read()) if t["type"] == "page"]
            devtools = DevTools(pages[0]["webSocketDebuggerUrl"])
            try:
                yield devtools
            finally:
                devtools.ws.close()
        finally:
            _kill_group(process)


def _wait_for(devtools: DevTools, expression: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = devtools.evaluate(expression)
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {expression}")


FRAME = """(() => {
  const frame = document.querySelector('iframe');
  const doc = frame && frame.contentDocument;
  if (!doc || !doc.querySelector('h1')) return null;
  return {text: doc.body.innerText, sandbox: frame.getAttribute('sandbox'), src: frame.src,
          h1: getComputedStyle(doc.querySelector('h1')).fontSize,
          links: [...doc.querySelectorAll('a')].map(a => [a.textContent, a.getAttribute('href'), a.target])};
})()"""


CLICK_FIRST_RUN_LINK = """(() => {
  const doc = document.querySelector('iframe').contentDocument;
  [...doc.querySelectorAll('a')].find(a => a.textContent == 'DAG run').click();
  return true;
})()"""


def test_the_ui_shows_the_view_to_a_logged_in_viewer_in_chromium(server: Server) -> None:
    """The viewer is logged in the way the UI's login page leaves them (the ``_token`` cookie); the UI at
    /plugin/stateful frames /stateful/, whose request carries that cookie and no Authorization header."""
    with chromium_page() as page:
        page("Network.enable")
        page("Log.enable")
        page("Runtime.enable")
        page("Network.setCookie", name="_token", value=server.tokens["viewer"], url=server.base, path="/")
        page("Page.navigate", url=f"{server.base}/plugin/stateful")
        frame = _wait_for(page, FRAME)
        assert "etl" in frame["text"] and "train" in frame["text"]
        assert "ingest" not in frame["text"] and "custom-job" not in frame["text"]
        assert frame["h1"] == "22px", "the stylesheet did not apply: the CSP hash does not match it"
        shot = os.environ.get("STATEFUL_UI_SCREENSHOT")  # a PNG of the page, for a person to look at
        if shot:
            Path(shot).write_bytes(base64.b64decode(page("Page.captureScreenshot", format="png")["data"]))
        # Airflow 3.3 frames external views in a sandbox without allow-top-navigation: a link that targets
        # the top window is refused there, so the view's links open in the frame, and the UI mirrors the
        # frame's path into its own URL.
        run_link = next(href for label, href, _ in frame["links"] if label == "DAG run")
        page.evaluate(CLICK_FIRST_RUN_LINK)
        _wait_for(page, f"document.querySelector('iframe').contentWindow.location.pathname == {run_link!r}")
        # The UI mirrors the frame's path a moment after the frame navigated (a fresh-clone run caught it still
        # showing the first page): wait for it, then check it.
        mirrored = f"/plugin/stateful{run_link}"
        _wait_for(page, f"location.pathname == {mirrored!r}", timeout=15)
        assert page.evaluate("location.pathname") == mirrored
        logged = [e["params"]["entry"]["text"] for e in page.events if e.get("method") == "Log.entryAdded"]
        assert not [t for t in logged if "Content Security Policy" in t or "Unsafe attempt" in t], logged


TAB_FRAME = """(() => {
  const frame = document.querySelector('iframe');
  const doc = frame && frame.contentDocument;
  if (!doc || !doc.querySelector('h1') || !doc.querySelector('table')) return null;
  return {text: doc.body.innerText, src: frame.getAttribute('src'), location: frame.contentWindow.location.href,
          frame_background: getComputedStyle(doc.body).backgroundColor,
          ui_background: getComputedStyle(document.documentElement).backgroundColor,
          tabs: [...document.querySelectorAll('a, button')].map(e => e.textContent.trim())};
})()"""


def _trigger(server: Server, dag_id: str, run_id: str) -> None:
    """A DAG run (queued; no scheduler runs here), so Airflow's UI has pages for its task instances."""
    request = urllib.request.Request(
        f"{server.base}/api/v2/dags/{dag_id}/dagRuns",
        data=json.dumps({"dag_run_id": run_id, "logical_date": None}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.tokens['admin']}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200, response.read()


def test_the_checkpoints_tabs_show_in_the_ui_in_light_and_dark_mode(server: Server) -> None:
    """The viewer opens the task instance page and the DAG run page of Airflow's UI, tab "Checkpoints": the UI
    frames the view with the placeholders of the tab's href replaced. ``STATEFUL_UI_SCREENSHOT_DIR``: where to
    save a PNG of each tab, in light and dark mode (docs/img/ holds the ones the docs show)."""
    _trigger(server, "etl", "manual__1")
    shots = os.environ.get("STATEFUL_UI_SCREENSHOT_DIR")
    pages = {
        "ti": "/dags/etl/runs/manual__1/tasks/enrich/plugin/stateful-checkpoints",
        "run": "/dags/etl/runs/manual__1/plugin/stateful-run-checkpoints",
    }
    with chromium_page() as page:
        page("Log.enable")
        page("Network.setCookie", name="_token", value=server.tokens["viewer"], url=server.base, path="/")
        page("Emulation.setDeviceMetricsOverride", width=1400, height=1300, deviceScaleFactor=1, mobile=False)
        backgrounds = {}
        for name, path in pages.items():
            for mode in ("light", "dark"):
                page("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": mode}])
                page("Page.navigate", url=f"{server.base}{path}")
                frame = _wait_for(page, TAB_FRAME)
                assert "Checkpoints" in frame["tabs"], frame["tabs"]
                if name == "ti":
                    # unmapped: the UI had no map index for {MAP_INDEX} and left it; the view reads it as -1
                    assert frame["src"] == "/stateful/ti/etl/manual__1/enrich?map_index={MAP_INDEX}", frame[
                        "src"
                    ]
                    assert "State of this run" in frame["text"] and "try 4 resumed" in frame["text"]
                    assert "report.csv" in frame["text"]
                else:
                    assert frame["src"] == "/stateful/run/etl/manual__1", frame["src"]
                    assert (
                        "stuck" in frame["text"] and "dead" in frame["text"] and "score [1]" in frame["text"]
                    )
                backgrounds[name, mode] = (frame["frame_background"], frame["ui_background"])
                if shots:
                    png = base64.b64decode(page("Page.captureScreenshot", format="png")["data"])
                    Path(shots, f"checkpoints-{name}-{mode}.png").write_bytes(png)
        # the view follows the browser's colour scheme, and then has the UI's own background (which follows it
        # too while the UI's theme is "system", its default)
        for (name, mode), (frame_background, ui_background) in backgrounds.items():
            assert frame_background == ui_background, (name, mode, frame_background, ui_background)
        assert backgrounds["ti", "light"][0] == "rgb(255, 255, 255)" != backgrounds["ti", "dark"][0]
        logged = [e["params"]["entry"]["text"] for e in page.events if e.get("method") == "Log.entryAdded"]
        assert not [t for t in logged if "Content Security Policy" in t], logged

"""The Stateful view's FastAPI app: an HTML page and a JSON API, behind Airflow's auth manager.

* ``GET /stateful/``: the page (server-rendered, no JavaScript);
* ``GET /stateful/api/identities?prefix=&limit=``: one summary per identity;
* ``GET /stateful/api/identities/{key}/history``: the kept checkpoints of one identity, newest first;
* ``GET /stateful/ti/{dag_id}/{run_id}/{task_id}?map_index=N`` (and ``/stateful/api/ti/...``): the Checkpoints
  tab of a task instance (status, lease, kept history, outputs, progress chart), :mod:`.task`;
* ``GET /stateful/run/{dag_id}/{run_id}`` (and ``/stateful/api/run/...``): the Checkpoints tab of a DAG run,
  :mod:`.run`.

``/`` and ``/api/identities`` take ``status=`` (``active``, ``stuck``, ``dead``, ``idle``, or several separated
by commas): the rows of the listing whose :func:`~airflow_stateful.core.fleet.status.work_status` is one of them.

Every route needs an authenticated user (a bearer token, or the session cookie the UI sets at login) and
shows only identities of DAGs that user may read (:mod:`.access`). There are no write actions.

Hardening, because a head record is input from whoever can write the bucket: the page is a Jinja2 template
with autoescape; every response carries a Content-Security-Policy without scripts (the one inline stylesheet
is allowed by its hash), ``nosniff``, and frame rules that let only Airflow's own UI (same origin) show it in
its frame. ``prefix`` and identity keys are checked (400 naming the value) before the store is touched. The
store is read on the view's own two threads, never on the api-server's shared thread pool (see
:class:`WorkGate`), and each listing is bounded (:class:`.rows.Bounds`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlencode, urlparse

from airflow.api_fastapi.app import get_auth_manager
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_stateful.core.errors import IdentityError, StatefulError
from airflow_stateful.core.fleet.status import STATUSES
from airflow_stateful.core.protocol.heads import HeadStore
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.plugins.view.access import Viewer, ViewerDep, checked_identity, checked_prefix
from airflow_stateful.plugins.view.rows import Bounds, Entry, Listing, collect, history_of
from airflow_stateful.plugins.view.run import dag_run_tab
from airflow_stateful.plugins.view.task import TabView, run_path, task_instance_tab, ti_path
from airflow_stateful.plugins.view.urls import URL_PREFIX

DEFAULT_LIMIT = 500
MAX_LIMIT = 2000

_TEMPLATES = Path(__file__).resolve().parent / "templates"
_ENV = Environment(
    loader=FileSystemLoader(_TEMPLATES), autoescape=True, undefined=StrictUndefined, auto_reload=False
)
_CSS = (_TEMPLATES / "stateful.css").read_text(encoding="utf-8")
_CSS_HASH = base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()

#: No script, no plugin, no foreign resource; only the page's own stylesheet (by hash); shown in a frame
#: only by a page of the same origin (Airflow's UI embeds external views with url_route in an iframe).
CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; style-src 'sha256-{_CSS_HASH}'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "SAMEORIGIN",  # for browsers that predate frame-ancestors
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",  # what a user may see depends on who they are
}

T = TypeVar("T")


def configured_store() -> ObjectStore:
    """The store of ``[stateful] backend_url``, with S3 credentials from ``[stateful] conn_id`` if any."""
    from airflow_stateful.hooks.state import StateHook

    return StateHook().get_store()


class WorkGate:
    """Runs the view's blocking work (listing the store, reading heads, rendering) on its own few threads.

    The api-server runs every sync ``def`` route on one shared thread pool (anyio's, 40 threads): a handler
    waiting on a slow store holds one thread, and 40 such requests starve every other sync route, Airflow's
    health check included. So the view's handlers are ``async`` and hand their work to this gate: at most
    ``workers`` run at once, at most ``queue`` more wait without holding a thread, and the rest get 503 with
    ``Retry-After`` at once. A slot is freed when the work ends, not when its client goes away.
    """

    def __init__(self, *, workers: int = 2, queue: int = 16) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-view")
        self._capacity = workers + queue
        self._admitted = 0
        self._lock = threading.Lock()

    def _release(self, _: Future[Any]) -> None:
        with self._lock:
            self._admitted -= 1

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        with self._lock:
            if self._admitted >= self._capacity:
                raise HTTPException(
                    status_code=503,
                    detail="the Stateful view is busy; retry in a few seconds",
                    headers={"Retry-After": "5"},
                )
            self._admitted += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)


def _airflow_base(request: Request) -> str:
    """Where Airflow's UI lives: this app's mount point without ``/stateful`` (``""`` at the root)."""
    root = str(request.scope.get("root_path") or "").rstrip("/")
    return root[: -len(URL_PREFIX)] if root.endswith(URL_PREFIX) else ""


def _raw_key(request: Request, decoded: str) -> str:
    """The identity key exactly as the client escaped it.

    Identity keys hold percent-escapes themselves (``run=scheduled__2026%3A...``), so a client sends them
    with ``%`` escaped as ``%25``. Starlette hands path parameters over decoded one level too far in some
    stacks; the raw path is unambiguous, so the key is cut from it and unescaped exactly once.
    """
    raw = request.scope.get("raw_path")
    marker, suffix = "/api/identities/", "/history"
    if isinstance(raw, bytes):
        path = raw.decode("latin-1").split("?", 1)[0]
        if marker in path and path.endswith(suffix):
            return unquote(path[path.rindex(marker) + len(marker) : -len(suffix)])
    return decoded


def configured_interval() -> timedelta:
    """``[stateful] expected_checkpoint_interval``: when a lease holder that declared none counts as stuck."""
    from airflow_stateful.config import load_settings

    return timedelta(seconds=load_settings().expected_checkpoint_interval)


def _view_root(request: Request) -> str:
    """Where this app is mounted (``/stateful``, or ``/airflow/stateful`` under a base path)."""
    return str(request.scope.get("root_path") or "").rstrip("/")


def _segments(request: Request, marker: tuple[str, ...], count: int) -> list[str]:
    """The ``count`` path segments after ``<root>/<marker...>/``, each unescaped exactly once.

    Cut from the raw path, like identity keys: a run id may hold ``/`` (escaped ``%2F`` by the UI), which the
    decoded path would split. 404 unless there are exactly ``count`` non-empty segments.
    """
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    parts = path.split("?", 1)[0].split("/")
    start = _view_root(request).count("/") + 1 + len(marker)
    if (
        tuple(parts[start - len(marker) : start]) != marker
        or len(parts) != start + count
        or "" in parts[start:]
    ):
        raise HTTPException(status_code=404, detail="not found")
    return [unquote(part) for part in parts[start:]]


def _map_index(value: str) -> int:
    """``map_index=``: an integer >= -1; empty or the UI's unreplaced ``{MAP_INDEX}`` (an unmapped task
    instance, whose page has no map index to put there) is -1."""
    if value in ("", "{MAP_INDEX}"):
        return -1
    if not re.fullmatch(r"-?[0-9]{1,9}", value) or int(value) < -1:
        raise HTTPException(status_code=400, detail=f"map_index {value!r} is not an integer >= -1")
    return int(value)


def _checked_task(dag_id: str, run_id: str, task_id: str, map_index: int) -> None:
    """400 naming the value unless these make a valid identity key (checked before anything else)."""
    try:
        Identity.for_task(dag_id=dag_id, task_id=task_id, map_index=map_index, run_id=run_id)
    except IdentityError as exc:
        raise HTTPException(status_code=400, detail=f"not a task instance: {exc}") from None


def _statuses(value: str) -> frozenset[str]:
    """``status=``: statuses separated by commas (empty: every status), else 400 naming the value."""
    wanted = frozenset(part.strip() for part in value.split(",") if part.strip())
    unknown = sorted(wanted - set(STATUSES))
    if unknown:
        raise HTTPException(
            status_code=400,
            detail=f"status {value!r} is not one of {', '.join(STATUSES)} (separate several with commas)",
        )
    return wanted


def _status_of(entry: Entry) -> str | None:
    status = entry.row.get("status")
    return str(status["status"]) if isinstance(status, dict) else None


def _safe_url(url: str) -> str:
    """The backend URL without any credentials someone put in it."""
    parsed = urlparse(url)
    if parsed.username or parsed.password:
        return parsed._replace(netloc=parsed.hostname or "").geturl()
    return url


def create_app(
    store: ObjectStore | Callable[[], ObjectStore] | None = None,
    *,
    clock: Callable[[], float] = time.time,
    bounds: Bounds | None = None,
    gate: WorkGate | None = None,
    default_interval: timedelta | None = None,
) -> FastAPI:
    """The view's FastAPI app.

    :param store: the object store to show, or a factory for it; default: ``[stateful] backend_url``,
        opened on the first request (never at import: Airflow imports plugins while it starts up).
    :param clock: seconds since the epoch, for idle ages and lease expiry.
    :param bounds: what one listing may cost; ``limit=`` of a request replaces ``bounds.limit``.
    :param gate: where the blocking work runs (default: two threads of the view's own).
    :param default_interval: when a lease holder that declared no ``expected_checkpoint_interval`` counts as
        stuck; default: ``[stateful] expected_checkpoint_interval``, read on the first request.
    """
    app = FastAPI(title="Stateful checkpoints", docs_url=None, redoc_url=None, openapi_url=None)
    # Airflow's dependencies find the auth manager on ``request.app.state``, which is the api-server's app
    # for its own routes but this app for ours: hand them the api-server's auth manager instead.
    try:  # Airflow 3.3; 3.1 and 3.2 call get_auth_manager() directly
        from airflow.api_fastapi.core_api.security import auth_manager_from_app
    except ImportError:
        pass
    else:
        app.dependency_overrides[auth_manager_from_app] = get_auth_manager
    work = gate or WorkGate()
    limits = bounds or Bounds()
    opened: list[ObjectStore] = []
    open_lock = threading.Lock()

    def get_store() -> ObjectStore:
        with open_lock:
            if not opened:
                opened.append(store if isinstance(store, ObjectStore) else (store or configured_store)())
            return opened[0]

    intervals: list[timedelta] = [default_interval] if default_interval is not None else []

    def interval() -> timedelta:
        with open_lock:
            if not intervals:
                intervals.append(configured_interval())
            return intervals[0]

    def backend_url(viewer: Viewer) -> str | None:
        return _safe_url(get_store().url) if viewer.reads_configuration else None

    def listing(viewer: Viewer, prefix: str, limit: int, base: str) -> Listing:
        return collect(
            get_store(),
            prefixes=viewer.scan_prefixes(prefix),
            may_read=viewer.may_read,
            bounds=replace(limits, limit=limit),
            now=clock(),
            base=base,
            default_interval=interval(),
        )

    def tab_work(
        read: Callable[..., TabView], context: dict[str, Any], **where: Any
    ) -> Callable[[], tuple[TabView, dict[str, Any]]]:
        """The work that reads a tab, ``read(store, **where, now=, default_interval=, bounds=)``, and returns it
        with the page's ``context``."""

        def load() -> tuple[TabView, dict[str, Any]]:
            tab = read(get_store(), **where, now=clock(), default_interval=interval(), bounds=limits)
            return tab, context

        return load

    def ti_tab(
        viewer: Viewer, request: Request, map_index: str, *, api: bool = False
    ) -> Callable[[], tuple[TabView, dict[str, Any]]]:
        """Check the request (400, then 403) and return the work that reads the task instance's tab."""
        dag_id, run_id, task_id = _segments(request, ("api", "ti") if api else ("ti",), 3)
        index = _map_index(map_index)
        _checked_task(dag_id, run_id, task_id, index)
        viewer.require_dag(dag_id)
        root = _view_root(request)
        context = {
            "dag_id": dag_id,
            "run_id": run_id,
            "task": task_id if index == -1 else f"{task_id} [{index}]",
            "run_href": run_path(root, dag_id, run_id),
            "json_href": ti_path(f"{root}/api", dag_id, run_id, task_id, index),
        }
        return tab_work(
            task_instance_tab, context, dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=index
        )

    def run_tab(
        viewer: Viewer, request: Request, *, api: bool = False
    ) -> Callable[[], tuple[TabView, dict[str, Any]]]:
        """Check the request (400, then 403) and return the work that reads the DAG run's tab."""
        dag_id, run_id = _segments(request, ("api", "run") if api else ("run",), 2)
        _checked_task(dag_id, run_id, "-", -1)
        viewer.require_dag(dag_id)
        root = _view_root(request)
        context = {"dag_id": dag_id, "run_id": run_id, "json_href": run_path(f"{root}/api", dag_id, run_id)}
        return tab_work(dag_run_tab, context, dag_id=dag_id, run_id=run_id, root=root)

    async def tab_page(template: str, load: Callable[[], tuple[TabView, dict[str, Any]]]) -> HTMLResponse:
        """A tab's page: ``load`` read and rendered with ``template`` by the work gate."""

        def render() -> str:
            tab, context = load()
            return _ENV.get_template(template).render(css=_CSS, tab=tab, **context)

        return HTMLResponse(await work.run(render))

    async def tab_json(load: Callable[[], tuple[TabView, dict[str, Any]]]) -> dict[str, Any]:
        """A tab's JSON body, read by the work gate."""
        tab, _ = await work.run(load)
        return tab.body

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Callable[[Request], Any]) -> Response:
        response: Response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def errors(request: Request, exc: StarletteHTTPException) -> Response:
        """Browsers get a small page (with a login link on 401); API clients Airflow's usual JSON."""
        if "text/html" not in request.headers.get("accept", ""):
            return await http_exception_handler(request, exc)
        login = None
        if exc.status_code == 401:
            login = get_auth_manager().get_url_login(next_url=str(request.url))
        body = _ENV.get_template("error.html").render(
            css=_CSS, status=exc.status_code, detail=str(exc.detail), login_href=login
        )
        return HTMLResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.get("/", response_class=HTMLResponse)
    async def page(
        request: Request,
        viewer: ViewerDep,
        prefix: str = "",
        limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
        status: str = "",
    ) -> HTMLResponse:
        prefix = checked_prefix(prefix)
        wanted = _statuses(status)
        base = _airflow_base(request)

        def href(status_value: str) -> str:
            params: dict[str, str | int] = {"prefix": prefix} if prefix else {}
            if limit != DEFAULT_LIMIT:
                params["limit"] = limit
            if status_value:
                params["status"] = status_value
            return f"?{urlencode(params)}" if params else "./"

        def render() -> str:
            found = listing(viewer, prefix, limit, base)
            counts = {name: sum(_status_of(e) == name for e in found.entries) for name in STATUSES}
            shown = [e for e in found.entries if not wanted or _status_of(e) in wanted]
            filters = [{"label": "all", "count": len(found.entries), "href": href(""), "on": not wanted}]
            filters += [
                {"label": name, "count": counts[name], "href": href(name), "on": wanted == {name}}
                for name in STATUSES
            ]
            json_query = href(",".join(sorted(wanted)))
            return _ENV.get_template("stateful.html").render(
                css=_CSS,
                entries=shown,
                listed=len(found.entries),
                filters=filters,
                status=", ".join(sorted(wanted)),
                truncated=found.truncated,
                backend_url=backend_url(viewer),
                prefix=prefix,
                json_href="api/identities" + (json_query if json_query.startswith("?") else ""),
            )

        return HTMLResponse(await work.run(render))

    @app.get("/api/identities")
    async def identities(
        request: Request,
        viewer: ViewerDep,
        prefix: str = "",
        limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
        status: str = "",
    ) -> dict[str, Any]:
        prefix = checked_prefix(prefix)
        wanted = _statuses(status)
        base = _airflow_base(request)

        def answer() -> dict[str, Any]:
            found = listing(viewer, prefix, limit, base)
            return {
                "backend_url": backend_url(viewer),
                "identities": [e.row for e in found.entries if not wanted or _status_of(e) in wanted],
                "status_counts": {
                    name: sum(_status_of(e) == name for e in found.entries) for name in STATUSES
                },
                "truncated": found.truncated,
            }

        return await work.run(answer)

    @app.get("/ti/{path:path}", response_class=HTMLResponse)
    async def task_instance_page(
        path: str, request: Request, viewer: ViewerDep, map_index: str = "-1"
    ) -> HTMLResponse:
        return await tab_page("task.html", ti_tab(viewer, request, map_index))

    @app.get("/api/ti/{path:path}")
    async def task_instance_api(
        path: str, request: Request, viewer: ViewerDep, map_index: str = "-1"
    ) -> dict[str, Any]:
        return await tab_json(ti_tab(viewer, request, map_index, api=True))

    @app.get("/run/{path:path}", response_class=HTMLResponse)
    async def dag_run_page(path: str, request: Request, viewer: ViewerDep) -> HTMLResponse:
        return await tab_page("run.html", run_tab(viewer, request))

    @app.get("/api/run/{path:path}")
    async def dag_run_api(path: str, request: Request, viewer: ViewerDep) -> dict[str, Any]:
        return await tab_json(run_tab(viewer, request, api=True))

    @app.get("/api/identities/{key:path}/history")
    async def history(key: str, request: Request, viewer: ViewerDep) -> dict[str, Any]:
        identity = checked_identity(_raw_key(request, key))
        viewer.require(identity)

        def load() -> HeadRecord | None:
            try:
                return HeadStore(store=get_store(), identity=identity).load()[0]
            except StatefulError as exc:  # a corrupt or forged head: say so, as the page's error rows do
                raise HTTPException(status_code=500, detail=f"{type(exc).__name__}: {exc}") from None

        head = await work.run(load)
        if head is None:
            raise HTTPException(status_code=404, detail=f"identity {identity.key!r} has no state")
        return {"identity": identity.key, "epoch": head.epoch, "checkpoints": history_of(head)}

    return app

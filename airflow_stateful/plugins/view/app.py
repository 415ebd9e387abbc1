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
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode, urlparse

from airflow.api_fastapi.app import get_auth_manager
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_stateful.core.errors import StatefulError
from airflow_stateful.core.fleet.status import STATUSES
from airflow_stateful.core.protocol.heads import HeadStore
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.plugins.view.access import Viewer, ViewerDep, checked_identity, checked_prefix
from airflow_stateful.plugins.view.configured import configured_interval, configured_store
from airflow_stateful.plugins.view.params import (
    checked_task,
    parsed_map_index,
    parsed_statuses,
    path_segments,
    raw_key,
    view_root,
)
from airflow_stateful.plugins.view.redact import NOTHING, Redactor
from airflow_stateful.plugins.view.rows import Bounds, Entry, Listing, collect, history_of, status_of
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


def _safe_url(url: str) -> str:
    """The backend URL without any credentials someone put in it."""
    parsed = urlparse(url)
    if parsed.username or parsed.password:
        return parsed._replace(netloc=parsed.hostname or "").geturl()
    return url


def listing_href(prefix: str, limit: int, status: str) -> str:
    """The listing's own link with ``status`` (``""``: every status), keeping ``prefix`` and a non-default
    ``limit``; ``./`` when there is nothing to keep."""
    params: dict[str, str | int] = {"prefix": prefix} if prefix else {}
    if limit != DEFAULT_LIMIT:
        params["limit"] = limit
    if status:
        params["status"] = status
    return f"?{urlencode(params)}" if params else "./"


def status_counts(entries: list[Entry]) -> dict[str, int]:
    """How many of ``entries`` have each status (error rows have none)."""
    return {name: sum(status_of(e) == name for e in entries) for name in STATUSES}


def status_filters(
    entries: list[Entry], prefix: str, limit: int, wanted: frozenset[str]
) -> list[dict[str, Any]]:
    """The page's status filters: "all", then each status, with its count and link, and whether it is on."""
    counts = status_counts(entries)
    filters = [
        {"label": "all", "count": len(entries), "href": listing_href(prefix, limit, ""), "on": not wanted}
    ]
    filters += [
        {
            "label": name,
            "count": counts[name],
            "href": listing_href(prefix, limit, name),
            "on": wanted == {name},
        }
        for name in STATUSES
    ]
    return filters


def use_airflow_auth_manager(app: FastAPI) -> None:
    """Hand Airflow's security dependencies the api-server's auth manager.

    They find it on ``request.app.state``, which is the api-server's app for its own routes but this app for
    ours. Airflow 3.3 has the dependency to override; 3.1 and 3.2 call ``get_auth_manager()`` directly.
    """
    try:
        from airflow.api_fastapi.core_api.security import auth_manager_from_app
    except ImportError:
        pass
    else:
        app.dependency_overrides[auth_manager_from_app] = get_auth_manager


async def security_headers(request: Request, call_next: Callable[[Request], Any]) -> Response:
    """Middleware: :data:`SECURITY_HEADERS` on every response, errors included."""
    response: Response = await call_next(request)
    response.headers.update(SECURITY_HEADERS)
    return response


async def error_page(request: Request, exc: StarletteHTTPException) -> Response:
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


TabLoad = Callable[[], tuple[TabView, dict[str, Any]]]
"""The work that reads a tab and returns it with its page's context (run by the work gate)."""


class View:
    """What the routes of one app share (the store, the clock, the bounds, the work gate), and the routes.

    The routes are methods so that :func:`create_app` reads as the list of them. Each one takes ``viewer:
    ViewerDep``: none answers without Airflow's auth manager (:mod:`.access`), and each checks what it is
    asked (400) and whether the viewer may read it (403) before the store is touched.
    """

    def __init__(
        self,
        store: ObjectStore | Callable[[], ObjectStore] | None,
        *,
        clock: Callable[[], float],
        bounds: Bounds | None,
        gate: WorkGate | None,
        default_interval: timedelta | None,
        signer: HeadSigner | None = None,
    ) -> None:
        self._store = store
        self.clock = clock
        self.bounds = bounds or Bounds()
        self.work = gate or WorkGate()
        self._lock = threading.Lock()
        self._opened: ObjectStore | None = None
        self._signer = signer
        self._marks: MarkStore | None = None
        self._interval = default_interval

    def store(self) -> ObjectStore:
        """The store, opened on the first request that reads it (never at import: Airflow imports plugins
        while it starts up); a factory that fails is asked again by the next request."""
        with self._lock:
            if self._opened is None:
                store = self._store
                if isinstance(store, ObjectStore):
                    self._opened = store
                elif store is not None:
                    self._opened = store()
                else:
                    self._opened, self._signer, self._marks = configured_store()
            return self._opened

    def marks(self) -> MarkStore | None:
        """The configured store's high-water marks (none for a store given to the app)."""
        self.store()
        return self._marks

    def signer(self) -> HeadSigner | None:
        """The head signing policy of the store (the configured one's, else what the app was given)."""
        self.store()
        return self._signer

    def interval(self) -> timedelta:
        """When a lease holder that declared no interval counts as stuck, read on the first request."""
        with self._lock:
            if self._interval is None:
                self._interval = configured_interval()
            return self._interval

    def backend_url(self, viewer: Viewer) -> str | None:
        return _safe_url(self.store().url) if viewer.reads_configuration else None

    def redactor(self, viewer: Viewer) -> Redactor:
        """What hides the store's location from ``viewer`` (nothing, for one who may read the configuration)."""
        return NOTHING if viewer.reads_configuration else Redactor.of(self.store())

    def listing(self, viewer: Viewer, prefix: str, limit: int, base: str) -> Listing:
        listing = collect(
            self.store(),
            prefixes=viewer.scan_prefixes(prefix),
            may_read=viewer.may_read,
            bounds=replace(self.bounds, limit=limit),
            now=self.clock(),
            base=base,
            default_interval=self.interval(),
            signer=self.signer(),
            marks=self.marks(),
        )
        return self.redactor(viewer).data(listing)

    def tab_work(
        self, viewer: Viewer, read: Callable[..., TabView], context: dict[str, Any], **where: Any
    ) -> TabLoad:
        """The work that reads a tab, ``read(store, **where, now=, default_interval=, bounds=, signer=)``, and returns it
        with the page's ``context``."""

        def load() -> tuple[TabView, dict[str, Any]]:
            tab = read(
                self.store(),
                **where,
                now=self.clock(),
                default_interval=self.interval(),
                bounds=self.bounds,
                signer=self.signer(),
                marks=self.marks(),
            )
            return self.redactor(viewer).data(tab), context

        return load

    def ti_tab(self, viewer: Viewer, request: Request, map_index: str, *, api: bool = False) -> TabLoad:
        """Check the request (400, then 403) and return the work that reads the task instance's tab."""
        dag_id, run_id, task_id = path_segments(request, ("api", "ti") if api else ("ti",), 3)
        index = parsed_map_index(map_index)
        checked_task(dag_id, run_id, task_id, index)
        viewer.require_dag(dag_id)
        root = view_root(request)
        context = {
            "dag_id": dag_id,
            "run_id": run_id,
            "task": task_id if index == -1 else f"{task_id} [{index}]",
            "run_href": run_path(root, dag_id, run_id),
            "json_href": ti_path(f"{root}/api", dag_id, run_id, task_id, index),
        }
        return self.tab_work(
            viewer, task_instance_tab, context, dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=index
        )

    def run_tab(self, viewer: Viewer, request: Request, *, api: bool = False) -> TabLoad:
        """Check the request (400, then 403) and return the work that reads the DAG run's tab."""
        dag_id, run_id = path_segments(request, ("api", "run") if api else ("run",), 2)
        checked_task(dag_id, run_id, "-", -1)
        viewer.require_dag(dag_id)
        root = view_root(request)
        context = {"dag_id": dag_id, "run_id": run_id, "json_href": run_path(f"{root}/api", dag_id, run_id)}
        return self.tab_work(viewer, dag_run_tab, context, dag_id=dag_id, run_id=run_id, root=root)

    async def tab_page(self, template: str, load: TabLoad) -> HTMLResponse:
        """A tab's page: ``load`` read and rendered with ``template`` by the work gate."""

        def render() -> str:
            tab, context = load()
            return _ENV.get_template(template).render(css=_CSS, tab=tab, **context)

        return HTMLResponse(await self.work.run(render))

    async def tab_json(self, load: TabLoad) -> dict[str, Any]:
        """A tab's JSON body, read by the work gate."""
        tab, _ = await self.work.run(load)
        return tab.body

    # -- the routes ------------------------------------------------------------------------------------------

    async def page(
        self,
        request: Request,
        viewer: ViewerDep,
        prefix: str = "",
        limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
        status: str = "",
    ) -> HTMLResponse:
        """``GET /``: the listing's page."""
        prefix = checked_prefix(prefix)
        wanted = parsed_statuses(status)
        base = _airflow_base(request)

        def render() -> str:
            found = self.listing(viewer, prefix, limit, base)
            shown = [e for e in found.entries if not wanted or status_of(e) in wanted]
            json_query = listing_href(prefix, limit, ",".join(sorted(wanted)))
            return _ENV.get_template("stateful.html").render(
                css=_CSS,
                entries=shown,
                listed=len(found.entries),
                filters=status_filters(found.entries, prefix, limit, wanted),
                status=", ".join(sorted(wanted)),
                truncated=found.truncated,
                backend_url=self.backend_url(viewer),
                prefix=prefix,
                json_href="api/identities" + (json_query if json_query.startswith("?") else ""),
            )

        return HTMLResponse(await self.work.run(render))

    async def identities(
        self,
        request: Request,
        viewer: ViewerDep,
        prefix: str = "",
        limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
        status: str = "",
    ) -> dict[str, Any]:
        """``GET /api/identities``: the listing's JSON."""
        prefix = checked_prefix(prefix)
        wanted = parsed_statuses(status)
        base = _airflow_base(request)

        def answer() -> dict[str, Any]:
            found = self.listing(viewer, prefix, limit, base)
            return {
                "backend_url": self.backend_url(viewer),
                "identities": [e.row for e in found.entries if not wanted or status_of(e) in wanted],
                "status_counts": status_counts(found.entries),
                "truncated": found.truncated,
            }

        return await self.work.run(answer)

    async def task_instance_page(
        self, path: str, request: Request, viewer: ViewerDep, map_index: str = "-1"
    ) -> HTMLResponse:
        return await self.tab_page("task.html", self.ti_tab(viewer, request, map_index))

    async def task_instance_api(
        self, path: str, request: Request, viewer: ViewerDep, map_index: str = "-1"
    ) -> dict[str, Any]:
        return await self.tab_json(self.ti_tab(viewer, request, map_index, api=True))

    async def dag_run_page(self, path: str, request: Request, viewer: ViewerDep) -> HTMLResponse:
        return await self.tab_page("run.html", self.run_tab(viewer, request))

    async def dag_run_api(self, path: str, request: Request, viewer: ViewerDep) -> dict[str, Any]:
        return await self.tab_json(self.run_tab(viewer, request, api=True))

    async def history(self, key: str, request: Request, viewer: ViewerDep) -> dict[str, Any]:
        """``GET /api/identities/{key}/history``: the kept checkpoints of one identity, newest first."""
        identity = checked_identity(raw_key(request, key))
        viewer.require(identity)

        def load() -> HeadRecord | None:
            try:
                return HeadStore(
                    store=self.store(), identity=identity, signer=self.signer(), marks=self.marks()
                ).load()[0]
            except StatefulError as exc:  # a corrupt or forged head: say so, as the page's error rows do
                detail = self.redactor(viewer).text(f"{type(exc).__name__}: {exc}")
                raise HTTPException(status_code=500, detail=detail) from None

        head = await self.work.run(load)
        if head is None:
            raise HTTPException(status_code=404, detail=f"identity {identity.key!r} has no state")
        return {"identity": identity.key, "epoch": head.epoch, "checkpoints": history_of(head)}


def create_app(
    store: ObjectStore | Callable[[], ObjectStore] | None = None,
    *,
    clock: Callable[[], float] = time.time,
    bounds: Bounds | None = None,
    gate: WorkGate | None = None,
    default_interval: timedelta | None = None,
    signer: HeadSigner | None = None,
) -> FastAPI:
    """The view's FastAPI app.

    :param store: the object store to show, or a factory for it; default: ``[stateful] backend_url``,
        opened on the first request (never at import: Airflow imports plugins while it starts up).
    :param clock: seconds since the epoch, for idle ages and lease expiry.
    :param bounds: what one listing may cost; ``limit=`` of a request replaces ``bounds.limit``.
    :param gate: where the blocking work runs (default: two threads of the view's own).
    :param default_interval: when a lease holder that declared no ``expected_checkpoint_interval`` counts as
        stuck; default: ``[stateful] expected_checkpoint_interval``, read on the first request.
    :param signer: the head signing policy of a ``store`` given here (the configured store comes with
        ``[stateful] signing_conn_id``'s).
    """
    view = View(
        store, clock=clock, bounds=bounds, gate=gate, default_interval=default_interval, signer=signer
    )
    app = FastAPI(title="Stateful checkpoints", docs_url=None, redoc_url=None, openapi_url=None)
    use_airflow_auth_manager(app)
    app.middleware("http")(security_headers)
    app.exception_handler(StarletteHTTPException)(error_page)
    # Every route takes ``viewer: ViewerDep`` (see View); the routes are the ones, in the order, they always were.
    app.get("/", response_class=HTMLResponse)(view.page)
    app.get("/api/identities")(view.identities)
    app.get("/ti/{path:path}", response_class=HTMLResponse)(view.task_instance_page)
    app.get("/api/ti/{path:path}")(view.task_instance_api)
    app.get("/run/{path:path}", response_class=HTMLResponse)(view.dag_run_page)
    app.get("/api/run/{path:path}")(view.dag_run_api)
    app.get("/api/identities/{key:path}/history")(view.history)
    return app

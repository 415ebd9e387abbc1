"""The Stateful view's FastAPI app: an HTML page and a JSON API, behind Airflow's auth manager.

* ``GET /stateful/``: the page (server-rendered, no JavaScript);
* ``GET /stateful/api/identities?prefix=&limit=``: one summary per identity;
* ``GET /stateful/api/identities/{key}/history``: the kept checkpoints of one identity, newest first.

Every route needs an authenticated user (a bearer token, or the session cookie the UI sets at login) and
shows only identities of DAGs that user may read (:mod:`.view_access`). There are no write actions.

Hardening, because a head record is input from whoever can write the bucket: the page is a Jinja2 template
with autoescape; every response carries a Content-Security-Policy without scripts (the one inline stylesheet
is allowed by its hash), ``nosniff``, and frame rules that let only Airflow's own UI (same origin) show it in
its frame. ``prefix`` and identity keys are checked (400 naming the value) before the store is touched. The
store is read on the view's own two threads, never on the api-server's shared thread pool (see
:class:`WorkGate`), and each listing is bounded (:class:`.view_rows.Bounds`).
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
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlencode, urlparse

from airflow.api_fastapi.app import get_auth_manager
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_stateful.core.errors import StatefulError
from airflow_stateful.core.head import HeadStore
from airflow_stateful.core.records import HeadRecord
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.plugins.stateful_view import URL_PREFIX
from airflow_stateful.plugins.view_access import Viewer, ViewerDep, checked_identity, checked_prefix
from airflow_stateful.plugins.view_rows import Bounds, Listing, collect, history_of

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
) -> FastAPI:
    """The view's FastAPI app.

    :param store: the object store to show, or a factory for it; default: ``[stateful] backend_url``,
        opened on the first request (never at import: Airflow imports plugins while it starts up).
    :param clock: seconds since the epoch, for idle ages and lease expiry.
    :param bounds: what one listing may cost; ``limit=`` of a request replaces ``bounds.limit``.
    :param gate: where the blocking work runs (default: two threads of the view's own).
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
        )

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
    ) -> HTMLResponse:
        prefix = checked_prefix(prefix)
        base = _airflow_base(request)

        def render() -> str:
            found = listing(viewer, prefix, limit, base)
            query = urlencode({"prefix": prefix} if prefix else {})
            if limit != DEFAULT_LIMIT:
                query = f"{query}&limit={limit}" if query else f"limit={limit}"
            return _ENV.get_template("stateful.html").render(
                css=_CSS,
                entries=found.entries,
                truncated=found.truncated,
                backend_url=backend_url(viewer),
                prefix=prefix,
                json_href=f"api/identities?{query}" if query else "api/identities",
            )

        return HTMLResponse(await work.run(render))

    @app.get("/api/identities")
    async def identities(
        request: Request,
        viewer: ViewerDep,
        prefix: str = "",
        limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    ) -> dict[str, Any]:
        prefix = checked_prefix(prefix)
        base = _airflow_base(request)

        def answer() -> dict[str, Any]:
            found = listing(viewer, prefix, limit, base)
            return {
                "backend_url": backend_url(viewer),
                "identities": [entry.row for entry in found.entries],
                "truncated": found.truncated,
            }

        return await work.run(answer)

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

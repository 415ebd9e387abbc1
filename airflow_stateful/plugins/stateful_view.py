"""The "Stateful" view in Airflow 3's UI: which identities hold state, who holds their lease, how big and idle.

Airflow's api-server mounts :data:`app` at ``/stateful`` (``fastapi_apps``) and the UI shows the page in its
frame under Browse (``external_views``). The view itself, with its authentication and authorization, lives
in :mod:`.view_app`, :mod:`.view_access` and :mod:`.view_rows`; see docs/ui-and-metrics.md.

This module stays light on purpose: every Airflow process that loads plugins imports it, task processes
included (for macros), while the view needs the api-server's security module and Airflow's DB models. So
:data:`app` is a shell that builds the real app on its first request, which only happens in the api-server.
"""

from __future__ import annotations

import threading
from typing import Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

URL_PREFIX = "/stateful"


class ServeView:
    """ASGI middleware that hands every HTTP request to the view's app, built on the first one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._view: ASGIApp | None = None
        self._lock = threading.Lock()

    def _built(self) -> ASGIApp:
        with self._lock:
            if self._view is None:
                from airflow_stateful.plugins.view_app import create_app

                self._view = create_app()
            return self._view

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan: the shell's own (empty)
            return
        view = self._view or self._built()
        await view(scope, receive, send)


def shell_app() -> FastAPI:
    """The app Airflow mounts: a FastAPI instance (Airflow's plugin loader expects one) that serves the view."""
    shell = FastAPI(title="Stateful checkpoints", docs_url=None, redoc_url=None, openapi_url=None)
    shell.add_middleware(ServeView)
    return shell


app = shell_app()


class StatefulPlugin(AirflowPlugin):
    """Adds the Stateful view to Airflow 3's UI (served by the api-server at ``/stateful``)."""

    name = "stateful"
    fastapi_apps: list[dict[str, Any]] = [{"app": app, "url_prefix": URL_PREFIX, "name": "Stateful"}]
    # url_route: the UI shows the page inside its own frame at /plugin/stateful, under "Browse".
    external_views = [
        {
            "name": "Stateful",
            "href": f"{URL_PREFIX}/",
            "url_route": "stateful",
            "destination": "nav",
            "category": "browse",
        }
    ]

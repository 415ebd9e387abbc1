"""The "Stateful" view in Airflow 3's UI: which identities hold state, who holds their lease, how big and idle,
and a "Checkpoints" tab on every task instance and DAG run page.

Airflow's api-server mounts :data:`app` at ``/stateful`` (``fastapi_apps``) and the UI shows the pages in its
frame: the listing under Browse, the tabs on task instance and DAG run pages (``external_views``). The view itself, with its authentication and authorization, lives
in :mod:`.view.app`, :mod:`.view.access` and :mod:`.view.rows`; see docs/ui-and-metrics.md.

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

from airflow_stateful.plugins.view.urls import URL_PREFIX


class ServeView:
    """ASGI middleware that hands every HTTP request to the view's app, built on the first one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._view: ASGIApp | None = None
        self._lock = threading.Lock()

    def _built(self) -> ASGIApp:
        with self._lock:
            if self._view is None:
                from airflow_stateful.plugins.view.app import create_app

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
    # url_route: the UI shows the page inside its own frame at /plugin/<url_route> ("Browse" for the nav entry,
    # a tab of the task instance or DAG run page for the others; url_routes are unique across all plugins).
    # In a tab's href, Airflow 3.3's UI replaces {DAG_ID}, {RUN_ID} and {TASK_ID} (URI-encoded) and {MAP_INDEX}
    # with the page's own values; an unmapped task instance's page has no map index, so {MAP_INDEX} stays as it
    # is there and the view reads it as -1. See docs/ui-and-metrics.md.
    external_views = [
        {
            "name": "Stateful",
            "href": f"{URL_PREFIX}/",
            "url_route": "stateful",
            "destination": "nav",
            "category": "browse",
        },
        {
            "name": "Checkpoints",
            "href": f"{URL_PREFIX}/ti/{{DAG_ID}}/{{RUN_ID}}/{{TASK_ID}}?map_index={{MAP_INDEX}}",
            "url_route": "stateful-checkpoints",
            "destination": "task_instance",
        },
        {
            "name": "Checkpoints",
            "href": f"{URL_PREFIX}/run/{{DAG_ID}}/{{RUN_ID}}",
            "url_route": "stateful-run-checkpoints",
            "destination": "dag_run",
        },
    ]

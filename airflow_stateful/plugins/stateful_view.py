"""The "Stateful" view: which identities hold state, who holds their lease, how big and how idle they are.

Served by a FastAPI app that Airflow 3's api-server mounts at ``/stateful`` (``fastapi_apps``), and shown in
the UI's navigation as an external view. The page is rendered on the server (no JavaScript), so it works
embedded in the UI, on its own, and in a headless browser. JSON endpoints give the same data to scripts:

* ``GET /stateful/api/identities?prefix=&limit=``: one summary per identity;
* ``GET /stateful/api/identities/{key}/history``: the kept checkpoints of one identity, newest first.

Only metadata is shown (sizes, sequence numbers, writers); checkpoint values are never read, so the view
cannot leak task data.
"""

from __future__ import annotations

import html
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote, urlparse

from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from airflow_stateful.core.catalog import list_identities
from airflow_stateful.core.head import HeadStore
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.progress import human_bytes
from airflow_stateful.core.records import HeadRecord, parse_iso
from airflow_stateful.core.stores.base import ObjectStore

log = logging.getLogger(__name__)

URL_PREFIX = "/stateful"
DEFAULT_LIMIT = 500


def configured_store() -> ObjectStore:
    """The store of ``[stateful] backend_url``, with S3 credentials from ``[stateful] conn_id`` if any."""
    from airflow_stateful.hooks.state import StateHook

    hook = StateHook()
    return hook.get_store()


def human_age(seconds: float) -> str:
    """``45s``, ``12m 3s``, ``5h 2m``, ``3d 4h``: idle ages at a glance."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def dag_links(identity: Identity, head: HeadRecord | None, base: str = "") -> dict[str, str]:
    """Links into Airflow's UI: the DAG, and the run whose state this is (or the lease holder's run)."""
    parts = identity.task_parts
    if not parts:
        return {}
    dag_id = str(parts["dag_id"])
    links = {"dag": f"{base}/dags/{quote(dag_id, safe='')}"}
    run_id: str | None = str(parts["scope"]) if parts["scope_kind"] == "run" else None
    if run_id is None and head is not None and head.lease is not None:
        run_id = head.lease.holder.run_id
    if run_id:
        links["run"] = f"{links['dag']}/runs/{quote(run_id, safe='')}"
    return links


def summarize(identity: Identity, head: HeadRecord | None, *, now: float, base: str = "") -> dict[str, Any]:
    """The JSON summary of one identity (the row of the table)."""
    parts = identity.task_parts or {}
    row: dict[str, Any] = {
        "identity": identity.key,
        "dag_id": parts.get("dag_id"),
        "task_id": parts.get("task_id"),
        "map_index": parts.get("map_index"),
        "scope_kind": parts.get("scope_kind"),
        "scope": parts.get("scope"),
        "links": dag_links(identity, head, base),
    }
    if head is None:
        return {**row, "error": "the head record disappeared while it was read"}
    latest = head.latest
    updated = head.updated_at or (latest.created_at if latest else "")
    lease = head.lease
    row.update(
        {
            "epoch": head.epoch,
            "checkpoints": len(head.checkpoints),
            "last_checkpoint": None
            if latest is None
            else {
                "seq": latest.seq,
                "created_at": latest.created_at,
                "schema_version": latest.schema_version,
                "total_size": latest.total_size,
                "file_count": latest.file_count,
            },
            "size": latest.total_size if latest else 0,
            "updated_at": updated or None,
            "idle_seconds": round(now - parse_iso(updated), 3) if updated else None,
            "lease": None
            if lease is None
            else {
                "holder": lease.holder.to_json(),
                "described": lease.holder.describe(),
                "acquired_at": lease.acquired_at,
                "expires_at": lease.expires_at,
                "expired": lease.expired(now),
            },
        }
    )
    return row


def _history(head: HeadRecord) -> list[dict[str, Any]]:
    return [
        {
            "seq": e.seq,
            "created_at": e.created_at,
            "schema_version": e.schema_version,
            "epoch": e.epoch,
            "total_size": e.total_size,
            "file_count": e.file_count,
        }
        for e in reversed(head.checkpoints)
    ]


def _airflow_base(request: Request) -> str:
    """Where Airflow's UI lives: this app's mount point without ``/stateful`` (``""`` at the root)."""
    root = str(request.scope.get("root_path") or "").rstrip("/")
    return root[: -len(URL_PREFIX)] if root.endswith(URL_PREFIX) else ""


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1a202c;background:#fff}
h1{font-size:22px;margin:0 0 4px} p.sub{color:#4a5568;margin:0 0 16px;font-size:14px}
table{border-collapse:collapse;width:100%;font-size:13px}
th{background:#edf2f7;text-align:left;padding:8px;border-bottom:2px solid #cbd5e0;white-space:nowrap}
td{padding:8px;border-bottom:1px solid #e2e8f0;vertical-align:top}
tr:hover td{background:#f7fafc} code{font-size:12px;color:#2d3748}
a{color:#017cee;text-decoration:none} a:hover{text-decoration:underline}
.held{color:#2f855a;font-weight:600} .expired{color:#c05621} .free{color:#718096}
.err{color:#c53030} .num{text-align:right;font-variant-numeric:tabular-nums}
details summary{cursor:pointer;color:#017cee} .hist td{padding:2px 8px;border:0;font-size:12px}
"""


def _lease_cell(row: dict[str, Any]) -> str:
    lease = row.get("lease")
    if not lease:
        return '<span class="free">free</span>'
    cls, label = ("expired", "expired") if lease["expired"] else ("held", "held")
    return (
        f'<span class="{cls}">{label}</span> by {html.escape(lease["described"])}'
        f"<br><small>until {html.escape(lease['expires_at'][:19])}Z</small>"
    )


def _history_cell(key: str, entries: list[dict[str, Any]]) -> str:
    if not entries:
        return '<span class="free">none</span>'
    rows = "".join(
        f"<tr><td>#{e['seq']}</td><td>{html.escape(e['created_at'][:19])}Z</td>"
        f"<td>schema {e['schema_version']}</td><td>{human_bytes(e['total_size'])}</td></tr>"
        for e in entries
    )
    href = f"api/identities/{quote(key, safe='/')}/history"
    return (
        f"<details><summary>{len(entries)} kept</summary><table class=hist>{rows}</table>"
        f'<a href="{html.escape(href)}">JSON</a></details>'
    )


def render_page(rows: list[dict[str, Any]], histories: dict[str, list[dict[str, Any]]], *, url: str) -> str:
    body = []
    for row in rows:
        links = row["links"]
        who = html.escape(row["identity"])
        if row.get("dag_id") is not None:
            scope = f"{row['scope_kind']} {row['scope']}"
            mapped = f" [{row['map_index']}]" if row["map_index"] != -1 else ""
            who = (
                f"<b>{html.escape(str(row['dag_id']))}</b> / {html.escape(str(row['task_id']))}{mapped}"
                f"<br><small>{html.escape(scope)}</small>"
            )
        run = ""
        if "run" in links:
            run = f'<a href="{html.escape(links["run"])}" target="_top">DAG run</a>'
        elif "dag" in links:
            run = f'<a href="{html.escape(links["dag"])}" target="_top">DAG</a>'
        if row.get("error"):
            body.append(f'<tr><td>{who}</td><td colspan=6 class="err">{html.escape(row["error"])}</td></tr>')
            continue
        last = row["last_checkpoint"]
        last_cell = (
            "—"
            if last is None
            else f"#{last['seq']} <small>(schema {last['schema_version']})</small>"
            f"<br><small>{html.escape(last['created_at'][:19])}Z</small>"
        )
        idle = human_age(row["idle_seconds"]) if row["idle_seconds"] is not None else "—"
        body.append(
            f"<tr><td>{who}</td><td>{last_cell}</td><td>{_lease_cell(row)}</td>"
            f'<td class="num">{human_bytes(row["size"])}</td><td class="num">{idle}</td>'
            f"<td>{_history_cell(row['identity'], histories.get(row['identity'], []))}</td><td>{run}</td></tr>"
        )
    if not body:
        body.append('<tr><td colspan=7 class="free">No identity holds state in this backend yet.</td></tr>')
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>Stateful checkpoints</title>"
        f"<style>{_CSS}</style></head><body><h1>Stateful checkpoints</h1>"
        f'<p class="sub">{len(rows)} identit{"y" if len(rows) == 1 else "ies"} in <code>{html.escape(url)}</code>'
        ' &middot; <a href="api/identities">JSON</a></p>'
        "<table><thead><tr><th>Identity</th><th>Last checkpoint</th><th>Lease</th><th>Size</th>"
        "<th>Idle</th><th>History</th><th>Airflow</th></tr></thead><tbody>"
        + "".join(body)
        + "</tbody></table></body></html>"
    )


def create_app(
    store: ObjectStore | Callable[[], ObjectStore] | None = None, *, clock: Callable[[], float] = time.time
) -> FastAPI:
    """The view's FastAPI app.

    :param store: the object store to show, or a factory for it; default: ``[stateful] backend_url``,
        opened on the first request (never at import: Airflow imports plugins while it starts up).
    :param clock: seconds since the epoch, for idle ages and lease expiry.
    """
    app = FastAPI(title="Stateful checkpoints", docs_url=None, redoc_url=None, openapi_url=None)
    opened: list[ObjectStore] = []

    def get_store() -> ObjectStore:
        if not opened:
            if isinstance(store, ObjectStore):
                opened.append(store)
            else:
                opened.append((store or configured_store)())
        return opened[0]

    def collect(prefix: str, limit: int, base: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        backend = get_store()
        rows: list[dict[str, Any]] = []
        histories: dict[str, Any] = {}
        for identity, _info in list_identities(backend, prefix):
            if len(rows) >= limit:
                break
            try:
                head = HeadStore(store=backend, identity=identity).load()[0]
            except Exception as exc:  # a corrupt or newer-format head must not hide every other identity
                row = summarize(identity, None, now=clock(), base=base)
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append(summarize(identity, head, now=clock(), base=base))
            histories[identity.key] = _history(head) if head else []
        return rows, histories

    @app.get("/", response_class=HTMLResponse)
    def page(
        request: Request, prefix: str = "", limit: int = Query(DEFAULT_LIMIT, ge=1, le=10000)
    ) -> HTMLResponse:
        rows, histories = collect(prefix, limit, _airflow_base(request))
        url = get_store().url
        return HTMLResponse(render_page(rows, histories, url=_safe_url(url)))

    @app.get("/api/identities")
    def identities(
        request: Request, prefix: str = "", limit: int = Query(DEFAULT_LIMIT, ge=1, le=10000)
    ) -> dict[str, Any]:
        rows, _ = collect(prefix, limit, _airflow_base(request))
        return {"backend_url": _safe_url(get_store().url), "identities": rows}

    @app.get("/api/identities/{key:path}/history")
    def history(key: str, request: Request) -> dict[str, Any]:
        key = _raw_key(request, key)
        try:
            identity = Identity.parse(key)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        head = HeadStore(store=get_store(), identity=identity).load()[0]
        if head is None:
            raise HTTPException(status_code=404, detail=f"identity {key!r} has no state")
        return {"identity": identity.key, "epoch": head.epoch, "checkpoints": _history(head)}

    return app


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


app = create_app()


class StatefulPlugin(AirflowPlugin):
    """Adds the Stateful view to Airflow 3's UI (served by the api-server at ``/stateful``)."""

    name = "stateful"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Stateful"}]
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

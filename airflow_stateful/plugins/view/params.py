"""What a request to the view asks for, read from its path and query and checked before anything else happens.

Each value is checked here (400 naming it, 404 for a path of the wrong shape) before the viewer's access to a DAG
is and before the store is touched, so a bad request costs nothing and learns nothing. Paths are cut from the raw path,
not Starlette's decoded one: identity keys and run ids hold ``%`` and ``/`` themselves (see :func:`raw_key`).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from fastapi import HTTPException, Request

from airflow_stateful.core.errors import IdentityError
from airflow_stateful.core.fleet.status import STATUSES
from airflow_stateful.core.records.identity import Identity


def view_root(request: Request) -> str:
    """Where this app is mounted (``/stateful``, or ``/airflow/stateful`` under a base path)."""
    return str(request.scope.get("root_path") or "").rstrip("/")


def raw_key(request: Request, decoded: str) -> str:
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


def path_segments(request: Request, marker: tuple[str, ...], count: int) -> list[str]:
    """The ``count`` path segments after ``<root>/<marker...>/``, each unescaped exactly once.

    Cut from the raw path, like identity keys: a run id may hold ``/`` (escaped ``%2F`` by the UI), which the
    decoded path would split. 404 unless there are exactly ``count`` non-empty segments.
    """
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    parts = path.split("?", 1)[0].split("/")
    start = view_root(request).count("/") + 1 + len(marker)
    if (
        tuple(parts[start - len(marker) : start]) != marker
        or len(parts) != start + count
        or "" in parts[start:]
    ):
        raise HTTPException(status_code=404, detail="not found")
    return [unquote(part) for part in parts[start:]]


def parsed_map_index(value: str) -> int:
    """``map_index=``: an integer >= -1; empty or the UI's unreplaced ``{MAP_INDEX}`` (an unmapped task
    instance, whose page has no map index to put there) is -1."""
    if value in ("", "{MAP_INDEX}"):
        return -1
    if not re.fullmatch(r"-?[0-9]{1,9}", value) or int(value) < -1:
        raise HTTPException(status_code=400, detail=f"map_index {value!r} is not an integer >= -1")
    return int(value)


def checked_task(dag_id: str, run_id: str, task_id: str, map_index: int) -> None:
    """400 naming the value unless these make a valid identity key (checked before anything else)."""
    try:
        Identity.for_task(dag_id=dag_id, task_id=task_id, map_index=map_index, run_id=run_id)
    except IdentityError as exc:
        raise HTTPException(status_code=400, detail=f"not a task instance: {exc}") from None


def parsed_statuses(value: str) -> frozenset[str]:
    """``status=``: statuses separated by commas (empty: every status), else 400 naming the value."""
    wanted = frozenset(part.strip() for part in value.split(",") if part.strip())
    unknown = sorted(wanted - set(STATUSES))
    if unknown:
        raise HTTPException(
            status_code=400,
            detail=f"status {value!r} is not one of {', '.join(STATUSES)} (separate several with commas)",
        )
    return wanted

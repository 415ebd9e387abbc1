"""Asking Airflow whether a task instance is finished, before GC deletes the state of its run.

Two ways, one protocol (:class:`~airflow_stateful.core.fleet.lifetimes.RunStates`): Airflow's REST API (:class:`RestApiRunStates`, for the maintenance
task, which in Airflow 3 cannot read the metadata database, and for a CLI pointed at an API server) and the
metadata database itself (``airflow_stateful.cli.airflow_db``, for the CLI where Airflow's database is
configured). The answer is an :class:`~airflow_stateful.core.fleet.lifetimes.AirflowAnswer`; anything that goes
wrong is an answer with ``error`` set, never an exception, so that GC keeps the state it could not ask about.

No Airflow import: the REST client is the standard library's, so this also runs where only boto3 is installed.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from typing import Any

from airflow_stateful.core.fleet.lifetimes import AirflowAnswer

MAX_RESPONSE_BYTES = 1024 * 1024
"""Largest API answer read (a task instance is a few KiB); anything larger is refused unread."""


def _ended(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class RestApiRunStates:
    """Airflow's REST API (``/api/v2``), with a token from ``/auth/token`` when a user name is given.

    :param base_url: the API server's URL (``http://airflow-api-server:8080``), without ``/api/v2``.
    :param username: a user that may read the DAGs GC judges; ``None``: no token is asked for (an auth manager
        that lets everybody in, as a test deployment's ``simple_auth_manager_all_admins``).
    :param password: that user's password. Never logged, never part of an answer or error.
    :param token: a ready access token instead of a user name and password.
    :param timeout: seconds per request.
    """

    def __init__(
        self,
        *,
        base_url: str,
        username: str | None = None,
        password: str | None = None,
        token: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"the Airflow API URL must be http(s)://host[:port], not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._username = username
        self._password = password
        self._token = token
        self.timeout = timeout
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RestApiRunStates({self.base_url!r})"

    def _get_token(self, *, renew: bool = False) -> str | None:
        with self._lock:
            if self._username is None or (self._token and not renew):
                return self._token
            body = json.dumps({"username": self._username, "password": self._password or ""}).encode()
            request = urllib.request.Request(
                f"{self.base_url}/auth/token",
                data=body,
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read(MAX_RESPONSE_BYTES))
            token = answer.get("access_token") if isinstance(answer, dict) else None
            if not isinstance(token, str) or not token:
                raise ValueError("the API server's /auth/token answer has no access_token")
            self._token = token
            return token

    def _get(self, path: str) -> tuple[int, Any]:
        """``(status, body)`` of a GET under ``/api/v2``; 404 is an answer, other HTTP errors raise."""
        for attempt in range(2):
            token = self._get_token(renew=attempt > 0)
            headers = {"Accept": "application/json"}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            request = urllib.request.Request(f"{self.base_url}/api/v2{path}", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.status, json.loads(response.read(MAX_RESPONSE_BYTES) or b"null")
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and attempt == 0 and self._username is not None:
                    continue  # the token expired: ask for a new one once
                if exc.code == 404:
                    return 404, None
                raise
        raise PermissionError("the API server refused the token (401) twice")

    def ask(self, *, dag_id: str, run_id: str, task_id: str, map_index: int) -> AirflowAnswer:
        quote = lambda part: urllib.parse.quote(part, safe="")  # noqa: E731
        dag, run, task = quote(dag_id), quote(run_id), quote(task_id)
        ti_path = f"/dags/{dag}/dagRuns/{run}/taskInstances/{task}"
        if map_index >= 0:
            ti_path += f"/{map_index}"
        try:
            status, body = self._get(ti_path)
            if status == 200 and isinstance(body, dict):
                state = body.get("state")
                return AirflowAnswer(
                    state=str(state)[:40] if state else "none", ended_at=_ended(body.get("end_date"))
                )
            if self._get(f"/dags/{dag}/dagRuns/{run}")[0] == 200:
                return AirflowAnswer(state=None)  # the run exists, the task instance does not (task removed)
            if self._get(f"/dags/{dag}")[0] == 200:
                return AirflowAnswer(run_known=False)
            return AirflowAnswer(dag_known=False, run_known=False)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            # Never the password or the token: only what kind of failure it was, and the server's status.
            detail = f"HTTP {exc.code}" if isinstance(exc, urllib.error.HTTPError) else type(exc).__name__
            return AirflowAnswer(error=f"{self.base_url}: {detail}")

"""The test stacks' REST client retries SQLite's "database is locked" answer, and only that one.

A stack on SQLite (tests/test_e2e_lifetimes.py, `make demo-kill`) answers a write that waited out SQLite's busy
timeout with HTTP 500; Airflow does not retry it. ``rest_request`` retries it, which it can only do if the answer
names the cause: the stacks run with ``[api] expose_stacktrace`` (``base_env``), otherwise Airflow answers
``"orig_error": "hidden"`` (a fresh-clone run failed that way on 2026-12-07). A small HTTP server on 127.0.0.1
plays the api-server here, with the two bodies Airflow 3.3's database error handler sends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from loopback_http import serving

from airflow_stateful.testing.local_stack import ApiError, base_env, rest_request


def airflow_db_error(orig_error: str) -> bytes:
    """The body of Airflow's ``_DatabaseErrorHandler`` (exposed: the cause; not exposed: ``hidden``)."""
    return json.dumps(
        {
            "detail": {
                "reason": "Database error",
                "statement": "INSERT INTO log (...) VALUES (...)" if orig_error != "hidden" else "hidden",
                "orig_error": orig_error,
                "message": "Serious error when handling your request.",
            }
        }
    ).encode()


class Api:
    def __init__(self, failures: list[bytes]) -> None:
        self.failures = failures
        self.calls = 0


@pytest.fixture
def api() -> Iterator[tuple[str, Api]]:
    state = Api([])

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            state.calls += 1
            if state.failures:
                body, code = state.failures.pop(0), 500
            else:
                body, code = b'{"is_paused": false}', 200
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield f"{url}/api/v2", state


def test_a_locked_database_is_retried_until_the_write_goes_through(api: tuple[str, Api]) -> None:
    url, state = api
    state.failures = [airflow_db_error("(sqlite3.OperationalError) database is locked")]
    assert rest_request(url, "PATCH", "/dags/lt_gc", {"is_paused": False}) == {"is_paused": False}
    assert state.calls == 2


def test_a_hidden_or_other_database_error_is_raised_at_once_naming_it(api: tuple[str, Api]) -> None:
    url, state = api
    for cause in ("hidden", "(sqlite3.IntegrityError) UNIQUE constraint failed: dag_run.run_id"):
        state.calls = 0
        state.failures = [airflow_db_error(cause)]
        with pytest.raises(ApiError, match="HTTP 500") as raised:
            rest_request(url, "PATCH", "/dags/lt_gc", {"is_paused": False})
        assert cause in str(raised.value)
        assert state.calls == 1


def test_the_stacks_ask_airflow_to_name_a_database_errors_cause(tmp_path: Path) -> None:
    env = base_env(tmp_path, tmp_path / "dags", 8080)
    assert env["AIRFLOW__API__EXPOSE_STACKTRACE"] == "True"

"""A new operator's configuration mistakes, as the command line reports them (issue 33, points 3 and 4).

Each test runs the real ``airflow-stateful`` console script in a process of its own against real servers: a
typo'd connection id, an endpoint that answers 404 to everything (a tiny HTTP server on 127.0.0.1 that is not
S3), wrong keys on SeaweedFS (a real S3 server that checks signatures), and the exit-code table of ``--help``,
every row of which is produced by a real command here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from loopback_http import serving
from s3_endpoint import S3Endpoint
from test_cli_first_hour import VALUE_ONLY, _s3_env, run_script

from airflow_stateful.core import CheckpointStore, store_from_url
from airflow_stateful.testing.s3_server import free_port


def _no_credentials_env(**extra: str) -> dict[str, str]:
    """The environment of a machine with no AWS credentials anywhere boto3 looks (and no instance metadata)."""
    env = os.environ.copy()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(name, None)
    env = {k: v for k, v in env.items() if not k.startswith("AIRFLOW_CONN_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_CONFIG_FILE="/nonexistent",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="us-east-1",
        **extra,
    )
    return env


def test_a_mistyped_connection_is_named_with_the_chain_that_found_nothing() -> None:
    """``conn_id = seaweedd`` (no such connection) on a machine without AWS credentials: the error says the
    connection does not exist and that boto3's chain found no credentials either, and it exits 2."""
    env = _no_credentials_env(AIRFLOW__STATEFUL__CONN_ID="seaweedd")
    closed = f"http://127.0.0.1:{free_port()}"  # never reached: signing fails first; never AWS either
    result = run_script("ls", "--backend", "s3://newcomer-state/p", "--endpoint-url", closed, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr
    assert "no S3 credentials for s3://newcomer-state/p" in err, err[-3000:]
    assert "the connection 'seaweedd'" in err and "does not exist" in err and "found none" in err, err[-3000:]
    assert "cannot reach" not in err and result.stdout == ""


@pytest.fixture(params=["html", "empty"])
def not_s3(request: pytest.FixtureRequest) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 that answers 404 to every request, as a web server or a console does: with
    an HTML page, or with an empty body (botocore then reports the code ``404``)."""
    page = b"<html><body>404 page not found</body></html>" if request.param == "html" else b""

    class Handler(BaseHTTPRequestHandler):
        def _nothing(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            body = page
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _nothing

        def log_message(self, format: str, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url


@pytest.mark.parametrize("verb", [["ls"], ["du"], ["gc", "--dry-run"]])
def test_an_endpoint_that_is_not_s3_is_called_so(not_s3: str, verb: list[str]) -> None:
    """An endpoint answering 404 to everything said ``object '' does not exist`` (exit 1); now it says the
    endpoint does not look like S3, names it, and exits 2, without the ``(object '')`` noise."""
    env = _no_credentials_env(
        AWS_ACCESS_KEY_ID="AKIAEXAMPLE000000001", AWS_SECRET_ACCESS_KEY="x", AIRFLOW__STATEFUL__CONN_ID=""
    )
    result = run_script(*verb, "--backend", "s3://newcomer-state/p", "--endpoint-url", not_s3, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr
    assert f"the endpoint {not_s3} answered a listing of bucket 'newcomer-state' with" in err, err[-3000:]
    assert "does not look like an S3 API" in err, err[-3000:]
    assert "object ''" not in err and "(object" not in err, err[-3000:]


@pytest.mark.s3
def test_wrong_keys_exit_2_and_say_where_the_keys_came_from(seaweedfs_endpoint: S3Endpoint) -> None:
    """Wrong credentials are a configuration problem (exit 2, as ``--help`` says), from the environment's
    chain and from a connection alike; the message names the source, never the secret."""
    backend = f"s3://{seaweedfs_endpoint.bucket}/p"
    endpoint = str(seaweedfs_endpoint.endpoint_url)
    secret = "wrong-secret-5b1e"
    env = _s3_env(
        seaweedfs_endpoint,
        AWS_ACCESS_KEY_ID="AKIAWRONGKEY00000001",
        AWS_SECRET_ACCESS_KEY=secret,
        AIRFLOW__STATEFUL__CONN_ID="",
    )
    result = run_script("ls", "--backend", backend, "--endpoint-url", endpoint, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"access to s3://{seaweedfs_endpoint.bucket}/p was denied" in result.stderr, result.stderr[-3000:]
    assert "boto3's standard credential chain" in result.stderr and secret not in result.stderr

    encoded = endpoint.replace(":", "%3A").replace("/", "%2F")
    conn = f"aws://AKIAWRONGKEY00000002:{secret}@/?endpoint_url={encoded}"
    env = _s3_env(seaweedfs_endpoint, AIRFLOW_CONN_NEWCOMER=conn, AIRFLOW__STATEFUL__CONN_ID="newcomer")
    result = run_script("du", "--backend", backend, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    tail = result.stderr[-3000:]
    assert "was denied" in result.stderr and "the connection 'newcomer'" in result.stderr, tail
    assert secret not in result.stderr


def _help_exit_codes() -> dict[int, str]:
    """The exit-code table of ``airflow-stateful --help``: code -> what it says."""
    shown = run_script("--help")
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    table = text.split("Exit codes scripts can rely on:", 1)[1].split("stuck is made for cron", 1)[0]
    rows = re.findall(r"(?:^|; )(\d) (.*?)(?=; \d |\.?\s*$)", table.strip())
    return {int(code): what for code, what in rows}


def test_every_exit_code_of_the_help_table_is_what_a_command_returns(tmp_path: Path) -> None:
    """Each row of ``--help``'s table, produced by a real command: 0 success, 1 a problem found (verify of a
    corrupted chunk), 2 bad usage or configuration (a mistyped option; no credentials; wrong keys are in the
    test above), 3 a live lease (rollback without --force), 4 no such identity."""
    codes = _help_exit_codes()
    assert sorted(codes) == [0, 1, 2, 3, 4], codes
    assert "configuration" in codes[2] and "lease" in codes[3] and "no such identity" in codes[4], codes

    state = tmp_path / "state"
    files = tmp_path / "files"
    files.mkdir()
    (files / "model.bin").write_bytes(os.urandom(300_000))  # under 1 MiB: one chunk in a pack
    backend = state.as_uri()
    store = store_from_url(backend)
    cs = CheckpointStore(store=store, identity=VALUE_ONLY)
    for n in (1, 2):
        lease = cs.acquire()
        cs.commit(lease, {"n": n}, files=files)
        cs.release(lease)
    env = _no_credentials_env()

    def code(*args: str) -> int:
        return run_script(*args, env=env).returncode

    assert code("ls", "--backend", backend) == 0
    assert code("ls", "--backend", backend, "--no-such-option") == 2
    no_keys = (
        "ls",
        "--backend",
        "s3://newcomer-state/p",
        "--endpoint-url",
        f"http://127.0.0.1:{free_port()}",
    )
    assert code(*no_keys) == 2
    assert code("show", "etl/never/run=manual__1/map=-1", "--backend", backend) == 4

    holder = CheckpointStore(store=store_from_url(backend), identity=VALUE_ONLY, lease_ttl=600)
    lease = holder.acquire()
    try:
        assert code("rollback", VALUE_ONLY.key, "--to", "1", "--backend", backend) == 3
    finally:
        holder.release(lease)

    packs = sorted((state / VALUE_ONLY.key / "~packs").iterdir())
    victim = packs[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the pack
    victim.chmod(0o600)
    victim.write_bytes(bytes(data))
    assert code("verify", VALUE_ONLY.key, "--backend", backend) == 1

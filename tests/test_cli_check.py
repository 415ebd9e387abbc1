"""``airflow-stateful check`` (issue 33, point 5): a deployment's configuration tried before a task runs.

Every test runs the real console script in a process of its own, configured only by environment as a worker is
(``AIRFLOW__STATEFUL__*``, ``AIRFLOW_CONN_*``), against real stores: a local directory, and SeaweedFS (a real S3
server that checks signatures and enforces conditional writes). The failures are real too: a connection id that
names nothing on a machine without AWS credentials, wrong keys, a bucket that does not exist, an Airflow API
connection to a closed port, a signing connection that does not exist.

The endpoint that ignores conditional writes is SeaweedFS behind :class:`DropConditions`, a loopback HTTP proxy
that removes ``If-None-Match`` and ``If-Match`` from every request and signs it again (SigV4, with the same
credentials: botocore signs those headers, so a proxy that only dropped them would be refused by SeaweedFS's
signature check). What the client then talks to is what npm's s3rver is: an S3 server that accepts both
headers and ignores them. Nothing is mocked: the bytes land in SeaweedFS, and SeaweedFS answers every request.
"""

from __future__ import annotations

import http.client
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from s3_endpoint import S3Endpoint
from test_cli_first_hour import _s3_env, run_script
from test_cli_setup_errors import _no_credentials_env

from airflow_stateful.testing.s3_server import free_port

CONDITIONS = ("if-none-match", "if-match")
_RESIGNED = (*CONDITIONS, "authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token")
_HOP = ("connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection")


def _checks(stdout: str) -> dict[str, dict[str, Any]]:
    return {row["check"]: row for row in json.loads(stdout)}


def _s3_conn(endpoint_url: str, region: str, login: str, password: str) -> str:
    extra = {"endpoint_url": endpoint_url, "region_name": region}
    return json.dumps({"conn_type": "aws", "login": login, "password": password, "extra": extra})


def _seaweed_env(
    weed: S3Endpoint, backend: str, *, endpoint_url: str | None = None, **extra: str
) -> dict[str, str]:
    """A worker's environment for SeaweedFS: ``[stateful]`` and the connection, nothing on the command line."""
    creds = weed.credentials
    conn = _s3_conn(
        endpoint_url or str(weed.endpoint_url),
        weed.region,
        creds["aws_access_key_id"],
        extra.pop("password", creds["aws_secret_access_key"]),
    )
    return _s3_env(
        weed,
        AIRFLOW__STATEFUL__BACKEND_URL=backend,
        AIRFLOW__STATEFUL__CONN_ID="stateful_check",
        AIRFLOW_CONN_STATEFUL_CHECK=conn,
        AWS_EC2_METADATA_DISABLED="true",
        **extra,
    )


def _left_under(weed: S3Endpoint, prefix: str) -> list[str]:
    listed = weed.client().list_objects_v2(Bucket=weed.bucket, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


class DropConditions:
    """An S3 endpoint that ignores conditional writes: ``upstream`` (SeaweedFS) behind a proxy on 127.0.0.1 that
    strips ``If-None-Match``/``If-Match`` and re-signs the request with ``credentials`` (SigV4, as the client
    signed it, for the Host the client addressed). Other requests are forwarded as they came."""

    def __init__(self, upstream: str, *, credentials: dict[str, str], region: str) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        target = http.client.urlsplit(upstream)
        signer = S3SigV4Auth(
            Credentials(credentials["aws_access_key_id"], credentials["aws_secret_access_key"]), "s3", region
        )
        proxy = self
        self.dropped = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP]
                if any(k.lower() in CONDITIONS for k, _ in headers):
                    proxy.dropped += 1
                    kept = {k: v for k, v in headers if k.lower() not in _RESIGNED}
                    request = AWSRequest(
                        method=self.command,
                        url=f"http://{self.headers['Host']}{self.path}",
                        data=body,
                        headers=kept,
                    )
                    signer.add_auth(request)
                    headers = list(request.headers.items())
                upstream_conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    upstream_conn.putrequest(
                        self.command, self.path, skip_host=True, skip_accept_encoding=True
                    )
                    for name, value in headers:
                        upstream_conn.putheader(name, value)
                    upstream_conn.endheaders(body or None)
                    answer = upstream_conn.getresponse()
                    data = answer.read()
                finally:
                    upstream_conn.close()
                self.send_response(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in (*_HOP, "content-length"):
                        self.send_header(name, value)
                length_header = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length_header or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def ignoring_endpoint(seaweedfs_endpoint: S3Endpoint) -> Iterator[DropConditions]:
    proxy = DropConditions(
        str(seaweedfs_endpoint.endpoint_url),
        credentials=seaweedfs_endpoint.credentials,
        region=seaweedfs_endpoint.region,
    )
    try:
        yield proxy
    finally:
        proxy.close()


# -- passing ------------------------------------------------------------------------------------------------
def test_check_passes_on_a_local_store_with_signing(tmp_path: Path) -> None:
    """A fresh ``file://`` deployment with a signing key: every check passes (the directory the probe had to
    create is a warning, not a failure), the probe is gone afterwards, and the key is never printed."""
    state = tmp_path / "state"
    key = f"signing-key-{uuid.uuid4().hex}"
    env = _no_credentials_env(
        AIRFLOW__STATEFUL__BACKEND_URL=state.as_uri(),
        AIRFLOW__STATEFUL__SIGNING_CONN_ID="stateful_signing",
        AIRFLOW_CONN_STATEFUL_SIGNING=json.dumps({"conn_type": "generic", "password": key}),
    )
    result = run_script("check", "--json", env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    checks = _checks(result.stdout)
    probe = ["reach", "write", "read", "list", "if-none-match", "if-match", "delete"]
    for name in ["settings", "signing", *probe]:
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["directory"]["status"] == "warn" and str(state) in checks["directory"]["detail"]
    assert "stateful_signing" in checks["signing"]["detail"] and "required" in checks["signing"]["detail"]
    assert not (state / "~check").exists() or not any((state / "~check").iterdir())
    assert key not in result.stdout + result.stderr

    table = run_script("check", env=env)  # again, for people: one line per check; the directory is there now
    assert table.returncode == 0, table.stderr[-3000:]
    lines = table.stdout.splitlines()
    assert [line.split()[1] for line in lines] == [name for name in checks if name != "directory"], lines
    assert all(line.split()[0] == "ok" for line in lines), lines


@pytest.mark.s3
def test_check_passes_on_seaweedfs(seaweedfs_endpoint: S3Endpoint) -> None:
    """A real S3 server, configured by ``[stateful]`` and an ``aws`` connection: all pass, exit 0, nothing is
    left under the prefix, and the connection's secret shows nowhere."""
    prefix = f"check-{uuid.uuid4().hex[:8]}"
    env = _seaweed_env(seaweedfs_endpoint, f"s3://{seaweedfs_endpoint.bucket}/{prefix}")
    result = run_script("check", "--json", env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    checks = _checks(result.stdout)
    assert {row["status"] for row in checks.values()} == {"ok"}, checks
    assert str(seaweedfs_endpoint.endpoint_url) in checks["connection"]["detail"]
    assert "the connection 'stateful_check'" in checks["connection"]["detail"]
    assert _left_under(seaweedfs_endpoint, prefix) == []
    secret = seaweedfs_endpoint.credentials["aws_secret_access_key"]
    assert secret not in result.stdout + result.stderr


# -- failing, each naming the setting to fix ---------------------------------------------------------------
def test_a_mistyped_connection_fails_naming_conn_id() -> None:
    """``conn_id = seaweedd`` on a machine without AWS credentials: a warning that the connection does not exist,
    then the write fails with no credentials, naming ``[stateful] conn_id``; exit 2."""
    closed = f"http://127.0.0.1:{free_port()}"  # never reached: signing the request fails first
    env = _no_credentials_env(
        AIRFLOW__STATEFUL__BACKEND_URL="s3://newcomer-state/p",
        AIRFLOW__STATEFUL__CONN_ID="seaweedd",
        STATEFUL_S3_ENDPOINT_URL=closed,
    )
    result = run_script("check", "--json", env=env)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    checks = _checks(result.stdout)
    assert checks["connection"]["status"] == "warn"
    assert "'seaweedd' ([stateful] conn_id) does not exist" in checks["connection"]["detail"]
    reach = checks["reach"]
    assert reach["status"] == "FAIL" and "no S3 credentials" in reach["detail"], reach
    assert "[stateful] conn_id" in reach["detail"] and "[stateful] conn_id 'seaweedd'" in reach["fix"], reach


@pytest.mark.s3
def test_wrong_keys_fail_naming_the_connection(seaweedfs_endpoint: S3Endpoint) -> None:
    secret = f"wrong-secret-{uuid.uuid4().hex[:8]}"
    env = _seaweed_env(seaweedfs_endpoint, f"s3://{seaweedfs_endpoint.bucket}/p", password=secret)
    result = run_script("check", env=env)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.split()[:2] == ["FAIL", "reach"]]
    assert "was denied" in line and "the connection 'stateful_check'" in line, line
    assert "-> fix: check [stateful] backend_url" in line and "[stateful] conn_id 'stateful_check'" in line
    assert secret not in result.stdout + result.stderr


@pytest.mark.s3
def test_a_missing_bucket_fails_naming_backend_url(seaweedfs_endpoint: S3Endpoint) -> None:
    bucket = f"no-such-{uuid.uuid4().hex[:10]}"
    env = _seaweed_env(seaweedfs_endpoint, f"s3://{bucket}/p")
    result = run_script("check", "--json", env=env)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    checks = _checks(result.stdout)
    reach = checks["reach"]
    assert reach["status"] == "FAIL" and f"bucket {bucket!r} does not exist" in reach["detail"], reach
    assert "backend_url" in reach["detail"] and "[stateful] backend_url" in reach["fix"]
    assert "write" not in checks, "nothing is written: SeaweedFS would create the bucket on a PutObject"
    names = [b["Name"] for b in seaweedfs_endpoint.client().list_buckets()["Buckets"]]
    assert bucket not in names


@pytest.mark.s3
def test_an_endpoint_that_ignores_conditional_writes_fails(
    seaweedfs_endpoint: S3Endpoint, ignoring_endpoint: DropConditions
) -> None:
    """SeaweedFS behind a proxy that drops If-None-Match and If-Match: plain writes, reads, listings and deletes
    pass, both conditions FAIL saying the endpoint ignores them and fencing is not safe; exit 2."""
    prefix = f"check-{uuid.uuid4().hex[:8]}"
    backend = f"s3://{seaweedfs_endpoint.bucket}/{prefix}"
    env = _seaweed_env(seaweedfs_endpoint, backend, endpoint_url=ignoring_endpoint.url)
    result = run_script("check", "--json", env=env)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    checks = _checks(result.stdout)
    for name in ("reach", "write", "read", "list", "delete"):
        assert checks[name]["status"] == "ok", checks[name]
    for name, header in (("if-none-match", "If-None-Match"), ("if-match", "If-Match")):
        row = checks[name]
        assert row["status"] == "FAIL", row
        assert f"IGNORES {header}" in row["detail"] and "fencing is NOT safe" in row["detail"], row
        assert "endpoint_url" in row["fix"], row
    assert ignoring_endpoint.dropped >= 3, (
        "the proxy dropped the conditions of the probe's conditional writes"
    )
    assert _left_under(seaweedfs_endpoint, prefix) == []

    direct = run_script("check", "--json", env=_seaweed_env(seaweedfs_endpoint, backend))
    assert direct.returncode == 0, "the same server without the proxy enforces both: " + direct.stdout


def test_signing_and_airflow_api_mistakes_fail_naming_their_settings(tmp_path: Path) -> None:
    """A signing connection that does not exist and an Airflow API connection to a port nobody listens on: both
    FAIL naming ``signing_conn_id`` / ``airflow_conn_id``, the store is not probed; no password is printed."""
    password = f"api-password-{uuid.uuid4().hex[:8]}"
    api = {
        "conn_type": "http",
        "host": f"http://127.0.0.1:{free_port()}",
        "login": "admin",
        "password": password,
    }
    env = _no_credentials_env(
        AIRFLOW__STATEFUL__BACKEND_URL=(tmp_path / "state").as_uri(),
        AIRFLOW__STATEFUL__SIGNING_CONN_ID="no_such_signing",
        AIRFLOW__STATEFUL__AIRFLOW_CONN_ID="stateful_api",
        AIRFLOW_CONN_STATEFUL_API=json.dumps(api),
    )
    result = run_script("check", "--json", env=env)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    checks = _checks(result.stdout)
    signing = checks["signing"]
    assert signing["status"] == "FAIL" and "signing_conn_id" in signing["detail"], signing
    assert "[stateful] signing_conn_id 'no_such_signing'" in signing["fix"]
    assert checks["store"]["status"] == "skip" and "write" not in checks
    airflow = checks["airflow-api"]
    assert airflow["status"] == "FAIL" and "[stateful] airflow_conn_id 'stateful_api'" in airflow["fix"], (
        airflow
    )
    assert password not in result.stdout + result.stderr
    assert not (tmp_path / "state").exists(), "nothing probed, nothing created"

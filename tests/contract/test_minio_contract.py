"""The S3 contract suite against a real MinIO server, whenever one can be run on this machine.

moto (serialized) is the S3 endpoint of ``make test``; its conditional writes are atomic only because it
serves one request at a time (tests/test_moto_atomicity.py). MinIO is the S3-compatible server users run
most, with atomic conditional writes of its own. It ships as a single binary from min.io: none of the
registries this project installs from carries it (checked 2026-12-02: PyPI's ``minio`` is the client library
only; npm and Debian have no server package either), and ``STATEFUL_TEST_MINIO=1`` (testcontainers) needs a
Docker engine. So this test looks for a ``minio`` binary (``$STATEFUL_TEST_MINIO_BINARY`` or on ``PATH``),
starts it on 127.0.0.1 with a temporary data directory, and runs tests/contract/test_s3_contract.py against
it in a subprocess; without one it skips, printing why. docs/reliability.md lists which endpoints were
verified and how.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from airflow_stateful.testing.s3_server import free_port

pytestmark = [pytest.mark.s3, pytest.mark.slow]
HERE = Path(__file__).resolve().parent


def test_the_s3_contract_suite_passes_on_a_real_minio_server(tmp_path: Path) -> None:
    binary = os.environ.get("STATEFUL_TEST_MINIO_BINARY") or shutil.which("minio")
    if not binary:
        reason = (
            "no MinIO server binary here (set STATEFUL_TEST_MINIO_BINARY or put `minio` on PATH; it is not on "
            "PyPI, npm or Debian): the contract suite ran on moto (serialized), SeaweedFS and the local store"
        )
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    port, console = free_port(), free_port()
    user, password = "stateful-test", "stateful-test-secret"
    env = {**os.environ, "MINIO_ROOT_USER": user, "MINIO_ROOT_PASSWORD": password}
    server = subprocess.Popen(
        [binary, "server", str(tmp_path / "data"), "--address", f"127.0.0.1:{port}",
         "--console-address", f"127.0.0.1:{console}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/minio/health/live", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"MinIO ({binary}) did not become ready on {url}")
                time.sleep(0.2)
        run_env = {
            **os.environ,
            "STATEFUL_TEST_S3_ENDPOINT": url,
            "STATEFUL_TEST_S3_ACCESS_KEY_ID": user,
            "STATEFUL_TEST_S3_SECRET_ACCESS_KEY": password,
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                str(HERE / "test_s3_contract.py"),
            ],
            env=run_env,
            cwd=HERE.parent.parent,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert result.returncode == 0, f"the contract suite failed on MinIO:\n{result.stdout[-6000:]}"
        assert " passed" in result.stdout
    finally:
        server.kill()
        server.wait()

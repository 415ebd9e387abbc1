"""Start moto's S3 server as a real HTTP server on 127.0.0.1, in its own process.

It runs in a subprocess, not in the test process, so that (a) the objects it stores do not count in the
caller's memory measurements and (b) the boto3 client goes through real HTTP, exactly as against AWS.
Requires ``moto[server]`` (the ``test`` extra).

``MotoServer.start(serialized=True)`` serves moto one request at a time, which makes its conditional writes
atomic as on S3: moto's own threaded server lets two concurrent ``If-Match`` writes of one key both succeed.
See :mod:`airflow_stateful.testing.moto_launcher` for why and how.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from types import TracebackType

DUMMY_ACCESS_KEY = "testing"
DUMMY_SECRET_KEY = "testing"  # moto accepts any credentials; these are not secrets


def free_port() -> int:
    """A port free on 127.0.0.1 right now (for servers that cannot bind port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _read_port(process: subprocess.Popen[bytes], timeout: float) -> int:
    """The port the launcher bound, from the one line it writes on stdout."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"moto's server printed no port within {timeout} s")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 64)
            if not chunk:
                process.wait(timeout=5)
                raise RuntimeError(f"moto's server exited with code {process.returncode} before listening")
            line += chunk
    return int(line)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    if process.stdout is not None:
        process.stdout.close()


@dataclass
class MotoServer:
    """A running moto S3 server bound to 127.0.0.1. Use as a context manager, or call ``stop()``."""

    port: int
    process: subprocess.Popen[bytes]
    #: whether requests are served one at a time, so conditional writes are atomic (see ``start``).
    serialized: bool = False

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, *, serialized: bool = False, timeout: float = 30.0) -> MotoServer:
        """Start the server in a subprocess and wait until it answers.

        :param serialized: serve one request at a time, so that concurrent conditional writes of one key
            have exactly one winner as on S3 (moto alone can let several win). Costs about nothing on
            loopback; see :mod:`airflow_stateful.testing.moto_launcher`.
        """
        command = [sys.executable, "-m", "airflow_stateful.testing.moto_launcher"]
        if serialized:
            command.append("--serialized")
        env = dict(os.environ, MOTO_ALLOW_NONEXISTENT_REGION="true")
        # The launcher binds port 0 itself and prints the port, so no other process can take it first.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        try:
            server = cls(port=_read_port(process, timeout), process=process, serialized=serialized)
            server._wait_ready(timeout)
        except BaseException as exc:
            _stop(process)
            if isinstance(exc, Exception):
                raise RuntimeError(f"moto's server did not start on 127.0.0.1: {exc}") from exc
            raise
        return server

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto's server exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        raise TimeoutError(f"moto's server not ready on port {self.port} after {timeout} s")

    def stop(self) -> None:
        _stop(self.process)

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

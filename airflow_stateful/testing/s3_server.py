"""Start moto's S3 server as a real HTTP server on 127.0.0.1, in its own process.

It runs in a subprocess, not in the test process, so that (a) the objects it stores do not count in the
caller's memory measurements and (b) the boto3 client goes through real HTTP, exactly as against AWS.
Requires ``moto[server]`` (the ``test`` extra).
"""

from __future__ import annotations

import os
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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class MotoServer:
    """A running ``moto_server`` bound to 127.0.0.1. Use as a context manager, or call ``stop()``."""

    port: int
    process: subprocess.Popen[bytes]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, *, timeout: float = 30.0) -> MotoServer:
        last_error: Exception | None = None
        for _ in range(3):  # a port taken between free_port() and bind: try another
            port = free_port()
            env = dict(os.environ, MOTO_ALLOW_NONEXISTENT_REGION="true")
            process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            server = cls(port=port, process=process)
            try:
                server._wait_ready(timeout)
                return server
            except Exception as exc:
                last_error = exc
                server.stop()
        raise RuntimeError(f"moto_server did not start on 127.0.0.1: {last_error}")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        raise TimeoutError(f"moto_server not ready on port {self.port} after {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

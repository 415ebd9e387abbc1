"""The S3 endpoint every S3 test talks to, over HTTP with the real boto3 client.

Default: moto's server, started on 127.0.0.1 in a subprocess for the pytest session, serving one request
at a time so that its conditional writes are atomic as on S3 and the compare-and-swap races run on it
(tests/test_moto_atomicity.py shows moto's own threaded server losing updates; serializing it costs about
2 s on the S3 contract suite). ``STATEFUL_TEST_MOTO_THREADED=1`` starts moto threaded instead; the races then
skip.
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
from botocore.config import Config

from airflow_stateful.core.stores.s3 import S3ObjectStore
from airflow_stateful.testing.s3_server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, MotoServer


@dataclass
class S3Endpoint:
    kind: str  # "moto", "minio" or "external"
    endpoint_url: str | None
    region: str
    bucket: str
    credentials: dict[str, str] = field(default_factory=dict)
    #: moto only: whether it serves one request at a time (``MotoServer.start(serialized=True)``).
    serialized: bool = False

    @property
    def atomic_cas(self) -> bool:
        """Threaded moto checks If-Match without a lock, so two concurrent writers can both win a CAS: the
        race tests skip there. Serialized moto, MinIO and S3 make conditional writes atomic."""
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


@contextlib.contextmanager
def s3_endpoint_from_env() -> Iterator[S3Endpoint]:
    region = os.environ.get("STATEFUL_TEST_S3_REGION", "us-east-1")
    given_bucket = os.environ.get("STATEFUL_TEST_S3_BUCKET")
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
        elif os.environ.get("STATEFUL_TEST_MINIO") == "1":
            url, creds = stack.enter_context(_minio())
            endpoint = S3Endpoint(kind="minio", endpoint_url=url, region=region, bucket="", credentials=creds)
        else:
            serialized = os.environ.get("STATEFUL_TEST_MOTO_THREADED") != "1"
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
        created = False
        if not endpoint.bucket:
            endpoint.bucket = f"stateful-test-{uuid.uuid4().hex[:10]}"
            kwargs: dict[str, Any] = {}
            if region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            endpoint.client().create_bucket(Bucket=endpoint.bucket, **kwargs)
            created = True
        try:
            yield endpoint
        finally:
            if created and endpoint.kind != "moto":
                _empty_and_delete(endpoint)


def _empty_and_delete(endpoint: S3Endpoint) -> None:
    client = endpoint.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=endpoint.bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=endpoint.bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=endpoint.bucket)

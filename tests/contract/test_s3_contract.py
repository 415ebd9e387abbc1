"""The contract suites on S3 over HTTP: moto's server by default, MinIO or AWS when configured."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.core.stores.s3 import S3ObjectStore
from contract.checkpoint_contract import CheckpointStoreContract
from contract.object_store_contract import ObjectStoreContract

pytestmark = pytest.mark.s3


@pytest.fixture
def store(s3_endpoint: S3Endpoint, s3_prefix: str) -> Iterator[S3ObjectStore]:
    # 5 MiB parts so the multipart paths run on test-sized files.
    with s3_endpoint.store(s3_prefix, part_size=5 * 1024 * 1024) as store:
        yield store


@pytest.fixture(autouse=True)
def _cas_atomicity(request: pytest.FixtureRequest, s3_endpoint: S3Endpoint) -> None:
    request.instance.atomic_cas = s3_endpoint.atomic_cas


class TestS3ObjectStore(ObjectStoreContract):
    pass


class TestS3CheckpointStore(CheckpointStoreContract):
    pass

"""The contract suites on S3 over HTTP, on two servers in every run: the session's main endpoint (moto's server
by default; MinIO or AWS when configured) and SeaweedFS, a real S3 server the suite starts itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_endpoint import S3Endpoint, on_both_servers

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.stores.s3 import S3ObjectStore
from contract.checkpoint_contract import CheckpointStoreContract
from contract.object_store_contract import ObjectStoreContract

pytestmark = pytest.mark.s3

s3_endpoint = on_both_servers()


@pytest.fixture
def store(s3_endpoint: S3Endpoint, s3_prefix: str) -> Iterator[S3ObjectStore]:
    # 5 MiB parts so the multipart paths run on test-sized files; 2 keys per listing page so every listing
    # crosses pages (where SeaweedFS's order departs from S3's).
    with s3_endpoint.store(s3_prefix, part_size=5 * 1024 * 1024, list_page_size=2) as store:
        yield store


@pytest.fixture(autouse=True)
def _cas_atomicity(request: pytest.FixtureRequest, s3_endpoint: S3Endpoint) -> None:
    request.instance.atomic_cas = s3_endpoint.atomic_cas


class TestS3ObjectStore(ObjectStoreContract):
    pass


class TestS3CheckpointStore(CheckpointStoreContract):
    pass


class TestS3LostResponses:
    """A request that took effect but whose answer was lost is retried by botocore and then sees 412.

    botocore's own ``needs-retry`` event is used to force that retry after a *successful* PutObject or
    CompleteMultipartUpload, so the real endpoint really receives the write twice.
    """

    def test_commit_survives_lost_answers_to_every_write(self, store: S3ObjectStore, tmp_path: Path) -> None:
        forced: list[str] = []

        def retry_once(request_dict: dict[str, Any], response: Any, attempts: int, **_: Any) -> float | None:
            if response is None or response[0].status_code != 200 or attempts > 1:
                return None
            url = str(request_dict.get("url", ""))
            forced.append(url.rsplit("/", 1)[-1])
            return 0.0  # "retry now", although the write landed

        events = store.client.meta.events
        events.register("needs-retry.s3.PutObject", retry_once)
        events.register("needs-retry.s3.CompleteMultipartUpload", retry_once)
        big = tmp_path / "files" / "big.bin"
        big.parent.mkdir()
        big.write_bytes(os.urandom(11 * 1024 * 1024))  # multipart with 5 MiB parts
        (tmp_path / "files" / "small.txt").write_text("small")
        cs = CheckpointStore(store=store, identity=Identity.parse("lost/answers"))
        lease = cs.acquire()
        cs.commit(lease, {"step": 1}, files=tmp_path / "files")
        cs.commit(lease, {"step": 2})
        events.unregister("needs-retry.s3.PutObject", retry_once)
        events.unregister("needs-retry.s3.CompleteMultipartUpload", retry_once)

        assert any("head.json" in f for f in forced) and any("manifests" in f or ".json" in f for f in forced)
        assert [e.seq for e in cs.history()] == [2, 1], "each commit recorded exactly once"
        first = cs.get(1)
        out = tmp_path / "out"
        cs.restore_files(first, out)
        assert (out / "big.bin").read_bytes() == big.read_bytes()
        assert cs.latest().value == {"step": 2}  # type: ignore[union-attr]

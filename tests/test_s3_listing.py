"""Listings on a server that is not S3: SeaweedFS lists in its own order and pages some delimited listings
wrongly (airflow_stateful/core/stores/s3_listing.py). The contract suite (tests/contract/test_s3_contract.py)
runs every listing across page boundaries on SeaweedFS too; these show the server's quirk itself."""

from __future__ import annotations

import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.core.stores import s3_listing
from airflow_stateful.core.stores.base import CommonPrefix

pytestmark = pytest.mark.s3


class TestPagedDelimitedListings:
    """SeaweedFS pages a listing with a delimiter other than ``/`` wrongly (airflow_stateful/core/stores/
    s3_listing.py): shown on the raw server, then the store's answer is the full listing rolled up."""

    FLEET = ["a/~head.json", "a/~manifests/1.json", "a/~data/c/f", "a/~", "a/b/~head.json", "a/b/~data/x"]
    EXPECTED = ["a/b/~", "a/~", "a/~data/c/f", "a/~head.json", "a/~manifests/1.json"]

    def _raw(self, endpoint: S3Endpoint, prefix: str) -> list[str] | str:
        client = endpoint.client()
        listed: list[str] = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=endpoint.bucket,
                Prefix=f"{prefix}/a/",
                Delimiter="/~",
                PaginationConfig={"PageSize": 1, "MaxItems": 50},
            ):
                listed += [o["Key"] for o in page.get("Contents", [])]
                listed += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        except Exception as exc:  # botocore's "the same next token was received twice"
            return repr(exc)
        return listed

    def test_seaweedfs_pages_a_delimited_listing_wrongly_and_the_store_does_not(
        self, seaweedfs_endpoint: S3Endpoint
    ) -> None:
        endpoint = seaweedfs_endpoint
        s3_prefix = endpoint.new_prefix()
        store = endpoint.store(s3_prefix, list_page_size=1)
        for key in self.FLEET:
            store.put(key, b"x")
        raw = self._raw(endpoint, s3_prefix)
        expected = [f"{s3_prefix}/{key}" for key in self.EXPECTED]
        assert isinstance(raw, str) or sorted(raw) != expected, (
            "SeaweedFS pages this listing right now: PAGES_DELIMITERS_WRONG in s3_listing.py may be dropped",
            raw,
        )
        got = [e.prefix if isinstance(e, CommonPrefix) else e.key for e in store.list_delimited("a/", "/~")]
        assert sorted(got) == self.EXPECTED

    def test_a_server_not_known_to_page_wrongly_is_caught_by_its_repeats(
        self, seaweedfs_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Were SeaweedFS not named, its repeated common prefixes still give it away."""
        monkeypatch.setattr(s3_listing, "PAGES_DELIMITERS_WRONG", ())
        store = seaweedfs_endpoint.store(seaweedfs_endpoint.new_prefix(), list_page_size=1)
        for key in self.FLEET:
            store.put(key, b"x")
        got = [e.prefix if isinstance(e, CommonPrefix) else e.key for e in store.list_delimited("a/", "/~")]
        assert sorted(got) == self.EXPECTED


@pytest.mark.parametrize("size", [0, 1001, -1])
def test_a_page_size_outside_what_s3_serves_is_refused_before_any_request(size: int) -> None:
    from airflow_stateful.core.stores.s3 import S3ObjectStore

    with pytest.raises(ValueError, match=rf"list_page_size must be between 1 and 1000 .*not {size}"):
        S3ObjectStore(bucket="never-reached", endpoint_url="http://127.0.0.1:9", list_page_size=size)

"""The contract suites on the local-directory store."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_stateful.core.stores.base import CommonPrefix
from airflow_stateful.core.stores.local import LocalObjectStore
from contract.checkpoint_contract import CheckpointStoreContract
from contract.object_store_contract import ObjectStoreContract


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(root=tmp_path / "state")


class TestLocalObjectStore(ObjectStoreContract):
    pass


class TestLocalCheckpointStore(CheckpointStoreContract):
    pass


def test_a_listing_never_leaves_the_root_or_follows_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    store = LocalObjectStore(root=tmp_path / "state", fsync=False)
    store.put("a/b", b"x")
    (tmp_path / "state" / "a" / "link").symlink_to(outside, target_is_directory=True)
    for bad in ("../", "../outside/", "/etc/", "a/../../"):
        with pytest.raises(ValueError, match="must stay inside the store's root"):
            list(store.list_objects(bad))
    assert [i.key for i in store.list_objects("")] == ["a/b"], "a link inside the root is not followed"


def test_the_local_store_lists_in_s3s_byte_order(tmp_path: Path) -> None:
    """Not a contract every store keeps (SeaweedFS does not), but the local store's own promise: a directory
    walk that sorts ``a/`` as a unit lists in S3's byte-wise order, plain and delimited."""
    store = LocalObjectStore(root=tmp_path / "state", fsync=False)
    keys = ["a/b", "a.txt", "a-b", "a0", "a/c/d", "b", "A"]
    for key in keys:
        store.put(key, b"x")
    assert [i.key for i in store.list_objects("")] == sorted(keys)
    assert [i.key for i in store.list_objects("a")] == sorted(k for k in keys if k.startswith("a"))
    delimited = [e.prefix if isinstance(e, CommonPrefix) else e.key for e in store.list_delimited("", "/")]
    assert delimited == ["A", "a-b", "a.txt", "a/", "a0", "b"]

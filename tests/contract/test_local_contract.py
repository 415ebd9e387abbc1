"""The contract suites on the local-directory store."""

from __future__ import annotations

from pathlib import Path

import pytest

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

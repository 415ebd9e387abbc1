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

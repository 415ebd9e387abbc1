"""Object stores the commit protocol runs on. See :mod:`~airflow_stateful.core.stores.base`."""

from __future__ import annotations

from airflow_stateful.core.stores.base import Blob, ObjectInfo, ObjectStore, StoredFile
from airflow_stateful.core.stores.registry import store_from_url

__all__ = ["Blob", "ObjectInfo", "ObjectStore", "StoredFile", "store_from_url"]

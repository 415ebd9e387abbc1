"""Byte stores with conditional writes, the layer the commit protocol runs on. See :mod:`~airflow_stateful.core.stores.base`.

The names below load on first use (PEP 562): importing one store module does not import boto3 or the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_stateful.core.lazy import load

_WHERE = {
    "Blob": "airflow_stateful.core.stores.base",
    "ObjectInfo": "airflow_stateful.core.stores.base",
    "ObjectStore": "airflow_stateful.core.stores.base",
    "StoredFile": "airflow_stateful.core.stores.base",
    "store_from_url": "airflow_stateful.core.stores.registry",
}

__all__ = [
    "Blob",
    "ObjectInfo",
    "ObjectStore",
    "StoredFile",
    "store_from_url",
]

if TYPE_CHECKING:
    from airflow_stateful.core.stores.base import Blob, ObjectInfo, ObjectStore, StoredFile
    from airflow_stateful.core.stores.registry import store_from_url


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` when it is first asked for (PEP 562)."""
    return load(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

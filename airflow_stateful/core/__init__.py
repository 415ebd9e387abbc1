"""The storage core: identities, object stores, the fenced commit protocol. Never imports Airflow.

This package also runs inside Kubernetes pods that only have boto3, so it depends on the standard library and
(for S3) boto3 alone; an import-linter contract (``[tool.importlinter]`` in pyproject.toml) keeps it that way.

Its layers, each importing only those below it (see docs/architecture.md)::

    fleet      many identities: catalog, status, stuck, usage, GC, lifetimes, sensor conditions
    protocol   one identity's fenced state: leases, the commit CAS, heads, retention, the writer session
    data       bytes for one identity: trees, chunks, the restore cache, transfers, restores
    stores     byte stores with conditional writes (local directory, S3)
    records    what is stored, no I/O: heads, manifests, trees, outputs, fields, codecs, hashing

``errors``, ``settings``, ``events``, ``durations`` and ``timestamps`` sit beside the layers and import none
above ``records``. The names below are loaded on first use (PEP 562), so ``import airflow_stateful.core.errors``
loads that module alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_stateful.core.lazy import load

_WHERE = {
    "CheckpointEntry": "airflow_stateful.core.records.heads",
    "HeadRecord": "airflow_stateful.core.records.heads",
    "Manifest": "airflow_stateful.core.records.manifests",
    "WriterInfo": "airflow_stateful.core.records.writer",
    "Identity": "airflow_stateful.core.records.identity",
    "ObjectStore": "airflow_stateful.core.stores.base",
    "store_from_url": "airflow_stateful.core.stores.registry",
    "CheckpointStore": "airflow_stateful.core.protocol.checkpoint_store",
    "Lease": "airflow_stateful.core.protocol.lease",
    "CrashGarbage": "airflow_stateful.core.protocol.retention",
    "IdleFor": "airflow_stateful.core.protocol.retention",
    "KeepLast": "airflow_stateful.core.protocol.retention",
    "RetentionPolicy": "airflow_stateful.core.protocol.retention",
    "WriterSession": "airflow_stateful.core.protocol.session",
    "GarbageReport": "airflow_stateful.core.fleet.gc",
    "collect_garbage": "airflow_stateful.core.fleet.gc",
}

__all__ = [
    "CheckpointEntry",
    "CheckpointStore",
    "CrashGarbage",
    "GarbageReport",
    "HeadRecord",
    "Identity",
    "IdleFor",
    "KeepLast",
    "Lease",
    "Manifest",
    "ObjectStore",
    "RetentionPolicy",
    "WriterInfo",
    "WriterSession",
    "collect_garbage",
    "store_from_url",
]

if TYPE_CHECKING:
    from airflow_stateful.core.fleet.gc import GarbageReport, collect_garbage
    from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
    from airflow_stateful.core.protocol.lease import Lease
    from airflow_stateful.core.protocol.retention import CrashGarbage, IdleFor, KeepLast, RetentionPolicy
    from airflow_stateful.core.protocol.session import WriterSession
    from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
    from airflow_stateful.core.records.identity import Identity
    from airflow_stateful.core.records.manifests import Manifest
    from airflow_stateful.core.records.writer import WriterInfo
    from airflow_stateful.core.stores.base import ObjectStore
    from airflow_stateful.core.stores.registry import store_from_url


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` when it is first asked for (PEP 562)."""
    return load(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

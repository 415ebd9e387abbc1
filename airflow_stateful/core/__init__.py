"""The storage core: identities, object stores, the fenced commit protocol. Never imports Airflow.

This package also runs inside Kubernetes pods that only have boto3, so it depends on the standard
library and (for S3) boto3 alone. ``tests/test_core_isolation.py`` keeps it that way.
"""

from __future__ import annotations

from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.gc import GarbageReport, collect_garbage
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.lease import Lease
from airflow_stateful.core.records import CheckpointEntry, HeadRecord, Manifest, WriterInfo
from airflow_stateful.core.retention import CrashGarbage, IdleFor, KeepLast, RetentionPolicy
from airflow_stateful.core.session import WriterSession
from airflow_stateful.core.stores import ObjectStore, store_from_url

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

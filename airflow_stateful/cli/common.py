"""What several commands need and none owns: one identity's checkpoints, a progress line, the lifetimes GC
judges by, sizes as people read them, and the objects of the identities a fleet verb selects.

In one place so that every verb reports progress, reads ``--idle-for`` and the other lifetime options and shows
a size the same way (``gc`` and ``du`` must agree on what a lifetime is, ``ls`` and ``du`` on a size). The store
is opened by :mod:`airflow_stateful.cli.opening`.
"""

from __future__ import annotations

import argparse
import logging

from airflow_stateful.cli.selections import selected_prefixes
from airflow_stateful.core.errors import CheckpointNotFoundError
from airflow_stateful.core.fleet.gc_plan import group_by_identity
from airflow_stateful.core.fleet.lifetimes import Lifetimes
from airflow_stateful.core.fleet.walk_progress import ItemProgress
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.canonical import canonical_json
from airflow_stateful.core.records.heads import CheckpointEntry
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import ObjectInfo, ObjectStore

_log = logging.getLogger("airflow_stateful")


def checkpoints_of(
    store: ObjectStore, key: str, *, signer: HeadSigner | None, marks: MarkStore | None = None
) -> CheckpointStore:
    """The identity's checkpoints; an identity without a head is not found (exit 4), not an empty one."""
    cs = CheckpointStore(store=store, identity=Identity.parse(key), signer=signer, marks=marks)
    if cs.head() is None:
        raise CheckpointNotFoundError(f"identity {key!r} has no state in {store.url}")
    return cs


def progress(label: str, total: int) -> ItemProgress:
    """A progress line on stderr (through the ``airflow_stateful`` logger) for a walk over ``total`` items."""
    return ItemProgress(label=label, total=total, logger=_log)


def lifetimes(args: argparse.Namespace) -> Lifetimes:
    """The options (``--idle-for``, ``--release-after-success``, ``--keep-failed-for``), else ``[stateful]``."""
    return Lifetimes.configured(
        args.settings,
        idle_for=args.idle_for,
        release_after_success=args.release_after_success,
        keep_failed_for=args.keep_failed_for,
    )


def checkpoint_size(entry: CheckpointEntry | None) -> int:
    """A checkpoint's size as ``ls``, ``history`` and ``du`` show it: its files' bytes plus its manifest's (the
    value and the file list; an inline manifest counted as the bytes it takes in the head). Never 0 for a
    checkpoint that holds a value. Not what is billed: ``du``'s ``bytes`` counts every stored object."""
    if entry is None:
        return 0
    manifest = len(canonical_json(entry.inline)) if entry.inline is not None else entry.manifest_size or 0
    return entry.total_size + manifest


def selected_groups(args: argparse.Namespace, store: ObjectStore) -> dict[str, list[ObjectInfo]]:
    """The objects of every identity ``args`` selects, grouped by identity (``du`` and ``gc`` size and plan from
    them): one listing per selected prefix, so a run selected across a DAG's tasks lists only that run's."""
    groups: dict[str, list[ObjectInfo]] = {}
    for prefix in selected_prefixes(args, store):
        groups.update(group_by_identity(store, prefix))
    return groups

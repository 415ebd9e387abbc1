"""Storage used per identity, and what it costs: the numbers behind ``airflow-stateful du``.

Bytes come from a listing (what the store bills), not from the head's ``total_size`` sums: a checkpoint
that keeps an earlier one's files shares their data, and crash garbage is billed although no head lists it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from airflow_stateful.core.errors import StatefulError
from airflow_stateful.core.fleet.catalog import HEAD_READERS, ordered_map, read_head
from airflow_stateful.core.fleet.gc import Progress, group_by_identity
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.retention import pack_usage, references, unreferenced
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.trees import PACK_DIR
from airflow_stateful.core.stores.base import ObjectInfo, ObjectStore
from airflow_stateful.core.timestamps import parse_iso

GB = 1024**3
DEFAULT_PRICE_PER_GB_MONTH = 0.023
"""S3 Standard, us-east-1, first 50 TB (USD per GB-month)."""


@dataclass(frozen=True)
class Usage:
    """One identity's footprint. ``idle_seconds`` is ``None`` for an identity with no head (an orphan).

    ``error`` says why its head could not be read (corrupt, forged, refused): its objects and bytes still
    count (they come from the listing), its checkpoints, garbage and idle age are unknown (0, 0, ``None``).
    """

    identity: str
    objects: int
    bytes: int
    garbage_bytes: int
    checkpoints: int
    idle_seconds: float | None
    error: str | None = None
    #: The head as read (``None``: an orphan, or unreadable), for what is judged from it (lifetimes, outcome).
    head: HeadRecord | None = field(default=None, repr=False, compare=False)
    #: Bytes in kept packs that no kept checkpoint needs (``disk_usage(packs=True)``; else ``None``).
    dead_pack_bytes: int | None = None

    def monthly_cost(self, price_per_gb_month: float) -> float:
        return self.bytes / GB * price_per_gb_month


def disk_usage(
    store: ObjectStore,
    *,
    prefix: str = "",
    now: float | None = None,
    progress: Progress | None = None,
    groups: dict[str, list[ObjectInfo]] | None = None,
    readers: int = HEAD_READERS,
    signer: HeadSigner | None = None,
    packs: bool = False,
) -> Iterator[Usage]:
    """Usage of every identity under ``prefix``, in key order, each as soon as its head is read.

    Sizes need every object listed (only a listing has them), so there is one full listing (``groups``: one
    already grouped by :func:`group_by_identity` saves it); the heads are then read ``readers`` at a time.
    ``packs``: also read the kept trees of each identity that has packs, for its dead pack bytes (one GET per
    kept tree: off by default, a fleet's ``du`` reads heads only).
    """
    now = time.time() if now is None else now
    if groups is None:
        groups = group_by_identity(store, prefix)
    listed = groups

    def usage_of(key: str) -> Usage:
        infos = listed[key]
        identity = Identity.parse(key)
        head_key = f"{key}/{HEAD_NAME}"
        read = read_head(store, identity, signer=signer) if any(i.key == head_key for i in infos) else None
        head = read.head if read is not None else None
        error = read.error if read is not None else None
        dead: int | None = None
        if packs and head is not None and error is None:
            dead = 0
            if any(i.key.startswith(f"{key}/{PACK_DIR}/") for i in infos):
                try:
                    cs = CheckpointStore(store=store, identity=identity, signer=signer)
                    dead = pack_usage(key, infos, references(head, trees=cs.content.tree_of)).dead_bytes
                except StatefulError as exc:
                    error = exc
        return Usage(
            identity=key,
            objects=len(infos),
            bytes=sum(i.size for i in infos),
            garbage_bytes=0 if error else sum(i.size for i in unreferenced(key, infos, head)),
            checkpoints=len(head.checkpoints) if head else 0,
            idle_seconds=max(now - parse_iso(head.updated_at), 0.0) if head and head.updated_at else None,
            error=f"{type(error).__name__}: {error}" if error else None,
            head=head,
            dead_pack_bytes=dead if error is None else None,
        )

    for usage in ordered_map(usage_of, sorted(groups), workers=readers):
        if progress:
            progress(1)
        yield usage

"""What one page of the view may still read, and the one reader of manifests that obeys it.

The Checkpoints tabs (:mod:`.task`, :mod:`.run`) read heads and manifests that anyone who can write the bucket
can write, for a user who may have asked for a run with thousands of identities. So every tab counts what it
lists and reads against one :class:`Budget` (the listing's object count and wall time, :class:`.rows.Bounds`;
at most :data:`MAX_MANIFESTS` manifest objects of at most :data:`MANIFEST_MAX_BYTES` each), and reads every
manifest through :func:`bounded_manifests`, so no tab has a cap of its own that another lacks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from airflow_stateful.core.data.content import ContentStore
from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.fleet.catalog import ordered_map
from airflow_stateful.core.records.heads import CheckpointEntry
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.plugins.view.rows import Bounds

MANIFEST_MAX_BYTES = 1024 * 1024
"""A manifest object larger than this is not read by the view (its value is that large: one page must not
download it, however many identities it shows)."""
MAX_MANIFESTS = 200
"""Manifest objects one request reads at most; inline manifests ride in their head and cost nothing."""
MANIFEST_READERS = 4
"""Manifest objects read at once (each is one GET whose time is mostly the round trip)."""


class Stop(Exception):
    """A bound was reached; the message says which."""


class Budget:
    """What one request may still read: listing entries, manifest objects, wall time."""

    def __init__(self, bounds: Bounds, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self.monotonic = monotonic
        self.deadline = monotonic() + bounds.seconds
        self.scanned = 0
        self.manifests = 0

    def count(self) -> None:
        """One more object listed or head read; Stop when a bound is reached."""
        self.scanned += 1
        if self.scanned > self.bounds.max_scanned:
            raise Stop(f"listed {self.bounds.max_scanned} objects")
        if self.monotonic() > self.deadline:
            raise Stop(f"read for {self.bounds.seconds:g} s")

    def manifest_refused(self, entry: CheckpointEntry) -> str | None:
        """Why the manifest of ``entry`` is not to be read, or None (and it is counted)."""
        if entry.inline is not None:
            return None
        if entry.manifest_size is not None and entry.manifest_size > MANIFEST_MAX_BYTES:
            return f"manifest of {human_bytes(entry.manifest_size)} not read"
        if self.manifests >= MAX_MANIFESTS:
            return f"not read ({MAX_MANIFESTS} manifests per page)"
        if self.monotonic() > self.deadline:
            return f"not read (after {self.bounds.seconds:g} s)"
        self.manifests += 1
        return None


@dataclass(frozen=True)
class ManifestRead:
    """One checkpoint's manifest as the view read it, or why it has none to show."""

    manifest: Manifest | None = None
    #: why it was not read: the bound that refused it (``refused``), or the read's error (``Type: message``)
    missing: str = ""
    refused: bool = False

    @property
    def shown(self) -> Manifest | str:
        """The manifest, or the words its row shows instead."""
        return self.manifest if self.manifest is not None else self.missing


def bounded_manifests(
    store: ObjectStore, identity: Identity, entries: Sequence[CheckpointEntry], budget: Budget
) -> list[ManifestRead]:
    """The manifest of each of ``entries`` (kept checkpoints of ``identity``) within ``budget``: the one place the
    view reads manifests, so every tab obeys the same caps (:meth:`Budget.manifest_refused`).

    Which ones are read is decided first, in the order of ``entries``, so the first ones win the budget; those
    are then read :data:`MANIFEST_READERS` at a time (a single one on this thread: no pool for one GET). A read
    that fails (a missing, corrupt or forged object: untrusted input) is that entry's answer, never raised.
    """
    refusals = [budget.manifest_refused(entry) for entry in entries]
    wanted = [entry for entry, refused in zip(entries, refusals, strict=True) if refused is None]
    # Below the head: the entries come from a head already read (and verified) by the caller.
    content = ContentStore(store=store, identity=identity)

    def read(entry: CheckpointEntry) -> ManifestRead:
        try:
            return ManifestRead(manifest=content.read_manifest(entry))
        except Exception as exc:  # shown on its own row
            return ManifestRead(missing=f"{type(exc).__name__}: {exc}")

    reads = iter(
        map(read, wanted) if len(wanted) < 2 else ordered_map(read, wanted, workers=MANIFEST_READERS)
    )
    return [
        next(reads) if refused is None else ManifestRead(missing=refused, refused=True)
        for refused in refusals
    ]


def bounded_manifest(
    store: ObjectStore, identity: Identity, entry: CheckpointEntry, budget: Budget
) -> ManifestRead:
    """:func:`bounded_manifests` of one checkpoint."""
    return bounded_manifests(store, identity, [entry], budget)[0]

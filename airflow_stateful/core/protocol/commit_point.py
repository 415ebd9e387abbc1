"""The commit point: how a checkpoint whose bytes are uploaded becomes the identity's newest, or does not.

A commit (:meth:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore.commit`) uploads chunks, trees
and a large manifest first; they stay invisible. Then one compare-and-swap of the head lists the new entry,
applies retention and renews the lease, succeeding only while the head carries the writer's epoch and token
(docs/adr/0001-commit-protocol.md). This module is that step, and the one after a write whose answer was lost:
the head is sealed and read back, so the commit is reported done exactly when it is.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Protocol

from airflow_stateful.core import events
from airflow_stateful.core.data.content import ContentStore
from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.errors import (
    CommitOutcomeUnknownError,
    ConcurrentCommitError,
    FencedError,
    StatefulError,
    StoreError,
)
from airflow_stateful.core.protocol.heads import HeadStore
from airflow_stateful.core.protocol.lease import Lease, check_holder, renewed
from airflow_stateful.core.protocol.retention import RetentionPolicy
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.formats import manifest_key
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import StagedOutput

log = logging.getLogger("airflow_stateful")

INLINE_MANIFEST_BYTES = 8 * 1024
"""A manifest up to this size rides inline in the head (a small commit is one conditional write)."""
INLINE_HEAD_BUDGET = 512 * 1024
"""...as long as the head stays below this size (heads are read by every reader: keep them small)."""


class Committing(Protocol):
    """What the commit point needs of the checkpoint store that commits (a protocol, so it is not imported)."""

    identity: Identity
    heads: HeadStore
    content: ContentStore
    retention: RetentionPolicy
    clock: Callable[[], float]
    lease_ttl: float


def entry_for(cs: Committing, manifest: Manifest, head: HeadRecord) -> CheckpointEntry:
    """The head entry of ``manifest``: inline when small (one write commits it), else written as an object."""
    raw = canonical_json(manifest.to_json()) + b"\n"
    inline = len(raw) <= INLINE_MANIFEST_BYTES and cs.heads.stored_size(head) + len(raw) <= INLINE_HEAD_BUDGET
    key = manifest_key(cs.identity.key, manifest.seq, manifest.commit_id)
    if not inline:
        cs.content.write_manifest(key, raw)
    return CheckpointEntry(
        seq=manifest.seq,
        commit_id=manifest.commit_id,
        manifest=None if inline else key,
        manifest_sha256=None if inline else sha256_hex(raw),
        manifest_size=None if inline else len(raw),
        created_at=manifest.created_at,
        schema_version=manifest.schema_version,
        epoch=manifest.epoch,
        total_size=manifest.total_size,
        file_count=manifest.file_count,
        tree=manifest.tree,
        # A copy made of the stored bytes: the caller's value object must never alias the head's record.
        inline=json.loads(raw) if inline else None,
        outputs_tree=manifest.outputs_tree,
    )


def advance_head(
    cs: Committing, lease: Lease, manifest: Manifest, entry: CheckpointEntry, *, unpin: Collection[str]
) -> int:
    """The commit point: compare-and-swap the head to list ``entry`` (retention applied, the lease renewed),
    only while it carries ``lease``. A lost answer is resolved by reading the head back (:func:`landed`)."""
    seq = manifest.seq
    freed: list[CheckpointEntry] = []

    def decide(current: HeadRecord | None) -> HeadRecord:
        current = check_holder(current, lease, action="commit to")
        if any(e.commit_id == entry.commit_id for e in current.checkpoints):
            return current  # our write landed; its answer was lost and a retry saw 412
        if current.next_seq != seq:
            raise ConcurrentCommitError(
                f"identity {cs.identity} advanced to seq {current.next_seq - 1} while this commit "
                f"(seq {seq}) was in flight with the same lease; commit from one thread at a time."
            )
        kept = [replace(e, pinned=None) if e.commit_id in unpin else e for e in current.checkpoints]
        keep, drop = cs.retention.split([*kept, entry])
        freed[:] = [e for e in drop if e.manifest or e.tree or e.outputs_tree]
        advanced = current.evolve(next_seq=seq + 1, checkpoints=tuple(keep))
        return renewed(advanced.evolve(format=advanced.written_format), now=cs.clock(), ttl=cs.lease_ttl)

    try:
        cs.heads.update(decide, fresh=False)
    except FencedError:
        events.emit(events.FENCED, identity=cs.identity.key, epoch=lease.epoch, action="commit")
        raise
    except StoreError as exc:
        # The write may have landed with its answer lost (a reset or timeout after the request was
        # sent, retries exhausted). The head says which: report the commit as done exactly when it is.
        if not landed(cs, manifest, lease, exc):
            raise
        log.warning(
            "the answer to the commit of checkpoint %d of %s was lost (%s); the head shows it landed",
            seq,
            cs.identity,
            exc,
        )
    return len(freed)


def announce(
    identity: Identity, manifest: Manifest, outputs: Mapping[str, StagedOutput], started: float
) -> None:
    """The events and log lines of a landed commit."""
    seq = manifest.seq
    if outputs:
        size = sum(o.size for o in outputs.values())
        events.emit(events.PUBLISHED, identity=identity.key, seq=seq, outputs=len(outputs), bytes=size)
        log.info(
            "%s: checkpoint %d made %d output(s) visible: %s",
            identity,
            seq,
            len(outputs),
            ", ".join(sorted(outputs)),
        )
    events.emit(
        events.COMMIT,
        identity=identity.key,
        seq=seq,
        bytes=manifest.total_size,
        files=manifest.file_count,
        duration=time.monotonic() - started,
    )
    log.info(
        "committed checkpoint %d of %s (%d file(s), %s, schema %d)",
        seq,
        identity,
        manifest.file_count,
        human_bytes(manifest.total_size),
        manifest.schema_version,
    )


def landed(cs: Committing, manifest: Manifest, lease: Lease, error: StoreError) -> bool:
    """Whether ``manifest``'s commit is in the head after its head write failed with ``error``.

    "Not in the head" is not yet "failed": an attempt held up in the network (past every read timeout)
    still carries ``If-Match`` with the ETag the head has now, and could land after this returns. So the
    head is sealed first: rewritten conditionally (the lease renewed), which changes its ETag, so that a
    held write can only ever get 412. Only then is the commit reported as failed.
    """

    def ours(head: HeadRecord | None) -> bool:
        return head is not None and any(e.commit_id == manifest.commit_id for e in head.checkpoints)

    def seal(current: HeadRecord | None) -> HeadRecord:
        if ours(current):
            return current  # type: ignore[return-value]  # it landed meanwhile: nothing to write
        return renewed(check_holder(current, lease, action="commit to"), now=cs.clock(), ttl=cs.lease_ttl)

    try:
        # FencedError passes: another writer took the head (so the held write can no longer land either).
        return ours(cs.heads.update(seal))
    except FencedError:
        raise
    except StatefulError as again:
        raise CommitOutcomeUnknownError(
            f"could not tell whether checkpoint {manifest.seq} of {cs.identity} was committed: writing "
            f"the head failed ({error}) and reading it back failed too ({again}). The previous checkpoint "
            "is intact either way; the next save reads the head again and goes on from the newest.",
            manifest=manifest,
        ) from error

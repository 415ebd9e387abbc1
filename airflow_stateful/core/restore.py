"""Restoring a checkpoint's files: verified, in parallel, all or nothing.

Every file is assembled in a staging directory inside the destination (same filesystem, so the final moves
are renames): format-2 files chunk by chunk, each chunk checked against its SHA-256 and size; format-1 files
object by object through the store's verifying download. Only when every file of the checkpoint is complete
and verified are they moved into place; on any error the destination is left exactly as it was.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from airflow_stateful.core import events
from airflow_stateful.core.errors import CheckpointCorruptError, ObjectNotFoundError
from airflow_stateful.core.files import check_restore_targets, safe_relative
from airflow_stateful.core.progress import TransferProgress
from airflow_stateful.core.records import Manifest, manifest_key
from airflow_stateful.core.transfer import download_files
from airflow_stateful.core.trees import ChunkRef

if TYPE_CHECKING:
    from airflow_stateful.core.checkpoint_store import CheckpointStore

log = logging.getLogger("airflow_stateful")

PROGRESS_MIN_BYTES = 64 * 1024 * 1024


class ChunkCache:
    """Where a restore may find chunks without downloading them (see :mod:`airflow_stateful.core.chunk_cache`)."""

    def get(self, chunk: ChunkRef) -> bytes | None:  # pragma: no cover - interface
        return None

    def put(self, chunk: ChunkRef, data: bytes) -> None:  # pragma: no cover - interface
        return None


def restore_files(
    checkpoints: CheckpointStore, manifest: Manifest, dest: str | Path, *, cache: ChunkCache | None = None
) -> list[Path]:
    """Download ``manifest``'s files into directory ``dest``, verified, all or nothing; the restored paths."""
    started = time.monotonic()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    identity = checkpoints.identity
    where = manifest_key(identity.key, manifest.seq, manifest.commit_id)
    tree = checkpoints.tree(manifest)
    paths = [f.path for f in tree.files] if tree is not None else [f.path for f in manifest.files]
    rels = [safe_relative(path, manifest_key=where) for path in paths]
    check_restore_targets(dest, rels)
    total = manifest.total_size
    progress = None
    if total >= PROGRESS_MIN_BYTES:
        progress = TransferProgress(
            label=f"restoring {len(rels)} file(s) of {identity}", total_bytes=total, logger=log
        )
    staging = dest / f".stateful-restore-{uuid.uuid4().hex[:12]}"
    try:
        if tree is not None:
            get: Callable[[ChunkRef], bytes | None] | None = cache.get if cache is not None else None
            download_files(
                checkpoints.store,
                files=[(f, staging / rel) for f, rel in zip(tree.files, rels, strict=True)],
                workers=checkpoints.parallelism,
                cached=get,
                remember=cache.put if cache is not None else None,
                progress=progress,
            )
        else:
            for rel, entry in zip(rels, manifest.files, strict=True):
                try:
                    checkpoints.store.download_file(
                        entry.key, staging / rel, size=entry.size, sha256=entry.sha256, progress=progress
                    )
                except ObjectNotFoundError as exc:
                    raise CheckpointCorruptError(
                        f"file {entry.path!r} of checkpoint {manifest.seq} of {identity} is missing: {exc}. "
                        "Nothing was restored."
                    ) from exc
        restored = []
        parents: set[Path] = set()
        for rel in rels:
            target = dest / rel
            if target.parent not in parents:
                target.parent.mkdir(parents=True, exist_ok=True)
                parents.add(target.parent)
            (staging / rel).replace(target)
            restored.append(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if progress:
        progress.finish()
    events.emit(
        events.RESTORE,
        identity=identity.key,
        seq=manifest.seq,
        bytes=total,
        files=len(restored),
        duration=time.monotonic() - started,
    )
    return restored

"""Restoring a checkpoint's files: verified, in parallel, all or nothing.

Every file is assembled in a staging directory inside the destination (same filesystem, so the final moves
are renames): format-2 files chunk by chunk, each chunk checked against its SHA-256 and size; format-1 files
object by object through the store's verifying download. Only when every file of the checkpoint is complete
and verified are they moved into place; on any error the destination is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from airflow_stateful.core import events
from airflow_stateful.core.errors import CheckpointCorruptError, ObjectNotFoundError
from airflow_stateful.core.files import check_distinct_paths, check_restore_targets, safe_relative
from airflow_stateful.core.progress import TransferProgress
from airflow_stateful.core.records import Manifest, manifest_key
from airflow_stateful.core.transfer import download_files
from airflow_stateful.core.trees import ChunkRef, TreeFile

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
    where = manifest_key(checkpoints.identity.key, manifest.seq, manifest.commit_id)
    tree = checkpoints.tree(manifest)
    if tree is not None:
        return restore_tree_files(
            checkpoints,
            list(tree.files),
            dest,
            where=where,
            label=str(checkpoints.identity),
            seq=manifest.seq,
            cache=cache,
        )
    return _restore_legacy(checkpoints, manifest, Path(dest), where=where)


def _restore_legacy(
    checkpoints: CheckpointStore, manifest: Manifest, dest: Path, *, where: str
) -> list[Path]:
    """Format 1: whole-file objects, each through the store's verifying download."""
    identity = checkpoints.identity

    def fetch(rels: list[PurePosixPath], incoming: Path, progress: TransferProgress | None) -> None:
        for rel, entry in zip(rels, manifest.files, strict=True):
            try:
                checkpoints.store.download_file(
                    entry.key, incoming / rel, size=entry.size, sha256=entry.sha256, progress=progress
                )
            except ObjectNotFoundError as exc:
                raise CheckpointCorruptError(
                    f"file {entry.path!r} of checkpoint {manifest.seq} of {identity} is missing: {exc}. "
                    "Nothing was restored."
                ) from exc

    return _restore(
        checkpoints,
        dest,
        [f.path for f in manifest.files],
        manifest.total_size,
        fetch,
        where=where,
        label=str(identity),
        seq=manifest.seq,
    )


def restore_tree_files(
    checkpoints: CheckpointStore,
    files: list[TreeFile],
    dest: str | Path,
    *,
    where: str,
    label: str,
    seq: int,
    cache: ChunkCache | None = None,
) -> list[Path]:
    """Download ``files`` (tree entries: relative path, size, chunks) into ``dest``, verified, all or nothing.

    A checkpoint's tree, or a published output's files. ``where`` names the record in errors, ``label`` what is
    restored in progress lines."""

    def fetch(rels: list[PurePosixPath], incoming: Path, progress: TransferProgress | None) -> None:
        download_files(
            checkpoints.store,
            files=[(f, incoming / rel) for f, rel in zip(files, rels, strict=True)],
            workers=checkpoints.parallelism,
            cached=cache.get if cache is not None else None,
            remember=cache.put if cache is not None else None,
            progress=progress,
        )

    paths = [f.path for f in files]
    return _restore(
        checkpoints, Path(dest), paths, sum(f.size for f in files), fetch, where=where, label=label, seq=seq
    )


def _restore(
    checkpoints: CheckpointStore,
    dest: Path,
    paths: list[str],
    total: int,
    fetch: Callable[[list[PurePosixPath], Path, TransferProgress | None], None],
    *,
    where: str,
    label: str,
    seq: int,
) -> list[Path]:
    """What every restore does around its downloads: undo an interrupted restore into ``dest``, check the paths,
    let ``fetch`` download and verify every file into a staging directory, then swap them in all or nothing, and
    report the restore. ``fetch(rels, incoming, progress)`` writes each ``incoming / rel``."""
    started = time.monotonic()
    dest.mkdir(parents=True, exist_ok=True)
    recover_interrupted(dest)
    rels = [safe_relative(path, manifest_key=where) for path in paths]
    check_distinct_paths(rels, manifest_key=where)
    check_restore_targets(dest, rels)
    progress = None
    if total >= PROGRESS_MIN_BYTES:
        progress = TransferProgress(
            label=f"restoring {len(rels)} file(s) of {label}", total_bytes=total, logger=log
        )
    staging = dest / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    try:
        fetch(rels, staging / "new", progress)
        restored = _swap_in(dest, staging, rels)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if progress:
        progress.finish()
    events.emit(
        events.RESTORE,
        identity=checkpoints.identity.key,
        seq=seq,
        bytes=total,
        files=len(restored),
        duration=time.monotonic() - started,
    )
    return restored


STAGING_PREFIX = ".stateful-restore-"
"""Name prefix of the staging directory a restore builds inside its destination."""
_JOURNAL = "journal.json"


def _swap_in(dest: Path, staging: Path, rels: list[PurePosixPath]) -> list[Path]:
    """Move the verified files from ``staging/new`` into ``dest``, all or nothing.

    A journal (the paths, and the directories this restore creates) is written first; each file already in
    ``dest`` is moved aside into ``staging/old`` before the new one takes its place. On any error the moves
    are undone here; after a crash (SIGKILL, a lost node) the next restore into ``dest`` (or
    :func:`recover_interrupted`) undoes them. Either way ``dest`` ends as it was or complete, never a mix.
    """
    created: list[str] = []
    seen: set[Path] = set()
    for rel in rels:
        for parent in reversed((dest / rel).parents):
            if parent in seen or parent == dest or dest not in parent.parents:
                continue
            seen.add(parent)
            if not parent.exists():
                created.append(str(parent.relative_to(dest)))
    existed = [(dest / rel).exists() or (dest / rel).is_symlink() for rel in rels]
    journal = {
        "pid": os.getpid(),
        "files": [str(rel) for rel in rels],
        "existed": existed,
        "created": created,
    }
    staging.mkdir(exist_ok=True)  # a checkpoint without files downloaded nothing into it
    with open(staging / _JOURNAL, "w", encoding="utf-8") as out:
        json.dump(journal, out)
        out.flush()
        os.fsync(out.fileno())
    restored = []
    try:
        for name in created:
            (dest / name).mkdir(exist_ok=True)
        for rel in rels:
            target = dest / rel
            # Stat again (the journal's `existed` is a moment old): a file that appeared since is moved aside too,
            # so a rollback puts it back instead of losing it.
            if target.exists() or target.is_symlink():
                aside = staging / "old" / rel
                aside.parent.mkdir(parents=True, exist_ok=True)
                target.replace(aside)
            (staging / "new" / rel).replace(target)
            restored.append(target)
    except BaseException:
        _roll_back(dest, staging, journal)
        raise
    # The restore is complete: drop the journal *before* the staging directory (whose deletion order is the
    # file system's), so a kill during that cleanup can never roll back a finished restore without its backups.
    (staging / _JOURNAL).unlink()
    return restored


def _roll_back(dest: Path, staging: Path, journal: dict[str, Any]) -> None:
    """Undo the moves of an interrupted :func:`_swap_in` (any prefix of them), newest first."""
    existed = journal.get("existed")
    for n, name in reversed(list(enumerate(journal["files"]))):
        rel = safe_relative(name, manifest_key="restore journal")
        target, aside, incoming = dest / rel, staging / "old" / rel, staging / "new" / rel
        was_there = existed[n] if isinstance(existed, list) and n < len(existed) else True
        if aside.exists() or aside.is_symlink():
            aside.replace(target)  # what was there before comes back
        elif not was_there and not incoming.exists() and (target.exists() or target.is_symlink()):
            target.unlink()  # moved in by the restore, where nothing was before
    for name in reversed(journal["created"]):
        with contextlib.suppress(OSError):
            (dest / safe_relative(name, manifest_key="restore journal")).rmdir()  # only if empty


def recover_interrupted(dest: str | Path) -> bool:
    """Undo a restore into ``dest`` that was killed while it moved files into place; True if one was found.

    A restore killed while downloading left only its staging directory (removed here: ``dest`` never
    changed). One killed while moving files left a journal: every file it had moved in is taken out again
    and every file it had moved aside is put back, so ``dest`` is exactly as before that restore. A staging
    directory whose process is still alive on this machine is left alone. Every restore calls this first.
    """
    dest = Path(dest)
    found = False
    if not dest.is_dir():
        return False
    for staging in dest.glob(f"{STAGING_PREFIX}*"):
        if not staging.is_dir() or staging.is_symlink():
            continue
        journal: dict[str, Any] | None = None
        with contextlib.suppress(OSError, ValueError):
            journal = json.loads((staging / _JOURNAL).read_text(encoding="utf-8"))
        pid = journal.get("pid") if isinstance(journal, dict) else None
        if isinstance(pid, int) and pid != os.getpid() and _alive(pid):
            log.warning("%s: another process (pid %d) is restoring here; leaving it alone", staging, pid)
            continue
        if (
            isinstance(journal, dict)
            and isinstance(journal.get("files"), list)
            and isinstance(journal.get("created"), list)
        ):
            log.warning("%s: undoing a restore that was interrupted while moving files into place", dest)
            _roll_back(dest, staging, journal)
        shutil.rmtree(staging, ignore_errors=True)
        found = True
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

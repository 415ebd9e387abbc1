"""Restoring a checkpoint's files: verified, in parallel, all or nothing.

Every file is assembled in a staging directory inside the destination (same filesystem, so the final moves
are renames), chunk by chunk, each chunk checked against its SHA-256 and size. Only when every file of the
checkpoint is complete and verified are they moved into place; on any error the destination is left exactly as
it was.

What the destination already holds is handled by the restore's mode (:mod:`airflow_stateful.core.data.restore_modes`):
in mode ``"exact"`` what the checkpoint does not have is moved aside within the same journaled swap, so a kill
or an error puts it back too, and it is deleted only once the swap completed.
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
from typing import Any, Protocol

from airflow_stateful.core import events
from airflow_stateful.core.collector import paused_collector
from airflow_stateful.core.data.destinations import check_destination, first_link, trusted_staging
from airflow_stateful.core.data.download import download_files
from airflow_stateful.core.data.files import check_distinct_paths, check_restore_targets, safe_relative
from airflow_stateful.core.data.packs import mostly_small
from airflow_stateful.core.data.restore_modes import (
    EMPTY,
    EXACT,
    STAGING_PREFIX,
    RestoreResult,
    check_mode,
    not_in_checkpoint,
    refuse_unless_empty,
)
from airflow_stateful.core.data.transfer_progress import TransferProgress
from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.records.formats import manifest_key
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.trees import ChunkRef, Tree, TreeFile
from airflow_stateful.core.stores.base import ObjectStore


class Restorable(Protocol):
    """What a restore needs of one identity's checkpoints (a
    :class:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore` is one): where the bytes are, whose they are,
    how many to move at once, and a checkpoint's verified tree. A protocol, so this module, which the checkpoint
    store calls, never imports it back."""

    @property
    def store(self) -> ObjectStore: ...

    @property
    def identity(self) -> Identity: ...

    @property
    def parallelism(self) -> int: ...

    def tree(self, manifest: Manifest) -> Tree | None: ...


log = logging.getLogger("airflow_stateful")

PROGRESS_MIN_BYTES = 64 * 1024 * 1024


class ChunkCache:
    """Where a restore may find chunks without downloading them (see :mod:`airflow_stateful.core.data.chunk_cache`)."""

    def get(self, chunk: ChunkRef) -> bytes | None:  # pragma: no cover - interface
        return None

    def put(self, chunk: ChunkRef, data: bytes) -> None:  # pragma: no cover - interface
        return None


def restore_files(
    checkpoints: Restorable,
    manifest: Manifest,
    dest: str | Path,
    *,
    mode: str = EXACT,
    cache: ChunkCache | None = None,
    shared_dest: bool = False,
    durable: bool = False,
    verb: str = "restoring",
) -> RestoreResult:
    """Download ``manifest``'s files into directory ``dest``, verified, all or nothing, in restore ``mode``.

    A checkpoint that carries no files (value only) leaves ``dest`` as it is in every mode: exact never empties
    a directory because of a checkpoint that did not save one. ``shared_dest``: see :func:`prepare`.
    ``durable``: fsync each restored file before it is moved into place (:mod:`.download`). ``verb`` starts the
    progress lines (``"verifying"`` for a read-back that keeps nothing)."""
    mode = check_mode(mode)
    dest = Path(dest)
    prepare(
        dest, mode, shared_dest=shared_dest
    )  # before the tree is read: mode "empty" refuses before anything is downloaded
    # A checkpoint's files are its tree (a manifest listing format-1 files is refused when it is read).
    tree = checkpoints.tree(manifest) if manifest.has_files else None
    if tree is None:
        return RestoreResult(dest=dest, mode=mode, seq=manifest.seq, untouched=True)
    return restore_tree_files(
        checkpoints,
        list(tree.files),
        dest,
        where=manifest_key(checkpoints.identity.key, manifest.seq, manifest.commit_id),
        label=str(checkpoints.identity),
        seq=manifest.seq,
        mode=mode,
        cache=cache,
        shared_dest=shared_dest,
        prepared=True,
        durable=durable,
        verb=verb,
    )


def prepare(dest: Path, mode: str, *, shared_dest: bool = False) -> None:
    """What a restore checks before it reads anything: that ``dest`` is this user's and nobody else may write
    it (:func:`~airflow_stateful.core.data.destinations.check_destination`; ``shared_dest=True`` says the caller
    shares it knowingly), then an interrupted restore into ``dest`` is undone (its rollback may bring files
    back), then mode ``"empty"`` refuses a destination that is not empty."""
    check_destination(dest, shared_dest=shared_dest)
    if dest.is_dir():
        recover_interrupted(dest)
    if mode == EMPTY:
        refuse_unless_empty(dest)


def restore_tree_files(
    checkpoints: Restorable,
    files: list[TreeFile],
    dest: str | Path,
    *,
    where: str,
    label: str,
    seq: int,
    mode: str = EXACT,
    what: str = "checkpoint",
    cache: ChunkCache | None = None,
    shared_dest: bool = False,
    prepared: bool = False,
    durable: bool = False,
    verb: str = "restoring",
) -> RestoreResult:
    """Download ``files`` (tree entries: relative path, size, chunks) into ``dest``, verified, all or nothing.

    A checkpoint's tree, or a published output's files. ``where`` names the record in errors, ``label`` what is
    restored in progress lines, ``what`` in the result's log line; ``mode`` is the restore mode. ``prepared``:
    the caller already ran :func:`prepare` on ``dest`` (its checks and recovery are not run twice). ``verb``:
    see :func:`restore_files`."""

    def fetch(rels: list[PurePosixPath], incoming: Path, progress: TransferProgress | None) -> None:
        download_files(
            checkpoints.store,
            files=[(f, incoming / rel) for f, rel in zip(files, rels, strict=True)],
            workers=checkpoints.parallelism,
            cached=cache.get if cache is not None else None,
            remember=cache.put if cache is not None else None,
            progress=progress,
            durable=durable,
        )

    paths = [f.path for f in files]
    total = sum(f.size for f in files)
    with paused_collector(
        when=mostly_small(len(files), total)
    ):  # as a save of them is (ContentStore.upload_tree)
        return _restore(
            checkpoints,
            Path(dest),
            paths,
            total,
            fetch,
            where=where,
            label=label,
            seq=seq,
            mode=check_mode(mode),
            what=what,
            shared_dest=shared_dest,
            prepared=prepared,
            verb=verb,
        )


def _restore(
    checkpoints: Restorable,
    dest: Path,
    paths: list[str],
    total: int,
    fetch: Callable[[list[PurePosixPath], Path, TransferProgress | None], None],
    *,
    where: str,
    label: str,
    seq: int,
    mode: str,
    what: str = "checkpoint",
    shared_dest: bool = False,
    prepared: bool = False,
    verb: str = "restoring",
) -> RestoreResult:
    """What every restore does around its downloads: undo an interrupted restore into ``dest``, apply the mode's
    check, check the paths, let ``fetch`` download and verify every file into a staging directory, then swap
    them in all or nothing (in mode ``"exact"`` moving out what the checkpoint does not have), and report the
    restore. ``fetch(rels, incoming, progress)`` writes each ``incoming / rel``."""
    started = time.monotonic()
    if not prepared:
        prepare(dest, mode, shared_dest=shared_dest)
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    rels = [safe_relative(path, manifest_key=where) for path in paths]
    check_distinct_paths(rels, manifest_key=where)
    check_restore_targets(dest, rels)
    progress = None
    if total >= PROGRESS_MIN_BYTES:
        progress = TransferProgress(
            label=f"{verb} {len(rels)} file(s) of {label}", total_bytes=total, logger=log
        )
    staging = dest / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    try:
        staging.mkdir(mode=0o700)  # this user's alone: a later recovery trusts nothing else
        fetch(rels, staging / "new", progress)
        restored, removed, replaced = _swap_in(dest, staging, rels, exact=mode == EXACT)
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
    return RestoreResult(
        dest=dest,
        mode=mode,
        seq=seq,
        files=restored,
        removed=removed,
        replaced=replaced,
        bytes=total,
        what=what,
    )


_JOURNAL = "journal.json"


def _swap_in(
    dest: Path, staging: Path, rels: list[PurePosixPath], *, exact: bool
) -> tuple[list[Path], list[str], int]:
    """Move the verified files from ``staging/new`` into ``dest``, all or nothing; with ``exact``, first move
    what the checkpoint does not have out of ``dest``. Returns the restored paths, the removed relative paths and
    how many files were replaced.

    A journal (the paths, the directories this restore creates, and what exact moves out) is written first;
    each file already in ``dest`` is moved aside into ``staging/old`` before the new one takes its place, and
    each entry exact moves out goes to ``staging/gone/<n>`` (a whole directory in one move). On any error the
    moves are undone here; after a crash (SIGKILL, a lost node) the next restore into ``dest`` (or
    :func:`recover_interrupted`) undoes them. Either way ``dest`` ends as it was or complete, never a mix. What
    was moved aside is deleted only with the staging directory, after the journal is gone.
    """
    # Strings and os.path, not Path objects: for a tree of 10,000 small files the Path arithmetic here cost more
    # than the moves themselves (docs/performance.md, issue 32). ``rels`` are checked relative paths.
    base = str(dest)
    names = [str(rel) for rel in rels]
    targets = [os.path.join(base, name) for name in names]
    created: list[str] = []
    seen: set[str] = set()
    for name in names:
        parts = name.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            parent = "/".join(parts[:depth])
            if parent in seen:
                continue
            seen.add(parent)
            if not os.path.exists(os.path.join(base, parent)):
                created.append(parent)
    existed = [os.path.lexists(target) for target in targets]
    aside, removed = not_in_checkpoint(dest, rels) if exact else ([], [])
    journal = {
        "pid": os.getpid(),
        "files": names,
        "existed": existed,
        "created": created,
        "removed": [str(rel) for rel in aside],
    }
    staging.mkdir(mode=0o700, exist_ok=True)  # a checkpoint without files downloaded nothing into it
    with open(staging / _JOURNAL, "w", encoding="utf-8") as out:
        json.dump(journal, out)
        out.flush()
        os.fsync(out.fileno())
    restored = []
    replaced = 0
    try:
        if aside:
            (staging / "gone").mkdir()
        for n, rel in enumerate(aside):
            extra = dest / rel
            if extra.exists() or extra.is_symlink():  # gone since it was listed: nothing to move
                extra.replace(staging / "gone" / str(n))
        for name in created:
            (dest / name).mkdir(mode=0o700, exist_ok=True)  # owner-only: a tree records no directory modes
        incoming, old = str(staging / "new"), str(staging / "old")
        for name, target in zip(names, targets, strict=True):
            # Stat again (the journal's `existed` is a moment old): a file that appeared since is moved aside too,
            # so a rollback puts it back instead of losing it.
            if os.path.lexists(target):
                aside_file = os.path.join(old, name)
                os.makedirs(os.path.dirname(aside_file), exist_ok=True)
                os.replace(target, aside_file)
                replaced += 1
            os.replace(os.path.join(incoming, name), target)
            restored.append(Path(target))
    except BaseException:
        _roll_back(dest, staging, journal)
        raise
    # The restore is complete: drop the journal *before* the staging directory (whose deletion order is the
    # file system's), so a kill during that cleanup can never roll back a finished restore without its backups.
    (staging / _JOURNAL).unlink()
    return restored, removed, replaced


def _roll_back(dest: Path, staging: Path, journal: dict[str, Any]) -> None:
    """Undo the moves of an interrupted :func:`_swap_in` (any prefix of them), newest first."""
    existed = journal.get("existed")
    for n, name in reversed(list(enumerate(journal["files"]))):
        rel = safe_relative(name, manifest_key="restore journal")
        _refuse_links(dest, rel, staging)
        target, aside, incoming = dest / rel, staging / "old" / rel, staging / "new" / rel
        was_there = existed[n] if isinstance(existed, list) and n < len(existed) else True
        if aside.exists() or aside.is_symlink():
            aside.replace(target)  # what was there before comes back
        elif not was_there and not incoming.exists() and (target.exists() or target.is_symlink()):
            target.unlink()  # moved in by the restore, where nothing was before
    for name in reversed(journal["created"]):
        rel = safe_relative(name, manifest_key="restore journal")
        _refuse_links(dest, rel, staging)
        with contextlib.suppress(OSError):
            (dest / rel).rmdir()  # only if empty
    removed = journal.get("removed")
    for n, name in reversed(list(enumerate(removed if isinstance(removed, list) else []))):
        gone = staging / "gone" / str(n)
        extra = _inside(name)
        if extra is not None and (gone.exists() or gone.is_symlink()):
            _refuse_links(dest, extra, staging)
            (dest / extra).parent.mkdir(parents=True, exist_ok=True)
            gone.replace(dest / extra)  # what exact moved out comes back


def _refuse_links(dest: Path, rel: PurePosixPath, staging: Path) -> None:
    link = first_link(dest, rel)
    if link is not None:
        raise InvalidValueError(
            f"{str(link)!r} is a symbolic link inside {str(dest)!r}: an interrupted restore is never undone "
            f"through links (that would act outside the destination). Nothing more was undone; what that restore "
            f"moved aside is still in {str(staging)!r}. Remove the link, then restore again"
        )


def _inside(name: Any) -> PurePosixPath | None:
    """A journal's removed path, if it stays inside the destination. Not :func:`safe_relative`: these are names
    found on disk (a backslash or an odd encoding is theirs to have), not names a checkpoint may record."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\x00" in name:
        return None
    rel = PurePosixPath(name)
    return None if any(part in ("", ".", "..") for part in name.split("/")) else rel


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
        distrust = trusted_staging(staging)
        if distrust is not None:
            # Not this user's own restore (planted, or another user's): acting on it could replace files
            # anywhere the journal names. It is left exactly as it is.
            log.warning("%s: not an interrupted restore of this user's (%s); left alone", staging, distrust)
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

"""TaskState: what a stateful task's code touches — the last value, saving, file checkpoints, resuming loops.

A TaskState is handed to the task by :class:`~airflow_stateful.operators.stateful.StatefulOperator` on top of
an open :class:`~airflow_stateful.core.protocol.session.WriterSession`: the session holds the lease (fencing every
earlier try) and renews it while the task computes, and it has already loaded, verified and migrated the
newest checkpoint. TaskState adds what task code wants on top: a value to carry, ``save``, and ``resume``
loops with their positions. It imports no Airflow: the operator turns its signals into Airflow's.

A save that fails (a value that cannot be encoded, a fenced writer, a network error) changes nothing the
task sees: :attr:`~TaskState.value`, :attr:`~TaskState.checkpoint` and the resume positions stay the last
committed ones (or what the task itself set since).

**Saving in the background** (``save(..., wait=False)``): see :mod:`airflow_stateful.pending_save` for the
rules and why.

**The worker's restore cache** (``restore_cache``, which ``StatefulOperator`` passes from ``[stateful]
restore_cache_dir``): a save with files keeps the chunks it committed in a directory on the worker, and
:meth:`TaskState.restore_files` takes chunks from there before downloading, each verified against the SHA-256
the checkpoint records. So a retry on the same machine restores the files its failed try saved without
downloading them again (see :mod:`airflow_stateful.core.data.chunk_cache`). The cache can only save downloads:
a file in it that does not match is deleted and the chunk downloaded, and a cache that fails is skipped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

from airflow_stateful.core.data.chunk_cache import LocalChunkCache
from airflow_stateful.core.data.restore_modes import RestoreResult
from airflow_stateful.core.data.snapshot import snapshot_files, snapshot_value
from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.errors import InvalidValueError, StopRequested
from airflow_stateful.core.protocol.effects import effect_key
from airflow_stateful.core.protocol.resume import ON_CHANGE, Walk
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.codecs import encode_value
from airflow_stateful.core.records.cursors import (
    CURSORS,
    MAX_NAME,
    Cursor,
    ItemKey,
    cursors_to_json,
    parse_cursors,
    read_cursors,
)
from airflow_stateful.core.records.heads import CheckpointEntry
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import OutputInfo
from airflow_stateful.pending_save import CheckpointInfo, PendingSave

log = logging.getLogger("airflow_stateful")

__all__ = ["CheckpointInfo", "PendingSave", "TaskState"]

T = TypeVar("T")


class TaskState:
    """The state of one stateful task instance, shared by all its tries.

    :param session: the open writer session of this try (lease held and renewed, checkpoint loaded).
    :param checkpoint_every: default for :meth:`resume`: commit after this many finished items.
    :param checkpoint_interval: default for :meth:`resume`: commit at least this often.
    :param clock: monotonic seconds, for ``checkpoint_interval``; injectable for tests.
    :param staging_dir: where ``save(files=..., wait=False)`` copies the files it snapshots; default: a
        hidden ``.stateful-staging`` directory beside the saved path (see :mod:`airflow_stateful.core.data.snapshot`).
    :param restore_cache: the worker's restore cache: saves with files fill it and :meth:`restore_files` reads
        it before downloading (every chunk verified); default ``None``: every restore downloads.
    """

    def __init__(
        self,
        *,
        session: WriterSession,
        checkpoint_every: int | None = None,
        checkpoint_interval: timedelta | None = None,
        clock: Callable[[], float] = time.monotonic,
        staging_dir: str | os.PathLike[str] | None = None,
        restore_cache: LocalChunkCache | None = None,
    ) -> None:
        self._session = session
        if restore_cache is not None:
            session.use_restore_cache(restore_cache)  # saves fill it, restores read it first
        self._value = session.value
        # What the task sees of the store, changed only in the task's own calls (never by the background save).
        self._latest: Manifest | None = session.latest
        # Bumped by every assignment to .value: a background save that lands later must not undo one.
        self._generation = 0
        self._pending: PendingSave | None = None
        self._collect_lock = threading.Lock()
        self._staging_dir = staging_dir
        self._resumed = session.latest is not None
        # resume() positions belong to one DAG run: a named identity carries its value into the next run,
        # but the next run iterates over new data and must start at its first item.
        start = session.start
        same_run = start is not None and start.writer.run_id == session.writer.run_id
        self._cursors: dict[str, Cursor] = (
            parse_cursors(start.extra, what=f"checkpoint {start.seq}") if start and same_run else {}
        )
        self._cursors_from = f"checkpoint {start.seq}" if start else "no checkpoint"
        self._every = checkpoint_every
        self._interval = checkpoint_interval
        self._clock = clock
        self._stop = threading.Event()

    # -- reading -------------------------------------------------------------------------------------------
    @property
    def value(self) -> Any:
        """The last committed value (or what this try set since); ``None`` when nothing was ever saved.

        A background save changes it only once the task has waited for it (see the module's docstring).
        """
        return self._value

    @value.setter
    def value(self, new: Any) -> None:
        """Set the value the next checkpoint commits (the next :meth:`resume` step or :meth:`save`)."""
        encode_value(
            new, self._session.value_codec
        )  # fail now, naming the problem, not at the next checkpoint
        self._value = new
        self._generation += 1

    @property
    def identity(self) -> Identity:
        """Whose state this is (the task instance's identity)."""
        return self._session.identity

    @property
    def store_url(self) -> str:
        """Where the state lives (``s3://bucket/prefix`` or ``file:///path``; never a credential)."""
        return self._session.store_url

    @property
    def resumed(self) -> bool:
        """True when this try started from a checkpoint written earlier (by an earlier try or run)."""
        return self._resumed

    @property
    def checkpoint(self) -> CheckpointInfo | None:
        """The newest checkpoint this state knows: the one it started from, or the last one it saved (a
        background save counts once the task has waited for it)."""
        latest = self._latest
        return CheckpointInfo.of(latest) if latest else None

    @property
    def pending_save(self) -> PendingSave | None:
        """The background save the task has not waited for yet (running or finished), or ``None``."""
        return self._pending

    @property
    def stop_requested(self) -> bool:
        """True once Airflow asked this try to stop; the next :meth:`resume` step or :meth:`save` ends it."""
        return self._stop.is_set()

    @property
    def lease_lost(self) -> bool:
        """True once this try lost its lease (a newer try took over): its next save will be refused."""
        return self._session.lost

    def effect_key(self, name: str) -> str:
        """A key for the external effect ``name``, the same in every try of this task instance.

        Pass it to a system that deduplicates (an upsert key, an idempotency header, a message deduplication
        id, a Kafka transactional id prefix): a retry redoing the work after the last checkpoint sends the same
        key, and the system drops the repeat. Different for another run (unless the identity is named: it spans
        runs), task or map index, and for another
        name: name each effect (``f"invoice-{n}"``). See :mod:`airflow_stateful.core.protocol.effects`.
        """
        return effect_key(self._session.identity, name)

    # -- outputs ---------------------------------------------------------------------------------------------
    def publish(self, name: str, path: str | os.PathLike[str], *, follow_symlinks: bool = False) -> None:
        """Stage the file or directory ``path`` as output ``name``, to become visible with the next save.

        The bytes are uploaded now (what is published is ``path`` as it is at this call; it may be changed or
        deleted afterwards), but no reader sees the output until the next :meth:`save` (or ``resume()``
        checkpoint) commits, atomically with that checkpoint. If this try dies or is fenced before then, the
        output never becomes visible (GC collects the upload) and the retry, redoing the work, publishes it
        again: each output name is committed once, by the try that committed it. A name published again
        replaces the output at the next commit. When the task returns with outputs still staged, the operator
        commits them with a last checkpoint of :attr:`value`.

        ``name``: 1-200 letters, digits, ``.``, ``_``, ``-``. Waits for a background save in flight first.
        """
        self.wait_for_save()
        staged = self._session.publish(name, Path(path), follow_symlinks=follow_symlinks)
        log.info(
            "output %r staged (%s, %s); visible with the next checkpoint",
            name,
            staged.kind,
            human_bytes(staged.size),
        )

    def outputs(self) -> dict[str, OutputInfo]:
        """The committed outputs of this identity as of :attr:`checkpoint`: name -> size, SHA-256, location, the
        checkpoint that committed it. Empty before the first commit that carried outputs; staged outputs are
        not listed (see :attr:`staged_outputs`)."""
        return self._session.outputs(self._latest) if self._latest is not None else {}

    @property
    def staged_outputs(self) -> list[str]:
        """Names of outputs published since the last commit (not visible to anyone yet)."""
        return sorted(self._session.staged_outputs)

    def request_stop(self) -> None:
        """Ask the running code to stop at its next checkpoint (called from ``on_kill``; thread-safe)."""
        self._stop.set()

    def history(self) -> list[CheckpointEntry]:
        """The kept checkpoints of this identity, newest first."""
        return self._session.history()

    # -- writing -------------------------------------------------------------------------------------------
    @overload
    def save(
        self,
        value: Any,
        files: str | Path | None = None,
        *,
        follow_symlinks: bool = False,
        wait: Literal[True] = True,
    ) -> CheckpointInfo: ...

    @overload
    def save(
        self,
        value: Any,
        files: str | Path | None = None,
        *,
        follow_symlinks: bool = False,
        wait: Literal[False],
    ) -> PendingSave: ...

    @overload
    def save(
        self, value: Any, files: str | Path | None = None, *, follow_symlinks: bool = False, wait: bool
    ) -> CheckpointInfo | PendingSave: ...

    def save(
        self,
        value: Any,
        files: str | Path | None = None,
        *,
        follow_symlinks: bool = False,
        wait: bool = True,
    ) -> CheckpointInfo | PendingSave:
        """Commit ``value`` (and, atomically with it, the file or directory ``files``) as a checkpoint.

        With ``files=None`` the checkpoint keeps the files of the previous one. If a stop was requested,
        the checkpoint is committed and then StopRequested ends the try. If the save fails, nothing the task
        sees changes: :attr:`value` is what it was before the call. Symbolic links below ``files`` are refused
        by name unless ``follow_symlinks=True``; then they are saved as what they point to, which must be
        inside ``files``.

        ``wait=False`` snapshots the value and the files (a copy in a staging directory) and returns a
        :class:`PendingSave` while the upload and the commit run in the background; the task may change
        ``files`` and the value right away. Bad input still fails here, before the call returns. The next
        save, a ``resume()`` commit and the end of the task wait for it, and raise its error if it failed
        (the call that raises it does nothing else). While a stop is requested the save is synchronous.

        Every save first waits for a background save still in flight.
        """
        if wait or self.stop_requested:
            info = self._commit(value, dict(self._cursors), files=files, follow_symlinks=follow_symlinks)
            if self.stop_requested:
                raise StopRequested(f"stop requested; progress saved in checkpoint {info.seq}")
            return info
        return self._save_in_background(value, files, follow_symlinks=follow_symlinks)

    def wait_for_save(self) -> CheckpointInfo | None:
        """Wait for the background save in flight, if any: its checkpoint, or raise its error; ``None`` if none.

        ``StatefulOperator`` calls this when the task's code returns, so a failed background save fails the
        try (and the retry resumes from the last checkpoint that landed).
        """
        pending = self._pending
        if pending is None:
            return None
        pending.join()
        if self._collect(pending) and pending.error is not None:
            raise pending.error
        return CheckpointInfo.of(pending.manifest) if pending.manifest else None

    def _collect(self, pending: PendingSave) -> bool:
        """Let the task see a finished background save; False if it was already seen (by another wait)."""
        with self._collect_lock:
            if self._pending is not pending:
                return False
            self._pending = None
            if pending.manifest is not None:
                self._latest = pending.manifest
                if self._generation == pending.generation:
                    self._value = pending.value
            return True

    def _save_in_background(
        self, value: Any, files: str | Path | None, *, follow_symlinks: bool
    ) -> PendingSave:
        self.wait_for_save()  # one save in flight at a time; a failed one is raised here, before this one starts
        self._session.ensure_alive()  # a fenced try stops now, before copying gigabytes
        frozen = snapshot_value(value, self._session.value_codec)
        cursors = dict(self._cursors)
        snapshot = None
        if files is not None:
            snapshot = snapshot_files(files, follow_symlinks=follow_symlinks, staging_root=self._staging_dir)
            log.info(
                "background save: %d file(s), %s snapshotted in %.2f s (%s) into %s; the task goes on while it "
                "uploads",
                snapshot.files,
                human_bytes(snapshot.bytes),
                snapshot.seconds,
                snapshot.method,
                snapshot.entry.parent,
            )
        pending = PendingSave(
            collect=self._collect, value=frozen, generation=self._generation, snapshot=snapshot
        )
        session = self._session

        def commit() -> Manifest:
            manifest = session.commit(
                frozen,
                files=snapshot.path if snapshot else None,
                extra={CURSORS: cursors_to_json(cursors)} if cursors else None,
            )
            return manifest

        try:
            pending.start(commit, name=f"stateful-save-{session.identity.key[:40]}")
        except BaseException:
            if snapshot is not None:
                snapshot.discard()
            raise
        self._pending = pending
        return pending

    def _commit(
        self,
        value: Any,
        cursors: dict[str, Cursor],
        *,
        files: str | Path | None = None,
        follow_symlinks: bool = False,
    ) -> CheckpointInfo:
        """Commit ``value`` with the resume positions ``cursors``; adopt the value only once the commit landed."""
        self.wait_for_save()
        manifest = self._session.commit(
            value,
            files=files,
            extra={CURSORS: cursors_to_json(cursors)} if cursors else None,
            follow_symlinks=follow_symlinks,
        )
        self._value, self._latest = value, manifest
        return CheckpointInfo.of(manifest)

    def _commit_value(self, cursors: dict[str, Cursor]) -> CheckpointInfo:
        """Commit :attr:`value` as it is once a background save in flight has been waited for (it may set it)."""
        self.wait_for_save()
        return self._commit(self._value, cursors)

    def _cursors_saved(self, name: str, cursor: Cursor) -> bool:
        latest = self._latest
        saved = read_cursors(latest.extra, what=f"checkpoint {latest.seq}")[0] if latest else {}
        return saved.get(name) == cursor

    def restore_files(
        self, dest: str | Path, *, mode: str = "exact", shared_dest: bool = False
    ) -> RestoreResult:
        """Restore the files of the newest checkpoint into directory ``dest``, verified; what it did, also logged.

        ``mode="exact"`` (default): afterwards ``dest`` holds exactly the checkpoint's files; what it does not
        have (a killed try's part files) is removed within the same all-or-nothing swap. ``mode="merge"``
        replaces same-named files and keeps the others; ``mode="empty"`` refuses a ``dest`` that is not missing
        or empty. With no checkpoint yet (or one without files) ``dest`` is left alone and the result is false,
        so ``if not state.restore_files(d)`` means "nothing to resume from".

        Waits for a background save in flight first (and raises its error), so "newest" includes it. Chunks
        found in the worker's restore cache (verified against the checkpoint's SHA-256) are not downloaded.

        ``dest`` must be this user's and writable by nobody else: another writer could plant links or a fake
        interrupted restore in it (InvalidValueError, nothing restored). ``shared_dest=True`` restores into a
        directory shared on purpose with writers you trust.
        """
        self.wait_for_save()
        return self._session.restore_files(dest, self._latest, mode=mode, shared_dest=shared_dest)

    def resume(
        self,
        iterable: Iterable[T],
        *,
        key: Callable[[T], ItemKey] | None = None,
        cursor: str = "items",
        every: int | None = None,
        interval: timedelta | None = None,
        on_change: str = "fail",
    ) -> Iterator[T]:
        """Iterate over ``iterable``, skipping the items earlier tries finished, checkpointing as it goes.

        An item counts as finished when the loop body returns and the next item is asked for. A checkpoint
        (the current :attr:`value` plus the cursor) is committed after every ``every`` finished items, at
        least every ``interval``, and at the end. A try that lost its lease is stopped before its next item
        with :class:`~airflow_stateful.core.errors.FencedError`. Cursors belong to one DAG run.

        :param key: a function giving each item's key (a ``str`` or an ``int``, unique), like ``sorted``'s
            ``key``: the cursor stores the last finished item's key, and a retry skips the items up to and
            including it, wherever it now is. It assumes the items before the last key are finished (a stable
            order: new items last). Without ``key=`` a retry skips as many items as were finished, which is right
            only if the iterable yields the same items in the same order; a fingerprint of the first items
            catches most changes (see :mod:`airflow_stateful.core.protocol.resume`).
        :param cursor: the cursor's name, when a task has more than one resumable loop.
        :param on_change: what a retry does when the iterable changed under the cursor: ``"fail"`` (default)
            raises :class:`~airflow_stateful.core.errors.CursorMismatchError` (the operator fails the try
            without a retry: the retry would meet the same iterable); ``"warn"`` logs a WARNING and resumes at
            the stored position, or, when the last key is gone, starts again from the first item (redoing work;
            it never skips items it cannot account for). A one-shot iterator is then kept in memory up to the
            last key, to be replayed.
        """
        every = every if every is not None else self._every
        interval = interval if interval is not None else self._interval
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise InvalidValueError(f"checkpoint_every must be a positive integer, not {every!r}")
        if isinstance(key, str):  # the cursor's name, as key= was before it took a function
            warnings.warn(
                f"resume(key={key!r}) names the cursor: pass cursor={key!r} instead (key= now takes a function "
                "giving each item's key)",
                DeprecationWarning,
                stacklevel=2,
            )
            if cursor != "items":
                raise InvalidValueError(
                    f"resume() got key={key!r} and cursor={cursor!r}: name the cursor once"
                )
            key, cursor = None, key
        elif key is not None and not callable(key):
            raise InvalidValueError(
                f"resume key= must be a function of an item returning a str or an int, or None, not {key!r}"
            )
        if not isinstance(cursor, str) or not 0 < len(cursor) <= MAX_NAME:
            raise InvalidValueError(
                f"resume cursor must be a string of 1-{MAX_NAME} characters, not {cursor!r}"
            )
        if on_change not in ON_CHANGE:
            raise InvalidValueError(
                f"resume on_change must be one of {', '.join(map(repr, ON_CHANGE))}, not {on_change!r}"
            )
        walk = Walk(
            iterable,
            name=cursor,
            stored=self._cursors.get(cursor),
            key=key,
            on_change=on_change,
            where=self._cursors_from,
        )
        since = self._clock()
        for item in walk.remaining():
            self._session.ensure_alive()  # a zombie stops here, before doing an item twice
            if self.stop_requested:
                self._cursors[cursor] = walk.cursor()
                info = self._commit_value(dict(self._cursors))
                raise StopRequested(
                    f"stop requested after {walk.position} items; progress saved in checkpoint {info.seq}"
                )
            yield item
            walk.finished()
            self._cursors[cursor] = walk.cursor()  # where this loop is; committed with the next checkpoint
            due_items = every is not None and walk.position % every == 0
            due_time = interval is not None and self._clock() - since >= interval.total_seconds()
            if due_items or due_time:
                self._commit_value(dict(self._cursors))
                since = self._clock()
        self._cursors[cursor] = walk.cursor()
        if not self._cursors_saved(cursor, self._cursors[cursor]):
            self._commit_value(dict(self._cursors))

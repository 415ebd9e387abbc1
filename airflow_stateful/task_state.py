"""TaskState: what a stateful task's code touches — the last value, saving, file checkpoints, resuming loops.

A TaskState is handed to the task by :class:`~airflow_stateful.operators.stateful.StatefulOperator` on top of
an open :class:`~airflow_stateful.core.session.WriterSession`: the session holds the lease (fencing every
earlier try) and renews it while the task computes, and it has already loaded, verified and migrated the
newest checkpoint. TaskState adds what task code wants on top: a value to carry, ``save``, and ``resume``
loops with their positions. It imports no Airflow: the operator turns its signals into Airflow's.

A save that fails (a value that cannot be encoded, a fenced writer, a network error) changes nothing the
task sees: :attr:`~TaskState.value`, :attr:`~TaskState.checkpoint` and the resume positions stay the last
committed ones (or what the task itself set since).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

from airflow_stateful.core.codecs import encode_value
from airflow_stateful.core.errors import InvalidValueError, StopRequested
from airflow_stateful.core.records import CheckpointEntry, Manifest, WriterInfo
from airflow_stateful.core.session import WriterSession

log = logging.getLogger("airflow_stateful")

T = TypeVar("T")
_CURSORS = "cursors"


@dataclass(frozen=True)
class CheckpointInfo:
    """Where the state came from: which checkpoint, written by which try, when, with which schema."""

    seq: int
    try_number: int | None
    created_at: str
    schema_version: int
    dag_version_id: str | None
    writer: WriterInfo

    @classmethod
    def of(cls, manifest: Manifest) -> CheckpointInfo:
        return cls(
            seq=manifest.seq,
            try_number=manifest.writer.try_number,
            created_at=manifest.created_at,
            schema_version=manifest.schema_version,
            dag_version_id=manifest.writer.dag_version_id,
            writer=manifest.writer,
        )


class TaskState:
    """The state of one stateful task instance, shared by all its tries.

    :param session: the open writer session of this try (lease held and renewed, checkpoint loaded).
    :param checkpoint_every: default for :meth:`resume`: commit after this many finished items.
    :param checkpoint_interval: default for :meth:`resume`: commit at least this often.
    :param clock: monotonic seconds, for ``checkpoint_interval``; injectable for tests.
    """

    def __init__(
        self,
        *,
        session: WriterSession,
        checkpoint_every: int | None = None,
        checkpoint_interval: timedelta | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._value = session.value
        self._resumed = session.latest is not None
        # resume() positions belong to one DAG run: a named identity carries its value into the next run,
        # but the next run iterates over new data and must start at its first item.
        start = session.start
        same_run = start is not None and start.writer.run_id == session.writer.run_id
        self._cursors: dict[str, int] = dict(
            (start.extra.get(_CURSORS) if start and same_run else None) or {}
        )
        self._every = checkpoint_every
        self._interval = checkpoint_interval
        self._clock = clock
        self._stop = threading.Event()

    # -- reading -------------------------------------------------------------------------------------------
    @property
    def value(self) -> Any:
        """The last committed value (or what this try set since); ``None`` when nothing was ever saved."""
        return self._value

    @value.setter
    def value(self, new: Any) -> None:
        """Set the value the next checkpoint commits (the next :meth:`resume` step or :meth:`save`)."""
        encode_value(
            new, self._session.value_codec
        )  # fail now, naming the problem, not at the next checkpoint
        self._value = new

    @property
    def resumed(self) -> bool:
        """True when this try started from a checkpoint written earlier (by an earlier try or run)."""
        return self._resumed

    @property
    def checkpoint(self) -> CheckpointInfo | None:
        """The newest checkpoint this state knows: the one it started from, or the last one it saved."""
        latest = self._session.latest
        return CheckpointInfo.of(latest) if latest else None

    @property
    def stop_requested(self) -> bool:
        """True once Airflow asked this try to stop; the next :meth:`resume` step or :meth:`save` ends it."""
        return self._stop.is_set()

    @property
    def lease_lost(self) -> bool:
        """True once this try lost its lease (a newer try took over): its next save will be refused."""
        return self._session.lost

    def request_stop(self) -> None:
        """Ask the running code to stop at its next checkpoint (called from ``on_kill``; thread-safe)."""
        self._stop.set()

    def history(self) -> list[CheckpointEntry]:
        """The kept checkpoints of this identity, newest first."""
        return self._session.checkpoints.history()

    # -- writing -------------------------------------------------------------------------------------------
    def save(
        self, value: Any, files: str | Path | None = None, *, follow_symlinks: bool = False
    ) -> CheckpointInfo:
        """Commit ``value`` (and, atomically with it, the file or directory ``files``) as a checkpoint.

        With ``files=None`` the checkpoint keeps the files of the previous one. If a stop was requested,
        the checkpoint is committed and then StopRequested ends the try. If the save fails, nothing the task
        sees changes: :attr:`value` is what it was before the call. Symbolic links below ``files`` are refused
        by name unless ``follow_symlinks=True``; then they are saved as what they point to, which must be
        inside ``files``.
        """
        info = self._commit(value, dict(self._cursors), files=files, follow_symlinks=follow_symlinks)
        if self.stop_requested:
            raise StopRequested(f"stop requested; progress saved in checkpoint {info.seq}")
        return info

    def _commit(
        self,
        value: Any,
        cursors: dict[str, int],
        *,
        files: str | Path | None = None,
        follow_symlinks: bool = False,
    ) -> CheckpointInfo:
        """Commit ``value`` with the resume positions ``cursors``; adopt the value only once the commit landed."""
        manifest = self._session.commit(
            value,
            files=files,
            extra={_CURSORS: cursors} if cursors else None,
            follow_symlinks=follow_symlinks,
        )
        self._value = value
        return CheckpointInfo.of(manifest)

    def _cursors_saved(self, key: str, position: int) -> bool:
        latest = self._session.latest
        saved = (latest.extra.get(_CURSORS) or {}) if latest else {}
        return bool(saved.get(key) == position)

    def restore_files(self, dest: str | Path) -> list[Path]:
        """Restore the files of the newest checkpoint into directory ``dest``, verified; ``[]`` if none."""
        return self._session.restore_files(dest)

    def resume(
        self,
        iterable: Iterable[T],
        *,
        key: str = "items",
        every: int | None = None,
        interval: timedelta | None = None,
    ) -> Iterator[T]:
        """Iterate over ``iterable``, skipping the items earlier tries finished, checkpointing as it goes.

        An item counts as finished when the loop body returns and the next item is asked for. A checkpoint
        (the current :attr:`value` plus the position) is committed after every ``every`` finished items, at
        least every ``interval``, and at the end. The iterable must yield the same items in the same order
        on every try. ``key`` names the cursor when a task has more than one resumable loop. A try that lost
        its lease is stopped before its next item with :class:`~airflow_stateful.core.errors.FencedError`.
        """
        every = every if every is not None else self._every
        interval = interval if interval is not None else self._interval
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise InvalidValueError(f"checkpoint_every must be a positive integer, not {every!r}")
        if not isinstance(key, str) or not key:
            raise InvalidValueError(f"resume key must be a non-empty string, not {key!r}")
        start = self._cursors.get(key, 0)
        if start:
            log.info("skipping %d finished items (cursor %r)", start, key)
        position = committed = start
        since = self._clock()
        for item in islice(iterable, start, None):
            self._session.ensure_alive()  # a zombie stops here, before doing an item twice
            if self.stop_requested:
                self._cursors[key] = position
                info = self._commit(self._value, dict(self._cursors))
                raise StopRequested(
                    f"stop requested after {position} items; progress saved in checkpoint {info.seq}"
                )
            yield item
            position += 1
            self._cursors[key] = position  # where this loop is; committed with the next checkpoint
            due_items = every is not None and position % every == 0
            due_time = interval is not None and self._clock() - since >= interval.total_seconds()
            if due_items or due_time:
                self._commit(self._value, dict(self._cursors))
                committed, since = position, self._clock()
        self._cursors[key] = position
        if position != committed or not self._cursors_saved(key, position):
            self._commit(self._value, dict(self._cursors))

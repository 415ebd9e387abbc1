"""PendingSave: a save running in the background (``TaskState.save(..., wait=False)``), and CheckpointInfo.

The call snapshots what it commits — the value
encoded at once, the files copied into a staging directory (:mod:`airflow_stateful.core.data.snapshot`: an
in-kernel copy, about 0.1 s for 256 MiB, or a reflink) — and returns a :class:`PendingSave`; the upload and
the commit run in a thread. The rules, and why:

* **One save in flight.** The next save (either kind), a ``resume()`` commit, :meth:`TaskState.restore_files`
  and the end of the task wait for the pending one first. Commits of one writer must be sequential (the
  head's compare-and-swap allows one sequence number at a time), and ``files=None`` must keep the files of
  the checkpoint just before it.
* **Errors surface at the next save or at the end of the task**, in the task's own thread, as the exception
  the commit raised (``FencedError`` for a lost lease, the store's error for a network failure). The call that
  surfaces it does nothing else: the next save is not attempted, so that an exception from ``save`` always
  means "this did not happen". At the end of the task the error fails the try, and Airflow's retry resumes
  from the last checkpoint that landed.
* **What the task sees changes only at calls it makes, never behind its back.** While a save is pending,
  :attr:`TaskState.value` and :attr:`TaskState.checkpoint` still show the last *collected* commit. When the
  task next waits (the next save, :meth:`TaskState.wait_for_save`, :meth:`PendingSave.wait`, a ``resume()``
  commit) and the save landed, they become that checkpoint and its value as stored (the snapshot) — unless
  the task assigned ``state.value`` after the call, which then stays: it is newer. If the save failed, both
  stay as they were: a failed save changes nothing, in the background too.
* **A stop wins over speed.** When a stop was requested (SIGTERM), ``save(wait=False)`` waits for the pending
  save, commits synchronously, and raises :class:`~airflow_stateful.core.errors.StopRequested`, like a
  synchronous save.
* **A crash while the thread uploads** (SIGKILL, OOM) leaves the previous checkpoint valid: nothing is
  visible before the head's compare-and-swap (docs/adr/0001-commit-protocol.md). The staging copy left behind
  is removed by the next background save into the same staging directory (its lock died with the process).

"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airflow_stateful.core.data.snapshot import FileSnapshot
from airflow_stateful.core.records.code_identity import CodeIdentity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.writer import WriterInfo

log = logging.getLogger("airflow_stateful")


@dataclass(frozen=True)
class CheckpointInfo:
    """Where the state came from: which checkpoint, written by which try, when, with which schema and code."""

    seq: int
    try_number: int | None
    created_at: str
    schema_version: int
    dag_version_id: str | None
    writer: WriterInfo
    #: What code wrote it: the task's code fingerprint, DAG version, DAG bundle and version, provider version
    #: (``None`` for a checkpoint written before this was recorded, or outside an operator).
    code: CodeIdentity | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> CheckpointInfo:
        return cls(
            seq=manifest.seq,
            try_number=manifest.writer.try_number,
            created_at=manifest.created_at,
            schema_version=manifest.schema_version,
            dag_version_id=manifest.writer.dag_version_id,
            writer=manifest.writer,
            code=manifest.code,
        )


class PendingSave:
    """A save running in the background, returned by ``TaskState.save(..., wait=False)``.

    The value and files were snapshotted when it was created; the upload and the commit run in a thread of
    their own. :meth:`wait` returns the committed checkpoint or raises what the commit raised. The task need
    not keep this object: the next save and the end of the task wait for it anyway.
    """

    def __init__(
        self,
        *,
        collect: Callable[[PendingSave], object],
        value: Any,
        generation: int,
        snapshot: FileSnapshot | None,
    ) -> None:
        self._collect = collect
        #: The value as the call snapshotted it, and the task's value generation at that moment.
        self.value = value
        self.generation = generation
        self._snapshot = snapshot
        self._done = threading.Event()
        #: The checkpoint the commit made, or the error it raised (set once :meth:`done`).
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        status = "failed" if self.error else "committed" if self.manifest else "running"
        return f"PendingSave({status})"

    @property
    def snapshot(self) -> FileSnapshot | None:
        """What the call copied (files, bytes, seconds, method); ``None`` for a value-only save."""
        return self._snapshot

    def done(self) -> bool:
        """True once the commit finished, landed or failed."""
        return self._done.is_set()

    def join(self) -> None:
        """Wait until the commit finished, without collecting its outcome."""
        self._done.wait()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the commit; the checkpoint it made, or raise its error (``TimeoutError`` if ``timeout`` passes).

        Waiting here counts as the task seeing the outcome: ``state.value`` and ``state.checkpoint`` show the
        checkpoint now, and an error raised here is not raised again by the next save.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background save is still running after {timeout} s")
        self._collect(self)
        if self.error is not None:
            raise self.error
        assert self.manifest is not None
        return CheckpointInfo.of(self.manifest)

    def start(self, commit: Callable[[], Manifest], *, name: str) -> None:
        """Run ``commit`` in a thread named ``name``."""
        # Not a daemon: a script that forgets to wait still lets its last save finish before the interpreter exits.
        self._thread = threading.Thread(target=self._run, args=(commit,), name=name, daemon=False)
        self._thread.start()

    def _run(self, commit: Callable[[], Manifest]) -> None:
        started = time.monotonic()
        try:
            self.manifest = commit()
            log.info(
                "background save committed checkpoint %d in %.1f s",
                self.manifest.seq,
                time.monotonic() - started,
            )
        except BaseException as exc:
            self.error = exc
            note = (
                "raised by a background save (save(wait=False)); it was not committed and the checkpoint "
                "before it is intact"
            )
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(note)
            log.error(
                "background save failed after %.1f s: %s: %s (raised at the next save or at the end of the task; "
                "the checkpoint before it is intact)",
                time.monotonic() - started,
                type(exc).__name__,
                exc,
            )
        finally:
            if self._snapshot is not None:
                self._snapshot.discard()
            self._done.set()

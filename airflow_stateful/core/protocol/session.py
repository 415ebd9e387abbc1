"""WriterSession: one writer's hold on an identity, for as long as its work runs.

Every writer (a stateful task through :class:`~airflow_stateful.task_state.TaskState`, the Kubernetes
operator, the in-pod client, the CLI's rollback) goes through this class, so there is one implementation of
what makes a writer safe:

* **open**: take the lease (a retry steals it, fencing every earlier try), or adopt a lease taken for this
  writer (a pod adopts the operator's), then load and verify the newest checkpoint and apply the upgrade
  rules: resume it, migrate it step by step (committing the migrated value before any user code runs), or
  refuse / restart per ``on_incompatible``;
* **heartbeat** and **lost**: a :class:`~airflow_stateful.core.protocol.lease_keeper.LeaseKeeper` renews the
  lease in a daemon thread, so a try may compute for hours between saves; once it is taken over, broken or not
  renewed within its ttl, the session is lost and the next :meth:`commit` raises :class:`FencedError` before
  uploading anything;
* **commit / release**: fenced commits through :class:`CheckpointStore`; on a clean end the lease is released.

What the writer sees and reads is :class:`~airflow_stateful.core.protocol.writer_view.WriterView`; where it
starts, :mod:`~airflow_stateful.core.protocol.upgrades`. See docs/adr/0003-lease-renewal-and-maintenance.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from airflow_stateful.core import events
from airflow_stateful.core.data.cache_use import remember_saved
from airflow_stateful.core.data.chunk_cache import LocalChunkCache
from airflow_stateful.core.errors import (
    CommitOutcomeUnknownError,
    FencedError,
    IncompatibleStateError,
    InvalidValueError,
    MigrationError,
)
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.lease import Lease, check_holder, checked_expected_interval
from airflow_stateful.core.protocol.lease_keeper import LeaseKeeper
from airflow_stateful.core.protocol.progress_watch import ProgressWatch
from airflow_stateful.core.protocol.staging import OutputStage
from airflow_stateful.core.protocol.upgrades import (
    UpgradeRules,
    describe_checkpoint,
    find_start,
)
from airflow_stateful.core.protocol.writer_view import WriterView
from airflow_stateful.core.records.code_identity import CodeIdentity
from airflow_stateful.core.records.codecs import JSON
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outcomes import FAILED, RUNNING, UP_FOR_RETRY, TryOutcome
from airflow_stateful.core.records.outputs import StagedOutput
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.settings import RENEW_FRACTION

log = logging.getLogger("airflow_stateful")

CLEANUP_AFTER = 4
"""Dropped checkpoints with objects of their own after which a session deletes them (in the background)."""


class WriterSession(WriterView):
    """A writer's lease on one identity, renewed in the background, with fenced commits.

    :param checkpoints: the identity's checkpoint store (its ``lease_ttl`` is the lease's ttl).
    :param writer: who writes (recorded in the lease and in every checkpoint).
    :param schema_version: the version of the value this code writes (an integer >= 1).
    :param migrations: ``{v: fn}`` turning a version ``v`` value into a version ``v + 1`` one.
    :param on_incompatible: ``"fail"`` (default) or ``"restart"`` when the newest checkpoint cannot be brought
        to ``schema_version``: start empty, and *pin* that checkpoint, so retention keeps it however many
        checkpoints this code commits; the code that wrote it resumes from it when it runs again (a deploy
        rolled back, then forward: :mod:`airflow_stateful.core.records.pins`).
    :param value_codec: ``"json"`` or ``"pickle"`` (opt-in by name, for writing and reading).
    :param steal: take the lease even from a live holder (an Airflow retry: the earlier try is over).
    :param lease: adopt this lease instead of taking one (a pod adopts the lease its operator took, an
        operator adopts the lease of the running pod it reattaches to).
    :param release_on_close: give the lease up when the session closes; default: only a lease this session
        took itself (a pod never releases the lease its operator holds for it).
    :param heartbeat: renew the lease in a background thread (turn off only where a test drives the clock).
    :param renew_every: seconds between renewals; default ``lease_ttl / 3``. Each wait is jittered down by
        up to 20 % so writers started together do not renew in lock-step.
    :param expected_checkpoint_interval: seconds within which this writer means to commit. Recorded in the
        lease (so ``airflow-stateful stuck``, the UI and the sensor can tell a stuck writer from a dead one), and
        checked by the heartbeat, which logs a warning and reports ``stateful.stuck`` once it is exceeded.
        Default: ``[stateful] expected_checkpoint_interval`` as readers apply it (not recorded).
    :param outcome: the try's ``running`` outcome (:mod:`airflow_stateful.core.records.outcomes`), recorded with the lease;
        :meth:`end` records how it ended when the session releases the lease.
    :param code: what code this writer runs (:mod:`airflow_stateful.core.records.code_identity`), recorded in every
        checkpoint it commits and compared with the checkpoint it resumes.
    :param on_code_change: when the checkpoint it resumes (same ``schema_version``) was written by other code
        (another fingerprint): ``"resume"`` (default: resume, one INFO line saying from what to what),
        ``"warn"`` (the same line as a WARNING), ``"restart"`` (start empty; the checkpoint stays in history) or
        ``"fail"`` (:class:`~airflow_stateful.core.errors.CodeChangedError`, the checkpoint untouched).
    :param restore_cache: the worker's (or node's) restore cache: every chunk a commit uploads, and the files a
        commit saves, are kept there, and :meth:`restore_files` reads it before downloading (each chunk
        verified). Tasks and pods alike get it through here (:meth:`use_restore_cache`).
    """

    def __init__(
        self,
        *,
        checkpoints: CheckpointStore,
        writer: WriterInfo,
        schema_version: int = 1,
        migrations: Mapping[int, Callable[[Any], Any]] | None = None,
        on_incompatible: str = "fail",
        value_codec: str = JSON,
        steal: bool = True,
        lease: Lease | None = None,
        heartbeat: bool = True,
        renew_every: float | None = None,
        release_on_close: bool | None = None,
        expected_checkpoint_interval: float | None = None,
        outcome: TryOutcome | None = None,
        code: CodeIdentity | None = None,
        on_code_change: str = "resume",
        restore_cache: LocalChunkCache | None = None,
    ) -> None:
        #: What this writer's code declares about the checkpoints it may meet (schema, migrations, codec, code).
        self.rules = UpgradeRules.checked(
            schema_version=schema_version,
            migrations=migrations,
            on_incompatible=on_incompatible,
            value_codec=value_codec,
            code=code,
            on_code_change=on_code_change,
        )
        if lease is not None and lease.identity != checkpoints.identity:
            raise ValueError(f"lease is for {lease.identity}, not {checkpoints.identity}")
        ttl = checkpoints.lease_ttl
        every = ttl * RENEW_FRACTION if renew_every is None else float(renew_every)
        if not 0 < every < ttl:
            raise ValueError(
                f"renew_every must be between 0 and the lease ttl ({ttl:g} s), not {renew_every!r}"
            )
        self.expected_interval = checked_expected_interval(expected_checkpoint_interval)
        #: When this writer last committed, for the progress it reports after each renewal.
        self._progress = ProgressWatch(identity=checkpoints.identity, expected=self.expected_interval)
        super().__init__(checkpoints=checkpoints, writer=writer, restore_cache=restore_cache)
        self._started_as = outcome
        self._ended_as: TryOutcome | None = None
        self.steal = steal
        self.renew_every = every
        self._adopted = lease
        self._release_on_close = lease is None if release_on_close is None else release_on_close
        self._heartbeat_on = heartbeat
        #: The lease, its renewal thread and whether it was lost.
        watch = self._progress.after_renewal
        self._keeper = LeaseKeeper(
            identity=self.identity, ttl=ttl, renew=checkpoints.renew, renew_every=every, on_renewed=watch
        )
        self._ended: Lease | None = None  # the lease held when the session closed
        self._write_lock = threading.Lock()  # a commit and a cleanup never run at once (the sweep's fencing)
        self._cleanup: threading.Thread | None = None
        #: The checkpoint this session started from (verified, before migration), or ``None``.
        self.start: Manifest | None = None
        #: The checkpoint skipped by ``on_incompatible="restart"`` (pinned) or ``on_code_change="restart"``.
        self.restarted_from: Manifest | None = None
        #: The pinned checkpoint this session resumed from (a rollforward after a rollback), or ``None``.
        self.resumed_pin: Manifest | None = None
        self._in_doubt: tuple[Manifest, Any] | None = None  # a commit whose outcome was unknown
        #: Outputs published since the last commit, by name: made visible by the next commit (see publish()).
        self._stage = OutputStage()

    def __repr__(self) -> str:
        return f"WriterSession(identity={self.identity.key!r}, lease={self._keeper.lease and self._keeper.lease.epoch})"

    # -- what the writer sees ------------------------------------------------------------------------------
    @property
    def schema_version(self) -> int:
        return self.rules.schema_version

    @property
    def value_codec(self) -> str:
        return self.rules.value_codec

    @property
    def code(self) -> CodeIdentity | None:
        return self.rules.code

    @property
    def lease(self) -> Lease:
        if self._keeper.lease is None:
            raise RuntimeError("the session is not open; call open() or use it as a context manager")
        return self._keeper.lease

    @property
    def lost(self) -> bool:
        """True once the lease is known to be taken over, broken, or expired without renewal."""
        return self._keeper.lost is not None or (
            self._keeper.lease is not None and time.monotonic() > self._keeper.deadline
        )

    def ensure_alive(self) -> None:
        """Raise FencedError if the lease is lost; cheap (no request), called before every upload."""
        self._keeper.check_deadline()
        if self._keeper.lost is not None:
            raise FencedError(
                f"cannot commit to identity {self.identity}: this writer lost its lease ({self._keeper.lost}). Nothing "
                "was uploaded; the last committed checkpoint is intact. Stop this writer; a retry resumes from "
                "that checkpoint."
            )

    # -- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> WriterSession:
        """Open the session, unless :meth:`open` already did; :meth:`close` runs on the way out."""
        return self if self._keeper.lease is not None else self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> WriterSession:
        """Take (or adopt) the lease, start renewing it, load the newest checkpoint and apply the upgrade rules."""
        if self._keeper.lease is not None:
            raise RuntimeError(f"{self!r} is already open")
        sent = time.monotonic()
        if self._adopted is not None:
            # Prove the adopted lease is still ours (and learn its real expiry) before doing any work.
            lease = self.checkpoints.renew(self._adopted)
        else:
            lease = self.checkpoints.acquire(
                holder=self.writer,
                steal=self.steal,
                expected_interval=self.expected_interval,
                outcome=self._started_as,
            )
        self._keeper.hold(lease, sent=sent)
        self._progress.progressed(sent)
        try:
            if self._heartbeat_on:
                self._keeper.start()
            self._load()
        except BaseException as exc:
            self._end_on_open_error(exc)
            self.close()
            raise
        return self

    def _end_on_open_error(self, exc: BaseException) -> None:
        """The try fails before its code ran: record it. A checkpoint this code can never read (schema, migration,
        codec, code change) fails it for good (the operator fails the task without a retry: another try of the
        same code would fail the same way); anything else is retried if the try could be."""
        start = self._started_as
        if start is None or self._ended_as is not None:
            return
        permanent = isinstance(exc, (IncompatibleStateError, MigrationError, InvalidValueError))
        retry = not permanent and start.if_killed == UP_FOR_RETRY
        self.end(
            UP_FOR_RETRY if retry else FAILED,
            retry_in=start.retry_delay if retry else None,
            reason=type(exc).__name__,
        )

    def end(self, state: str, *, retry_in: float | None = None, reason: str | None = None) -> None:
        """Say how this try ended (an Airflow task instance state, :mod:`airflow_stateful.core.records.outcomes`);
        :meth:`close` records it in the head with the release of the lease, so maintenance knows whether
        Airflow will run the task again. ``retry_in``: seconds until a retry or reschedule may run."""
        writer = self.writer
        start = self._started_as or TryOutcome(
            RUNNING, "", try_number=writer.try_number, run_id=writer.run_id
        )
        self._ended_as = start.ended(
            state=state, now=self.checkpoints.clock(), retry_in=retry_in, reason=reason
        )

    def close(self, *, release: bool | None = None) -> None:
        """Stop renewing and release the lease (unless told not to; a lost one is left alone). Never raises.

        :param release: ``False`` keeps the lease unrenewed (it expires one ttl later), e.g. for a pod that
            must still save after its operator was stopped; default: ``release_on_close``.
        """
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup.join()
        releasing = self._release_on_close if release is None else release
        if releasing and self._keeper.lease is not None and self._keeper.lost is None:
            self._sweep_quietly()  # before the lease goes: the sweep is fenced by it
        self._keeper.stop()
        lease = self._keeper.release()
        self._ended = lease or self._ended
        if lease is None or not releasing:
            return
        if self._keeper.lost is not None:
            return  # fenced or expired: someone else's lease now, or nobody's
        try:
            self.checkpoints.release(lease, outcome=self._ended_as)
        except Exception as exc:  # never mask the writer's own outcome; the lease expires by itself
            log.warning("could not release the lease on %s: %s (it expires by itself)", self.identity, exc)

    def _load(self) -> None:
        """Where this writer starts (:func:`~airflow_stateful.core.protocol.upgrades.find_start`); a migrated value
        is committed before any user code runs, files kept."""
        found = find_start(
            self.checkpoints, self.lease, self.rules, writer=self.writer, check=self.ensure_alive
        )
        self.start, self.restarted_from, self.resumed_pin = (
            found.start,
            found.restarted_from,
            found.resumed_pin,
        )
        self._latest, self._value = found.latest, found.value
        if found.migrated is None:
            return
        latest = found.latest
        assert latest is not None
        info = self.commit(found.migrated, extra=found.carried)
        events.emit(
            events.RESUME, identity=self.identity.key, seq=latest.seq, schema_version=latest.schema_version
        )
        log.info(
            "resuming from %s, migrated %d -> %d (committed as checkpoint %d)",
            describe_checkpoint(latest),
            latest.schema_version,
            self.schema_version,
            info.seq,
        )

    # -- writing --------------------------------------------------------------------------------------------
    def commit(
        self,
        value: Any,
        *,
        files: str | Path | None = None,
        extra: dict[str, Any] | None = None,
        keep_files: bool = True,
        exclude: Collection[str] = (),
        follow_symlinks: bool = False,
    ) -> Manifest:
        """Commit ``value`` (and the file or directory ``files``) as the identity's newest checkpoint.

        With ``files=None`` and ``keep_files`` the checkpoint keeps the files of :attr:`latest` by reference.
        Symbolic links below ``files`` are refused unless ``follow_symlinks`` (never outside ``files``).
        Raises FencedError at once, before any upload, when the session has lost its lease. On any error
        nothing this session knows changes (:attr:`latest`, :attr:`value`), and neither does the store.
        """
        if self._keeper.lease is None and self._ended is not None:
            raise self._ended_error(self._ended)
        self.ensure_alive()
        sent = time.monotonic()
        try:
            with self._write_lock:
                self._settle_in_doubt()
                manifest = self._commit(
                    value,
                    files=files,
                    extra=extra,
                    keep_files=keep_files,
                    exclude=exclude,
                    follow_symlinks=follow_symlinks,
                )
        except FencedError as exc:
            if self._keeper.lost is None:
                held = self._keeper.lease or self._adopted
                self._keeper.mark_lost(str(exc), epoch=held.epoch if held else 0)
            raise
        except CommitOutcomeUnknownError as exc:
            if isinstance(exc.manifest, Manifest):
                self._in_doubt = (exc.manifest, value)
            events.emit(events.COMMIT_FAILED, identity=self.identity.key, error=type(exc).__name__)
            raise
        except Exception as exc:
            events.emit(events.COMMIT_FAILED, identity=self.identity.key, error=type(exc).__name__)
            raise
        self._latest, self._value = manifest, value
        if files is not None and self.restore_cache is not None:
            # The tree the commit just wrote: no request. Also the chunks the upload did not send.
            remember_saved(self.restore_cache, manifest, self.checkpoints.tree(manifest), files)
        self._progress.progressed()
        self._keeper.confirmed(sent)
        if self.checkpoints.cleanup_due >= CLEANUP_AFTER:
            self._start_cleanup()
        return manifest

    def _settle_in_doubt(self) -> None:
        """After a commit whose outcome was unknown, read the head: if it landed, it is this session's newest
        checkpoint (and value) from now on, exactly as if its answer had arrived."""
        if self._in_doubt is None:
            return
        manifest, value = self._in_doubt
        head = self.checkpoints.head()
        if head is not None and any(e.commit_id == manifest.commit_id for e in head.checkpoints):
            log.warning("%s: checkpoint %d did land; going on from it", self.identity, manifest.seq)
            self._latest, self._value = manifest, value
            self._stage.landed(manifest)
        self._in_doubt = None

    def _commit(
        self,
        value: Any,
        *,
        files: str | Path | None,
        extra: dict[str, Any] | None,
        keep_files: bool,
        exclude: Collection[str],
        follow_symlinks: bool,
    ) -> Manifest:
        staged = self._stage.taken()
        manifest: Manifest = self.checkpoints.commit(
            self.lease,
            value,
            files=files,
            schema_version=self.schema_version,
            writer=self.writer,
            extra=extra,
            value_codec=self.value_codec,
            keep_files_from=self._latest if files is None and keep_files else None,
            previous=self._latest,
            exclude=exclude,
            follow_symlinks=follow_symlinks,
            check=self.ensure_alive,
            outputs=staged,
            code=self.code,
        )
        self._stage.committed(staged)
        return manifest

    # -- outputs --------------------------------------------------------------------------------------------
    def publish(self, name: str, path: str | Path, *, follow_symlinks: bool = False) -> StagedOutput:
        """Stage the file or directory ``path`` as output ``name``; the next :meth:`commit` makes it visible.

        Its bytes are uploaded now (chunks the identity already holds are not), so the commit that publishes it
        stays cheap, and so that what is published is the content at this call. Until that commit nobody sees
        it; if this writer dies or is fenced first, the upload is garbage that GC collects and the retry
        publishes again. Publishing a name again before the commit replaces the staged one; after it, the next
        commit replaces the committed one. Raises FencedError, uploading nothing, once the lease is lost.
        """
        self.ensure_alive()
        with self._write_lock:
            staged = self.checkpoints.stage_output(
                self.lease,
                name,
                path,
                known=self._stage.known_chunks(self.checkpoints.content, self._latest),
                follow_symlinks=follow_symlinks,
                check=self.ensure_alive,
            )
            self._stage.add(staged)
        return staged

    @property
    def staged_outputs(self) -> dict[str, StagedOutput]:
        """Outputs published since the last commit (visible only once the next commit lands)."""
        return self._stage.taken()

    def _start_cleanup(self) -> None:
        """Delete what retention dropped, in the background, one cleanup at a time (commits wait for it)."""
        if self._cleanup is not None and self._cleanup.is_alive():
            return
        self._cleanup = threading.Thread(
            target=self._sweep_quietly, name=f"stateful-cleanup-{self.identity.key[:40]}", daemon=True
        )
        self._cleanup.start()

    def _sweep_quietly(self) -> None:
        lease = self._keeper.lease
        if lease is None or self._keeper.lost is not None:
            return
        try:
            with self._write_lock:
                self.checkpoints.sweep(lease, keep=self._stage.keys())
        except Exception as exc:  # the objects stay until the next sweep or GC; never fail the writer for it
            log.warning("could not delete the objects of dropped checkpoints of %s: %s", self.identity, exc)

    def purge(self) -> int:
        """Delete the identity's state entirely, fenced like a commit, and end the session.

        The heartbeat stops first, so it never reports the vanished head as a lost lease. Returns the number of
        objects deleted.
        """
        self.ensure_alive()
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup.join()
        self._keeper.stop()
        with self._write_lock:
            deleted = self.checkpoints.purge(self.lease)
        self._ended = self._keeper.release()
        return deleted

    def _ended_error(self, lease: Lease) -> FencedError:
        """Why a session that already ended (its try is over) may not commit: the head says who owns it now."""
        try:
            check_holder(self.checkpoints.head(), lease, action="commit to")
        except FencedError as exc:
            return exc
        return FencedError(
            f"cannot commit to identity {self.identity}: this writer's session has ended (its lease at epoch "
            f"{lease.epoch} was given up). Nothing was uploaded; stop this writer."
        )

    # -- the heartbeat --------------------------------------------------------------------------------------
    def _stop_heartbeat(self) -> None:
        self._keeper.stop()

"""StatefulOperator: the base class that gives a task durable, fenced, upgrade-safe state.

Operator authors subclass it and implement ``execute_stateful(self, context, state)``. Before that runs,
``execute`` takes the identity's lease (fencing every earlier try of this task instance), loads and verifies
the latest checkpoint, and brings it to this code's ``schema_version`` (migrating step by step, committing
the migrated value, or refusing with an error that names both versions).

Which stops use a retry:

* the task's code raises, or the process is killed without warning (SIGKILL, OOM, a lost spot instance):
  Airflow counts a failed try; the retry resumes from the last checkpoint;
* SIGTERM (a worker shutting down or draining, a pod being evicted): Airflow calls ``on_kill``; the next
  ``resume()`` step or ``save()`` commits and the try ends by *rescheduling*, which does not use a retry;
* the task instance is marked failed or cleared in Airflow: Airflow has already decided the try's fate and
  kills the process a few seconds after SIGTERM; whatever was committed until then stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

from airflow_stateful.core import events
from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.codecs import CODECS, JSON, decode_value
from airflow_stateful.core.errors import (
    IncompatibleStateError,
    InvalidValueError,
    MigrationError,
    StopRequested,
)
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.lease import Lease
from airflow_stateful.core.migrations import migrate, migration_path, validate_schema
from airflow_stateful.core.records import Manifest, WriterInfo
from airflow_stateful.hooks.state import StateHook
from airflow_stateful.task_state import TaskState

log = logging.getLogger("airflow_stateful")

ON_INCOMPATIBLE = ("fail", "restart")
ON_SUCCESS = ("keep", "delete")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InvalidValueError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")


class StatefulOperator(BaseOperator):
    """Base class for operators whose work resumes from a checkpoint on retry.

    :param schema_version: version of the state this code writes (an integer >= 1 that only grows).
    :param migrations: ``{v: fn}`` where ``fn`` turns a version ``v`` value into a version ``v + 1`` one.
    :param on_incompatible: ``"fail"`` (default) or ``"restart"`` when the checkpoint's schema cannot be
        brought to ``schema_version`` (newer than the code, or no migration path).
    :param checkpoint_every: default for ``state.resume()``: commit after this many finished items.
    :param checkpoint_interval: default for ``state.resume()``: commit at least this often.
    :param identity: a name for state that lives across DAG runs (e.g. ``"nightly-watermark"``); default
        ``None``: state belongs to this DAG run. (templated)
    :param backend_url: ``s3://bucket/prefix`` or ``file:///path``; default ``[stateful] backend_url``. (templated)
    :param conn_id: Airflow connection for S3; default ``[stateful] conn_id``. (templated)
    :param on_success: ``"keep"`` (default) the state after success, or ``"delete"`` it.
    :param keep_last: checkpoints kept for this task's identity; default ``[stateful] keep_last``.
    :param value_codec: ``"json"`` (default) or ``"pickle"`` (opt-in by name; readers must opt in too).
    :param reschedule_delay: how long after a SIGTERM stop the task is rescheduled.
    """

    template_fields: Sequence[str] = ("identity", "backend_url", "conn_id")

    def __init__(
        self,
        *,
        schema_version: int = 1,
        migrations: Mapping[int, Callable[[Any], Any]] | None = None,
        on_incompatible: str = "fail",
        checkpoint_every: int | None = None,
        checkpoint_interval: timedelta | None = None,
        identity: str | None = None,
        backend_url: str | None = None,
        conn_id: str | None = None,
        on_success: str = "keep",
        keep_last: int | None = None,
        value_codec: str = JSON,
        reschedule_delay: timedelta = timedelta(seconds=5),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Everything that is not templated is checked now, when the DAG is parsed.
        self.migrations = validate_schema(schema_version, migrations)
        self.schema_version = schema_version
        check_choice("on_incompatible", on_incompatible, ON_INCOMPATIBLE)
        check_choice("on_success", on_success, ON_SUCCESS)
        check_choice("value_codec", value_codec, CODECS)
        if checkpoint_every is not None and (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 1
        ):
            raise InvalidValueError(f"checkpoint_every must be a positive integer, not {checkpoint_every!r}")
        if checkpoint_interval is not None and (
            not isinstance(checkpoint_interval, timedelta) or checkpoint_interval <= timedelta(0)
        ):
            raise InvalidValueError(
                f"checkpoint_interval must be a positive timedelta, not {checkpoint_interval!r}"
            )
        if identity is not None and "{{" not in str(identity):
            self._identity_for(dag_id="dag", task_id="task", map_index=-1, run_id="run", name=identity)
        self.on_incompatible = on_incompatible
        self.checkpoint_every = checkpoint_every
        self.checkpoint_interval = checkpoint_interval
        self.identity = identity
        self.backend_url = backend_url
        self.conn_id = conn_id
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise InvalidValueError(f"keep_last must be an integer >= 1, not {keep_last!r}")
        self.on_success = on_success
        self.keep_last = keep_last
        self.value_codec = value_codec
        self.reschedule_delay = reschedule_delay
        self._state: TaskState | None = None
        self._stop_early = False

    # -- to implement --------------------------------------------------------------------------------------
    def execute_stateful(self, context: Any, state: TaskState) -> Any:
        """Do the work, reading ``state.value`` and saving progress with ``state.save`` / ``state.resume``."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute_stateful(context, state)")

    # -- Airflow entry points ------------------------------------------------------------------------------
    @staticmethod
    def _identity_for(
        *, dag_id: str, task_id: str, map_index: int, run_id: str, name: str | None
    ) -> Identity:
        if name is not None:
            return Identity.for_task(dag_id=dag_id, task_id=task_id, map_index=map_index, name=name)
        return Identity.for_task(dag_id=dag_id, task_id=task_id, map_index=map_index, run_id=run_id)

    def execute(self, context: Any) -> Any:
        # A stop belongs to one execution; an operator object reused for the next one starts clean.
        self._state, self._stop_early = None, False
        ti = context["ti"]
        identity = self._identity_for(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            map_index=ti.map_index,
            run_id=context["dag_run"].run_id,
            name=self.identity or None,
        )
        hook = StateHook(backend_url=self.backend_url, conn_id=self.conn_id, keep_last=self.keep_last)
        checkpoints = hook.checkpoint_store(identity)
        writer = StateHook.writer_for(context)
        # This try is the one Airflow runs now: take the lease even from a live holder (an earlier try that
        # is still running is a zombie), which fences it.
        lease = checkpoints.acquire(holder=writer, steal=True)
        try:
            try:
                state = self._open_state(checkpoints, lease, writer)
            except (IncompatibleStateError, MigrationError, InvalidValueError) as exc:
                # Deterministic: another try of the same code would fail the same way. Fail without retrying;
                # fix the DAG (or the migration) and clear the task.
                raise AirflowFailException(str(exc)) from exc
            self._state = state
            if self._stop_early:
                state.request_stop()
            try:
                result = self.execute_stateful(context, state)
            except StopRequested as stop:
                when = datetime.now(tz=timezone.utc) + self.reschedule_delay
                log.warning("%s; rescheduling at %s (this does not use a retry)", stop, when.isoformat())
                raise AirflowRescheduleException(when) from stop
            if self.on_success == "delete":
                checkpoints.purge(lease)
            return result
        finally:
            try:
                checkpoints.release(lease)
            except Exception as exc:  # never mask the task's own outcome; the lease simply expires
                log.warning("could not release the lease on %s: %s (it expires by itself)", identity, exc)
            checkpoints.store.close()

    def on_kill(self) -> None:
        """SIGTERM: ask the code to stop at its next checkpoint. ``execute`` keeps running until then."""
        log.warning("stop requested: the next checkpoint ends this try")
        self._stop_early = True
        if self._state is not None:
            self._state.request_stop()

    # -- opening the state ---------------------------------------------------------------------------------
    def _open_state(self, checkpoints: CheckpointStore, lease: Lease, writer: WriterInfo) -> TaskState:
        return open_task_state(
            checkpoints,
            lease,
            writer,
            schema_version=self.schema_version,
            migrations=self.migrations,
            on_incompatible=self.on_incompatible,
            value_codec=self.value_codec,
            checkpoint_every=self.checkpoint_every,
            checkpoint_interval=self.checkpoint_interval,
        )


def describe_checkpoint(manifest: Manifest) -> str:
    """``checkpoint 7 (written by try 2, at ..., schema 1, dag version ...)`` for task logs."""
    writer = manifest.writer
    parts = [f"try {writer.try_number}" if writer.try_number is not None else writer.describe()]
    parts.append(f"at {manifest.created_at}")
    parts.append(f"schema {manifest.schema_version}")
    if writer.dag_version_id:
        parts.append(f"dag version {writer.dag_version_id}")
    return f"checkpoint {manifest.seq} (written by {', '.join(parts)})"


def open_task_state(
    checkpoints: CheckpointStore,
    lease: Lease,
    writer: WriterInfo,
    *,
    schema_version: int,
    migrations: Mapping[int, Callable[[Any], Any]],
    on_incompatible: str,
    value_codec: str = JSON,
    checkpoint_every: int | None = None,
    checkpoint_interval: timedelta | None = None,
) -> TaskState:
    """The upgrade rules shared by every stateful operator: load and verify the latest checkpoint, then
    resume it, migrate it step by step (committing the migrated value, files kept, before user code runs),
    or refuse / restart per ``on_incompatible``."""
    latest = checkpoints.latest()
    state_args: dict[str, Any] = {
        "checkpoints": checkpoints,
        "lease": lease,
        "writer": writer,
        "schema_version": schema_version,
        "value_codec": value_codec,
        "checkpoint_every": checkpoint_every,
        "checkpoint_interval": checkpoint_interval,
    }
    if latest is None:
        log.info("no checkpoint for %s yet: starting fresh", checkpoints.identity)
        return TaskState(**state_args)
    value = decode_value(
        latest.value, latest.value_codec, allowed=value_codec, where=f"checkpoint {latest.seq}"
    )
    origin = describe_checkpoint(latest)
    resumed = {
        "identity": checkpoints.identity.key,
        "seq": latest.seq,
        "schema_version": latest.schema_version,
    }
    try:
        migration_path(latest.schema_version, schema_version, migrations)
    except IncompatibleStateError as exc:
        if on_incompatible == "fail":
            raise IncompatibleStateError(
                f"cannot resume from {origin}: {exc} The checkpoint is untouched."
            ) from exc
        log.warning(
            "%s is incompatible (%s); on_incompatible='restart': starting fresh, it stays in history",
            origin,
            exc,
        )
        return TaskState(**state_args)
    if latest.schema_version == schema_version:
        log.info("resuming from %s", origin)
        events.emit(events.RESUME, **resumed)
        return TaskState(**state_args, start=latest, value=value)
    migrated = migrate(value, latest.schema_version, schema_version, migrations)
    state = TaskState(**state_args, start=latest, value=migrated)
    info = state.save(migrated)  # committed before any user code runs, keeping the files
    events.emit(events.RESUME, **resumed)
    log.info(
        "resuming from %s, migrated %d -> %d (committed as checkpoint %d)",
        origin,
        latest.schema_version,
        schema_version,
        info.seq,
    )
    return state

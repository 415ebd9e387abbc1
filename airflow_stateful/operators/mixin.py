"""StatefulMixin: what every operator with durable, fenced state shares, written once.

:class:`~airflow_stateful.operators.stateful.StatefulOperator` (and through it the Python operator and the
decorator) and :class:`~airflow_stateful.operators.kubernetes.StatefulKubernetesPodOperator` mix it into
their Airflow base class. It holds the stateful arguments, checks them when the DAG is parsed, names the task
instance's identity, and opens the :class:`~airflow_stateful.core.protocol.session.WriterSession` that takes the lease
(fencing every earlier try), keeps it alive while the task runs and applies the upgrade rules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_stateful.compat import AirflowFailException, AirflowRescheduleException
from airflow_stateful.core.errors import IncompatibleStateError, InvalidValueError, MigrationError
from airflow_stateful.core.protocol.migrations import validate_schema
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.protocol.upgrades import ON_INCOMPATIBLE
from airflow_stateful.core.records.code_identity import ON_CODE_CHANGE, fingerprint_callable
from airflow_stateful.core.records.codecs import CODECS, JSON
from airflow_stateful.core.records.formats import MAX_KEPT
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.hooks.state import StateHook
from airflow_stateful.operators.lifecycle import code_identity, ending, starting_outcome

log = logging.getLogger("airflow_stateful")

STATEFUL_TEMPLATE_FIELDS: tuple[str, ...] = ("identity", "backend_url", "conn_id")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InvalidValueError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")


def identity_for(*, dag_id: str, task_id: str, map_index: int, run_id: str, name: str | None) -> Identity:
    """A task instance's identity: per DAG run, or across runs when ``name`` is given."""
    if name:
        return Identity.for_task(dag_id=dag_id, task_id=task_id, map_index=map_index, name=name)
    return Identity.for_task(dag_id=dag_id, task_id=task_id, map_index=map_index, run_id=run_id)


class StatefulMixin:
    """Stateful arguments, their parse-time checks, the identity and the writer session.

    :param schema_version: version of the state this code writes (an integer >= 1 that only grows).
    :param migrations: ``{v: fn}`` where ``fn`` turns a version ``v`` value into a version ``v + 1`` one.
    :param on_incompatible: ``"fail"`` (default) or ``"restart"`` when the checkpoint's schema cannot be
        brought to ``schema_version`` (newer than the code, or no migration path). ``"restart"`` starts fresh
        and pins the checkpoint it cannot read, so the code that wrote it resumes from it when it is deployed
        again (docs/stateful-tasks.md, "Deploy rollbacks").
    :param on_code_change: when the checkpoint to resume has this ``schema_version`` but was written by other
        code (another fingerprint of the task's code): ``"resume"`` (default; one INFO line says what changed),
        ``"warn"`` (the same line as a WARNING), ``"restart"`` (start fresh) or ``"fail"`` (fail the task without
        a retry, the checkpoint untouched).
    :param identity: a name for state that lives across DAG runs (e.g. ``"nightly-watermark"``); default
        ``None``: state belongs to this DAG run. (templated)
    :param backend_url: ``s3://bucket/prefix`` or ``file:///path``; default ``[stateful] backend_url``. (templated)
    :param conn_id: Airflow connection for S3; default ``[stateful] conn_id``. (templated)
    :param keep_last: checkpoints kept for this task's identity; default ``[stateful] keep_last``.
    :param value_codec: ``"json"`` (default) or ``"pickle"`` (opt-in by name; readers must opt in too).
    :param reschedule_delay: how long after a SIGTERM stop the task is rescheduled.
    :param expected_checkpoint_interval: how often this task commits when healthy. A try that holds a live
        lease but commits nothing for longer is *stuck* (alive, no progress): its log says so, the
        ``stateful.stuck`` metric turns 1, and ``airflow-stateful stuck``, ``ls`` and the UI list it. Default
        ``[stateful] expected_checkpoint_interval`` (1 hour).
    """

    def __init__(
        self,
        *,
        schema_version: int = 1,
        migrations: Mapping[int, Callable[[Any], Any]] | None = None,
        on_incompatible: str = "fail",
        identity: str | None = None,
        backend_url: str | None = None,
        conn_id: str | None = None,
        keep_last: int | None = None,
        value_codec: str = JSON,
        reschedule_delay: timedelta = timedelta(seconds=5),
        expected_checkpoint_interval: timedelta | None = None,
        on_code_change: str = "resume",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Everything that is not templated is checked now, when the DAG is parsed.
        self.migrations = validate_schema(schema_version, migrations)
        self.schema_version = schema_version
        check_choice("on_incompatible", on_incompatible, ON_INCOMPATIBLE)
        check_choice("on_code_change", on_code_change, ON_CODE_CHANGE)
        self.on_code_change = on_code_change
        check_choice("value_codec", value_codec, CODECS)
        if identity is not None and "{{" not in str(identity):
            identity_for(dag_id="dag", task_id="task", map_index=-1, run_id="run", name=identity)
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or not 1 <= keep_last <= MAX_KEPT
        ):
            raise InvalidValueError(f"keep_last must be an integer from 1 to {MAX_KEPT}, not {keep_last!r}")
        if not isinstance(reschedule_delay, timedelta) or reschedule_delay < timedelta(0):
            raise InvalidValueError(f"reschedule_delay must be a timedelta >= 0, not {reschedule_delay!r}")
        if expected_checkpoint_interval is not None and (
            not isinstance(expected_checkpoint_interval, timedelta)
            or not timedelta(seconds=1) <= expected_checkpoint_interval <= timedelta(days=366)
        ):
            raise InvalidValueError(
                "expected_checkpoint_interval must be a timedelta from 1 second to a year, not "
                f"{expected_checkpoint_interval!r}"
            )
        self.expected_checkpoint_interval = expected_checkpoint_interval
        self.on_incompatible = on_incompatible
        self.identity = identity
        self.backend_url = backend_url
        self.conn_id = conn_id
        self.keep_last = keep_last
        self.value_codec = value_codec
        self.reschedule_delay = reschedule_delay

    def stateful_identity(self, context: Any) -> Identity:
        """This task instance's identity: ``(dag_id, task_id, run or identity name, map_index)``."""
        ti = context["ti"]
        return identity_for(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            map_index=ti.map_index,
            run_id=context["dag_run"].run_id,
            name=self.identity or None,
        )

    def state_hook(self) -> StateHook:
        return StateHook(backend_url=self.backend_url, conn_id=self.conn_id, keep_last=self.keep_last)

    def open_session(self, context: Any, hook: StateHook | None = None) -> WriterSession:
        """Take the lease for this try (stealing it: an earlier try still running is a zombie, and is fenced
        by the raised epoch), start renewing it, and load the checkpoint under the upgrade rules.

        A checkpoint this code can never read (schema, migration, codec) fails the task without a retry:
        another try of the same code would fail the same way. Fix the DAG or the migration, then clear it.
        """
        hook = hook or self.state_hook()
        session = WriterSession(
            checkpoints=hook.checkpoint_store(self.stateful_identity(context)),
            writer=StateHook.writer_for(context),
            schema_version=self.schema_version,
            migrations=self.migrations,
            on_incompatible=self.on_incompatible,
            value_codec=self.value_codec,
            steal=True,
            expected_checkpoint_interval=self.expected_interval_seconds(hook),
            outcome=starting_outcome(self, context),
            code=code_identity(context, self.code_fingerprint()),
            on_code_change=self.on_code_change,
        )
        try:
            return session.open()
        except (IncompatibleStateError, MigrationError, InvalidValueError) as exc:
            raise AirflowFailException(str(exc)) from exc

    def code_fingerprint(self) -> str | None:
        """A fingerprint of this task's own code (:func:`~airflow_stateful.core.records.code_identity.fingerprint_callable`
        of ``execute_stateful``); operators that run other code (a callable, a pod) override it."""
        method = getattr(type(self), "execute_stateful", None)
        return fingerprint_callable(method) if callable(method) else None

    def record_end(self, session: WriterSession, context: Any, exc: BaseException | None) -> None:
        """Tell the session how this try ends (written with the lease's release): what Airflow does next."""
        state, retry_in, reason = ending(self, context, exc)
        session.end(state, retry_in=retry_in, reason=reason)

    def expected_interval_seconds(self, hook: StateHook) -> float:
        """The task's ``expected_checkpoint_interval``, or ``[stateful] expected_checkpoint_interval``."""
        if self.expected_checkpoint_interval is not None:
            return self.expected_checkpoint_interval.total_seconds()
        return hook.settings.expected_checkpoint_interval

    def reschedule(self, reason: object) -> AirflowRescheduleException:
        """End this try by rescheduling it (a stop that does not use a retry)."""
        when = datetime.now(tz=timezone.utc) + self.reschedule_delay
        log.warning("%s; rescheduling at %s (this does not use a retry)", reason, when.isoformat())
        return AirflowRescheduleException(when)

"""Sensors on an identity's durable state: wait for a checkpoint, or for its writer to let go.

* :class:`CheckpointSensor` waits until an identity has a checkpoint that meets a condition (it exists;
  its seq is at least N; it was written after a time; a field of its value compares to a value, or any
  callable on the value returns true), e.g. to start a consumer DAG once a producer's state is far enough.
* :class:`LeaseReleasedSensor` waits until no live lease holds an identity: its writer finished (or
  died and its lease expired). That is the safe point to upgrade the writer's code or hand the state over
  to another DAG.

Both work in ``poke`` and ``reschedule`` mode and, with ``deferrable=True``, in the triggerer through
:class:`~airflow_stateful.triggers.checkpoint.CheckpointTrigger`. An unreadable store (missing bucket,
denied credentials, corrupt head record) fails the sensor at once with the library's message, rather
than after ``timeout``.

The identity is given either whole (``identity="etl/export/name=orders/map=-1"``) or by the parts a
stateful task's identity is made of: ``external_dag_id`` (default: this DAG), ``external_task_id``,
``map_index`` and one scope, ``name`` (the ``identity=`` given to ``@stateful_task``) or ``run_id``
(default: this DAG run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException

from airflow_stateful.compat import airflow_conf
from airflow_stateful.core.errors import InvalidValueError, StatefulError
from airflow_stateful.core.fleet.conditions import LEASE_RELEASED, CheckpointCondition
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.hooks.state import StateHook
from airflow_stateful.triggers.checkpoint import CheckpointTrigger

_UNSET: Any = object()
_DEFAULT_MAX_POLL_INTERVAL = 60.0


class CheckpointSensorError(AirflowException):
    """The sensor cannot read the identity's state; waiting longer would not help."""


def _templated(value: Any) -> bool:
    return isinstance(value, str) and "{{" in value


class _IdentitySensor(BaseSensorOperator):
    """What both sensors share: which identity, which store, and the three ways of waiting."""

    template_fields: Sequence[str] = (
        "identity",
        "external_dag_id",
        "external_task_id",
        "run_id",
        "name",
        "map_index",
        "backend_url",
        "conn_id",
    )

    def __init__(
        self,
        *,
        identity: str | None = None,
        external_dag_id: str | None = None,
        external_task_id: str | None = None,
        run_id: str | None = None,
        name: str | None = None,
        map_index: int | str = -1,
        backend_url: str | None = None,
        conn_id: str | None = None,
        deferrable: bool = airflow_conf().getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if identity is not None:
            parts = {
                "external_dag_id": external_dag_id,
                "external_task_id": external_task_id,
                "run_id": run_id,
                "name": name,
            }
            given = [part for part, value in parts.items() if value is not None]
            if given:
                raise InvalidValueError(
                    f"{self.task_id}: give either identity (a whole key) or its parts, not both "
                    f"(also got {', '.join(given)})."
                )
            if not _templated(identity):
                Identity.parse(identity)
        elif external_task_id is None:
            raise InvalidValueError(
                f"{self.task_id}: say which state to watch: identity='<key>', or external_task_id= (with "
                "external_dag_id=, and name= for state that lives across runs)."
            )
        if name is not None and run_id is not None:
            raise InvalidValueError(
                f"{self.task_id}: give name= (state across runs) or run_id= (state of one run), not both."
            )
        if name is not None and not _templated(name):
            Identity.for_task(dag_id="dag", task_id="task", name=name)  # a bad name fails at parse time
        self.identity = identity
        self.external_dag_id = external_dag_id
        self.external_task_id = external_task_id
        self.run_id = run_id
        self.name = name
        self.map_index = map_index
        self.backend_url = backend_url
        self.conn_id = conn_id
        self.deferrable = deferrable
        self._hook: StateHook | None = None
        self._checkpoints: CheckpointStore | None = None

    # -- to implement --------------------------------------------------------------------------------------
    def condition(self) -> CheckpointCondition:
        """What to wait for, built from the rendered template fields."""
        raise NotImplementedError

    def predicate(self) -> Callable[[Any], bool] | None:
        """A callable on the checkpoint's value that must also hold (poke and reschedule mode only)."""
        return None

    # -- the identity and its store ------------------------------------------------------------------------
    def watched_identity(self, context: Any) -> Identity:
        """The identity named by the (rendered) arguments."""
        if self.identity is not None:
            return Identity.parse(str(self.identity).strip())
        map_index = self.map_index
        if isinstance(map_index, str):
            try:
                map_index = int(map_index.strip())
            except ValueError:
                raise InvalidValueError(f"map_index must be an integer, not {self.map_index!r}") from None
        name = self.name or None
        return Identity.for_task(
            dag_id=self.external_dag_id or context["ti"].dag_id,
            task_id=str(self.external_task_id),
            map_index=map_index,
            name=name,
            run_id=None if name else (self.run_id or context["dag_run"].run_id),
        )

    def _open(self, context: Any) -> CheckpointStore:
        if self._checkpoints is None:
            identity = self.watched_identity(context)
            if "/" not in identity.key:
                self.log.warning(
                    "identity %r is a single segment; to watch the state of @stateful_task(identity=%r), "
                    "pass external_dag_id=, external_task_id= and name=%r instead",
                    identity.key,
                    identity.key,
                    identity.key,
                )
            self._hook = StateHook(backend_url=self.backend_url, conn_id=self.conn_id)
            self._checkpoints = self._hook.checkpoint_store(identity)
        return self._checkpoints

    def _close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.store.close()
        self._checkpoints = None
        self._hook = None

    # -- Airflow entry points ------------------------------------------------------------------------------
    def poke(self, context: Any) -> bool | PokeReturnValue:
        where = "the identity"
        try:
            checkpoints = self._open(context)
            where = f"identity {checkpoints.identity} in {checkpoints.store.url}"
            condition = self.condition()
            verdict = condition.evaluate(
                checkpoints.head(), checkpoints.latest, now=time.time(), predicate=self.predicate()
            )
        except StatefulError as exc:
            raise CheckpointSensorError(f"cannot check {where}: {exc}") from exc
        if not verdict:
            self.log.info(
                "waiting for %s of %s: %s", condition.describe(), checkpoints.identity, verdict.reason
            )
            return False
        self.log.info("%s: %s", checkpoints.identity, verdict.reason)
        return PokeReturnValue(is_done=True, xcom_value=verdict.result(checkpoints.identity.key))

    def execute(self, context: Any) -> Any:
        try:
            if not self.deferrable:
                return super().execute(context)
            # Check once here: a condition that already holds needs no trip through the triggerer.
            done = self.poke(context)
            if isinstance(done, PokeReturnValue) and done:
                return done.xcom_value
            checkpoints = self._open(context)
            assert self._hook is not None
            self.defer(
                trigger=CheckpointTrigger(
                    identity=checkpoints.identity.key,
                    condition=self.condition().to_dict(),
                    # What this worker resolved, so the trigger watches the same store; no credentials.
                    backend_url=self._hook.backend_url,
                    conn_id=self._hook.conn_id,
                    poll_interval=self.poke_interval,
                    max_poll_interval=max(
                        self.poke_interval,
                        self.max_wait.total_seconds() if self.max_wait else _DEFAULT_MAX_POLL_INTERVAL,
                    ),
                ),
                method_name="execute_complete",
                timeout=timedelta(seconds=self.timeout),
            )
        finally:
            self._close()

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        """Resume after the trigger fired: return its result, or fail with its message."""
        if event.get("status") != "success":
            raise CheckpointSensorError(event.get("message") or f"the trigger failed: {event!r}")
        self.log.info("%s", event.get("reason", "condition met"))
        return event["result"]


class CheckpointSensor(_IdentitySensor):
    """Waits until an identity has a checkpoint that meets a condition, so downstream work reads enough state.

    With no condition it waits for the first checkpoint. All conditions given must hold together, on the
    latest checkpoint. Returns (as XCom) ``{"identity", "seq", "created_at", "epoch"}`` of the checkpoint
    that met them. To read the state, open ``StateHook().checkpoint_store(Identity.parse(result["identity"]))``
    and call ``latest()`` (the writer may have moved on, and retention may have pruned ``seq`` since).

    :param identity: the whole identity key to watch, e.g. ``"etl/export/name=orders/map=-1"``. (templated)
    :param external_dag_id: with ``external_task_id``: the DAG of the stateful task; default this DAG.
        (templated)
    :param external_task_id: the stateful task whose state to watch. (templated)
    :param name: the state's name (the ``identity=`` given to ``@stateful_task``) for state that lives
        across DAG runs. (templated)
    :param run_id: for state of one DAG run: that run's id; default this sensor's DAG run. (templated)
    :param map_index: the mapped task instance; default ``-1`` (unmapped). (templated)
    :param min_seq: the latest checkpoint's sequence number must be at least this.
    :param newer_than: the latest checkpoint must have been written after this time (a timezone-aware
        ``datetime`` or ISO 8601 string, e.g. ``"{{ data_interval_end }}"``). (templated)
    :param field: dotted path into the checkpoint's JSON value (``"stats.rows"``; ``""`` for the whole
        value) to compare with ``op`` and ``value``. Works in every mode.
    :param op: ``==`` (default), ``!=``, ``<``, ``<=``, ``>`` or ``>=``.
    :param value: what ``field`` is compared to (JSON), e.g. ``"{{ ds }}"``. (templated)
    :param predicate: any callable on the checkpoint's value that must return true. Poke and reschedule
        mode only: a callable cannot be handed to the triggerer, so ``deferrable=True`` refuses it.
    :param backend_url: ``s3://bucket/prefix`` or ``file:///path``; default ``[stateful] backend_url``.
        (templated)
    :param conn_id: Airflow connection for S3; default ``[stateful] conn_id``. (templated)
    :param deferrable: wait in the triggerer (default ``[operators] default_deferrable``). The trigger
        checks after ``poke_interval`` seconds, then backs off up to ``max_wait`` (default 60 s).
    """

    template_fields: Sequence[str] = (*_IdentitySensor.template_fields, "newer_than", "value")

    def __init__(
        self,
        *,
        min_seq: int | None = None,
        newer_than: datetime | str | None = None,
        field: str | None = None,
        op: str = "==",
        value: Any = _UNSET,
        predicate: Callable[[Any], bool] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (field is None) != (value is _UNSET):
            raise InvalidValueError(
                f"{self.task_id}: field= and value= go together (got field={field!r}"
                f"{'' if value is _UNSET else f', value={value!r}'})."
            )
        if predicate is not None and not callable(predicate):
            raise InvalidValueError(f"{self.task_id}: predicate must be callable, not {predicate!r}")
        if predicate is not None and self.deferrable:
            raise InvalidValueError(
                f"{self.task_id}: a predicate callable cannot run in the triggerer (trigger arguments are "
                "stored as JSON); use field=, op= and value= with deferrable=True, or pass deferrable=False."
            )
        self.min_seq = min_seq
        self.newer_than = newer_than
        self.field = field
        self.op = op
        self.value = None if value is _UNSET else value
        self._predicate = predicate
        # Everything that is not templated is checked now, when the DAG is parsed.
        CheckpointCondition(min_seq=min_seq, field=field, op=op, value=self.value)
        if newer_than is not None and not _templated(newer_than):
            self.condition()

    def condition(self) -> CheckpointCondition:
        newer_than = self.newer_than
        if isinstance(newer_than, datetime):
            if newer_than.tzinfo is None:
                raise InvalidValueError(
                    f"newer_than {newer_than!r} has no timezone, so it is ambiguous; pass an aware datetime."
                )
            newer_than = newer_than.isoformat()
        elif newer_than is not None:
            newer_than = str(newer_than).strip() or None
        return CheckpointCondition(
            min_seq=self.min_seq, newer_than=newer_than, field=self.field, op=self.op, value=self.value
        )

    def predicate(self) -> Callable[[Any], bool] | None:
        return self._predicate


class LeaseReleasedSensor(_IdentitySensor):
    """Waits until no live lease holds an identity: the safe point to upgrade its writer or hand it over.

    A lease is live while its writer runs (it is renewed by every commit) and until its TTL passes after a
    crash. An identity that was never used holds no lease, so the sensor succeeds at once. Returns (as XCom)
    ``{"identity", "seq", "created_at", "epoch"}``: the identity's epoch and latest checkpoint at that moment.

    :param identity: the whole identity key to watch, e.g. ``"etl/export/name=orders/map=-1"``. (templated)
    :param external_dag_id: with ``external_task_id``: the DAG of the stateful task; default this DAG.
        (templated)
    :param external_task_id: the stateful task whose lease to watch. (templated)
    :param name: the state's name (the ``identity=`` given to ``@stateful_task``). (templated)
    :param run_id: for state of one DAG run: that run's id; default this sensor's DAG run. (templated)
    :param map_index: the mapped task instance; default ``-1`` (unmapped). (templated)
    :param backend_url: ``s3://bucket/prefix`` or ``file:///path``; default ``[stateful] backend_url``.
        (templated)
    :param conn_id: Airflow connection for S3; default ``[stateful] conn_id``. (templated)
    :param deferrable: wait in the triggerer (default ``[operators] default_deferrable``).
    """

    def condition(self) -> CheckpointCondition:
        return CheckpointCondition(kind=LEASE_RELEASED)

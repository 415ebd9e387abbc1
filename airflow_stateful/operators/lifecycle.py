"""What a stateful try tells its head about itself: how it will end if killed, how it ended, and what code ran.

Airflow decides a failed try's fate after ``execute`` raised (``_handle_current_task_failed`` in the task
runner): ``AirflowFailException`` and ``AirflowSensorTimeout`` fail it for good, skip and reschedule
exceptions and deferral end it without a failure, and anything else is retried when the execution API said
the try may retry (``should_retry``: ``try_number <= max_tries``). This module makes the same call from the
exception the operator sees, so the head's outcome (:mod:`airflow_stateful.core.records.outcomes`) says what Airflow
will do, and computes when a retry can run the way Airflow does (the lower bound of its backoff).

Two cases it cannot see: a ``RetryPolicy`` (Airflow 3.3) that fails a try early or changes its delay, and a
person marking the task failed or clearing it. Both only make the recorded outcome more cautious than the truth
(a retry recorded where none comes): maintenance keeps the state, and where it can ask Airflow it learns the
truth (:mod:`airflow_stateful.core.fleet.lifetimes`).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_stateful.core.records.code_identity import CodeIdentity
from airflow_stateful.core.records.outcomes import (
    DEFERRED,
    FAILED,
    SKIPPED,
    SUCCESS,
    UP_FOR_RESCHEDULE,
    UP_FOR_RETRY,
    TryOutcome,
    earliest_retry,
    starting,
)
from airflow_stateful.version import __version__

_FAIL_FOR_GOOD = frozenset({"AirflowFailException", "AirflowSensorTimeout", "AirflowTaskTerminated"})
_SKIP = frozenset({"AirflowSkipException"})
_DEFER = frozenset({"TaskDeferred"})
_RESCHEDULE = frozenset({"AirflowRescheduleException"})
_SUCCEED = frozenset({"DownstreamTasksSkipped"})


def _names(exc: BaseException) -> set[str]:
    """Class names along the exception's MRO: Airflow moved these classes between 3.1 and 3.3."""
    return {cls.__name__ for cls in type(exc).__mro__}


def will_retry(context: Any) -> bool:
    """Whether Airflow retries this try if it fails: the execution API's ``should_retry`` when the task runner
    has it, else Airflow's own rule (``max_tries != 0 and try_number <= max_tries``)."""
    ti = context["ti"]
    server = getattr(ti, "_ti_context_from_server", None)
    should = getattr(server, "should_retry", None)
    if isinstance(should, bool):
        return should
    max_tries, try_number = getattr(ti, "max_tries", None), getattr(ti, "try_number", None)
    if not isinstance(max_tries, int) or not isinstance(try_number, int):
        return False
    return max_tries != 0 and try_number <= max_tries


def _seconds(value: Any) -> float | None:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def retry_delay(task: Any, context: Any) -> float:
    """The earliest seconds before this try's retry can run, from the task's retry settings."""
    return earliest_retry(
        try_number=int(getattr(context["ti"], "try_number", 1) or 1),
        retry_delay=_seconds(getattr(task, "retry_delay", None)) or 0.0,
        exponential_backoff=getattr(task, "retry_exponential_backoff", 0) or 0,
        max_retry_delay=_seconds(getattr(task, "max_retry_delay", None)),
    )


def starting_outcome(task: Any, context: Any) -> TryOutcome:
    """``running``, with what Airflow does when this try dies without a word."""
    ti = context["ti"]
    retry = will_retry(context)
    max_tries = getattr(ti, "max_tries", None)
    try_number = getattr(ti, "try_number", None)
    return starting(
        now=time.time(),
        try_number=try_number if isinstance(try_number, int) else None,
        max_tries=max_tries if isinstance(max_tries, int) else None,
        run_id=context["dag_run"].run_id,
        will_retry=retry,
        retry_delay=retry_delay(task, context) if retry else None,
    )


def ending(task: Any, context: Any, exc: BaseException | None) -> tuple[str, float | None, str | None]:
    """``(state, retry_in, reason)`` for a try that returned (``exc`` None) or raised ``exc``."""
    if exc is None:
        return SUCCESS, None, None
    names = _names(exc)
    reason = type(exc).__name__
    if names & _SUCCEED:
        return SUCCESS, None, None
    if names & _SKIP:
        return SKIPPED, None, reason
    if names & _DEFER:
        return DEFERRED, None, None
    if names & _RESCHEDULE:
        when = getattr(exc, "reschedule_date", None)
        retry_in = None
        if isinstance(when, datetime):
            aware = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
            retry_in = max((aware - datetime.now(tz=timezone.utc)).total_seconds(), 0.0)
        return UP_FOR_RESCHEDULE, retry_in, None
    if names & _FAIL_FOR_GOOD or not will_retry(context):
        return FAILED, None, reason
    return UP_FOR_RETRY, retry_delay(task, context), reason


def code_identity(context: Any, fingerprint: str | None) -> CodeIdentity:
    """The code this try runs: the task's fingerprint, the DAG version, the DAG bundle and its version."""
    ti = context["ti"]
    version = getattr(ti, "dag_version_id", None)
    bundle = getattr(ti, "bundle_instance", None)
    bundle_name = getattr(bundle, "name", None)
    # The version the try runs (a Git bundle's commit; None for the unversioned DAG folder). dag.test() loads no
    # bundle: then both are unknown.
    bundle_version = getattr(bundle, "version", None)
    return CodeIdentity(
        fingerprint=fingerprint,
        dag_version_id=str(version) if version else None,
        bundle_name=str(bundle_name) if bundle_name else None,
        bundle_version=str(bundle_version) if bundle_version else None,
        provider_version=__version__,
    )

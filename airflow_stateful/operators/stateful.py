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
  kills the process a few seconds after SIGTERM; whatever was committed until then stays;
* a ``resume()`` loop whose iterable changed under its cursor (``CursorMismatchError``): the try fails
  *without* a retry, which would meet the same iterable; its message says what changed and what to do.

A save running in the background (``state.save(..., wait=False)``) is always waited for before the session
closes: when the code returns (its error then fails the try), on a stop, and when the code raised.

Every try gets the worker's restore cache (``[stateful] restore_cache_dir``, on by default): the files a try
saves stay on the worker, and ``state.restore_files`` in a retry on the same machine takes the unchanged
chunks from there, verified, instead of downloading them (:mod:`airflow_stateful.core.data.chunk_cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from airflow_stateful.compat import AirflowFailException
from airflow_stateful.core.data.chunk_cache import LocalChunkCache, restore_cache_for
from airflow_stateful.core.data.placement import warmth
from airflow_stateful.core.errors import CursorMismatchError, InvalidValueError, StopRequested
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.protocol.upgrades import describe_checkpoint
from airflow_stateful.operators.mixin import STATEFUL_TEMPLATE_FIELDS, StatefulMixin, check_choice
from airflow_stateful.task_state import TaskState

log = logging.getLogger("airflow_stateful")

ON_SUCCESS = ("keep", "delete")

__all__ = ["ON_SUCCESS", "StatefulOperator", "check_choice", "describe_checkpoint"]


class StatefulOperator(StatefulMixin, BaseOperator):
    """Base class for operators whose work resumes from a checkpoint on retry.

    Takes the stateful arguments of :class:`~airflow_stateful.operators.mixin.StatefulMixin`
    (``schema_version``, ``migrations``, ``on_incompatible``, ``identity``, ``backend_url``, ``conn_id``,
    ``keep_last``, ``value_codec``, ``reschedule_delay``) plus:

    :param checkpoint_every: default for ``state.resume()``: commit after this many finished items.
    :param checkpoint_interval: default for ``state.resume()``: commit at least this often.
    :param on_success: ``"keep"`` (default) the state after success, or ``"delete"`` it.
    :param output_asset_events: when the task has ``outlets``, put the outputs this run committed
        (``state.publish``) in the ``extra`` of each outlet's asset event, under ``"stateful_outputs"``
        (default True). Airflow emits those events only when the task succeeds, after every output was
        committed, so a DAG scheduled on the asset runs on committed outputs only.
    """

    template_fields: Sequence[str] = STATEFUL_TEMPLATE_FIELDS

    def __init__(
        self,
        *,
        checkpoint_every: int | None = None,
        checkpoint_interval: timedelta | None = None,
        on_success: str = "keep",
        output_asset_events: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_choice("on_success", on_success, ON_SUCCESS)
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
        self.checkpoint_every = checkpoint_every
        self.checkpoint_interval = checkpoint_interval
        self.on_success = on_success
        self.output_asset_events = bool(output_asset_events)
        self._state: TaskState | None = None
        self._stop_early = False

    # -- to implement --------------------------------------------------------------------------------------
    def execute_stateful(self, context: Any, state: TaskState) -> Any:
        """Do the work, reading ``state.value`` and saving progress with ``state.save`` / ``state.resume``."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute_stateful(context, state)")

    # -- Airflow entry points ------------------------------------------------------------------------------
    def execute(self, context: Any) -> Any:
        # A stop belongs to one execution; an operator object reused for the next one starts clean.
        self._state, self._stop_early = None, False
        hook = self.state_hook()
        cache = restore_cache_for(hook.settings)
        try:
            session = self.open_session(context, hook)
            with session:
                state = TaskState(
                    session=session,
                    checkpoint_every=self.checkpoint_every,
                    checkpoint_interval=self.checkpoint_interval,
                    restore_cache=cache,
                )
                self._state = state
                if cache is not None:
                    log_cache_warmth(session, cache)
                if self._stop_early:
                    state.request_stop()
                try:
                    result = self.execute_stateful(context, state)
                    # The end of the task waits for a save still running in the background
                    # (save(wait=False)); if it failed, its error fails this try and the retry resumes from
                    # the last checkpoint that landed.
                    state.wait_for_save()
                    if state.staged_outputs:
                        log.info("committing the outputs still staged (%s)", ", ".join(state.staged_outputs))
                        state.save(state.value)
                except StopRequested as stop:
                    _settle_background_save(state)
                    rescheduled = self.reschedule(stop)
                    self.record_end(session, context, rescheduled)
                    raise rescheduled from stop
                except CursorMismatchError as exc:  # a retry of this code would meet the same iterable
                    _settle_background_save(state)
                    failed = AirflowFailException(str(exc))
                    self.record_end(session, context, failed)
                    raise failed from exc
                except BaseException as exc:
                    _settle_background_save(state)
                    self.record_end(session, context, exc)
                    raise
                if self.output_asset_events:
                    attach_outputs_to_outlets(self, context, state)
                if self.on_success == "delete":
                    session.purge()
                else:
                    self.record_end(session, context, None)  # written with the lease's release
                return result
        finally:
            if cache is not None:
                cache.close()  # the session closed above, after every save was waited for
            hook.close()

    def on_kill(self) -> None:
        """SIGTERM: ask the code to stop at its next checkpoint. ``execute`` keeps running until then."""
        log.warning("stop requested: the next checkpoint ends this try")
        self._stop_early = True
        if self._state is not None:
            self._state.request_stop()


def log_cache_warmth(session: WriterSession, cache: LocalChunkCache) -> None:
    """Say whether this worker's restore cache holds the checkpoint the try resumes from (see
    :mod:`airflow_stateful.core.data.placement`). Never fails the try."""
    latest = session.latest
    if latest is None or not latest.has_files:
        return
    try:
        tree = session.tree(latest)
        if tree is not None:
            log.info("%s", warmth(latest, tree, cache, here=session.writer).describe())
    except Exception as exc:
        log.warning("could not tell whether the restore cache is warm: %s", exc)


def outputs_event_extra(context: Any, state: TaskState) -> dict[str, Any]:
    """What an outlet's asset event carries about the outputs: the identity, the checkpoint, and the outputs
    committed in this DAG run (an identity named across runs also lists earlier runs' outputs; those are not
    news to a downstream DAG)."""
    run_id = context["dag_run"].run_id
    checkpoint = state.checkpoint
    return {
        "store": state.store_url,
        "identity": str(state.identity),
        "seq": checkpoint.seq if checkpoint else None,
        "outputs": {
            name: info.to_json() for name, info in state.outputs().items() if info.run_id in (None, run_id)
        },
    }


def attach_outputs_to_outlets(task: BaseOperator, context: Any, state: TaskState) -> None:
    """Put :func:`outputs_event_extra` in the ``extra`` of the asset event of each of ``task``'s outlets."""
    outlets = list(getattr(task, "outlets", None) or [])
    if not outlets:
        return
    extra = outputs_event_extra(context, state)
    events = context["outlet_events"]
    for outlet in outlets:
        try:
            events[outlet].extra["stateful_outputs"] = extra
        except (KeyError, TypeError, AttributeError) as exc:  # an outlet kind without events (a plain URI?)
            log.warning("no asset event extra for outlet %r: %s", outlet, exc)
    log.info(
        "the asset event(s) of %d outlet(s) list %d output(s) committed in this run: %s",
        len(outlets),
        len(extra["outputs"]),
        ", ".join(extra["outputs"]) or "none",
    )


def _settle_background_save(state: TaskState) -> None:
    """Let a background save finish before the session closes and gives the lease up; never raises.

    The try is already ending with its own exception (or a stop), which is what Airflow must see; a failed
    background save is logged beside it. Letting the save finish, rather than abandoning it, keeps the progress
    it carries when it lands.
    """
    try:
        state.wait_for_save()
    except Exception as exc:
        log.error("a background save also failed: %s: %s", type(exc).__name__, exc)

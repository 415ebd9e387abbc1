"""How each try of a stateful task ended, as its head records it: what GC, ``ls`` and ``du`` judge lifetimes by.

A checkpoint is worth keeping exactly as long as Airflow may still run the task that reads it. Airflow knows
that (the task instance's state), but maintenance cannot always ask it, and a killed try tells nobody. So the
operator writes what it knows into the head, in the same compare-and-swap that takes or gives up the lease:

* when a try starts: ``running``, with what Airflow will do if this try dies without a word (SIGKILL, OOM, a
  lost node): retry it (``if_killed="up_for_retry"``, no earlier than ``retry_delay``) or fail it for good;
* when a try ends: ``success``, ``up_for_retry`` (with the earliest time the retry can run, from ``retries``,
  ``retry_delay``, ``retry_exponential_backoff`` and ``max_retry_delay``, as Airflow computes it), ``failed``
  (no retry left, or ``AirflowFailException``), ``up_for_reschedule``, ``deferred`` or ``skipped``.

The names are Airflow's task instance states, so a person reading ``airflow-stateful ls`` next to the Airflow
UI sees the same words. A try can still run while its state is in :data:`CAN_RUN`; only the others (success,
failed, skipped) let maintenance release state (see :mod:`airflow_stateful.core.fleet.lifetimes`). No Airflow import here:
the operator turns Airflow's objects into the plain numbers :func:`earliest_retry` takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.timestamps import utcnow_iso

RUNNING = "running"
SUCCESS = "success"
UP_FOR_RETRY = "up_for_retry"
FAILED = "failed"
UP_FOR_RESCHEDULE = "up_for_reschedule"
DEFERRED = "deferred"
SKIPPED = "skipped"

STATES = (RUNNING, SUCCESS, UP_FOR_RETRY, FAILED, UP_FOR_RESCHEDULE, DEFERRED, SKIPPED)
CAN_RUN = frozenset({RUNNING, UP_FOR_RETRY, UP_FOR_RESCHEDULE, DEFERRED})
"""Outcomes after which Airflow runs the task again by itself: its state must be kept."""

MAX_RETRY_DELAY = 24 * 3600.0
"""Airflow's own cap on a computed retry delay (``abstractoperator.MAX_RETRY_DELAY``, one day)."""
_MAX_REASON = 200


def earliest_retry(
    *,
    try_number: int,
    retry_delay: float,
    exponential_backoff: float | bool = 0,
    max_retry_delay: float | None = None,
) -> float:
    """Seconds after a failed try ``try_number`` ends before Airflow may start its retry, at the earliest.

    Airflow (``TaskInstance.next_retry_datetime``) waits ``retry_delay``, or with exponential backoff
    ``ceil(retry_delay * multiplier ** (try_number - 1))`` plus a hash-chosen amount of up to as much again,
    capped at one day and at ``max_retry_delay``. The hash part cannot be known here, so this is the lower
    bound: the retry never runs sooner, and usually runs up to twice as late. ``exponential_backoff`` is the
    multiplier (Airflow 3.3) or a bool (earlier releases: ``True`` means 2).
    """
    delay = max(float(retry_delay), 0.0)
    multiplier = 2.0 if exponential_backoff is True else float(exponential_backoff or 0)
    if multiplier not in (0.0, 1.0) and multiplier > 0:
        try:
            delay = float(max(math.ceil(delay * multiplier ** (max(try_number, 1) - 1)), 1))
        except OverflowError:
            delay = MAX_RETRY_DELAY
        delay = min(delay, MAX_RETRY_DELAY)
    if max_retry_delay is not None:
        delay = min(delay, float(max_retry_delay))
    return delay


@dataclass(frozen=True)
class TryOutcome:
    """The newest try's outcome, as the head records it.

    :param state: one of :data:`STATES` (Airflow's task instance state names).
    :param at: when it was recorded (the writer's clock, ISO 8601 UTC): the try's start for ``running``, its
        end otherwise.
    :param try_number: Airflow's try number (1-based), if known.
    :param max_tries: the task instance's ``max_tries`` (``retries``, raised when the task is cleared).
    :param run_id: the DAG run of the try (a named identity spans runs).
    :param retry_at: ``up_for_retry``: the earliest time the retry can run; ``up_for_reschedule``: when it is
        rescheduled to; ``running``: the earliest time a retry could run if this try died now (lease expiry plus
        the retry delay is later still).
    :param if_killed: ``running`` only: what Airflow does when this try dies without recording an outcome
        (``up_for_retry`` or ``failed``).
    :param retry_delay: ``running`` only: the seconds :func:`earliest_retry` gives for this try.
    :param reason: why the try failed (the exception's class name), for people.
    """

    state: str
    at: str
    try_number: int | None = None
    max_tries: int | None = None
    run_id: str | None = None
    retry_at: str | None = None
    if_killed: str | None = None
    retry_delay: float | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"outcome state must be one of {', '.join(STATES)}, not {self.state!r}")
        if self.if_killed not in (None, UP_FOR_RETRY, FAILED):
            raise ValueError(f"if_killed must be up_for_retry or failed, not {self.if_killed!r}")

    def ended(
        self, *, state: str, now: float, retry_in: float | None = None, reason: str | None = None
    ) -> TryOutcome:
        """This try's end: ``state`` at ``now``; ``retry_in`` seconds until a retry (or reschedule) may run."""
        return TryOutcome(
            state=state,
            at=utcnow_iso(now),
            try_number=self.try_number,
            max_tries=self.max_tries,
            run_id=self.run_id,
            retry_at=utcnow_iso(now + retry_in) if retry_in is not None else None,
            reason=(reason or None) and str(reason)[:_MAX_REASON],
        )

    def describe(self) -> str:
        """``up_for_retry (try 2 of 4, may run from ...)`` for tables and logs."""
        bits = []
        if self.try_number is not None:
            total = f" of {self.max_tries + 1}" if self.max_tries is not None else ""
            bits.append(f"try {self.try_number}{total}")
        if self.state == UP_FOR_RETRY and self.retry_at:
            bits.append(f"may run from {self.retry_at}")
        elif self.state == UP_FOR_RESCHEDULE and self.retry_at:
            bits.append(f"rescheduled to {self.retry_at}")
        elif self.state == RUNNING and self.if_killed:
            bits.append(f"if killed: {self.if_killed.replace('_', ' ')}")
        else:
            bits.append(f"at {self.at}")
        if self.reason:
            bits.append(self.reason)
        return f"{self.state} ({', '.join(bits)})"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"state": self.state, "at": self.at}
        for name in ("try_number", "max_tries", "run_id", "retry_at", "if_killed", "retry_delay", "reason"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return body

    @classmethod
    def from_json(cls, data: Any, *, what: str = "outcome") -> TryOutcome:
        """Typed and bounded (it comes from storage); an unknown state is corrupt, not guessed at."""
        f = Fields(data, what=what)
        state = f.text("state", max_len=32)
        if state not in STATES:
            raise f.bad("state", f"one of {', '.join(STATES)}")
        if_killed = f.optional_text("if_killed", max_len=32)
        if if_killed not in (None, UP_FOR_RETRY, FAILED):
            raise f.bad("if_killed", "up_for_retry or failed")
        return cls(
            state=state,
            at=f.time("at"),
            try_number=f.optional_integer("try_number", minimum=0),
            max_tries=f.optional_integer("max_tries", minimum=-1),
            run_id=f.optional_text("run_id", max_len=250),
            retry_at=f.optional_time("retry_at"),
            if_killed=if_killed,
            retry_delay=f.optional_number("retry_delay", maximum=366 * 86400.0),
            reason=f.optional_text("reason", max_len=_MAX_REASON),
        )


def starting(
    *,
    now: float,
    try_number: int | None,
    max_tries: int | None,
    run_id: str | None,
    will_retry: bool,
    retry_delay: float | None,
) -> TryOutcome:
    """The outcome a try records as it takes the lease: running, and what happens to it if it is killed."""
    return TryOutcome(
        state=RUNNING,
        at=utcnow_iso(now),
        try_number=try_number,
        max_tries=max_tries,
        run_id=run_id,
        if_killed=UP_FOR_RETRY if will_retry else FAILED,
        retry_delay=retry_delay if will_retry else None,
        retry_at=utcnow_iso(now + retry_delay) if will_retry and retry_delay is not None else None,
    )

"""How long an identity's state lives: as long as Airflow may still run the task that reads it, then a policy.

An age alone cannot decide it. A try ``up_for_retry`` with a long backoff, a rescheduled or deferred task, a
run a person will clear next week: each looks idle and each must resume. And a run that succeeded needs its
per-run state no more. So :func:`judge` reads the outcome the operator recorded in the head
(:mod:`airflow_stateful.core.records.outcomes`) and, where Airflow could be asked (:mod:`airflow_stateful.core.fleet.airflow_runs`),
what Airflow says of the task instance now:

* **a live lease**: kept (a try is running);
* **the task can still run** (``up_for_retry``, ``up_for_reschedule``, ``deferred``, or a try that died without a
  word while Airflow had retries left): kept, however old. Only Airflow saying the task instance is finished (or
  that its DAG run is gone) lifts this;
* **per-run state of a task that succeeded** (or was skipped): released ``release_after_success`` after it
  ended, when that is set; otherwise it ages out like any other state (``idle_for``);
* **failed for good**: kept at least ``keep_failed_for`` after the failure, so a task cleared in that time
  resumes; then it ages out by ``idle_for``;
* **named identities** (state that spans DAG runs) and state with no recorded outcome: ``idle_for``, as before.

Whole-identity deletions of per-run state need Airflow's confirmation wherever Airflow can be asked: a run it
says is not finished (a cleared task is queued, a retry is scheduled) is kept, and so is every identity whose
run it could not be asked about. Where nobody can ask Airflow (a laptop without the metadata database, a
maintenance task without an API connection) the head alone decides, as described.

This module only decides; :mod:`airflow_stateful.core.fleet.gc` acts, and ``ls``/``du`` show the same verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from airflow_stateful.core.durations import optional_duration, parse_duration
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import NAMED_SCOPE, Identity
from airflow_stateful.core.records.outcomes import CAN_RUN, FAILED, RUNNING, SKIPPED, SUCCESS, UP_FOR_RETRY
from airflow_stateful.core.settings import KEEP_FAILED_FOR, LEASE_GRACE, StatefulSettings
from airflow_stateful.core.timestamps import parse_iso, utcnow_iso

KEEP = "keep"
IDLE = "idle"
RELEASED = "released"

#: Airflow task instance states after which the scheduler runs the task again by itself (or is running it).
AIRFLOW_CAN_RUN = frozenset(
    {
        "none",
        "scheduled",
        "queued",
        "running",
        "restarting",
        "up_for_retry",
        "up_for_reschedule",
        "deferred",
        "awaiting_input",
    }
)
#: Airflow task instance states that end a task instance until a person clears it.
AIRFLOW_FINISHED = {
    "success": SUCCESS,
    "skipped": SKIPPED,
    "failed": FAILED,
    "upstream_failed": FAILED,
    "removed": SKIPPED,
}


@dataclass(frozen=True)
class Lifetimes:
    """The lifetime settings GC applies.

    :param idle_for: state not updated for this long goes (the fallback rule); ``None``: never by age.
    :param release_after_success: per-run state of a task that succeeded goes this long after it ended;
        ``None`` (the default, ``[stateful] release_after_success`` unset): it ages out by ``idle_for`` as before.
    :param keep_failed_for: per-run state of a task that failed for good is kept at least this long after the
        failure, whatever ``idle_for`` says, so a task cleared meanwhile resumes.
    """

    idle_for: timedelta | None = None
    release_after_success: timedelta | None = None
    keep_failed_for: timedelta | None = KEEP_FAILED_FOR

    @classmethod
    def configured(
        cls,
        settings: StatefulSettings,
        *,
        idle_for: timedelta | str | None = None,
        release_after_success: timedelta | str | None = None,
        keep_failed_for: timedelta | str | None = None,
    ) -> Lifetimes:
        """The lifetimes a GC pass applies: what its caller gave (the CLI's options, the operator's arguments),
        else the ``[stateful]`` settings. ``0``/``"never"`` switches ``release_after_success`` or
        ``keep_failed_for`` off; ``idle_for`` has no setting (``None``: no age limit)."""

        def pick(given: timedelta | str | None, configured: float | None, what: str) -> timedelta | None:
            if given is None:
                return timedelta(seconds=configured) if configured else None
            return optional_duration(given, what=what)

        return cls(
            idle_for=parse_duration(idle_for, what="idle_for") if idle_for is not None else None,
            release_after_success=pick(
                release_after_success, settings.release_after_success, "release_after_success"
            ),
            keep_failed_for=pick(keep_failed_for, settings.keep_failed_for, "keep_failed_for"),
        )


@dataclass(frozen=True)
class AirflowAnswer:
    """What Airflow said about the task instance an identity belongs to.

    :param state: the task instance's state (``"none"`` for no state yet), when it was found.
    :param ended_at: its ``end_date`` (seconds since the epoch), if Airflow has one.
    :param dag_known: Airflow knows the DAG (if not: another deployment's state, or a deleted DAG; the head decides).
    :param run_known: the DAG run exists (if the DAG is known and the run is not, the run was deleted).
    :param error: why Airflow could not be asked; then nothing is concluded.
    """

    state: str | None = None
    ended_at: float | None = None
    dag_known: bool = True
    run_known: bool = True
    error: str | None = None

    def describe(self) -> str:
        if self.error:
            return f"Airflow could not be asked ({self.error})"
        if not self.dag_known:
            return "Airflow does not know the DAG"
        if not self.run_known:
            return "Airflow has no such DAG run (deleted)"
        if self.state is None:
            return "Airflow has no such task instance in the run"
        return f"Airflow says the task instance is {self.state}"


class RunStates(Protocol):
    """Where GC learns a task instance's state from Airflow (:mod:`airflow_stateful.core.fleet.airflow_runs`: the REST
    API; ``airflow_stateful.cli.airflow_db``: the metadata database). Never raises: a failure is an answer with
    ``error`` set."""

    def ask(self, *, dag_id: str, run_id: str, task_id: str, map_index: int) -> AirflowAnswer: ...


@dataclass(frozen=True)
class Verdict:
    """The lifetime judgement on one identity.

    :param action: ``keep``, ``idle`` (delete: aged out) or ``released`` (delete: succeeded long enough ago).
    :param reason: one line for people (``gc --dry-run``, ``du``, ``ls --json``).
    :param ask: Airflow's word may change it, so ask where Airflow can be asked: before deleting per-run state
        (is the run really finished?), and on per-run state kept because the task can still run (did it finish
        since, marked failed by a person or failed early by a retry policy?).
    :param until: when a keep may end by itself (seconds since the epoch), if it can.
    """

    action: str
    reason: str
    ask: bool = False
    until: float | None = None

    @property
    def delete(self) -> bool:
        return self.action != KEEP


def _ago(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{rest // 60}m"
    return f"{rest // 60}m{rest % 60}s"


def _span(value: timedelta) -> str:
    return _ago(value.total_seconds())


def is_per_run(identity: Identity) -> bool:
    """Per-run state (``run=<run_id>``): its lifetime follows one task instance. Named state spans runs."""
    parts = identity.task_parts
    return parts is not None and parts["scope_kind"] != NAMED_SCOPE


def effective_outcome(head: HeadRecord, *, now: float, grace: float) -> tuple[str | None, float | None, str]:
    """``(state, since, why)``: the outcome as it stands now, from the head alone.

    A try that took the lease and died without recording its end (its lease is dead) has the outcome it
    predicted when it started (``if_killed``), as of its lease's expiry.
    """
    outcome = head.outcome
    lease = head.lease
    if outcome is None:
        return None, None, "no outcome recorded"
    if outcome.state == RUNNING:
        if lease is not None and not lease.dead(now, grace=grace):
            return RUNNING, parse_iso(outcome.at), outcome.describe()
        died = parse_iso(lease.expires_at) if lease is not None else parse_iso(head.updated_at or outcome.at)
        state = outcome.if_killed or UP_FOR_RETRY
        try_text = f"try {outcome.try_number}" if outcome.try_number is not None else "a try"
        if state == UP_FOR_RETRY:
            why = f"{try_text} died without recording an outcome (lease expired {utcnow_iso(died)}); Airflow retries it"
        else:
            why = f"{try_text} died without recording an outcome (lease expired {utcnow_iso(died)}) with no retry left"
        return state, died, why
    return outcome.state, parse_iso(outcome.at), outcome.describe()


def judge(
    head: HeadRecord,
    identity: Identity,
    *,
    now: float,
    lifetimes: Lifetimes,
    grace: float = LEASE_GRACE,
    airflow: AirflowAnswer | None = None,
) -> Verdict:
    """What GC does with ``identity`` as a whole (see the module docstring). Never looks at objects."""
    lease = head.lease
    if lease is not None and not lease.dead(now, grace=grace):
        return Verdict(KEEP, f"kept: a live lease is held by {lease.holder.describe()}")
    state, since, why = effective_outcome(head, now=now, grace=grace)
    per_run = is_per_run(identity)
    if airflow is not None and per_run:
        overridden = _with_airflow(airflow, state, since, why)
        if isinstance(overridden, Verdict):
            return overridden
        state, since, why = overridden
    said = f"; {why}" if airflow is not None and per_run else ""  # what Airflow said, where it was asked
    idle = _idle_rule(head, now=now, lifetimes=lifetimes)
    if state in CAN_RUN:
        ago = f" since {_ago(now - since)}" if since is not None else ""
        return Verdict(KEEP, f"kept: the task can still run: {why}{ago}", ask=per_run)
    if not per_run:
        return idle
    if state in (SUCCESS, SKIPPED):
        assert since is not None
        release = lifetimes.release_after_success
        if release is not None:
            if now - since > release.total_seconds():
                return Verdict(
                    RELEASED,
                    f"released: {state} {_ago(now - since)} ago, longer than release_after_success="
                    f"{_span(release)}{said}",
                    ask=True,
                )
            return Verdict(
                KEEP,
                f"kept: {state} {_ago(now - since)} ago; released after release_after_success={_span(release)}{said}",
                until=since + release.total_seconds(),
            )
        return _confirmed(idle, f"{state} {_ago(now - since)} ago{said}")
    if state == FAILED:
        assert since is not None
        keep = lifetimes.keep_failed_for
        if keep is not None and now - since <= keep.total_seconds():
            return Verdict(
                KEEP,
                f"kept: failed for good {_ago(now - since)} ago, kept keep_failed_for={_span(keep)} so a cleared "
                f"task resumes{said}",
                until=since + keep.total_seconds(),
            )
        return _confirmed(idle, f"failed for good {_ago(now - since)} ago{said}")
    return _confirmed(idle, why)


def _with_airflow(
    answer: AirflowAnswer, state: str | None, since: float | None, why: str
) -> Verdict | tuple[str | None, float | None, str]:
    """Airflow's word over the head's: a Verdict when it decides alone, else the outcome to judge by."""
    if answer.error is not None:
        return Verdict(KEEP, f"kept: cannot tell whether the run is finished: {answer.describe()}")
    if not answer.dag_known:
        # Another deployment's state, or a DAG deleted from Airflow: Airflow knows nothing either way, so the
        # head decides, exactly as where Airflow cannot be asked at all (a task that can still run stays kept).
        return state, since, f"{why}; {answer.describe()}"
    if not answer.run_known or answer.state is None:
        # The run (or the task in it) is gone: nothing can retry or clear it. Its age decides.
        return None, since, answer.describe()
    if answer.state in AIRFLOW_CAN_RUN:
        return Verdict(KEEP, f"kept: {answer.describe()}: it can still run (cleared, retried or running)")
    finished = AIRFLOW_FINISHED.get(answer.state)
    if finished is None:
        return Verdict(KEEP, f"kept: {answer.describe()}, a state this library does not know")
    ended = answer.ended_at if answer.ended_at is not None else since
    if state != finished or since is None:
        why = f"{answer.describe()} (the head said: {why})"
    return finished, ended, why


def _idle_rule(head: HeadRecord, *, now: float, lifetimes: Lifetimes) -> Verdict:
    idle_for = lifetimes.idle_for
    updated = parse_iso(head.updated_at) if head.updated_at else None
    if idle_for is None:
        return Verdict(KEEP, "kept: no idle_for given")
    if updated is None:
        return Verdict(KEEP, "kept: the head records no update time")
    if now - updated > idle_for.total_seconds():
        return Verdict(
            IDLE, f"idle: not updated for {_ago(now - updated)}, longer than idle_for={_span(idle_for)}"
        )
    return Verdict(
        KEEP,
        f"kept: updated {_ago(now - updated)} ago, within idle_for={_span(idle_for)}",
        until=updated + idle_for.total_seconds(),
    )


def _confirmed(verdict: Verdict, what: str) -> Verdict:
    """A per-run verdict by age, saying what the outcome was; a deletion needs Airflow's confirmation."""
    return Verdict(verdict.action, f"{verdict.reason} ({what})", ask=verdict.delete, until=verdict.until)


def lifetime_of(
    head: HeadRecord,
    identity: Identity,
    *,
    now: float,
    lives: Lifetimes,
    grace: float = LEASE_GRACE,
    airflow: RunStates | None = None,
) -> Verdict:
    """The lifetime verdict on ``identity``, confirmed with Airflow where it can be asked.

    Airflow is asked only where its word can change the verdict: before deleting per-run state, and about per-run
    state kept because the task can still run (Airflow may say the task instance finished since: marked failed,
    or a retry policy that failed it early). Every answer is an :class:`~airflow_stateful.core.fleet.lifetimes.AirflowAnswer`;
    one that says nothing certain keeps the state.
    """
    verdict = judge(head, identity, now=now, lifetimes=lives, grace=grace)
    parts = identity.task_parts
    if airflow is None or not verdict.ask or parts is None or not is_per_run(identity):
        return verdict
    answer = airflow.ask(
        dag_id=str(parts["dag_id"]),
        run_id=str(parts["scope"]),
        task_id=str(parts["task_id"]),
        map_index=int(parts["map_index"]),
    )
    return judge(head, identity, now=now, lifetimes=lives, grace=grace, airflow=answer)

"""State lives as long as Airflow needs it: lifetimes judged from recorded outcomes, and GC acting on them.

The judge (:mod:`airflow_stateful.core.fleet.lifetimes`) is a pure function of a head and, optionally, what Airflow
said; these tests build heads the way the protocol writes them (through a real CheckpointStore on a local store,
with writer clocks set in the past where age matters) and run real GC passes over them. Airflow's own answers
come from :class:`AirflowAnswer` values here; tests/test_e2e_lifetimes.py asks a real Airflow.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.fleet.gc import IDLE, RELEASED, apply_gc, plan_gc
from airflow_stateful.core.fleet.lifetimes import AirflowAnswer, Lifetimes, judge
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.outcomes import (
    FAILED,
    SUCCESS,
    UP_FOR_RESCHEDULE,
    UP_FOR_RETRY,
    TryOutcome,
    earliest_retry,
    starting,
)
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.local import LocalObjectStore

DAY = 86400.0
NOW = time.time()


def per_run(n: int = 0) -> Identity:
    return Identity.for_task(dag_id="etl", task_id=f"t{n}", run_id=f"manual__{n}")


def named(n: int = 0) -> Identity:
    return Identity.for_task(dag_id="etl", task_id=f"t{n}", name="watermark")


def write(
    store: LocalObjectStore,
    identity: Identity,
    *,
    days_ago: float,
    end: str | None,
    will_retry: bool = True,
    retry_in: float | None = None,
    killed: bool = False,
) -> CheckpointStore:
    """A try of ``identity`` ``days_ago`` days ago: takes the lease (recording ``running``), commits, and either
    ends with ``end`` (recorded with the release) or, ``killed``, just stops (its lease expires)."""
    at = NOW - days_ago * DAY
    cs = CheckpointStore(store=store, identity=identity, clock=lambda: at, lease_ttl=60)
    start = starting(
        now=at, try_number=1, max_tries=1, run_id="manual__0", will_retry=will_retry, retry_delay=300.0
    )
    lease = cs.acquire(holder=WriterInfo(try_number=1), outcome=start)
    cs.commit(lease, {"n": 1})
    if killed:
        return cs
    assert end is not None
    cs.release(lease, outcome=start.ended(state=end, now=at, retry_in=retry_in))
    return cs


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(root=tmp_path / "store")


def head_of(cs: CheckpointStore) -> HeadRecord:
    head = cs.head()
    assert head is not None
    return head


IDLE_5M = Lifetimes(idle_for=timedelta(minutes=5))


def test_the_head_records_the_outcome_with_the_lease_and_its_release(store: LocalObjectStore) -> None:
    cs = write(store, per_run(), days_ago=0, end=UP_FOR_RETRY, retry_in=600)
    head = head_of(cs)
    assert head.lease is None and head.outcome is not None
    assert (head.outcome.state, head.outcome.try_number, head.outcome.max_tries) == (UP_FOR_RETRY, 1, 1)
    assert head.outcome.retry_at is not None and head.outcome.retry_at > head.outcome.at
    killed = head_of(write(store, per_run(1), days_ago=0, end=None, killed=True))
    assert killed.lease is not None and killed.outcome is not None
    assert (killed.outcome.state, killed.outcome.if_killed) == ("running", UP_FOR_RETRY)


@pytest.mark.parametrize(
    ("end", "kwargs", "kept"),
    [
        (UP_FOR_RETRY, {"retry_in": 40 * DAY}, True),  # a long backoff: older than idle_for, still kept
        (UP_FOR_RESCHEDULE, {"retry_in": 3600}, True),
        ("deferred", {}, True),
        (FAILED, {}, True),  # failed for good: kept keep_failed_for (30 days by default) so a clear resumes
        (SUCCESS, {}, False),  # idle, finished: goes by idle_for as before
    ],
)
def test_idle_for_never_deletes_what_can_still_run_or_be_cleared(
    store: LocalObjectStore, end: str, kwargs: dict[str, float], kept: bool
) -> None:
    head = head_of(write(store, per_run(), days_ago=2, end=end, **kwargs))
    verdict = judge(head, per_run(), now=NOW, lifetimes=IDLE_5M)
    assert verdict.delete is not kept, verdict.reason
    assert verdict.reason.startswith("kept" if kept else "idle"), verdict.reason


def test_a_try_killed_without_a_word_is_judged_by_what_it_predicted(store: LocalObjectStore) -> None:
    retried = head_of(write(store, per_run(0), days_ago=2, end=None, killed=True, will_retry=True))
    verdict = judge(retried, per_run(0), now=NOW, lifetimes=IDLE_5M)
    assert not verdict.delete and "Airflow retries it" in verdict.reason
    last = head_of(write(store, per_run(1), days_ago=40, end=None, killed=True, will_retry=False))
    verdict = judge(last, per_run(1), now=NOW, lifetimes=IDLE_5M)
    assert verdict.delete and "failed for good" in verdict.reason, verdict.reason
    recent = head_of(write(store, per_run(2), days_ago=2, end=None, killed=True, will_retry=False))
    assert not judge(recent, per_run(2), now=NOW, lifetimes=IDLE_5M).delete, "kept keep_failed_for"


def test_success_is_released_after_release_after_success_and_failure_after_keep_failed_for(
    store: LocalObjectStore,
) -> None:
    lives = Lifetimes(release_after_success=timedelta(days=1), keep_failed_for=timedelta(days=10))
    ok_old = head_of(write(store, per_run(0), days_ago=2, end=SUCCESS))
    ok_new = head_of(write(store, per_run(1), days_ago=0.5, end=SUCCESS))
    assert judge(ok_old, per_run(0), now=NOW, lifetimes=lives).action == RELEASED
    verdict = judge(ok_new, per_run(1), now=NOW, lifetimes=lives)
    assert not verdict.delete and verdict.until is not None and verdict.until > NOW
    # Failed for good: no release without idle_for, and never within keep_failed_for even with it.
    bad = head_of(write(store, per_run(2), days_ago=5, end=FAILED))
    assert not judge(bad, per_run(2), now=NOW, lifetimes=lives).delete
    with_idle = Lifetimes(idle_for=timedelta(days=1), keep_failed_for=timedelta(days=10))
    assert not judge(bad, per_run(2), now=NOW, lifetimes=with_idle).delete
    assert judge(bad, per_run(2), now=NOW + 6 * DAY, lifetimes=with_idle).action == IDLE


def test_named_identities_age_out_by_idle_time_and_are_never_released_by_success(
    store: LocalObjectStore,
) -> None:
    lives = Lifetimes(idle_for=timedelta(days=30), release_after_success=timedelta(seconds=1))
    fresh = head_of(write(store, named(0), days_ago=2, end=SUCCESS))
    assert not judge(fresh, named(0), now=NOW, lifetimes=lives).delete
    old = head_of(write(store, named(1), days_ago=31, end=FAILED))
    assert judge(old, named(1), now=NOW, lifetimes=lives).action == IDLE, "no keep_failed_for for named state"
    waiting = head_of(write(store, named(2), days_ago=31, end=UP_FOR_RETRY, retry_in=60))
    assert not judge(waiting, named(2), now=NOW, lifetimes=lives).delete, "a pending retry is kept, named too"


def test_airflow_has_the_last_word_on_per_run_state(store: LocalObjectStore) -> None:
    lives = Lifetimes(idle_for=timedelta(minutes=5), release_after_success=timedelta(days=1))
    failed_long_ago = head_of(write(store, per_run(0), days_ago=40, end=FAILED))
    cleared = AirflowAnswer(state="queued")
    verdict = judge(failed_long_ago, per_run(0), now=NOW, lifetimes=lives, airflow=cleared)
    assert not verdict.delete and "queued" in verdict.reason, "a cleared task's state is never deleted"
    unreachable = AirflowAnswer(error="http://127.0.0.1:1: URLError")
    verdict = judge(failed_long_ago, per_run(0), now=NOW, lifetimes=lives, airflow=unreachable)
    assert not verdict.delete and "cannot tell" in verdict.reason
    # A retry the head still waits for, which Airflow says ended (marked failed, or a retry policy failed it).
    waiting = head_of(write(store, per_run(1), days_ago=40, end=UP_FOR_RETRY, retry_in=60))
    assert not judge(waiting, per_run(1), now=NOW, lifetimes=lives).delete
    marked = AirflowAnswer(state="failed", ended_at=NOW - 35 * DAY)
    verdict = judge(waiting, per_run(1), now=NOW, lifetimes=lives, airflow=marked)
    assert verdict.action == IDLE and "Airflow says the task instance is failed" in verdict.reason
    # A succeeded run Airflow knows nothing of (another deployment): the head decides, as if not asked.
    done = head_of(write(store, per_run(2), days_ago=2, end=SUCCESS))
    stranger = AirflowAnswer(dag_known=False, run_known=False)
    assert judge(done, per_run(2), now=NOW, lifetimes=lives, airflow=stranger).action == RELEASED
    assert not judge(waiting, per_run(1), now=NOW, lifetimes=lives, airflow=stranger).delete
    # A deleted run can never be retried: its age decides even where the head said a retry was pending.
    gone = AirflowAnswer(run_known=False)
    assert judge(waiting, per_run(1), now=NOW, lifetimes=lives, airflow=gone).action == IDLE


class RecordingRunStates:
    """Airflow as a table of answers; records every question (to show GC asks only where it matters)."""

    def __init__(self, answers: dict[str, AirflowAnswer]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def ask(self, *, dag_id: str, run_id: str, task_id: str, map_index: int) -> AirflowAnswer:
        self.asked.append(task_id)
        return self.answers.get(task_id, AirflowAnswer(error="not in the table"))


def test_gc_deletes_only_finished_runs_and_says_why_for_every_identity(store: LocalObjectStore) -> None:
    retry = write(store, per_run(0), days_ago=3, end=UP_FOR_RETRY, retry_in=10 * DAY)
    failed = write(store, per_run(1), days_ago=3, end=FAILED)
    done = write(store, per_run(2), days_ago=3, end=SUCCESS)
    cleared = write(store, per_run(3), days_ago=3, end=SUCCESS)
    fresh = write(store, per_run(4), days_ago=0, end=SUCCESS)
    airflow = RecordingRunStates(
        {
            "t0": AirflowAnswer(state="up_for_retry"),
            "t2": AirflowAnswer(state="success"),
            "t3": AirflowAnswer(state="scheduled"),  # cleared since it succeeded
        }
    )
    plan = plan_gc(
        store, idle_for=timedelta(days=1), min_age=timedelta(0), airflow=airflow, expired_state=False
    )
    why = {p.identity: p.why for p in plan.everything}
    assert set(why) == {cs.identity.key for cs in (retry, failed, done, cleared, fresh)}, (
        "every identity, kept or not"
    )
    assert [p.identity for p in plan.identities] == [done.identity.key]
    assert why[done.identity.key].startswith("idle:") and "success" in why[done.identity.key]
    assert "can still run" in why[retry.identity.key]
    assert "keep_failed_for" in why[failed.identity.key]
    assert "scheduled" in why[cleared.identity.key]
    assert why[fresh.identity.key].startswith("kept: updated")
    # Asked where its word can change the verdict: the pending retry and the two deletions by age; not the
    # failure inside keep_failed_for nor the fresh one.
    assert sorted(airflow.asked) == ["t0", "t2", "t3"]
    result = apply_gc(plan)
    assert done.head() is None and all(cs.head() is not None for cs in (retry, failed, cleared, fresh))
    assert not result.skipped


def test_gc_skips_an_identity_whose_task_started_again_after_the_plan(store: LocalObjectStore) -> None:
    done = write(store, per_run(0), days_ago=3, end=SUCCESS)
    plan = plan_gc(store, idle_for=timedelta(days=1), min_age=timedelta(0), expired_state=False)
    assert [p.identity for p in plan.identities] == [done.identity.key]
    # The task is cleared and its new try runs and fails before the plan is applied: same checkpoints, new outcome.
    cs = CheckpointStore(store=store, identity=done.identity)
    start = starting(now=time.time(), try_number=2, max_tries=2, run_id="r", will_retry=True, retry_delay=1)
    lease = cs.acquire(holder=WriterInfo(try_number=2), outcome=start)
    cs.release(lease, outcome=start.ended(state=UP_FOR_RETRY, now=time.time(), retry_in=60))
    result = apply_gc(plan)
    assert done.identity.key in result.skipped and cs.head() is not None


def test_an_outcome_from_storage_is_typed_and_bounded() -> None:
    from airflow_stateful.core.errors import CheckpointCorruptError

    good = TryOutcome(state=SUCCESS, at="2026-12-01T00:00:00.000000+00:00", try_number=2).to_json()
    assert TryOutcome.from_json(good).state == SUCCESS
    for bad in ({**good, "state": "exploded"}, {**good, "try_number": True}, {**good, "reason": "x" * 5000}):
        with pytest.raises(CheckpointCorruptError):
            TryOutcome.from_json(bad)


@pytest.mark.parametrize(
    ("try_number", "delay", "backoff", "cap", "expected"),
    [
        (1, 300, 0, None, 300),
        (3, 300, 0, None, 300),
        (1, 60, 2, None, 60),
        (3, 60, 2, None, 240),  # ceil(60 * 2 ** 2)
        (3, 60, True, None, 240),  # Airflow 3.1/3.2: a bool, True meaning 2
        (3, 60, 5, None, 1500),
        (10, 60, 2, timedelta(hours=1).total_seconds(), 3600),
        (60, 60, 2, None, 86400),  # Airflow's own one-day cap
        (2, 0, 2, None, 1),  # never below 1 s with backoff
    ],
)
def test_the_earliest_retry_is_airflows_lower_bound(
    try_number: int, delay: float, backoff: float | bool, cap: float | None, expected: float
) -> None:
    assert earliest_retry(
        try_number=try_number, retry_delay=delay, exponential_backoff=backoff, max_retry_delay=cap
    ) == pytest.approx(expected)


def test_the_earliest_retry_never_exceeds_what_airflow_computes(airflow_home: Path) -> None:
    """Airflow's own ``TaskInstance.next_retry_datetime`` (the scheduler's rule) for the same settings: our bound
    is at most it, and at least half of it (the hash part adds up to the base again)."""
    from datetime import datetime, timezone

    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk import BaseOperator

    for n, (delay, backoff, cap) in enumerate([(60, 0, None), (60, 2.0, None), (30, 3.0, 600)]):
        task = BaseOperator(
            task_id=f"t{n}",
            retry_delay=timedelta(seconds=delay),
            retry_exponential_backoff=backoff,
            max_retry_delay=timedelta(seconds=cap) if cap else None,
        )
        for try_number in (1, 2, 4):
            ended = datetime(2026, 12, 1, tzinfo=timezone.utc)
            # The scheduler's method, called on the fields it reads (no database row is needed for it).
            ti = SimpleNamespace(
                task=task,
                dag_id="d",
                task_id=task.task_id,
                logical_date=ended,
                try_number=try_number,
                end_date=ended,
                retry_delay_override=None,
                log=logging.getLogger("test"),
            )
            airflow_delay = (TaskInstance.next_retry_datetime(ti) - ended).total_seconds()
            ours = earliest_retry(
                try_number=try_number, retry_delay=delay, exponential_backoff=backoff, max_retry_delay=cap
            )
            assert ours <= airflow_delay <= 2 * ours + 1, (
                delay,
                backoff,
                cap,
                try_number,
                ours,
                airflow_delay,
            )


def test_du_shows_each_identitys_lifetime_and_when_a_keep_ends(
    store: LocalObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """``du`` judges from the heads alone, with the same options as ``gc``."""
    import json

    from airflow_stateful.cli.main import main

    ok = write(store, per_run(0), days_ago=0.5, end=SUCCESS)
    waiting = write(store, per_run(1), days_ago=40, end=UP_FOR_RETRY, retry_in=60)
    code = main(
        ["du", "--json", "--backend", store.url, "--release-after-success", "1d", "--idle-for", "30d"]
    )
    rows = {r["identity"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0
    row = rows[ok.identity.key]
    assert row["outcome"] == SUCCESS and "released after release_after_success=1d0h" in row["lifetime"]
    assert (
        row["lifetime_until"] is not None and row["lifetime_until"] > datetime.now(timezone.utc).isoformat()
    )
    assert rows[waiting.identity.key]["lifetime"].startswith("kept: the task can still run")
    assert rows[waiting.identity.key]["lifetime_until"] is None, (
        "a pending retry's keep has no end of its own"
    )

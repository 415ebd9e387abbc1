"""Background saves (``state.save(..., wait=False)``) on real stores, in real processes, and under real Airflow.

What is checked: the snapshot is the bytes and the value of the moment of the call; saves commit one at a
time and in order; a failed background save changes nothing and is raised at the next save or at the end
of the task (whose retry resumes from the last good checkpoint); a stop (SIGTERM) waits for the save in
flight; a writer SIGKILLed mid-upload leaves the last good checkpoint, restorable byte for byte, and the
staging copy it left behind is removed by the next save on the machine. Every store test runs on the local
directory and on S3 over HTTP (moto's server by default). Nothing here asserts a duration: how long the task
is blocked is measured by ``benchmarks/bench_async_save.py``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import test_lease_renewal
import test_stateful_tasks
from maintenance import OutageStore, keys, tree
from test_stateful_tasks import checkpoints, run_dag, task_instance, write_dag

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
from airflow_stateful.core.data.snapshot import STAGING_DIRNAME, snapshot_files, staging_roots, sweep_staging
from airflow_stateful.core.errors import FencedError, InvalidValueError, StopRequested, StoreError
from airflow_stateful.core.records.cursors import cursor_position
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.task_state import PendingSave, TaskState

REPO = Path(__file__).resolve().parent.parent
IDENTITY = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__async")
MIB = 1024 * 1024

# Fixtures shared with other suites (pytest finds them by name in this module): ``backend`` is each store (local
# directory, S3) plus how a subprocess opens it; ``restore_sigterm`` puts back the SIGTERM handler Airflow replaces.
backend = test_lease_renewal.backend
restore_sigterm = test_stateful_tasks.restore_sigterm


def open_state(store: ObjectStore, *, try_number: int = 1) -> tuple[TaskState, WriterSession]:
    """A try's state on an open writer session (lease taken, renewed in the background)."""
    checkpoints = CheckpointStore(store=store, identity=IDENTITY, keep_last=5)
    session = WriterSession(checkpoints=checkpoints, writer=WriterInfo(try_number=try_number)).open()
    return TaskState(session=session), session


def close(state: TaskState, session: WriterSession) -> None:
    """What StatefulOperator does at the end of a try: wait for the save in flight, then end the session."""
    try:
        state.wait_for_save()
    finally:
        session.close()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def digests(root: Path) -> dict[str, str]:
    """``{relative path: SHA-256}`` of every file below ``root`` (hashes, so large trees stay out of memory)."""
    return {
        path.relative_to(root).as_posix(): file_digest(path)
        for path in sorted(p for p in root.rglob("*") if p.is_file())
    }


def random_file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            f.write(os.urandom(MIB))
    return path


# -- the snapshot is taken at the call ---------------------------------------------------------------------------
def test_what_is_committed_is_the_value_and_the_bytes_at_the_call(
    backend: dict[str, Any], tmp_path: Path, library_log: list[str]
) -> None:
    """The task rewrites, deletes and adds files and mutates the value right after save returns."""
    store: ObjectStore = backend["store"]
    work = tmp_path / "work"
    random_file(work / "weights.bin", 32 * MIB)
    tree(work, {"step.txt": b"step 1", "sub/notes.txt": b"notes of step 1"})
    expected = digests(work)
    value = {"epoch": 1, "losses": [0.5]}
    state, session = open_state(store)
    try:
        pending = state.save(value, files=work, wait=False)
        # The very next instructions of the task: everything changes while the upload runs.
        value["epoch"] = 2
        value["losses"].append(0.25)
        (work / "weights.bin").write_bytes(b"epoch 2 weights")
        (work / "step.txt").unlink()
        (work / "new.txt").write_bytes(b"not in checkpoint 1")
        assert isinstance(pending, PendingSave)
        info = pending.wait()
    finally:
        close(state, session)
    assert info.seq == 1
    latest = CheckpointStore(store=store, identity=IDENTITY).latest()
    assert latest is not None and latest.seq == 1
    assert latest.value == {"epoch": 1, "losses": [0.5]}, "the value as it was at the call"
    restored = tmp_path / "restored"
    CheckpointStore(store=store, identity=IDENTITY).restore_files(latest, restored)
    assert digests(restored) == expected, "the bytes as they were at the call"
    assert state.value == {"epoch": 1, "losses": [0.5]} and state.value is not value
    assert not (tmp_path / STAGING_DIRNAME).exists(), "the staging copy is removed after the commit"
    # The task log shows the background save: the snapshot, the upload (from the save's thread), the commit.
    assert any(m.startswith("background save: 3 file(s), 32.0 MiB snapshotted in ") for m in library_log)
    assert any(m.startswith("background save committed checkpoint 1 in ") for m in library_log)


def test_a_single_file_is_snapshotted_under_its_own_name(backend: dict[str, Any], tmp_path: Path) -> None:
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights at the call")
    state, session = open_state(backend["store"])
    try:
        pending = state.save({"n": 1}, files=model, wait=False)
        model.write_bytes(b"weights written after the call")
        pending.wait()
        restored = tmp_path / "restored"
        assert list(state.restore_files(restored)) == [restored / "model.pt"]
    finally:
        close(state, session)
    assert (restored / "model.pt").read_bytes() == b"weights at the call"


def test_bad_input_fails_at_the_call_with_nothing_in_flight(tmp_path: Path) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        state, session = open_state(store)
        work = tree(tmp_path / "work", {"a": b"a"})
        (work / "link").symlink_to(work / "a")
        try:
            with pytest.raises(InvalidValueError, match="not JSON-serializable"):
                state.save({"bad": object()}, wait=False)
            with pytest.raises(InvalidValueError, match="does not exist"):
                state.save({"n": 1}, files=tmp_path / "missing", wait=False)
            with pytest.raises(InvalidValueError, match="is a symbolic link"):
                state.save({"n": 1}, files=work, wait=False)
            with pytest.raises(InvalidValueError, match="inside the saved directory"):
                TaskState(session=session, staging_dir=work / "staging").save(
                    {"n": 1}, files=work, follow_symlinks=True, wait=False
                )
            assert state.pending_save is None
            assert not (tmp_path / STAGING_DIRNAME).exists()
        finally:
            close(state, session)
        assert CheckpointStore(store=store, identity=IDENTITY).history() == []


def test_a_staging_name_that_is_not_a_directory_of_ours_is_never_written_through(tmp_path: Path) -> None:
    """A link planted where the staging directory goes: the copy goes to the private fallback instead."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tree(tmp_path / "work", {"a": b"secret weights"})
    (tmp_path / STAGING_DIRNAME).symlink_to(elsewhere)
    snapshot = snapshot_files(work)
    try:
        assert snapshot.entry.parent == staging_roots(work)[1]
        assert (snapshot.path / "a").read_bytes() == b"secret weights"
        assert list(elsewhere.iterdir()) == []
    finally:
        snapshot.discard()
    with pytest.raises(InvalidValueError, match="no usable staging directory"):
        snapshot_files(work, staging_root=tmp_path / STAGING_DIRNAME)


# -- one at a time, in order ----------------------------------------------------------------------------------
def test_background_saves_commit_one_at_a_time_in_order(backend: dict[str, Any], tmp_path: Path) -> None:
    store: ObjectStore = backend["store"]
    one, two = tmp_path / "one", tmp_path / "two"
    random_file(one / "weights.bin", 32 * MIB)
    random_file(two / "weights.bin", 4 * MIB)
    state, session = open_state(store)
    try:
        first = state.save({"epoch": 1}, files=one, wait=False)
        second = state.save({"epoch": 2}, files=two, wait=False)  # waits for the first, then snapshots
        assert first.done(), "the second save waited for the first"
        third = state.save({"epoch": 3}, wait=False)  # no files: keeps the second's, which must have landed
        fourth = state.save({"epoch": 4})
        assert [p.wait().seq for p in (first, second, third)] == [1, 2, 3]
        assert fourth.seq == 4
    finally:
        close(state, session)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    assert [e.seq for e in cs.history()] == [4, 3, 2, 1]
    assert [cs.get(seq).value for seq in (1, 2, 3, 4)] == [{"epoch": n} for n in (1, 2, 3, 4)]
    for seq, files in ((1, one), (2, two), (3, two), (4, two)):
        restored = tmp_path / f"restored-{seq}"
        cs.restore_files(cs.get(seq), restored)
        assert digests(restored) == digests(files), f"checkpoint {seq}"


def test_what_the_task_sees_changes_only_when_it_waits(tmp_path: Path) -> None:
    """value/checkpoint move at the task's own calls; an assignment made after the call is newer and stays."""
    with LocalObjectStore(root=tmp_path / "state") as store:
        state, session = open_state(store)
        try:
            state.save({"n": 1})
            pending = state.save({"n": 2}, wait=False)
            while not pending.done():
                time.sleep(0.01)
            assert state.value == {"n": 1} and state.checkpoint.seq == 1  # type: ignore[union-attr]
            assert state.pending_save is pending
            assert state.wait_for_save().seq == 2  # type: ignore[union-attr]
            assert state.value == {"n": 2} and state.checkpoint.seq == 2  # type: ignore[union-attr]
            assert state.pending_save is None and state.wait_for_save() is None

            pending = state.save({"n": 3}, wait=False)
            state.value = {"n": "set by the task after the call"}
            pending.wait()
            assert state.checkpoint.seq == 3  # type: ignore[union-attr]
            assert state.value == {"n": "set by the task after the call"}
        finally:
            close(state, session)


def test_a_resume_commit_waits_for_the_background_save_and_carries_its_value(tmp_path: Path) -> None:
    """resume() commits state.value: after a background save that is the saved value, once waited for."""
    with LocalObjectStore(root=tmp_path / "state") as store:
        state, session = open_state(store)
        try:
            state.save({"watermark": "2026-01-01"}, files=tree(tmp_path / "w", {"a": b"a"}), wait=False)
            assert list(state.resume(range(3), every=2)) == [0, 1, 2]
        finally:
            close(state, session)
        cs = CheckpointStore(store=store, identity=IDENTITY)
        assert [cs.get(seq).value for seq in (1, 2, 3)] == [{"watermark": "2026-01-01"}] * 3
        assert [cursor_position(cs.get(seq), "items") for seq in (1, 2, 3)] == [None, 2, 3]


def test_a_pickled_value_is_copied_at_the_call(tmp_path: Path) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        session = WriterSession(
            checkpoints=cs, writer=WriterInfo(try_number=1), value_codec="pickle", heartbeat=False
        ).open()
        state = TaskState(session=session)
        value = {"seen": {1, 2}}
        pending = state.save(value, wait=False)
        value["seen"].add(3)
        pending.wait()
        session.close()
        reader = WriterSession(checkpoints=cs, writer=WriterInfo(try_number=2), value_codec="pickle").open()
        assert reader.value == {"seen": {1, 2}}
        reader.close()


# -- errors ------------------------------------------------------------------------------------------------------
def test_a_failed_background_save_is_raised_once_at_the_next_save_and_changes_nothing(tmp_path: Path) -> None:
    """A store outage during the background commit: the next save raises the store's error and does nothing
    else; value and checkpoint stay the last committed ones; the save after that works."""
    with LocalObjectStore(root=tmp_path / "state") as inner:
        store = OutageStore(inner)
        state, session = open_state(store)
        try:
            state.save({"n": 1})
            store.down.set()
            pending = state.save({"n": 2}, files=tree(tmp_path / "w", {"a": b"a"}), wait=False)
            while not pending.done():
                time.sleep(0.01)
            store.down.clear()
            with pytest.raises(StoreError, match="unreachable"):
                state.save({"n": 3})
            assert state.value == {"n": 1} and state.checkpoint.seq == 1  # type: ignore[union-attr]
            assert [e.seq for e in state.history()] == [1], (
                "neither the failed save nor the next one committed"
            )
            assert state.save({"n": 3}).seq == 2, "the error was raised once; the next save works"
            with pytest.raises(StoreError):
                pending.wait()  # the handle still tells its own outcome
        finally:
            close(state, session)
        assert not (tmp_path / STAGING_DIRNAME).exists(), "a failed save removes its staging copy too"


def test_a_fenced_background_save_raises_fenced_error_at_the_next_save(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    """A newer try takes the lease; the background commit fails (before uploading) and the next save says so."""
    store: ObjectStore = backend["store"]
    state, session = open_state(store)
    try:
        state.save({"n": 1})
        CheckpointStore(store=store, identity=IDENTITY).acquire(steal=True)  # the retry starts
        work = tmp_path / "work"
        random_file(work / "weights.bin", 8 * MIB)
        pending = state.save({"n": 2}, files=work, wait=False)
        with pytest.raises(FencedError):
            state.save({"n": 3})
        assert pending.done() and state.lease_lost
        assert state.value == {"n": 1} and state.checkpoint.seq == 1  # type: ignore[union-attr]
        with pytest.raises(FencedError):  # and so is every later save of this zombie, at once
            state.save({"n": 4}, wait=False)
    finally:
        session.close()
    cs = CheckpointStore(store=store, identity=IDENTITY)
    assert [e.seq for e in cs.history()] == [1]
    assert cs.latest().value == {"n": 1}  # type: ignore[union-attr]


# -- a writer SIGKILLed mid-upload -------------------------------------------------------------------------------
KILLED_SAVER = textwrap.dedent(
    """
    import os, sys, time
    from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
    from airflow_stateful.core.stores.registry import store_from_url
    from airflow_stateful.task_state import TaskState

    url, key, good, big = sys.argv[1:5]
    endpoint = os.environ.get("STATEFUL_S3_ENDPOINT_URL")
    store = store_from_url(url, **({"endpoint_url": endpoint} if url.startswith("s3://") else {}))
    cs = CheckpointStore(store=store, identity=Identity.parse(key))
    with WriterSession(checkpoints=cs, writer=WriterInfo.current(try_number=1)) as session:
        state = TaskState(session=session)
        state.save({"step": 1}, files=good)
        print("committed", flush=True)
        sys.stdin.readline()  # the test counts the objects now
        pending = state.save({"step": 2}, files=big, wait=False)
        print(pending.snapshot.entry, flush=True)
        while True:  # computing while the upload runs: only SIGKILL ends this
            time.sleep(0.05)
    """
)


def test_a_writer_sigkilled_mid_upload_leaves_the_last_good_checkpoint(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    store: ObjectStore = backend["store"]
    good = tree(tmp_path / "good", {"weights.bin": os.urandom(MIB), "meta/step": b"1"})
    big = tmp_path / "big"
    for n in range(8):  # several files, so part of the upload is visible long before its end
        random_file(big / f"shard-{n}.bin", 24 * MIB)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STATEFUL_", "AWS_"))}
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVER, backend["url"], IDENTITY.key, str(good), str(big)],
        env={**clean, **backend["env"], "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        line = writer.stdout.readline()
        assert line.strip() == "committed", writer.stderr.read() if writer.stderr else line
        before = keys(store)
        writer.stdin.write("go\n")
        writer.stdin.flush()
        entry = Path(writer.stdout.readline().strip())
        deadline = time.monotonic() + 60
        while not keys(store) - before:  # the background upload has started writing objects
            assert time.monotonic() < deadline and writer.poll() is None, "the upload never started"
            time.sleep(0.01)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    uploaded = keys(store) - before
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    assert latest.seq == 1, "the save completed before the kill: make the test's data larger"
    assert latest.value == {"step": 1} and uploaded, "killed mid-upload, with part of the data written"
    assert entry.is_dir() and entry.parent == tmp_path / STAGING_DIRNAME, "the killed writer's staging copy"

    # The retry, on the same machine: it resumes from the last good checkpoint, byte for byte...
    state, session = open_state(store, try_number=2)
    try:
        assert state.value == {"step": 1} and state.checkpoint.seq == 1  # type: ignore[union-attr]
        restored = tmp_path / "restored"
        state.restore_files(restored)
        assert digests(restored) == digests(good)
        # ...and its own background save of the same directory removes what the killed one left behind.
        pending = state.save({"step": 2}, files=big, wait=False)
        assert not entry.exists(), "the dead writer's staging copy is swept by the next snapshot"
        assert pending.wait().seq == 2
    finally:
        close(state, session)
    assert not (tmp_path / STAGING_DIRNAME).exists()
    again = tmp_path / "restored-2"
    cs.restore_files(cs.get(2), again)
    assert digests(again) == digests(big)


LIVE_STAGER = textwrap.dedent(
    """
    import os, sys, time
    from airflow_stateful.core.data.snapshot import snapshot_files

    snapshot = snapshot_files(sys.argv[1], staging_root=sys.argv[2])
    print(snapshot.entry, flush=True)
    if sys.argv[3] == "die":
        os._exit(0)  # no cleanup: as if killed
    while True:
        time.sleep(0.05)
    """
)


def test_sweeping_removes_only_staging_left_by_dead_processes(tmp_path: Path) -> None:
    """The lock is the proof of life: a live save's copy stays, a dead one's goes, foreign names stay."""
    source = tree(tmp_path / "src", {"a": b"data"})
    root = tmp_path / "staging"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def stage(mode: str) -> tuple[subprocess.Popen[str], Path]:
        process = subprocess.Popen(
            [sys.executable, "-c", LIVE_STAGER, str(source), str(root), mode],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        return process, Path(process.stdout.readline().strip())

    live, live_entry = stage("live")
    try:
        dead, dead_entry = stage("die")
        dead.wait(timeout=30)
        foreign = tree(root / "not-ours", {"keep": b"keep"})
        assert (dead_entry / "data" / "a").read_bytes() == b"data"
        assert sweep_staging(root) == [dead_entry]
        assert live_entry.is_dir() and foreign.is_dir() and not dead_entry.exists()
        # In this process too: a snapshot of ours is live until discarded.
        mine = snapshot_files(source, staging_root=root)
        assert sweep_staging(root) == [] and mine.entry.is_dir()
        mine.discard()
        assert not mine.entry.exists()
    finally:
        live.kill()
        live.wait(timeout=30)
    assert sweep_staging(root) == [live_entry]
    assert sorted(p.name for p in root.iterdir()) == ["not-ours"]


# -- under Airflow ------------------------------------------------------------------------------------------------
FAILS_IN_BACKGROUND = """\
import os

from airflow_stateful.core import CheckpointStore, Identity, store_from_url


def steal_the_lease():
    # What a newer try does: from now on this try is a zombie, and its commits are refused.
    ti = current_ti()
    identity = Identity.for_task(dag_id=ti.dag_id, task_id=ti.task_id, run_id=ti.run_id)
    store = store_from_url(os.environ["AIRFLOW__STATEFUL__BACKEND_URL"])
    CheckpointStore(store=store, identity=identity).acquire(steal=True)


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0))
    def train(state: TaskState):
        ti = current_ti()
        work = Path(__WORK__)
        work.mkdir(parents=True, exist_ok=True)
        if ti.try_number == 1:
            (work / "weights.bin").write_bytes(b"epoch 1 weights")
            state.save({"epoch": 1}, files=work)
            record(1, 1)
            steal_the_lease()
            (work / "weights.bin").write_bytes(b"epoch 2 weights the store never sees")
            state.save({"epoch": 2}, files=work, wait=False)
            record(1, 2)
            return "try 1 returned"  # the end of the task waits for the save, which failed
        record(ti.try_number, state.value["epoch"])
        state.restore_files(Path(__RESTORED__))
        (work / "weights.bin").write_bytes(os.urandom(__SIZE__))
        state.save({"epoch": state.value["epoch"] + 1}, files=work, wait=False)
        return "try 2 returned"  # the end of the task waits for the save, which lands

    train()


dag_object = the_dag()
"""


@pytest.mark.airflow
def test_a_task_whose_last_background_save_fails_ends_failed_and_its_retry_resumes(
    dags_folder: Path, tmp_path: Path, library_log: list[str]
) -> None:
    work, restored = tmp_path / "work", tmp_path / "restored"
    body = (
        FAILS_IN_BACKGROUND.replace("__WORK__", repr(str(work)))
        .replace("__RESTORED__", repr(str(restored)))
        .replace("__SIZE__", str(8 * MIB))
    )
    dag_file = write_dag(dags_folder, tmp_path, body)
    _, run = run_dag(dag_file)
    assert dag_file.rows() == [[1, 1], [1, 2], [2, 1]], "try 1 returned, failed anyway; try 2 resumed at 1"
    ti = task_instance(run, "train")
    assert run.state == "success" and ti.try_number == 2
    assert (restored / "weights.bin").read_bytes() == b"epoch 1 weights", "the last good checkpoint's files"
    assert any(m.startswith("background save failed after ") for m in library_log)
    cs = checkpoints(dag_file.dag_id, "train", run_id=run.run_id)
    latest = cs.latest()
    assert latest is not None and latest.value == {"epoch": 2} and latest.writer.try_number == 2
    assert [e.seq for e in cs.history()][:2] == [2, 1], "try 1's background save never became a checkpoint"
    final = tmp_path / "final"
    cs.restore_files(latest, final)
    assert digests(final) == digests(work), "try 2's background save landed before the task ended"


RAISES_WHILE_SAVING = """\
import os


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0))
    def train(state: TaskState):
        ti = current_ti()
        work = Path(__WORK__)
        work.mkdir(parents=True, exist_ok=True)
        if ti.try_number == 1:
            (work / "weights.bin").write_bytes(os.urandom(__SIZE__))
            pending = state.save({"epoch": 1}, files=work, wait=False)
            record(1, 1, int(pending.done()))
            raise RuntimeError("the next epoch crashed while the save was uploading")
        record(ti.try_number, state.value["epoch"], 0)
        return state.value

    train()


dag_object = the_dag()
"""


@pytest.mark.airflow
def test_a_task_that_raises_while_a_save_uploads_lets_it_land_and_the_retry_resumes_from_it(
    dags_folder: Path, tmp_path: Path
) -> None:
    """The try fails with its own error, but only after the save in flight landed (before the lease went)."""
    body = RAISES_WHILE_SAVING.replace("__WORK__", repr(str(tmp_path / "work"))).replace(
        "__SIZE__", str(32 * MIB)
    )
    dag_file = write_dag(dags_folder, tmp_path, body)
    _, run = run_dag(dag_file)
    assert dag_file.rows() == [[1, 1, 0], [2, 1, 0]], "raised mid-upload; the retry resumed at epoch 1"
    assert run.state == "success" and task_instance(run, "train").try_number == 2
    latest = checkpoints(dag_file.dag_id, "train", run_id=run.run_id).latest()
    assert latest is not None and latest.seq == 1 and latest.writer.try_number == 1


STOPPED_WHILE_SAVING = """\
import os
import signal
import shutil


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=0, reschedule_delay=timedelta(seconds=1))
    def train(state: TaskState):
        context = get_current_context()
        ti, execution = context["ti"], context["task_reschedule_count"]
        work = Path(__WORK__)
        work.mkdir(parents=True, exist_ok=True)
        if execution == 0:
            (work / "weights.bin").write_bytes(os.urandom(__SIZE__))
            shutil.copy(work / "weights.bin", Path(__EXPECTED__))
            pending = state.save({"epoch": 1}, files=work, wait=False)
            os.kill(os.getpid(), signal.SIGTERM)  # the worker shuts down while the upload runs
            record(ti.try_number, execution, 1, int(pending.done()), int(state.stop_requested))
            (work / "weights.bin").write_bytes(b"never saved")
            # No files: keeps those of the save in flight, which this waits for; then it commits and stops.
            state.save({"epoch": 2}, wait=False)
            record(ti.try_number, execution, 99, 0, 0)
        record(ti.try_number, execution, state.value["epoch"], 0, 0)
        state.restore_files(Path(__RESTORED__))
        return state.value

    train()


dag_object = the_dag()
"""


@pytest.mark.airflow
def test_sigterm_waits_for_the_background_save_then_stops(
    dags_folder: Path, tmp_path: Path, restore_sigterm: None
) -> None:
    work, restored, expected = tmp_path / "work", tmp_path / "restored", tmp_path / "expected.bin"
    body = (
        STOPPED_WHILE_SAVING.replace("__WORK__", repr(str(work)))
        .replace("__RESTORED__", repr(str(restored)))
        .replace("__EXPECTED__", repr(str(expected)))
        .replace("__SIZE__", str(64 * MIB))
    )
    dag_file = write_dag(dags_folder, tmp_path, body)
    _, run = run_dag(dag_file)
    rows = dag_file.rows()
    assert rows[0] == [1, 0, 1, 0, 1], "the stop arrived while the background save was still running"
    assert rows[1:] == [[1, 1, 2, 0, 0]], "the stop ended execution 0; execution 1 resumed at epoch 2"
    ti = task_instance(run, "train")
    assert run.state == "success" and ti.try_number == 1, "a stop reschedules without using a retry"
    cs = checkpoints(dag_file.dag_id, "train", run_id=run.run_id)
    assert [cs.get(seq).value for seq in (1, 2)] == [{"epoch": 1}, {"epoch": 2}], "in order, nothing lost"
    assert digests(restored) == {"weights.bin": file_digest(expected)}, (
        "checkpoint 2 kept the files of the save it waited for"
    )


def test_stop_requested_makes_a_background_save_synchronous(tmp_path: Path) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        state, session = open_state(store)
        try:
            state.request_stop()
            with pytest.raises(StopRequested, match="progress saved in checkpoint 1"):
                state.save({"n": 1}, wait=False)
            assert state.pending_save is None and state.checkpoint.seq == 1  # type: ignore[union-attr]
        finally:
            close(state, session)


def test_the_background_thread_is_not_left_running(tmp_path: Path) -> None:
    """Every test above waits for its saves; a save's thread ends with its commit."""
    with LocalObjectStore(root=tmp_path / "state") as store:
        state, session = open_state(store)
        pending = state.save({"n": 1}, wait=False)
        pending.wait()
        close(state, session)
        assert pending._thread is not None
        pending._thread.join(timeout=10)
        assert not pending._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("stateful-save-")]

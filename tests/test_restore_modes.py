"""Restore modes: a restore into a directory that already holds files has a defined result, never a mix.

``exact`` (the task side's and the core's default) leaves the destination holding exactly the checkpoint's files,
what it does not have moved out within the same journaled all-or-nothing swap (an error or a SIGKILL puts it back
too); ``merge`` keeps the others; ``empty`` refuses a destination that is not empty before anything is read. Every
restore returns (and the task side logs) what it did, "no checkpoint yet" included. On the local store and on S3
over HTTP (moto's server), with real files; the CLI in-process, the pod client as a real subprocess.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from maintenance import read_tree, tree
from s3_endpoint import S3Endpoint

from airflow_stateful.cli.main import main as cli_main
from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
from airflow_stateful.core.data.restore import STAGING_PREFIX, recover_interrupted
from airflow_stateful.core.data.restore_modes import RestoreResult
from airflow_stateful.core.errors import CheckpointCorruptError, DestinationNotEmptyError, InvalidValueError
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.task_state import TaskState

IDENTITY = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
SAVED = {"part-0001.parquet": b"one" * 500, "part-0002.parquet": b"two" * 500, "meta/schema.json": b"{}"}
STALE = "part-0003.tmp"
"""What a killed try leaves beside the restored files: written after the last checkpoint, in none."""


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(root=tmp_path / "state")
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    with endpoint.store(request.getfixturevalue("s3_prefix")) as s3:
        yield s3


def committed(store: ObjectStore, work: Path, files: dict[str, bytes] = SAVED) -> CheckpointStore:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    cs.commit(cs.acquire(steal=True), {"step": 1}, files=tree(work, files))
    return cs


def listing(root: Path) -> dict[str, bytes | str | None]:
    """Every entry below ``root``: files with their bytes, links as ``-> target``, directories as ``None``."""
    found: dict[str, bytes | str | None] = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        found[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else None
    return found


def staging_left(dest: Path) -> list[str]:
    return [p.name for p in dest.iterdir() if p.name.startswith(STAGING_PREFIX)]


# -- exact -------------------------------------------------------------------------------------------------------
def test_exact_removes_a_stale_part_file_left_beside_the_restored_ones(
    store: ObjectStore, tmp_path: Path
) -> None:
    """The issue: a retry restored beside the killed try's part file. Exact is the default: it is gone."""
    cs = committed(store, tmp_path / "work")
    latest = cs.latest()
    assert latest is not None
    dest = tree(tmp_path / "dest", {**SAVED, "part-0001.parquet": b"half written", STALE: b"killed try"})
    result = cs.restore_files(latest, dest)
    assert read_tree(dest) == SAVED, "exactly the checkpoint's files: the stale part file went"
    assert isinstance(result, RestoreResult) and result.mode == "exact" and result.seq == latest.seq
    assert result.removed == [STALE] and result.replaced == 3 and len(result) == 3 and result
    assert sorted(result) == sorted(dest / rel for rel in SAVED)
    assert result.describe() == (
        f"restored checkpoint {latest.seq} into {dest} (exact): 3 file(s), {result.bytes / 1024:.1f} KiB, "
        f"3 replaced; removed 1 not in it: {STALE}"
    )
    assert staging_left(dest) == []


def test_merge_keeps_the_file_the_checkpoint_does_not_have(store: ObjectStore, tmp_path: Path) -> None:
    cs = committed(store, tmp_path / "work")
    latest = cs.latest()
    assert latest is not None
    dest = tree(tmp_path / "dest", {STALE: b"killed try"})
    result = cs.restore_files(latest, dest, mode="merge")
    assert read_tree(dest) == {**SAVED, STALE: b"killed try"}
    assert result.mode == "merge" and result.removed == [] and result.replaced == 0


NESTED = {"a/b/keep.bin": b"keep", "a/top.bin": b"top", "c.bin": b"c"}
NESTED_BEFORE = {
    "a/b/stale.tmp": b"stale beside a kept file",
    "a/b/deep/x.tmp": b"in a directory the checkpoint does not have",
    "logs/1.txt": b"1",
    "logs/2/3.txt": b"3",
    "c.bin": b"old c",
}


def nested_dest(dest: Path, outside: Path) -> Path:
    """NESTED_BEFORE plus empty directories and links (one to a file outside, one to a directory)."""
    tree(dest, NESTED_BEFORE)
    (dest / "a" / "empty").mkdir(parents=True)
    (dest / "e" / "f").mkdir(parents=True)
    outside.write_bytes(b"outside: a link to it goes, it stays")
    (dest / "a" / "link").symlink_to(outside)
    (dest / "dirlink").symlink_to(dest / "logs")
    return dest


def test_exact_into_nested_directories_removes_extra_files_and_now_empty_directories(
    store: ObjectStore, tmp_path: Path
) -> None:
    cs = committed(store, tmp_path / "work", NESTED)
    latest = cs.latest()
    assert latest is not None
    dest = nested_dest(tmp_path / "dest", tmp_path / "outside.txt")
    result = cs.restore_files(latest, dest, mode="exact")
    assert listing(dest) == {**NESTED, "a": None, "a/b": None}, "the directories the checkpoint needs stay"
    assert (tmp_path / "outside.txt").read_bytes() == b"outside: a link to it goes, it stays"
    assert result.removed == sorted(
        [
            "a/b/deep/",
            "a/b/deep/x.tmp",
            "a/b/stale.tmp",
            "a/empty/",
            "a/link",
            "dirlink",
            "e/",
            "e/f/",
            "logs/",
            "logs/1.txt",
            "logs/2/",
            "logs/2/3.txt",
        ]
    )
    assert result.replaced == 1 and staging_left(dest) == []


def test_exact_never_counts_or_removes_the_librarys_working_directories(tmp_path: Path) -> None:
    """A background save's snapshot staging sits beside the saved file (so inside the directory it is restored
    to) and may be in use; another restore's staging is that restore's to undo."""
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = committed(store, tmp_path / "work")
        latest = cs.latest()
        assert latest is not None
        dest = tree(tmp_path / "dest", {".stateful-staging/snap-1/model.pt": b"being saved", STALE: b"stale"})
        result = cs.restore_files(latest, dest)
        assert read_tree(dest) == {**SAVED, ".stateful-staging/snap-1/model.pt": b"being saved"}
        assert result.removed == [STALE]
        only_ours = tree(tmp_path / "only-ours", {".stateful-staging/snap-2/x": b"being saved"})
        cs.restore_files(latest, only_ours, mode="empty")  # not content: an empty directory to mode "empty"


def test_a_corrupt_chunk_found_during_the_download_leaves_dest_exactly_as_before(tmp_path: Path) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = committed(store, tmp_path / "work", NESTED)
        latest = cs.latest()
        assert latest is not None
        tree_ = cs.tree(latest)
        assert tree_ is not None
        chunk = next(c for f in tree_.files if f.path == "c.bin" for c in f.chunks)
        (tmp_path / "state" / chunk.key).write_bytes(b"C")  # same size, other bytes: found only on download
        dest = nested_dest(tmp_path / "dest", tmp_path / "outside.txt")
        before = listing(dest)
        with pytest.raises(CheckpointCorruptError):
            cs.restore_files(latest, dest, mode="exact")
        assert listing(dest) == before, "the extra files too: nothing was moved"
        assert staging_left(dest) == []


def test_an_error_at_any_move_of_the_exact_swap_is_undone_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every move (exact's moves out, the files' moves aside and in) fails in turn: dest ends as before."""
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = committed(store, tmp_path / "work", NESTED)
        latest = cs.latest()
        assert latest is not None
        real = os.replace  # what Path.replace calls, and the swap itself
        failed_at = 0
        for n in range(1, 40):
            dest = nested_dest(tmp_path / f"dest{n}", tmp_path / "outside.txt")
            before = listing(dest)
            calls = 0

            def replace(source: Any, target: Any, n: int = n) -> None:
                nonlocal calls
                calls += 1
                if calls == n:
                    raise OSError(28, "No space left on device")
                real(source, target)

            monkeypatch.setattr(os, "replace", replace)
            try:
                cs.restore_files(latest, dest, mode="exact")
            except OSError as exc:
                assert "No space left" in str(exc)
                monkeypatch.undo()
                assert listing(dest) == before, f"failed at move {n}: dest is a mix"
                assert staging_left(dest) == [] and recover_interrupted(dest) is False
                failed_at = n
                continue
            monkeypatch.undo()
            assert listing(dest) == {**NESTED, "a": None, "a/b": None}
            break
        # 7 entries moved out (a/b/deep, a/b/stale.tmp, a/empty, a/link, dirlink, e, logs: a directory in one
        # move), 1 file moved aside (c.bin), 3 moved in: 11 moves.
        assert failed_at == 11


def _die_at(n: int, dest: str, store_root: str) -> None:
    calls = 0
    real = os.replace  # what Path.replace calls, and the swap itself

    def replace(source: Any, target: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == n:
            os._exit(137)  # SIGKILL between two moves: nothing of this process runs any more
        real(source, target)

    os.replace = replace
    with LocalObjectStore(root=Path(store_root)) as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        latest = cs.latest()
        assert latest is not None
        cs.restore_files(latest, dest, mode="exact")
    os._exit(0)


def test_a_sigkill_during_the_exact_swap_is_undone_by_the_next_restore(tmp_path: Path) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = committed(store, tmp_path / "work", NESTED)
        latest = cs.latest()
        assert latest is not None
        context = multiprocessing.get_context("fork")
        kills = 0
        for n in range(1, 40):
            dest = nested_dest(tmp_path / f"dest{n}", tmp_path / "outside.txt")
            before = listing(dest)
            child = context.Process(target=_die_at, args=(n, str(dest), str(tmp_path / "state")))
            child.start()
            child.join(60)
            assert child.exitcode in (0, 137), child.exitcode
            if child.exitcode == 0:
                break
            kills += 1
            assert staging_left(dest), "the kill left its staging (and journal)"
            assert listing(dest) != before or n == 1, "the kill landed mid-swap"
            # The next restore first undoes the killed one (its files back, exact's moved-out entries too) ...
            assert recover_interrupted(dest) is True
            assert listing(dest) == before, f"killed at move {n}: dest is a mix"
            # ... and then completes.
            result = cs.restore_files(latest, dest, mode="exact")
            assert listing(dest) == {**NESTED, "a": None, "a/b": None} and "logs/1.txt" in result.removed
        assert kills == 11


# -- empty, and the mode's name ------------------------------------------------------------------------------------
def test_empty_refuses_a_non_empty_dest_before_downloading_anything(tmp_path: Path) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = committed(store, tmp_path / "work")
        latest = cs.latest()
        assert latest is not None
        tree_ = cs.tree(latest)
        assert tree_ is not None
        # The tree and every chunk gone: any read of them would fail with CheckpointCorruptError.
        store.delete_many([latest.tree.key, *(c.key for f in tree_.files for c in f.chunks)])  # type: ignore[union-attr]
        fresh = CheckpointStore(store=store, identity=IDENTITY)  # no cached tree
        dest = tree(tmp_path / "dest", {"notes.txt": b"mine", "b.txt": b"b", "c/d.txt": b"d"})
        before = listing(dest)
        with pytest.raises(DestinationNotEmptyError) as refused:
            fresh.restore_files(latest, dest, mode="empty")
        message = str(refused.value)
        assert str(dest) in message and "b.txt, c, notes.txt" in message
        assert "'exact'" in message and "'merge'" in message
        assert isinstance(refused.value, InvalidValueError) and isinstance(refused.value, ValueError)
        assert listing(dest) == before and staging_left(dest) == []


def test_empty_accepts_a_missing_or_empty_dest(store: ObjectStore, tmp_path: Path) -> None:
    cs = committed(store, tmp_path / "work")
    latest = cs.latest()
    assert latest is not None
    missing = tmp_path / "missing" / "dest"
    result = cs.restore_files(latest, missing, mode="empty")
    assert read_tree(missing) == SAVED and result.mode == "empty"
    empty = tmp_path / "empty"
    (empty / f"{STAGING_PREFIX}0123456789ab" / "new").mkdir(parents=True)  # a killed download's staging
    cs.restore_files(latest, empty, mode="empty")
    assert read_tree(empty) == SAVED and staging_left(empty) == [], "a restore's staging is never content"


def test_a_bad_mode_name_is_refused_naming_it_and_the_choices(tmp_path: Path) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = committed(store, tmp_path / "work")
        latest = cs.latest()
        assert latest is not None
        says = r"restore mode must be one of 'exact', 'merge', 'empty', not 'mirror'"
        with pytest.raises(InvalidValueError, match=says):
            cs.restore_files(latest, tmp_path / "dest", mode="mirror")
        with pytest.raises(InvalidValueError, match=says):
            cs.restore_output("anything", tmp_path / "dest", mode="mirror")
        session = WriterSession(checkpoints=cs, writer=WriterInfo(try_number=2), heartbeat=False, steal=True)
        with session, pytest.raises(InvalidValueError, match=says):
            TaskState(session=session).restore_files(tmp_path / "dest", mode="mirror")
        assert not (tmp_path / "dest").exists()


# -- the task side: TaskState (and the session under it) -----------------------------------------------------------
def open_state(store: ObjectStore, try_number: int) -> TaskState:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    session = WriterSession(
        checkpoints=cs, writer=WriterInfo(try_number=try_number), heartbeat=False, steal=True
    ).open()
    return TaskState(session=session)


def test_task_state_with_no_checkpoint_says_so_and_leaves_the_directory_alone(
    tmp_path: Path, library_log: list[str]
) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        state = open_state(store, 1)
        workdir = tree(tmp_path / "work", {STALE: b"written before any checkpoint"})
        result = state.restore_files(workdir)
        assert not result and len(result) == 0 and result.seq is None
        assert read_tree(workdir) == {STALE: b"written before any checkpoint"}
        assert f"no checkpoint yet: nothing restored, {workdir} left as it was" in library_log


def test_a_retry_restores_exactly_the_checkpoint_and_logs_what_it_removed(
    tmp_path: Path, library_log: list[str]
) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        first = open_state(store, 1)
        workdir = tree(tmp_path / "work", SAVED)
        first.save({"parts": 2}, files=workdir)
        (workdir / STALE).write_bytes(b"the try was killed while writing this")
        retry = open_state(store, 2)
        result = retry.restore_files(workdir)
        assert read_tree(workdir) == SAVED and result and result.removed == [STALE]
        assert any(
            line.startswith("restored checkpoint 1 into")
            and "(exact)" in line
            and f"not in it: {STALE}" in line
            for line in library_log
        ), library_log
        (workdir / STALE).write_bytes(b"again")
        assert open_state(store, 3).restore_files(workdir, mode="merge").removed == []
        assert (workdir / STALE).exists()


# -- published outputs: the mode applies to DIR/NAME, never to the rest of DIR ------------------------------------
def test_restore_output_applies_the_mode_to_the_outputs_own_path(store: ObjectStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    with WriterSession(
        checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False, steal=True
    ) as session:
        session.publish("model", tree(tmp_path / "src" / "model", {"w.bin": b"weights", "cfg.json": b"{}"}))
        session.publish("report.csv", tree(tmp_path / "src", {"report.csv": b"a,b\n"}) / "report.csv")
        session.commit({"day": 1})
    out = tree(tmp_path / "out", {"mine.txt": b"not the output's", "model/stale.bin": b"an older model's"})
    result = cs.restore_output("model", out)
    assert read_tree(out) == {
        "mine.txt": b"not the output's",
        "model/w.bin": b"weights",
        "model/cfg.json": b"{}",
    }
    assert result.removed == ["stale.bin"] and result.dest == out / "model" and len(result) == 2
    with pytest.raises(DestinationNotEmptyError, match="model"):
        cs.restore_output("model", out, mode="empty")
    result = cs.restore_output("report.csv", out, mode="exact")
    assert read_tree(out)["report.csv"] == b"a,b\n" and read_tree(out)["mine.txt"] == b"not the output's"
    assert (
        result.mode == "exact" and list(result) == [out / "report.csv"] and result.dest == out / "report.csv"
    )
    with pytest.raises(DestinationNotEmptyError, match="already exists"):
        cs.restore_output("report.csv", out, mode="empty")
    fresh = tmp_path / "fresh"
    assert list(cs.restore_output("report.csv", fresh, mode="empty")) == [fresh / "report.csv"]


# -- the CLI: a person's directory, never emptied unasked ---------------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], backend: str, *args: str) -> tuple[int, str, str]:
    code = cli_main([*args, "--backend", backend])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_cat_files_refuses_a_non_empty_directory_unless_a_mode_is_chosen(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    backend = (tmp_path / "state").as_uri()
    with LocalObjectStore(root=tmp_path / "state") as store:
        committed(store, tmp_path / "work")
    mine = tree(tmp_path / "mine", {"notes.txt": b"my notes"})
    code, out, err = cli(capsys, backend, "cat", IDENTITY.key, "--files", str(mine))
    assert code == 2, err
    assert str(mine) in err and "notes.txt" in err and "--mode exact" in err and "--mode merge" in err
    assert read_tree(mine) == {"notes.txt": b"my notes"} and staging_left(mine) == []
    code, out, err = cli(capsys, backend, "cat", IDENTITY.key, "--files", str(mine), "--mode", "merge")
    assert code == 0 and read_tree(mine) == {**SAVED, "notes.txt": b"my notes"}
    code, out, err = cli(
        capsys, backend, "cat", IDENTITY.key, "--files", str(mine), "--mode", "exact", "--json"
    )
    assert code == 0 and read_tree(mine) == SAVED
    got = json.loads(out)
    assert got["value"] == {"step": 1}
    assert got["restore"]["mode"] == "exact" and got["restore"]["files"] == 3
    assert got["restore"]["removed"] == ["notes.txt"]
    assert "(exact): 3 file(s)" in err and "removed 1 not in it: notes.txt" in err
    code, out, err = cli(capsys, backend, "cat", IDENTITY.key, "--files", str(tmp_path / "new"))
    assert code == 0 and read_tree(tmp_path / "new") == SAVED and "(empty)" in err
    assert json.loads(out) == {"step": 1}
    with pytest.raises(SystemExit) as bad:
        cli(capsys, backend, "cat", IDENTITY.key, "--files", str(mine), "--mode", "mirror")
    assert bad.value.code == 2 and "invalid choice: 'mirror'" in capsys.readouterr().err


def test_cli_outputs_get_refuses_an_existing_output_unless_a_mode_is_chosen(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    backend = (tmp_path / "state").as_uri()
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        with WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False) as session:
            session.publish("model", tree(tmp_path / "src" / "model", {"w.bin": b"weights"}))
            session.commit({"day": 1})
    dl = tree(tmp_path / "dl", {"other.txt": b"mine", "model/old.bin": b"an older download"})
    args = ("outputs", IDENTITY.key, "--get", "model", "--to", str(dl))
    code, _, err = cli(capsys, backend, *args)
    assert code == 2 and str(dl / "model") in err and "old.bin" in err and "--mode" in err, err
    assert read_tree(dl) == {"other.txt": b"mine", "model/old.bin": b"an older download"}
    code, out, err = cli(capsys, backend, *args, "--mode", "exact", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["restore"]["removed"] == ["old.bin"] and got["restore"]["mode"] == "exact"
    assert read_tree(dl) == {"other.txt": b"mine", "model/w.bin": b"weights"}, "DIR's other files stay"
    assert "removed 1 not in it: old.bin" in err


# -- the pod client -------------------------------------------------------------------------------------------------
def test_the_pod_client_restores_exactly_the_checkpoint(tmp_path: Path) -> None:
    backend = (tmp_path / "state").as_uri()
    with LocalObjectStore(root=tmp_path / "state") as store:
        committed(store, tmp_path / "work")
        lease = CheckpointStore(store=store, identity=IDENTITY).acquire(steal=True)  # the operator's lease
    pod_dir = tree(tmp_path / "pod", {STALE: b"the killed pod's", ".stateful-value.json": b'{"step": 0}'})
    env = {
        **os.environ,
        "STATEFUL_IDENTITY": IDENTITY.key,
        "STATEFUL_BACKEND_URL": backend,
        "STATEFUL_EPOCH": str(lease.epoch),
        "STATEFUL_LEASE_TOKEN": lease.token,
    }
    done = subprocess.run(
        [sys.executable, "-m", "airflow_stateful.client", "restore", str(pod_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert read_tree(pod_dir) == {**SAVED, ".stateful-value.json": b'{"step": 1}'}
    assert "(exact): 3 file(s)" in done.stderr and f"removed 2 not in it: .stateful-value.json, {STALE}" in (
        done.stderr
    )

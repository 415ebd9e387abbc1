"""A restore is all or nothing, even when its process dies while it moves files into place.

Every file is downloaded and verified in a staging directory first; only then are files moved into the
destination, one rename each. These tests kill a real child process (``os._exit``, the same as SIGKILL: no
``finally`` runs) at every one of those renames in turn, then check that the next restore's recovery puts
the destination back exactly as it was, byte for byte; and that a move failing in-process is undone at once.
In mode ``"exact"`` the file the checkpoint does not have is moved out by one of those renames: a kill puts it
back too. The only thing replaced is ``os.replace`` (which ``Path.replace`` calls too) in the child, to choose
the moment of death deterministically.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from maintenance import read_tree, tree

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.data.restore import STAGING_PREFIX, recover_interrupted
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="etl", task_id="restore", run_id="manual__1")
BEFORE = {"a.bin": b"old a", "sub/b.bin": b"old b", "keep.txt": b"not in the checkpoint"}
SAVED = {"a.bin": b"new a" * 1000, "sub/b.bin": b"new b", "fresh/deep/c.bin": b"new c", "d.bin": b"new d"}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Iterator[CheckpointStore]:
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        cs.commit(cs.acquire(), {"n": 1}, files=tree(tmp_path / "work", SAVED))
        yield cs


def listing(root: Path) -> dict[str, bytes | None]:
    """Every entry below ``root``: files with their bytes, directories as ``None``."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")
    }


def _die_at(n: int, dest: str, store_root: str, mode: str) -> None:
    calls = 0
    real = os.replace

    def replace(source: Any, target: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == n:
            os._exit(137)  # killed between two renames: nothing of this process runs any more
        real(source, target)

    os.replace = replace
    with LocalObjectStore(root=Path(store_root)) as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        latest = cs.latest()
        assert latest is not None
        cs.restore_files(latest, dest, mode=mode)
    os._exit(0)


@pytest.mark.parametrize(
    ("mode", "complete", "renames"),
    [
        # keep.txt is not in the checkpoint: merge keeps it; exact moves it out (one more rename to die at).
        ("merge", {**BEFORE, **SAVED}, 6),
        ("exact", SAVED, 7),
    ],
)
def test_a_restore_killed_at_any_rename_is_undone_by_the_next_one(
    checkpoint: CheckpointStore, tmp_path: Path, mode: str, complete: dict[str, bytes], renames: int
) -> None:
    latest = checkpoint.latest()
    assert latest is not None
    context = multiprocessing.get_context("fork")
    renames_seen = 0
    for n in range(1, 20):
        dest = tree(tmp_path / f"dest{n}", BEFORE)
        before = listing(dest)
        child = context.Process(target=_die_at, args=(n, str(dest), str(tmp_path / "state"), mode))
        child.start()
        child.join(60)
        assert child.exitcode in (0, 137), child.exitcode
        if child.exitcode == 0:
            break  # n is past the last rename: the restore completed
        renames_seen += 1
        assert any(p.name.startswith(STAGING_PREFIX) for p in dest.iterdir()), "the kill left its staging"
        assert recover_interrupted(dest) is True
        assert listing(dest) == before, f"killed at rename {n}: the destination is a mix"
        # ... and a restore after the crash completes.
        checkpoint.restore_files(latest, dest, mode=mode)
        assert read_tree(dest) == complete
        assert not any(p.name.startswith(STAGING_PREFIX) for p in dest.iterdir())
    # 4 files, 2 of them replacing an existing one: 6 renames, each a moment to die at (+1 for exact's move).
    assert renames_seen == renames


def test_a_move_that_fails_is_undone_before_the_error_reaches_the_task(
    checkpoint: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    latest = checkpoint.latest()
    assert latest is not None
    real = os.replace
    calls = 0

    def replace(source: Any, target: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise OSError(28, "No space left on device")
        real(source, target)

    dest = tree(tmp_path / "dest", BEFORE)
    before = listing(dest)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.restore_files(latest, dest)
    monkeypatch.undo()
    assert listing(dest) == before
    assert recover_interrupted(dest) is False, "nothing is left behind for a later recovery"


def test_a_killed_download_leaves_the_destination_untouched(
    checkpoint: CheckpointStore, tmp_path: Path
) -> None:
    """A staging directory without a journal (killed while downloading) is only removed."""
    dest = tree(tmp_path / "dest", BEFORE)
    before = listing(dest)
    leftover = tree(dest / f"{STAGING_PREFIX}0123456789ab" / "new", {"a.bin": b"half a chu"})
    assert recover_interrupted(dest) is True
    assert not leftover.exists() and listing(dest) == before


def test_restoring_a_checkpoint_without_files_changes_nothing(tmp_path: Path) -> None:
    """Found by the S3 fault tests: the journal was written into a staging directory never created."""
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        cs.commit(cs.acquire(), {"n": 1})
        latest = cs.latest()
        assert latest is not None
        dest = tree(tmp_path / "dest", BEFORE)
        result = cs.restore_files(latest, dest)
        assert not result and result.files == [] and result.untouched
        assert listing(dest) == {**BEFORE, "sub": None}, "exact never empties a directory for a file-less one"


def _die_while_cleaning_up(dest: str, store_root: str) -> None:
    """Delete the staging directory's backups first (tmpfs lists newest first), then die mid-cleanup."""
    import shutil

    from airflow_stateful.core.data import restore

    real = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        real(Path(path) / "old", ignore_errors=True)
        os._exit(137)

    restore.shutil.rmtree = rmtree  # type: ignore[attr-defined]
    with LocalObjectStore(root=Path(store_root)) as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        latest = cs.latest()
        assert latest is not None
        cs.restore_files(latest, dest)
    os._exit(0)


def test_a_restore_killed_while_cleaning_up_is_never_rolled_back_without_its_backups(
    checkpoint: CheckpointStore, tmp_path: Path
) -> None:
    """Found by the kill soak on tmpfs: the backups went before the journal, and the recovery then deleted the
    files it could not put back. The journal now goes first: a finished restore stays finished."""
    dest = tree(tmp_path / "dest", BEFORE)
    child = multiprocessing.get_context("fork").Process(
        target=_die_while_cleaning_up, args=(str(dest), str(tmp_path / "state"))
    )
    child.start()
    child.join(60)
    assert child.exitcode == 137
    recover_interrupted(dest)
    assert read_tree(dest) == SAVED  # exact (the default): keep.txt, not in the checkpoint, went too
    assert not any(p.name.startswith(STAGING_PREFIX) for p in dest.iterdir())

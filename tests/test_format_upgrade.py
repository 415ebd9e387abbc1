"""Rolling upgrade across the checkpoint format change (format 1 -> format 2, docs/adr/0004).

During a rolling upgrade old and new workers share a bucket. The promises:

* this release reads checkpoints the previous release wrote (values, files, history) and keeps them
  restorable after it commits on top of them and cleans up;
* the previous release, meeting a checkpoint this release wrote, refuses with a clear error (it never
  misreads the new layout).

The package has not been published to the package index, so "the previous release" is the last commit of
this repository that wrote format 1 (``OLD_RELEASE``), exported with ``git archive`` and run in its own
interpreter with only that code on its path. Where the history is not there (a shallow clone, an sdist), the
test skips and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.records.formats import PLAIN_FORMAT
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


def check_upgrade(old_code: Path, store: ObjectStore, settings: dict[str, Any], work: Path) -> None:
    assert run_old(old_code, "write", dict(settings), work) == {"ok": True}

    # This release reads the old checkpoints: the value, the files, the history.
    cs = CheckpointStore(store=store, identity=IDENTITY)
    head = cs.head()
    assert head is not None and head.format == 1
    old_latest = cs.latest()
    assert old_latest is not None and old_latest.value == {"step": 2, "by": "old"}
    assert old_latest.tree is None and len(old_latest.files) == 2
    cs.restore_files(old_latest, work / "new-restore-1")
    assert digest_tree(work / "new-restore-1") == digest_tree(work / "old-src-2")
    cs.verify(old_latest)  # reads every byte back and checks the recorded hashes; raises on a mismatch

    # This release commits on top (format 2), dropping nothing the old checkpoints need; a sweep keeps
    # every old checkpoint that is still kept restorable.
    lease = cs.acquire()
    src = work / "new-src"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"\x07" * 500_000)
    new = cs.commit(lease, {"step": 3, "by": "new"}, files=src)
    cs.sweep(lease)
    head = cs.head()
    assert head is not None and head.format == PLAIN_FORMAT == 2
    assert [e.seq for e in head.checkpoints][-3:] == [1, 2, 3]
    cs.restore_files(cs.get(1), work / "new-restore-old-1")
    assert digest_tree(work / "new-restore-old-1") == digest_tree(work / "old-src-1")
    cs.restore_files(cs.get(2), work / "new-restore-old-2")
    assert digest_tree(work / "new-restore-old-2") == digest_tree(work / "old-src-2")
    cs.restore_files(new, work / "new-restore-3")
    assert digest_tree(work / "new-restore-3") == digest_tree(src)
    cs.release(lease)

    # The old release meeting the new layout refuses, naming the format, instead of misreading it.
    seen = run_old(old_code, "read", dict(settings), work)
    assert seen["ok"] is False, f"the old release read a format-2 checkpoint: {seen}"
    assert seen["error"] == "FormatVersionError", seen
    assert "format 2" in seen["message"] and "newer" in seen["message"], seen["message"]
    assert not (work / "old-restore").exists() or not any((work / "old-restore").iterdir())


def test_local_store_upgrade(old_code: Path, tmp_path: Path) -> None:
    root = tmp_path / "state"
    check_upgrade(old_code, LocalObjectStore(root=root), {"kind": "local", "root": str(root)}, tmp_path)


@pytest.mark.s3
def test_s3_store_upgrade(old_code: Path, tmp_path: Path, s3_endpoint: Any, s3_prefix: str) -> None:
    settings = {"kind": "s3", "bucket": s3_endpoint.bucket, "prefix": s3_prefix, **s3_endpoint.options()}
    check_upgrade(old_code, s3_endpoint.store(s3_prefix), settings, tmp_path)


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
    assert result["read"].startswith("FormatVersionError") and "format 3" in result["read"]
    assert result["gc"] == "ran" or result["gc"].startswith("FormatVersionError"), result["gc"]
    assert result["deleted"] == [] and {info.key for info in store.list_objects("")} == before
    out = tmp_path / "out"
    assert list(CheckpointStore(store=store, identity=IDENTITY).restore_output("report", out)) == [
        out / "report"
    ]

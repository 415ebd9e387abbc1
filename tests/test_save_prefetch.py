"""A save reads the head and the previous tree while it lists its files (core/protocol/prefetch.py).

What a user must never see from that overlap: a read that fails on the thread costing them their deduplication
or their save, or bytes read ahead trusted without the verification every tree read gets. The store is the
real local directory store, wrapped only to fail or count calls (tests/contract/faults.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from contract.faults import CrashingStore

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import StoreUnavailableError
from airflow_stateful.core.stores.base import Blob
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="prefetch", task_id="train", run_id="r1")


class TreeGetFails(CrashingStore):
    """The real store, whose next ``failures`` GETs of a tree object fail as an unreachable store's do."""

    def __init__(self, inner: LocalObjectStore, *, failures: int) -> None:
        super().__init__(inner)
        self.failures = failures
        self.tree_gets = 0

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        if "/~trees/" in key:
            self.tree_gets += 1
            if self.failures:
                self.failures -= 1
                raise StoreUnavailableError(f"injected: the network dropped while reading {key}")
        return super().get(key, max_bytes=max_bytes)


def write_tree(root: Path, count: int) -> list[Path]:
    paths = []
    for i in range(count):
        path = root / f"d{i % 5}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(2048))
        paths.append(path)
    return paths


def first_save(store: LocalObjectStore, src: Path) -> None:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    lease = cs.acquire()
    cs.commit(lease, {"n": 1}, files=src)
    cs.release(lease)


def pack_keys(cs: CheckpointStore) -> dict[str, set[str]]:
    """The pack each file of the newest checkpoint's tree is in, by path."""
    latest = cs.latest()
    assert latest is not None
    tree = cs.content.tree(latest)
    assert tree is not None
    return {f.path: {c.key for c in f.chunks} for f in tree.files}


def test_a_tree_read_failing_while_the_files_are_listed_is_read_again_and_the_re_save_still_deduplicates(
    tmp_path: Path,
) -> None:
    store = LocalObjectStore(root=tmp_path / "state")
    src = tmp_path / "src"
    paths = write_tree(src, 40)
    first_save(store, src)
    before = pack_keys(CheckpointStore(store=store, identity=IDENTITY))
    paths[7].write_bytes(os.urandom(2048))

    flaky = TreeGetFails(store, failures=1)
    cs = CheckpointStore(store=flaky, identity=IDENTITY)  # a new process: nothing in memory
    lease = cs.acquire()
    cs.commit(lease, {"n": 2}, files=src)
    cs.release(lease)

    assert flaky.tree_gets == 2, "the failed read ahead is read again by the save itself"
    after = pack_keys(CheckpointStore(store=store, identity=IDENTITY))
    changed = paths[7].relative_to(src).as_posix()
    assert after[changed] != before[changed], "the rewritten file went into a new pack"
    assert {p: k for p, k in after.items() if p != changed} == {
        p: k for p, k in before.items() if p != changed
    }, "every file that did not change still points at the chunks already stored: the re-save deduplicated"
    restored = tmp_path / "restored"
    reader = CheckpointStore(store=store, identity=IDENTITY)
    latest = reader.latest()
    assert latest is not None and latest.value == {"n": 2}
    reader.restore_files(latest, restored)
    assert {
        p.relative_to(restored).as_posix(): p.read_bytes() for p in restored.rglob("*") if p.is_file()
    } == {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}


def test_a_tree_corrupted_in_the_bucket_is_not_trusted_when_read_ahead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalObjectStore(root=tmp_path / "state")
    src = tmp_path / "src"
    write_tree(src, 40)
    first_save(store, src)
    [tree_file] = (tmp_path / "state").rglob("~trees/*.json")
    body = bytearray(tree_file.read_bytes())
    body[body.index(b'"size":2048') + 8] = ord("1")  # one file's size altered: still valid JSON
    tree_file.write_bytes(bytes(body))

    cs = CheckpointStore(store=store, identity=IDENTITY)
    lease = cs.acquire()
    with caplog.at_level(logging.WARNING, logger="airflow_stateful"):
        cs.commit(lease, {"n": 2}, files=src)
    cs.release(lease)

    assert "not deduplicating against checkpoint 1" in caplog.text
    assert "is corrupt" in caplog.text, "the bytes read ahead were checked against the tree's SHA-256"
    latest = CheckpointStore(store=store, identity=IDENTITY).latest()
    assert latest is not None and latest.value == {"n": 2}
    restored = tmp_path / "restored"
    CheckpointStore(store=store, identity=IDENTITY).restore_files(latest, restored)
    assert {
        p.relative_to(restored).as_posix(): p.read_bytes() for p in restored.rglob("*") if p.is_file()
    } == {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}

"""A commit whose answer was lost is reported as committed exactly when it is, and the writer goes on.

The head write is the commit point. When the connection drops after the request was sent (retries exhausted,
a reset after forwarding), the write may or may not have landed. These tests put a real store (local
directory or S3 over HTTP) behind a wrapper that, at the head write, either forwards it and then raises the
store's own error (the answer was lost), or raises without forwarding (the request never left); and,
optionally, fails the read-back too. The wrapper is the only stand-in: everything else is the real protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from contract.faults import CrashingStore
from maintenance import missing_references, read_tree, tree
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import CommitOutcomeUnknownError, StoreError
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import Blob, ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="etl", task_id="lost", run_id="manual__1")


class LosingStore(CrashingStore):
    """Forwards everything; the next head write can be made to lose its answer or never leave."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        #: "lost" (landed, answer lost), "lost-unreadable" (and the next head read fails too) or "dropped"
        #: (never sent)
        self.head_write: str | None = None
        self.head_reads_fail = 0

    def put(self, key: str, data: bytes, **kwargs: Any) -> str:
        fault, self.head_write = (
            (self.head_write, None) if key.endswith(HEAD_NAME) else (None, self.head_write)
        )
        if fault == "dropped":
            raise StoreError(f"PUT {key}: connection reset before the request was sent")
        etag = self.inner.put(key, data, **kwargs)
        if fault == "lost-unreadable":
            self.head_reads_fail = 1
        if fault in ("lost", "lost-unreadable"):
            raise StoreError(f"PUT {key}: read timeout (the request was sent; no answer)")
        return etag

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        if key.endswith(HEAD_NAME) and self.head_reads_fail:
            self.head_reads_fail -= 1
            raise StoreError(f"GET {key}: connection refused")
        return self.inner.get(key, max_bytes=max_bytes)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LosingStore]:
    if request.param == "local":
        with LocalObjectStore(root=tmp_path / "state") as local:
            yield LosingStore(local)
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    with endpoint.store(request.getfixturevalue("s3_prefix")) as s3:
        yield LosingStore(s3)


def session(store: ObjectStore, *, keep_last: int = 1) -> WriterSession:
    cs = CheckpointStore(store=store, identity=IDENTITY, keep_last=keep_last)
    return WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False).open()


def newest(store: LosingStore) -> Any:
    latest = CheckpointStore(store=store.inner, identity=IDENTITY).latest()
    return latest and latest.value


def test_a_lost_answer_to_a_landed_commit_is_reported_as_committed(store: LosingStore) -> None:
    writer = session(store)
    writer.commit({"n": 1})
    store.head_write = "lost"
    manifest = writer.commit({"n": 2})  # landed: the head read back says so
    assert manifest.value == {"n": 2} and writer.value == {"n": 2} and newest(store) == {"n": 2}
    assert writer.commit({"n": 3}).seq == manifest.seq + 1, "the writer goes on from its own landed commit"
    assert newest(store) == {"n": 3}


def test_a_commit_that_never_left_is_reported_as_failed(store: LosingStore) -> None:
    writer = session(store)
    writer.commit({"n": 1})
    store.head_write = "dropped"
    with pytest.raises(StoreError, match="connection reset before the request was sent"):
        writer.commit({"n": 2})
    assert writer.value == {"n": 1} and newest(store) == {"n": 1}
    assert writer.commit({"n": 3}).value == {"n": 3} and newest(store) == {"n": 3}


def test_an_unknown_outcome_says_so_and_the_next_save_settles_it(store: LosingStore, tmp_path: Path) -> None:
    """The head cannot be read back either: the error says the outcome is unknown. The next save reads the
    head, adopts the landed checkpoint, and deduplicates only against what the head still keeps (retention
    keep_last=1 already dropped the checkpoint before it, whose chunks GC may delete at any time)."""
    writer = session(store)
    first = tree(tmp_path / "w1", {"a.bin": b"A" * 70_000, "b.bin": b"B" * 50_000})
    writer.commit({"n": 1}, files=first)
    second = tree(tmp_path / "w2", {"a.bin": b"a" * 70_000, "b.bin": b"B" * 50_000})
    store.head_write = "lost-unreadable"
    with pytest.raises(
        CommitOutcomeUnknownError, match=r"could not tell whether checkpoint 2 .* was committed"
    ):
        writer.commit({"n": 2}, files=second)
    assert writer.value == {"n": 1}, "nothing the writer knows changes on an error"
    assert newest(store) == {"n": 2}, "(it did land)"
    # The writer's own sweep runs meanwhile: the chunks only checkpoint 1 held are deleted.
    before = {info.key for info in store.inner.list_objects("")}
    writer.checkpoints.sweep(writer.lease)
    assert before - {info.key for info in store.inner.list_objects("")}, (
        "checkpoint 1's own chunks were deleted"
    )
    # The next save brings back checkpoint 1's first file: its chunks must be uploaded again, not assumed.
    third = tree(tmp_path / "w3", {"a.bin": b"A" * 70_000, "c.bin": b"C" * 10})
    assert writer.commit({"n": 3}, files=third).seq == 3
    reader = CheckpointStore(store=store.inner, identity=IDENTITY)
    latest = reader.latest()
    assert latest is not None and latest.value == {"n": 3}
    reader.restore_files(latest, tmp_path / "out")
    assert read_tree(tmp_path / "out") == read_tree(third)
    assert missing_references(store.inner, IDENTITY) == []


def test_a_dedup_base_the_head_no_longer_keeps_is_not_trusted(store: LosingStore, tmp_path: Path) -> None:
    """A caller's ``previous`` that retention dropped (and whose chunks a sweep deleted) is not assumed to
    hold anything: the chunks are uploaded again."""
    cs = CheckpointStore(store=store.inner, identity=IDENTITY, keep_last=1)
    lease = cs.acquire()
    files = tree(tmp_path / "w1", {"a.bin": b"A" * 70_000})
    first = cs.commit(lease, {"n": 1}, files=files)
    cs.commit(lease, {"n": 2}, files=tree(tmp_path / "w2", {"b.bin": b"B" * 10}))
    cs.sweep(lease)
    cs.commit(lease, {"n": 3}, files=files, previous=first)
    latest = cs.latest()
    assert latest is not None and missing_references(store.inner, IDENTITY) == []
    cs.restore_files(latest, tmp_path / "out")
    assert read_tree(tmp_path / "out") == read_tree(files)

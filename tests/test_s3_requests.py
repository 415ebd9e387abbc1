"""What the library sends to S3 for its hot paths, on the wire (botocore's ``before-send``, once per attempt).

A small commit is one conditional PUT of the head, sent without waiting for ``100 Continue``; large bodies keep
the handshake. These run on the session's S3 endpoint (moto by default, SeaweedFS or another server with
``STATEFUL_TEST_S3_ENDPOINT``), over HTTP with the real boto3 client.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.core.errors import CheckpointCorruptError, FencedError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.stores.s3 import MIB, S3ObjectStore
from airflow_stateful.core.stores.s3_session import SMALL_PUT_BYTES

pytestmark = pytest.mark.s3


class Wire:
    """Method, key, headers of every request the client sends."""

    def __init__(self, client: Any) -> None:
        self.sent: list[tuple[str, str, dict[str, str]]] = []
        client.meta.events.register("before-send.s3", self._record)

    def _record(self, request: Any, **_: Any) -> None:
        headers = {
            k.lower(): v.decode() if isinstance(v, bytes) else str(v) for k, v in request.headers.items()
        }
        self.sent.append((request.method, request.url.split("?")[0], headers))

    def take(self) -> list[tuple[str, str, dict[str, str]]]:
        sent, self.sent = self.sent, []
        return sent


def test_a_small_commit_is_one_conditional_put_without_expect_continue(
    s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    store = s3_endpoint.store(s3_prefix)
    wire = Wire(store.client)
    cs = CheckpointStore(store=store, identity=Identity.parse("wire/small"))
    lease = cs.acquire()
    cs.commit(lease, {"step": 0})
    wire.take()
    for step in range(1, 6):  # past keep_last: retention drops inline checkpoints without a request
        cs.commit(lease, {"step": step})
        sent = wire.take()
        assert [(method, url.rsplit("/", 1)[-1]) for method, url, _ in sent] == [("PUT", "~head.json")]
        headers = sent[0][2]
        assert headers.get("if-match"), "the commit point is the conditional write"
        assert "expect" not in headers, "a head of a few KiB is sent without waiting for 100 Continue"
    assert cs.latest().value == {"step": 5}  # type: ignore[union-attr]


def test_large_puts_keep_expect_continue(s3_endpoint: S3Endpoint, s3_prefix: str) -> None:
    store = s3_endpoint.store(s3_prefix)
    wire = Wire(store.client)
    store.put("small", b"x" * SMALL_PUT_BYTES)
    store.put("large", b"x" * (SMALL_PUT_BYTES + 1))
    store.put("chunk", b"x" * MIB, if_none_match=True)
    expects = [headers.get("expect") for _, _, headers in wire.take()]
    assert expects == [None, "100-continue", "100-continue"]
    assert store.get("small").data == b"x" * SMALL_PUT_BYTES


def test_a_client_of_the_callers_is_left_as_it_is(s3_endpoint: S3Endpoint, s3_prefix: str) -> None:
    client = s3_endpoint.client()
    store = s3_endpoint.store(s3_prefix, client=client)
    wire = Wire(client)
    store.put("small", b"{}")
    assert [headers.get("expect") for _, _, headers in wire.take()] == ["100-continue"]


def test_a_fenced_writer_still_lands_nothing_and_is_told_why(s3_endpoint: S3Endpoint, s3_prefix: str) -> None:
    """The small commit reads nothing first: the conditional write alone fences a writer whose lease was taken
    over (its cached head's ETag no longer matches), and the error names the new holder's epoch."""
    zombie = CheckpointStore(store=s3_endpoint.store(s3_prefix), identity=Identity.parse("wire/fenced"))
    old = zombie.acquire()
    zombie.commit(old, {"step": 1})
    retry = CheckpointStore(store=s3_endpoint.store(s3_prefix), identity=Identity.parse("wire/fenced"))
    new = retry.acquire(steal=True)
    with pytest.raises(FencedError, match="epoch"):
        zombie.commit(old, {"step": 2})
    assert retry.latest().value == {"step": 1}  # type: ignore[union-attr]
    retry.commit(new, {"step": 3})
    assert retry.latest().value == {"step": 3}  # type: ignore[union-attr]


def test_the_stored_head_size_is_known_without_encoding_it_again(
    s3_endpoint: S3Endpoint, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = s3_endpoint.store(s3_prefix)
    cs = CheckpointStore(store=store, identity=Identity.parse("wire/size"))
    lease = cs.acquire()
    cs.commit(lease, {"step": 1})
    stored = len(store.get(cs.heads.key).data)
    head = cs.heads.cached()
    assert head is not None

    def no_encoding(*_: Any, **__: Any) -> bytes:
        raise AssertionError("the head was encoded again")

    with monkeypatch.context() as patch:
        patch.setattr(type(head), "to_bytes", no_encoding)
        assert cs.heads.stored_size(head) == stored
    loaded, _ = cs.heads.load()
    assert loaded is not None and cs.heads.stored_size(loaded) == stored
    other = head.evolve(next_seq=head.next_seq + 1)  # not the cached head: encoded to tell
    assert cs.heads.stored_size(other) == len(other.to_bytes())


def big_file(root: Path, size: int) -> Path:
    files = root / "files"
    files.mkdir()
    (files / "big.bin").write_bytes(os.urandom(size))
    return files


def test_chunk_reads_skip_the_transport_checksum_every_other_read_asks_for_it(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """A chunk's bytes are checked against its SHA-256 by the restore, so botocore need not also compute the
    CRC32 of each response; heads, trees and state documents have the server's checksum checked as before."""
    store = s3_endpoint.store(s3_prefix)
    cs = CheckpointStore(store=store, identity=Identity.parse("wire/restore"))
    lease = cs.acquire()
    cs.commit(lease, {"step": 1}, files=big_file(tmp_path, 9 * MIB))
    wire = Wire(store.client)
    reader = CheckpointStore(store=store, identity=Identity.parse("wire/restore"))
    reader.restore_files(reader.latest(), tmp_path / "out")  # type: ignore[arg-type]
    modes = {url.rsplit("/", 2)[-2]: headers.get("x-amz-checksum-mode") for _, url, headers in wire.take()}
    assert modes.pop("~chunks") is None
    assert modes.pop("~packs", None) is None  # the file's small tail chunk, if it has one, read by range
    assert modes and set(modes.values()) == {"ENABLED"}, modes  # the head and the tree
    assert (tmp_path / "out" / "big.bin").read_bytes() == (tmp_path / "files" / "big.bin").read_bytes()


def test_a_corrupt_chunk_is_still_refused(s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path) -> None:
    store = s3_endpoint.store(s3_prefix)
    cs = CheckpointStore(store=store, identity=Identity.parse("wire/corrupt"))
    lease = cs.acquire()
    manifest = cs.commit(lease, {"step": 1}, files=big_file(tmp_path, 6 * MIB))
    chunk = cs.tree(manifest).files[0].chunks[0]  # type: ignore[union-attr]
    data = bytearray(store.get_chunk(chunk.key, size=chunk.size))
    data[len(data) // 2] ^= 1
    store.client.put_object(Bucket=store.bucket, Key=f"{s3_prefix}/{chunk.key}", Body=bytes(data))
    with pytest.raises(CheckpointCorruptError, match="corrupt"):
        cs.restore_files(manifest, tmp_path / "out")
    assert not (tmp_path / "out" / "big.bin").exists()


class Concurrency(S3ObjectStore):
    """The S3 store, counting how many chunk reads are in flight at once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def get_chunk(self, key: str, *, size: int) -> bytes:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.05)  # a slow link: every worker that may send should be sending
            return super().get_chunk(key, size=size)
        finally:
            with self.lock:
                self.now -= 1


def test_a_restore_keeps_every_worker_busy(s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path) -> None:
    """With 2-4 MiB chunks, a 12 MiB in-flight cap kept 3 to 6 GETs going whatever the parallelism."""
    store = Concurrency(bucket=s3_endpoint.bucket, prefix=s3_prefix, **s3_endpoint.options())
    cs = CheckpointStore(store=store, identity=Identity.parse("wire/busy"), parallelism=8)
    lease = cs.acquire()
    manifest = cs.commit(lease, {"step": 1}, files=big_file(tmp_path, 48 * MIB))
    assert len(cs.tree(manifest).files[0].chunks) >= 12  # type: ignore[union-attr]
    cs.restore_files(manifest, tmp_path / "out")
    assert store.most == 8
    assert (tmp_path / "out" / "big.bin").read_bytes() == (tmp_path / "files" / "big.bin").read_bytes()

"""What the library sends to S3 for its hot paths, on the wire (botocore's ``before-send``, once per attempt).

A small commit is one conditional PUT of the head, sent without waiting for ``100 Continue``; large bodies keep
the handshake. These run on the session's S3 endpoint (moto by default, SeaweedFS or another server with
``STATEFUL_TEST_S3_ENDPOINT``), over HTTP with the real boto3 client.
"""

from __future__ import annotations

from typing import Any

import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.core.errors import FencedError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.stores.s3 import MIB
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

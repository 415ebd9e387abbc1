"""moto's threaded server loses updates; the serialized one (``MotoServer.start(serialized=True)``) does not.

The contract's compare-and-swap races only mean something on a server whose conditional writes are atomic.
moto checks ``If-Match`` and then stores the object without a lock, on one thread per request, so two
writers holding the same ETag can both win. These tests measure that on both servers, with the same
client and the same rounds:

* the lost-update test: 8 writers race ``PutObject(IfMatch=etag)`` on one key, round after round. The
  serialized server must never let two win. The threaded one must lose some: that shows the test sees a
  lost update when there is one (if moto ever checks under a lock, that test fails and says so);
* what a one-request-at-a-time server could break: ``Expect: 100-continue`` must be answered at once
  (botocore otherwise waits 1 s), a stalled upload or a half-read GET body must not block other requests,
  parallel multipart part uploads must finish, ListObjectsV2 must paginate.

Both servers run with ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=1024``: moto then writes every value above 1 KiB to
its spill file, and that write, between the check and the store, releases the GIL. That is the same window
every object above 5 MiB has with moto's defaults; with it, 4 KiB writes race often enough to measure in a
few seconds (measured: about 20% of rounds with two or more winners on the threaded server).
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from airflow_stateful.testing.s3_server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, MotoServer

pytestmark = [pytest.mark.s3, pytest.mark.slow]

BUCKET = "atomicity"
WRITERS = 8
ROUNDS = 100
MIB = 1024 * 1024


def client(server: MotoServer, **config: Any) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=DUMMY_ACCESS_KEY,
        aws_secret_access_key=DUMMY_SECRET_KEY,
        # One attempt: a retried write that had landed would be counted as a loser and hide a double win.
        config=Config(
            s3={"addressing_style": "path"}, retries={"max_attempts": 1}, max_pool_connections=16, **config
        ),
    )


def start(serialized: bool) -> MotoServer:
    env = pytest.MonkeyPatch()
    env.setenv("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", "1024")  # read by the server process only
    try:
        server = MotoServer.start(serialized=serialized)
    finally:
        env.undo()
    client(server).create_bucket(Bucket=BUCKET)
    return server


@pytest.fixture(scope="module")
def serialized() -> Iterator[MotoServer]:
    with start(serialized=True) as server:
        yield server


@pytest.fixture(scope="module")
def threaded() -> Iterator[MotoServer]:
    with start(serialized=False) as server:
        yield server


def race_once(clients: list[Any], key: str, etag: str, bodies: list[bytes]) -> list[int]:
    """All writers put ``IfMatch=etag`` at once; returns who won. Any answer but 200 or 412 fails the test."""
    barrier = threading.Barrier(len(clients))
    winners: list[int] = []
    errors: list[str] = []

    def write(i: int) -> None:
        barrier.wait()
        try:
            clients[i].put_object(Bucket=BUCKET, Key=key, Body=bodies[i], IfMatch=etag)
            winners.append(i)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "PreconditionFailed":
                errors.append(f"{key}, writer {i}: {exc}")
        except Exception as exc:
            errors.append(f"{key}, writer {i}: {exc!r}")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return winners


def lost_update_rounds(server: MotoServer, rounds: int, size: int = 4096) -> Counter[int]:
    """Race ``WRITERS`` conditional writes of one key per round; returns how many rounds had how many winners."""
    setup = client(server)
    clients = [client(server) for _ in range(WRITERS)]
    bodies = [os.urandom(size) for _ in range(WRITERS)]
    winners_per_round: Counter[int] = Counter()
    for round_ in range(rounds):
        key = f"race/{round_}"
        etag = setup.put_object(Bucket=BUCKET, Key=key, Body=b"start")["ETag"]
        winners = race_once(clients, key, etag, bodies)
        winners_per_round[len(winners)] += 1
        stored = setup.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert any(stored == bodies[i] for i in winners), f"{key}: the object holds no winner's body"
    return winners_per_round


def double_wins(histogram: Counter[int]) -> int:
    return sum(n for winners, n in histogram.items() if winners > 1)


def test_serialized_moto_never_lets_two_conditional_writes_win(
    serialized: MotoServer, record_property: Any
) -> None:
    histogram = lost_update_rounds(serialized, ROUNDS)
    record_property("winners_per_round", dict(histogram))
    print(f"serialized moto: winners per round {dict(histogram)} over {ROUNDS} rounds")
    assert histogram == Counter({1: ROUNDS}), (
        f"{double_wins(histogram)} of {ROUNDS} rounds had several winners: {dict(histogram)}"
    )


def test_threaded_moto_loses_updates(threaded: MotoServer, record_property: Any) -> None:
    """The measurement sees a lost update where one happens (else the serialized result would prove nothing)."""
    histogram = lost_update_rounds(threaded, ROUNDS)
    record_property("winners_per_round", dict(histogram))
    print(
        f"threaded moto: {double_wins(histogram)}/{ROUNDS} rounds with several winners, "
        f"winners per round {dict(histogram)}"
    )
    assert double_wins(histogram) > 0, (
        f"no lost update in {ROUNDS} rounds on moto's threaded server ({dict(histogram)}): either this "
        "test no longer provokes the race, or moto now checks If-Match under a lock (then the serialized "
        "server is no longer needed; see airflow_stateful/testing/moto_launcher.py)"
    )


class RawExchange:
    """One request over a raw socket, to see exactly what the server sends when (botocore hides it)."""

    def __init__(self, server: MotoServer, key: str, body: bytes, *, expect_continue: bool = False) -> None:
        self.body = body
        self.buffer = b""
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        head = f"PUT /{BUCKET}/{key} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Length: {len(body)}\r\n"
        if expect_continue:
            head += "Expect: 100-continue\r\n"
        self.sock.sendall(f"{head}\r\n".encode())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next_status(self, timeout: float) -> bytes | None:
        """The next status line (its header block consumed), or None if none came within ``timeout``."""
        self.sock.settimeout(timeout)
        while b"\r\n\r\n" not in self.buffer:
            try:
                chunk = self.sock.recv(4096)
            except TimeoutError:
                return None
            if not chunk:
                raise ConnectionError(f"connection closed; received {self.buffer!r}")
            self.buffer += chunk
        block, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        return block.split(b"\r\n", 1)[0]

    def final_status(self, timeout: float) -> bytes | None:
        """The first status line that is not ``100 Continue`` (werkzeug may send that one twice)."""
        while (status := self.next_status(timeout)) is not None and status.startswith(b"HTTP/1.1 100"):
            pass
        return status

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["serialized", "threaded"])
def test_a_stalled_upload_blocks_no_one_and_100_continue_comes_at_once(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """A client that stops halfway through a body holds up no other request (the serialized server reads
    bodies before it takes its lock), and ``Expect: 100-continue`` is answered at once, so botocore never
    waits its 1 s fallback. A single-threaded server fails both."""
    server: MotoServer = request.getfixturevalue(mode)
    held_body = os.urandom(64 * 1024)
    held = RawExchange(server, "held", held_body)
    held.send(held_body[: len(held_body) // 2])
    time.sleep(0.2)  # the server is now waiting for the rest of the held body
    second = RawExchange(server, "second", b"second", expect_continue=True)
    interim = second.next_status(0.5)
    assert interim is not None and interim.startswith(b"HTTP/1.1 100"), (
        f"no 100 Continue within 0.5 s: {interim!r}"
    )
    second.send(second.body)
    status = second.final_status(2)
    assert status is not None and status.startswith(b"HTTP/1.1 200"), (
        f"a request waited for a stalled upload: {status!r}"
    )
    held.send(held_body[len(held_body) // 2 :])
    assert (held.final_status(10) or b"").startswith(b"HTTP/1.1 200")
    held.close()
    second.close()
    s3 = client(server)
    assert s3.get_object(Bucket=BUCKET, Key="held")["Body"].read() == held_body
    assert s3.get_object(Bucket=BUCKET, Key="second")["Body"].read() == b"second"


def test_a_half_read_download_does_not_block_other_requests(serialized: MotoServer) -> None:
    """A client may keep a GET body open while it sends other requests (a single-threaded server hangs
    then: it cannot accept the next request until it has written the whole response)."""
    s3 = client(serialized, read_timeout=5)
    data = os.urandom(32 * MIB)  # well above loopback socket buffers
    s3.put_object(Bucket=BUCKET, Key="big", Body=data)
    stream = s3.get_object(Bucket=BUCKET, Key="big")["Body"]
    head = stream.read(1024)
    # A server blocked on the open download answers nothing until it is read to the end, which happens only
    # below: this PutObject would time out (5 s, then botocore's retries) and raise. No wall-clock bound here,
    # the machine may be loaded: the request succeeding while the body is still unread is the proof.
    client(serialized, read_timeout=5).put_object(Bucket=BUCKET, Key="meanwhile", Body=io.BytesIO(b"x"))
    assert client(serialized).get_object(Bucket=BUCKET, Key="meanwhile")["Body"].read() == b"x"
    assert head + stream.read() == data


def test_parallel_multipart_parts_and_listing_pages(serialized: MotoServer) -> None:
    """Parts of one upload sent from 5 threads at once all land (received in parallel, stored one by one),
    and ListObjectsV2 pages through continuation tokens as on S3."""
    s3 = client(serialized)
    parts = [os.urandom(5 * MIB) for _ in range(4)] + [b"tail"]
    upload_id = s3.create_multipart_upload(Bucket=BUCKET, Key="multi")["UploadId"]
    etags: dict[int, str] = {}

    def send(number: int) -> None:
        etags[number] = s3.upload_part(
            Bucket=BUCKET, Key="multi", UploadId=upload_id, PartNumber=number, Body=parts[number - 1]
        )["ETag"]

    threads = [threading.Thread(target=send, args=(n,)) for n in range(1, len(parts) + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(etags) == list(range(1, len(parts) + 1))
    s3.complete_multipart_upload(
        Bucket=BUCKET,
        Key="multi",
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]},
        IfNoneMatch="*",
    )
    assert s3.get_object(Bucket=BUCKET, Key="multi")["Body"].read() == b"".join(parts)

    keys = [f"list/{i:04d}" for i in range(250)]
    for key in keys:
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"")
    pages = list(
        s3.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix="list/", PaginationConfig={"PageSize": 100}
        )
    )
    assert [len(page["Contents"]) for page in pages] == [100, 100, 50]
    assert [o["Key"] for page in pages for o in page["Contents"]] == keys

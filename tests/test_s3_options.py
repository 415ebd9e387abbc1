"""S3 as enterprises run it: encryption, expected bucket owner, TLS, botocore config, profile, assumed role.

Everything runs against the real S3 endpoint (moto's server by default) with the real boto3 client. moto
stores and returns SSE-S3/SSE-KMS settings, so encryption is checked by HEAD on every object the package
wrote. moto accepts any ``ExpectedBucketOwner`` without enforcing it, so the owner is checked on the wire:
every request the client really sends (botocore's ``before-send`` event, once per attempt) is recorded over a
full commit + restore + GC cycle. moto's server also answers STS, so the assumed role is real: moto's own
record of the roles it handed out (``/moto-api/data.json``) is compared with the keys the S3 requests were
signed with. TLS ``verify`` runs through a real TLS terminator with a self-signed certificate.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import logging
import os
import re
import socket
import ssl
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity, collect_garbage
from airflow_stateful.core.errors import ConfigurationError, StoreError
from airflow_stateful.core.protocol.state_documents import (
    KeyValueStore,
    collect_expired,
    object_key,
    task_prefix,
)
from airflow_stateful.core.settings import LEASE_TTL
from airflow_stateful.core.stores.registry import store_from_url
from airflow_stateful.core.stores.s3 import S3ObjectStore
from airflow_stateful.core.stores.s3_session import assumed_role_credentials

pytestmark = pytest.mark.s3

MIB = 1024 * 1024
OWNER = "123456789012"  # moto's default account: the bucket really belongs to it
KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/1b1b1b1b-2c2c-3d3d-4e4e-5f5f5f5f5f5f"


@pytest.fixture
def moto(s3_endpoint: S3Endpoint) -> S3Endpoint:
    """Tests that use a made-up KMS key, account or role: only moto accepts them."""
    if s3_endpoint.kind != "moto":
        pytest.skip("uses a made-up KMS key, account and role that only moto accepts")
    return s3_endpoint


@dataclass
class Sent:
    operation: str
    method: str
    url: str
    headers: dict[str, str]


class Recorder:
    """Every HTTP request a boto3 client sends (each attempt), from botocore's ``before-send`` event."""

    def __init__(self, client: Any) -> None:
        self.sent: list[Sent] = []
        self._client = client
        client.meta.events.register("before-send", self._record)

    def _record(self, event_name: str, request: Any, **_: Any) -> None:
        headers = {
            k.lower(): v.decode() if isinstance(v, bytes) else str(v) for k, v in request.headers.items()
        }
        self.sent.append(Sent(event_name.split(".")[-1], request.method, request.url, headers))

    def close(self) -> None:
        self._client.meta.events.unregister("before-send", self._record)

    def operations(self) -> Counter[str]:
        return Counter(s.operation for s in self.sent)


def big_and_small(root: Path, *, big: int = 11 * MIB) -> Path:
    files = root / "files"
    (files / "nested").mkdir(parents=True)
    (files / "small.txt").write_text("small")
    (files / "nested" / "big.bin").write_bytes(os.urandom(big))  # multipart with 5 MiB parts
    return files


def full_cycle(store: S3ObjectStore, tmp: Path) -> dict[str, str]:
    """Every kind of request the package makes: commits (chunks, trees, an out-of-line manifest), restore
    (whole gets of chunks), a large object written in parts and read with ranged gets, retention deletes,
    crash-garbage GC, task state documents and their expiry, and the lost-completion check of a multipart
    upload (HeadObject) followed by its abort. Returns the keys written, by kind."""
    identity = Identity.parse(f"cycle/{uuid.uuid4().hex[:8]}")
    cs = CheckpointStore(store=store, identity=identity, keep_last=1)
    lease = cs.acquire()
    files = big_and_small(tmp)
    cs.commit(lease, {"step": 1}, files=files)
    # A value too big to ride inline in the head gets a manifest object of its own; keep_last=1: the first
    # checkpoint is deleted (DeleteObjects, off the commit path).
    second = cs.commit(lease, {"step": 2, "pad": "x" * 10_000}, files=files)
    restored = cs.restore_files(cs.latest() or second, tmp / "out")  # whole gets and ranged gets
    assert sorted(p.name for p in restored) == ["big.bin", "small.txt"]
    assert (tmp / "out" / "nested" / "big.bin").read_bytes() == (files / "nested" / "big.bin").read_bytes()
    orphan = f"{identity.key}/~chunks/{'cc' * 32}"
    store.put(orphan, b"left behind by a crashed writer", if_none_match=True)
    cs.release(lease)
    gc = collect_garbage(cs, min_age=datetime.timedelta(0), grace=0)
    assert orphan in gc.deleted

    documents = KeyValueStore(store=store)
    prefix = task_prefix(dag_id="d", run_id=f"r-{uuid.uuid4().hex[:6]}", task_id="t", map_index=None)
    kept, expired = object_key(prefix, "offset"), object_key(prefix, "old")
    documents.write(kept, '"42"')
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    documents.write(expired, '"0"', expires_at=past)
    assert expired in collect_expired(store).deleted  # a conditional DeleteObject
    documents.delete(object_key(prefix, "never-written"))

    # A second upload to an existing key: its completion loses (412), the object's ETag is checked
    # (HeadObject: not ours) and the upload is aborted.
    duplicate = f"{identity.key}/~chunks/{'dd' * 32}"
    store.upload_file(duplicate, files / "nested" / "big.bin")
    other = tmp / "other.bin"
    other.write_bytes(os.urandom(6 * MIB))
    with pytest.raises(Exception, match=r"lost|exists"):
        store.upload_file(duplicate, other)
    # Checkpoint chunks are at most 4 MiB (whole GETs); a large object is read with ranged GETs.
    big = files / "nested" / "big.bin"
    store.download_file(
        duplicate,
        tmp / "duplicate.bin",
        size=big.stat().st_size,
        sha256=hashlib.sha256(big.read_bytes()).hexdigest(),
    )
    assert (tmp / "duplicate.bin").read_bytes() == big.read_bytes()
    return {"head": f"{identity.key}/head.json", "state": kept, "duplicate": duplicate}


# -- encryption on every object written ---------------------------------------------------------------------
ENCRYPTIONS = {
    "sse-s3": {"server_side_encryption": "AES256"},
    "sse-kms": {"server_side_encryption": "aws:kms", "sse_kms_key_id": KMS_KEY, "bucket_key_enabled": True},
}


@pytest.mark.parametrize("kind", sorted(ENCRYPTIONS))
def test_every_object_written_carries_the_configured_encryption(
    moto: S3Endpoint, s3_prefix: str, tmp_path: Path, kind: str
) -> None:
    options = ENCRYPTIONS[kind]
    with moto.store(s3_prefix, part_size=5 * MIB, **options) as store:  # type: ignore[arg-type]
        recorder = Recorder(store.client)
        full_cycle(store, tmp_path)
        recorder.close()

    client = moto.client()  # a plain client: what S3 says about the objects, not what we sent
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=moto.bucket, Prefix=f"{s3_prefix}/"
        )
        for o in page.get("Contents", [])
    ]
    kinds = {"head.json": 0, "~manifests/": 0, "~trees/": 0, "~chunks/": 0, "~task-state/": 0}
    for key in keys:
        head = client.head_object(Bucket=moto.bucket, Key=key)
        assert head.get("ServerSideEncryption") == options["server_side_encryption"], key
        assert head.get("SSEKMSKeyId") == options.get("sse_kms_key_id"), key
        for marker in kinds:
            kinds[marker] += marker in key
    assert all(kinds.values()), (
        f"heads, manifests, trees, chunks and state documents were all checked: {kinds}"
    )
    multipart = [k for k in keys if client.head_object(Bucket=moto.bucket, Key=k)["ETag"].endswith('-3"')]
    assert multipart, "a multipart object was among them"

    # On the wire: both kinds of write carry the settings; parts inherit them (S3 refuses SSE on UploadPart).
    expected = {"x-amz-server-side-encryption": options["server_side_encryption"]}
    if kind == "sse-kms":
        expected["x-amz-server-side-encryption-aws-kms-key-id"] = KMS_KEY
        expected["x-amz-server-side-encryption-bucket-key-enabled"] = "true"
    writes = [s for s in recorder.sent if s.operation in ("PutObject", "CreateMultipartUpload")]
    assert {s.operation for s in writes} == {"PutObject", "CreateMultipartUpload"}
    for sent in writes:
        assert {k: sent.headers.get(k) for k in expected} == expected, (sent.operation, sent.url)
    for sent in recorder.sent:
        if sent.operation == "UploadPart":
            assert "x-amz-server-side-encryption" not in sent.headers
    if kind == "sse-kms":  # moto keeps the bucket-key flag of single-request objects
        head = client.head_object(Bucket=moto.bucket, Key=next(k for k in keys if k.endswith("head.json")))
        assert head.get("BucketKeyEnabled") is True


def test_conditional_writes_keep_their_meaning_with_encryption(moto: S3Endpoint, s3_prefix: str) -> None:
    from airflow_stateful.core.errors import PreconditionFailedError

    with moto.store(s3_prefix, **ENCRYPTIONS["sse-kms"]) as store:  # type: ignore[arg-type]
        etag = store.put("k", b"1", if_none_match=True)
        with pytest.raises(PreconditionFailedError):
            store.put("k", b"2", if_none_match=True)
        newer = store.put("k", b"2", if_match=etag)
        with pytest.raises(PreconditionFailedError):
            store.put("k", b"3", if_match=etag)
        assert store.get("k").etag == newer and store.get("k").data == b"2"


# -- expected bucket owner on every request -------------------------------------------------------------------
EVERY_OPERATION = {
    "PutObject",
    "GetObject",
    "HeadObject",
    "ListObjectsV2",
    "CreateMultipartUpload",
    "UploadPart",
    "CompleteMultipartUpload",
    "AbortMultipartUpload",
    "DeleteObject",
    "DeleteObjects",
}


def test_every_request_carries_the_expected_bucket_owner(
    moto: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    with moto.store(s3_prefix, part_size=5 * MIB, expected_bucket_owner=OWNER) as store:
        recorder = Recorder(store.client)
        full_cycle(store, tmp_path)
        recorder.close()
    assert set(recorder.operations()) >= EVERY_OPERATION, recorder.operations()
    ranged = [s for s in recorder.sent if s.operation == "GetObject" and "range" in s.headers]
    assert ranged, "the large object was read with ranged gets"
    missing = [
        (s.operation, s.url) for s in recorder.sent if s.headers.get("x-amz-expected-bucket-owner") != OWNER
    ]
    assert not missing, f"requests without x-amz-expected-bucket-owner: {missing}"


def test_no_owner_header_unless_configured(s3_endpoint: S3Endpoint, s3_prefix: str) -> None:
    """The recorder sees headers for real: without the option, no request carries one."""
    with s3_endpoint.store(s3_prefix) as store:
        recorder = Recorder(store.client)
        store.put("a", b"1")
        store.get("a")
        recorder.close()
    assert recorder.sent and not any("x-amz-expected-bucket-owner" in s.headers for s in recorder.sent)


def test_the_options_cost_no_request(moto: S3Endpoint, s3_prefix: str, tmp_path: Path) -> None:
    """A small commit sends as many requests with encryption and owner as without: a re-save of unchanged
    files 2 (the tree's check, the head), a value-only save 1 (the head, its manifest inline)."""

    def count(**options: Any) -> list[int]:
        with moto.store(f"{s3_prefix}/{len(options)}", **options) as store:
            cs = CheckpointStore(store=store, identity=Identity.parse("count/me"))
            lease = cs.acquire()
            (tmp_path / "files").mkdir(exist_ok=True)
            (tmp_path / "files" / "a.txt").write_text("hello")
            cs.commit(lease, {"step": 0}, files=tmp_path / "files")
            recorder = Recorder(store.client)
            cs.commit(lease, {"step": 1}, files=tmp_path / "files")
            small = len(recorder.sent)
            cs.commit(lease, {"step": 2})
            recorder.close()
            return [small, len(recorder.sent) - small]

    plain = count()
    assert count(expected_bucket_owner=OWNER, **ENCRYPTIONS["sse-kms"]) == plain  # type: ignore[arg-type]
    assert plain == [2, 1]


# -- botocore config and TLS -------------------------------------------------------------------------------
def test_config_kwargs_reach_the_client_merged_with_the_stores_needs(moto: S3Endpoint) -> None:
    store = S3ObjectStore(
        bucket=moto.bucket,
        max_concurrency=8,
        config_kwargs={
            "connect_timeout": 3,
            "read_timeout": 7,
            "retries": {"mode": "adaptive", "total_max_attempts": 3},
            "max_pool_connections": 2,  # too few for 16 chunks in flight: raised to 4 x max_concurrency
            "s3": {"addressing_style": "virtual"},
        },
        **moto.options(),
    )
    config = store.client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (3, 7)
    assert config.retries == {"mode": "adaptive", "total_max_attempts": 3}
    assert config.max_pool_connections == 32
    assert config.s3 == {"addressing_style": "virtual"}

    down = S3ObjectStore(
        bucket=moto.bucket,
        config_kwargs={"retries": {"mode": "standard", "total_max_attempts": 3}, "connect_timeout": 1},
        **{**moto.options(), "endpoint_url": "http://127.0.0.1:9"},  # nothing listens there
    )
    recorder = Recorder(down.client)
    with pytest.raises(StoreError, match="cannot reach"):
        down.get("k")
    assert len(recorder.sent) == 3, "total_max_attempts=3: three real attempts"


def test_default_config(moto: S3Endpoint) -> None:
    config = S3ObjectStore(bucket=moto.bucket, **moto.options()).client.meta.config
    assert config.retries == {"mode": "standard", "total_max_attempts": 6}  # max_attempts 5, as before
    assert config.s3 == {"addressing_style": "path"}
    assert config.max_pool_connections == 16  # 8 chunks in flight and the heads read beside them
    # Tuned down from botocore's 60 s each (issue 14): a hung endpoint fails a request after at most
    # 6 x (5 + 20) s plus under 2 s of backoff, a quarter of the default lease ttl, so the lease heartbeat and
    # a commit hear of it long before the lease could expire unnoticed.
    assert (config.connect_timeout, config.read_timeout) == (5, 20)
    worst = config.retries["total_max_attempts"] * (config.connect_timeout + config.read_timeout) + 2
    assert worst <= LEASE_TTL / 3


def test_default_timeouts_yield_to_config_kwargs(moto: S3Endpoint) -> None:
    config = S3ObjectStore(
        bucket=moto.bucket, config_kwargs={"read_timeout": 120}, **moto.options()
    ).client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (5, 120)


class TlsTerminator:
    """A real TLS endpoint on 127.0.0.1 with a self-signed certificate, forwarding to an HTTP endpoint."""

    def __init__(self, target: str, directory: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stateful-test-ca")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
            )
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        self.ca_bundle = directory / "ca.pem"
        self.ca_bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file = directory / "key.pem"
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self.ca_bundle, key_file)
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()  # the client refused our certificate
            return
        upstream = socket.create_connection(self.target)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pump, args=(upstream, tls), daemon=True).start()
        pump(tls, upstream)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def tls(moto: S3Endpoint, tmp_path: Path) -> Iterator[TlsTerminator]:
    assert moto.endpoint_url
    terminator = TlsTerminator(moto.endpoint_url, tmp_path)
    yield terminator
    terminator.close()


def test_verify_takes_a_ca_bundle_or_false(moto: S3Endpoint, s3_prefix: str, tls: TlsTerminator) -> None:
    options = {**moto.options(), "endpoint_url": tls.url}
    untrusted = S3ObjectStore(
        bucket=moto.bucket, prefix=s3_prefix, config_kwargs={"retries": {"total_max_attempts": 1}}, **options
    )
    with pytest.raises(StoreError, match=r"SSL|certificate"):
        untrusted.put("k", b"1")  # botocore's default trust store does not know our CA

    trusted = S3ObjectStore(bucket=moto.bucket, prefix=s3_prefix, verify=str(tls.ca_bundle), **options)
    trusted.put("k", b"over TLS")
    unverified = S3ObjectStore(bucket=moto.bucket, prefix=s3_prefix, verify=False, **options)
    assert unverified.get("k").data == b"over TLS"


# -- credentials: profile and assumed role -----------------------------------------------------------------
def signing_key(sent: Sent) -> str:
    match = re.search(r"Credential=([A-Z0-9]+)/", sent.headers.get("authorization", ""))
    assert match, sent.headers
    return match.group(1)


def test_profile_name_is_the_source_of_credentials(
    moto: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[stateful-test]\naws_access_key_id = AKIAPROFILE000000001\naws_secret_access_key = s\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    store = S3ObjectStore(
        bucket=moto.bucket,
        prefix=s3_prefix,
        endpoint_url=moto.endpoint_url,
        region_name=moto.region,
        profile_name="stateful-test",
    )
    recorder = Recorder(store.client)
    store.put("k", b"1")
    assert [signing_key(s) for s in recorder.sent] == ["AKIAPROFILE000000001"]
    with pytest.raises(ConfigurationError, match="profile_name 'no-such-profile' is not in the AWS config"):
        S3ObjectStore(bucket=moto.bucket, endpoint_url=moto.endpoint_url, profile_name="no-such-profile")


class StsRecorder:
    """A plain HTTP proxy in front of moto's STS that keeps every request and answer it forwards.

    What the connection's role assumption really sent (``RoleArn``, ``RoleSessionName``, ``ExternalId``) and
    the credentials STS really answered, seen on the wire rather than inside botocore.
    """

    def __init__(self, target: str) -> None:
        import http.client
        import http.server
        from urllib.parse import parse_qs, urlparse

        self.calls: list[dict[str, str]] = []
        self.answers: list[dict[str, str]] = []
        recorder = self
        upstream = urlparse(target)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # STS's query protocol: form-encoded POSTs
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.calls.append({k: v[0] for k, v in parse_qs(body.decode()).items()})
                conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request("POST", self.path, body=body, headers=headers)
                response = conn.getresponse()
                answer = response.read()
                found = dict(
                    re.findall(r"<(AccessKeyId|SecretAccessKey|SessionToken)>([^<]+)<", answer.decode())
                )
                if found:
                    recorder.answers.append(found)
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "server",
                        "date",
                    ):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sts(moto: S3Endpoint) -> Iterator[StsRecorder]:
    assert moto.endpoint_url
    recorder = StsRecorder(moto.endpoint_url)
    yield recorder
    recorder.close()


def test_role_arn_signs_every_request_with_the_roles_credentials(
    moto: S3Endpoint, sts: StsRecorder, s3_prefix: str, tmp_path: Path
) -> None:
    role_arn = f"arn:aws:iam::{OWNER}:role/stateful-{uuid.uuid4().hex[:8]}"
    external_id = f"ext-{uuid.uuid4().hex[:8]}"
    store = S3ObjectStore(
        bucket=moto.bucket,
        prefix=s3_prefix,
        role_arn=role_arn,
        assume_role_kwargs={"RoleSessionName": "Airflow_stateful_test", "ExternalId": external_id},
        sts_endpoint_url=sts.url,
        **moto.options(),
    )
    assert sts.calls == [], "building the store costs no STS request"
    recorder = Recorder(store.client)
    cs = CheckpointStore(store=store, identity=Identity.parse("assumed/role"))
    lease = cs.acquire()
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "f.txt").write_text("x")
    cs.commit(lease, {"step": 1}, files=tmp_path / "files")
    assert cs.latest() is not None

    assert len(sts.calls) == 1, "one AssumeRole for the whole cycle"
    call = sts.calls[0]
    assert (call["Action"], call["RoleArn"]) == ("AssumeRole", role_arn)
    assert (call["RoleSessionName"], call["ExternalId"]) == ("Airflow_stateful_test", external_id)
    answer = sts.answers[0]
    assert {signing_key(s) for s in recorder.sent} == {answer["AccessKeyId"]}, "never the source key"
    assert {s.headers.get("x-amz-security-token") for s in recorder.sent} == {answer["SessionToken"]}


def test_role_credentials_are_renewed_before_they_expire(moto: S3Endpoint, sts: StsRecorder) -> None:
    """A role session of 15 min (STS's shortest): kept for 9 min, renewed once less than 5 min are left."""
    role_arn = f"arn:aws:iam::{OWNER}:role/stateful-{uuid.uuid4().hex[:8]}"
    client = boto3.client("sts", endpoint_url=sts.url, region_name=moto.region, **moto.credentials)
    offset = datetime.timedelta(0)

    def clock() -> datetime.datetime:
        return datetime.datetime.now(datetime.timezone.utc) + offset

    kwargs = {"RoleArn": role_arn, "RoleSessionName": "renewal", "DurationSeconds": 900}
    credentials = assumed_role_credentials(client, kwargs, time_fetcher=clock)
    assert sts.calls == [], "deferred: nothing is fetched before the first use"
    first = credentials.get_frozen_credentials().access_key
    offset = datetime.timedelta(minutes=9)
    assert credentials.get_frozen_credentials().access_key == first
    assert len(sts.calls) == 1
    offset = datetime.timedelta(minutes=11)
    renewed = credentials.get_frozen_credentials().access_key
    assert renewed != first and len(sts.calls) == 2
    assert [a["AccessKeyId"] for a in sts.answers] == [first, renewed]
    assert role_arn in repr(credentials) and first not in repr(credentials)


# -- bad input: a clear error naming the value, before anything is written -------------------------------------
BAD = [
    (
        {"server_side_encryption": "AES-256"},
        "server_side_encryption must be one of AES256, aws:kms, aws:kms:dsse, not 'AES-256'",
    ),
    (
        {"server_side_encryption": "AES256", "sse_kms_key_id": "alias/k"},
        "sse_kms_key_id 'alias/k' needs server_side_encryption aws:kms",
    ),
    (
        {"sse_kms_key_id": "alias/k"},
        "sse_kms_key_id 'alias/k' needs server_side_encryption aws:kms or aws:kms:dsse, not None",
    ),
    (
        {"server_side_encryption": "AES256", "bucket_key_enabled": True},
        "bucket_key_enabled True needs server_side_encryption aws:kms",
    ),
    (
        {"server_side_encryption": "aws:kms", "bucket_key_enabled": "yes"},
        "bucket_key_enabled must be true or false, not 'yes'",
    ),
    (
        {"expected_bucket_owner": 12345678901},
        "expected_bucket_owner must be a 12-digit AWS account id, not 12345678901 (write it as a string",
    ),
    ({"expected_bucket_owner": "me"}, "expected_bucket_owner must be a 12-digit AWS account id, not 'me'"),
    ({"verify": "false"}, "verify must be true, false or the path of a CA bundle, not the string 'false'"),
    ({"verify": 1}, "verify must be true, false or the path of a CA bundle, not 1"),
    ({"verify": "/no/such/ca.pem"}, "verify: the CA bundle '/no/such/ca.pem' does not exist"),
    ({"config_kwargs": {"retry": {}}}, "config_kwargs has the unknown key(s) 'retry'; accepted: client_cert"),
    (
        {"config_kwargs": {"retries": {"mode": "fast"}}},
        "config_kwargs.retries.mode must be one of legacy, standard, adaptive, not 'fast'",
    ),
    (
        {"config_kwargs": {"connect_timeout": "5"}},
        "config_kwargs.connect_timeout must be a number >= 0.001, not '5'",
    ),
    (
        {"config_kwargs": {"s3": {"addressing_style": "host"}}},
        "config_kwargs.s3.addressing_style must be one of auto, path, virtual, not 'host'",
    ),
    (
        {"config_kwargs": {"signature_version": "unsigned"}},
        "config_kwargs.signature_version 'unsigned' cannot write",
    ),
    (
        {"role_arn": "my-role"},
        "role_arn must be an IAM role ARN (arn:aws:iam::<account>:role/<name>), not 'my-role'",
    ),
    (
        {"role_arn": f"arn:aws:iam::{OWNER}:role/r", "assume_role_kwargs": {"SerialNumber": "x"}},
        "assume_role_kwargs has the unsupported key(s) 'SerialNumber' (MFA codes",
    ),
    (
        {"role_arn": f"arn:aws:iam::{OWNER}:role/r", "assume_role_kwargs": {"DurationSeconds": 60}},
        "assume_role_kwargs.DurationSeconds must be an integer >= 900, not 60",
    ),
    ({"assume_role_kwargs": {"ExternalId": "xx"}}, "assume_role_kwargs is set but role_arn is not"),
]


@pytest.mark.parametrize(("options", "message"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_options_are_refused_before_anything_is_written(
    s3_endpoint: S3Endpoint, s3_prefix: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        store_from_url(f"s3://{s3_endpoint.bucket}/{s3_prefix}", **s3_endpoint.options(), **options)
    assert message in str(caught.value)
    assert not list(s3_endpoint.store(s3_prefix).list_objects("")), "nothing was written"


def test_s3_options_on_a_local_directory_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"S3 option.* expected_bucket_owner do not apply"):
        store_from_url(tmp_path.as_uri(), expected_bucket_owner=OWNER)


# -- secrets ---------------------------------------------------------------------------------------------------
def test_secrets_never_show_in_reprs_errors_or_logs(
    moto: S3Endpoint, sts: StsRecorder, s3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret_key = f"SECRETKEY{uuid.uuid4().hex}"
    token = f"SESSIONTOKEN{uuid.uuid4().hex}"
    role_arn = f"arn:aws:iam::{OWNER}:role/stateful-{uuid.uuid4().hex[:8]}"
    texts: list[str] = []
    caplog.set_level(logging.DEBUG, logger="airflow_stateful")
    common = {
        "endpoint_url": moto.endpoint_url,
        "region_name": moto.region,
        "aws_access_key_id": "AKIASOURCE0000000001",
        "aws_secret_access_key": secret_key,
        "aws_session_token": token,
    }
    with pytest.raises(ConfigurationError) as bad:
        S3ObjectStore(bucket=moto.bucket, server_side_encryption="AES-256", **common)
    texts.append(str(bad.value))

    store = S3ObjectStore(
        bucket=moto.bucket,
        prefix=s3_prefix,
        role_arn=role_arn,
        sts_endpoint_url=sts.url,
        expected_bucket_owner=OWNER,
        server_side_encryption="aws:kms",
        **common,
    )
    store.put("k", b"1")  # the role is assumed: its credentials exist now
    role_secrets = [(a["SecretAccessKey"], a["SessionToken"]) for a in sts.answers]
    assert len(role_secrets) == 1
    texts += [repr(store), str(store), repr(store.client)]
    for failing in (
        S3ObjectStore(
            bucket="no-such-bucket-stateful", role_arn=role_arn, sts_endpoint_url=sts.url, **common
        ),
        S3ObjectStore(
            bucket=moto.bucket,
            config_kwargs={"retries": {"total_max_attempts": 1}},
            **{**common, "endpoint_url": "http://127.0.0.1:9"},
        ),
    ):
        with pytest.raises(StoreError) as caught:
            failing.get("k")
        texts += [str(caught.value), repr(caught.value), repr(failing)]
    texts += [record.getMessage() for record in caplog.records]
    for secret in (secret_key, token, *role_secrets[0]):
        assert not any(secret in text for text in texts), secret[:12]


# -- the `aws` connection, read the amazon provider's way -----------------------------------------------------
def connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, **conn: Any) -> str:
    import json

    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "aws", **conn}))
    return conn_id


def hook_options(conn_id: str) -> dict[str, Any]:
    from airflow_stateful.hooks.state import StateHook

    return StateHook(backend_url="s3://some-bucket/p", conn_id=conn_id).s3_options()


def test_the_hook_reads_the_amazon_providers_extras(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked before use")
    conn_id = connection(
        monkeypatch,
        "stateful_enterprise",
        login="AKIAEXAMPLE000000001",
        password="s3cr3t",
        extra={
            "region_name": "eu-west-1",
            "verify": str(ca),
            "profile_name": "ignored-with-keys",
            "role_arn": f"arn:aws:iam::{OWNER}:role/state-writer",
            "assume_role_kwargs": {"ExternalId": "tenant-7", "DurationSeconds": 3600},
            "config_kwargs": {"retries": {"mode": "adaptive", "max_attempts": 10}, "read_timeout": 120},
            "endpoint_url": "http://global.example:9000",
            "service_config": {
                "s3": {
                    "endpoint_url": "http://s3.example:9000",  # wins over the global one
                    "bucket_name": "the-amazon-providers-own-key",
                    "extra_args": {
                        "ServerSideEncryption": "aws:kms",
                        "SSEKMSKeyId": KMS_KEY,
                        "BucketKeyEnabled": True,
                        "ExpectedBucketOwner": OWNER,
                    },
                },
                "sts": {"endpoint_url": "http://sts.example:9000"},
                "ecr": {"endpoint_url": "http://ecr.example"},
            },
            "aws_account_id": "other hooks' business",
        },
    )
    assert hook_options(conn_id) == {
        "aws_access_key_id": "AKIAEXAMPLE000000001",
        "aws_secret_access_key": "s3cr3t",
        "region_name": "eu-west-1",
        "profile_name": "ignored-with-keys",
        "role_arn": f"arn:aws:iam::{OWNER}:role/state-writer",
        "assume_role_kwargs": {
            "ExternalId": "tenant-7",
            "DurationSeconds": 3600,
            "RoleSessionName": "Airflow_stateful_enterprise",  # the amazon provider's default name
        },
        "endpoint_url": "http://s3.example:9000",
        "sts_endpoint_url": "http://sts.example:9000",
        "verify": str(ca),
        "config_kwargs": {"retries": {"mode": "adaptive", "max_attempts": 10}, "read_timeout": 120},
        "server_side_encryption": "aws:kms",
        "sse_kms_key_id": KMS_KEY,
        "bucket_key_enabled": True,
        "expected_bucket_owner": OWNER,
    }


def test_the_hook_takes_keys_from_the_extra_only_in_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    conn_id = connection(
        monkeypatch,
        "stateful_extra_keys",
        login="AKIALONELOGIN0000001",  # without a password: ignored, as in the amazon provider
        extra={
            "aws_access_key_id": "AKIAEXTRA00000000001",
            "aws_secret_access_key": "x",
            "aws_session_token": "t",
        },
    )
    options = hook_options(conn_id)
    assert (options["aws_access_key_id"], options["aws_session_token"]) == ("AKIAEXTRA00000000001", "t")


HOOK_BAD = [
    (
        {"service_config": {"s3": {"extra_args": {"ACL": "public-read"}}}},
        "connection 'stateful_bad' extra service_config.s3.extra_args has the unsupported key(s) 'ACL'",
    ),
    (
        {"service_config": {"s3": {"extra_args": {"ServerSideEncryption": "aws:kmz"}}}},
        "connection 'stateful_bad' extra service_config.s3.extra_args.ServerSideEncryption must be one of AES256, "
        "aws:kms, aws:kms:dsse, not 'aws:kmz'",
    ),
    (
        {"service_config": {"s3": {"extra_args": {"SSEKMSKeyId": "alias/k"}}}},
        "extra service_config.s3.extra_args.SSEKMSKeyId 'alias/k' needs "
        "connection 'stateful_bad' extra service_config.s3.extra_args.ServerSideEncryption aws:kms",
    ),
    (
        {"verify": "False"},
        "connection 'stateful_bad' extra verify must be true, false or the path of a CA bundle",
    ),
    (
        {"config_kwargs": {"retires": 3}},
        "connection 'stateful_bad' extra config_kwargs has the unknown key(s) 'retires'",
    ),
    (
        {"role_arn": f"arn:aws:iam::{OWNER}:role/r", "assume_role_method": "assume_role_with_web_identity"},
        "connection 'stateful_bad' extra assume_role_method 'assume_role_with_web_identity' is not supported",
    ),
    (
        {"service_config": {"s3": "http://x"}},
        "connection 'stateful_bad' extra service_config.s3 must be a JSON object",
    ),
    ({"aws_secret_access_key": 123456789}, "extra aws_secret_access_key must be a string, not int"),
]


@pytest.mark.parametrize(("extra", "message"), HOOK_BAD, ids=[str(i) for i in range(len(HOOK_BAD))])
def test_bad_connection_extras_are_named_before_anything_is_written(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], message: str
) -> None:
    # A password without a login is not used (the amazon provider's rule), so the extra's keys are read too.
    connection(monkeypatch, "stateful_bad", password="hunter2-secret", extra=extra)
    with pytest.raises(ConfigurationError) as caught:
        hook_options("stateful_bad")
    assert message in str(caught.value)
    assert "hunter2-secret" not in str(caught.value) and "123456789" not in str(caught.value)


def test_a_store_from_the_connection_encrypts_and_names_the_owner(
    moto: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: the connection alone (endpoint in service_config.s3) configures a store that writes with
    SSE-KMS and sends the expected owner."""
    from airflow_stateful.hooks.state import StateHook

    conn_id = connection(
        monkeypatch,
        "stateful_kms",
        login=moto.credentials["aws_access_key_id"],
        password=moto.credentials["aws_secret_access_key"],
        extra={
            "region_name": moto.region,
            "service_config": {
                "s3": {
                    "endpoint_url": moto.endpoint_url,
                    "extra_args": {
                        "ServerSideEncryption": "aws:kms",
                        "SSEKMSKeyId": KMS_KEY,
                        "ExpectedBucketOwner": OWNER,
                    },
                }
            },
        },
    )
    hook = StateHook(backend_url=f"s3://{moto.bucket}/{s3_prefix}", conn_id=conn_id)
    store = hook.get_store()
    assert isinstance(store, S3ObjectStore)
    recorder = Recorder(store.client)
    cs = hook.checkpoint_store(Identity.parse("from/connection"))
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "f.txt").write_text("x")
    cs.commit(cs.acquire(), {"step": 1}, files=tmp_path / "files")
    hook.close()
    assert recorder.sent and all(s.headers.get("x-amz-expected-bucket-owner") == OWNER for s in recorder.sent)
    client = moto.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=moto.bucket, Prefix=f"{s3_prefix}/")["Contents"]]
    assert len(keys) == 3  # head, manifest, data file
    for key in keys:
        head = client.head_object(Bucket=moto.bucket, Key=key)
        assert (head["ServerSideEncryption"], head["SSEKMSKeyId"]) == ("aws:kms", KMS_KEY)

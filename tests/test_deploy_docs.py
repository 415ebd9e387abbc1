"""The IAM policy of docs/deploy.md is measured, not guessed.

Every S3 operation the library's real S3 store sends is recorded (a botocore ``before-parameter-build.s3``
hook on the store's own client) while it does what deployments do, against moto's server over HTTP: a writer
session commits a small value, a value with a manifest of its own, a few small files and a file larger than
both a chunk and the store's multipart part size, restores and verifies, and a task's state is deleted on
success; the ``airflow-stateful`` verbs run in-process on the same store (``ls``, ``du``, ``show``,
``history``, ``cat --files``, ``verify --all``, ``rollback``, ``unlock``, ``gc`` with retention and idle
deletion); the task state store's documents are written, read, deleted and expired; and a store configured
for SSE-KMS commits and restores.

The operations are mapped to IAM actions and compared with ``deploy/iam-policy.json``: it must grant every
action used and no other; every key must fall inside the policy's object resource and every listing below
the prefix; every write must carry a condition header (so the bucket policy's deny of unconditional writes
never blocks the library) and every delete of a head must be conditional. The JSON blocks of docs/deploy.md
must be these documents.

What this cannot show: that AWS evaluates the documents as described (moto does not enforce IAM or bucket
policies, nor KMS key policies). That part rests on AWS's documentation, quoted in docs/deploy.md.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.cli import main as cli_main
from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.protocol.state_documents import (
    KeyValueStore,
    collect_expired,
    object_key,
    task_prefix,
)
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.settings import StatefulSettings
from airflow_stateful.core.stores.s3 import S3ObjectStore

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parent.parent
POLICY_FILE = REPO / "deploy" / "iam-policy.json"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
MIB = 1024 * 1024
DAY = 86400.0

#: S3 API operation -> the IAM actions it needs (AWS's "Actions, resources, and condition keys for Amazon S3").
#: Operations the library does not send today are listed too, so that a new one maps to its real action and
#: the comparison with the policy fails, rather than the test.
OPERATION_ACTIONS: dict[str, frozenset[str]] = {
    "GetObject": frozenset({"s3:GetObject"}),
    "HeadObject": frozenset({"s3:GetObject"}),
    "PutObject": frozenset({"s3:PutObject"}),
    "CreateMultipartUpload": frozenset({"s3:PutObject"}),
    "UploadPart": frozenset({"s3:PutObject"}),
    "CompleteMultipartUpload": frozenset({"s3:PutObject"}),
    "AbortMultipartUpload": frozenset({"s3:AbortMultipartUpload"}),
    "ListParts": frozenset({"s3:ListMultipartUploadParts"}),
    "ListMultipartUploads": frozenset({"s3:ListBucketMultipartUploads"}),
    "ListObjectsV2": frozenset({"s3:ListBucket"}),
    "ListObjects": frozenset({"s3:ListBucket"}),
    "HeadBucket": frozenset({"s3:ListBucket"}),
    "GetBucketLocation": frozenset({"s3:GetBucketLocation"}),
    "DeleteObject": frozenset({"s3:DeleteObject"}),
    "DeleteObjects": frozenset({"s3:DeleteObject"}),
    "CopyObject": frozenset({"s3:GetObject", "s3:PutObject"}),
    "GetObjectTagging": frozenset({"s3:GetObjectTagging"}),
    "PutObjectTagging": frozenset({"s3:PutObjectTagging"}),
}
MULTIPART = {"CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "AbortMultipartUpload"}
BUCKET_LEVEL = {"ListObjectsV2", "ListObjects", "HeadBucket", "GetBucketLocation", "ListMultipartUploads"}
KMS_ACTIONS = {"kms:GenerateDataKey", "kms:Decrypt"}
KMS_KEY = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"


# -- recording ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    operation: str
    params: dict[str, Any]


class Recorder:
    """Records each API call a boto3 client makes (once per call, whatever botocore retries)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        #: (operation, error code) of every answer that was an error, e.g. ("GetObject", "NoSuchKey").
        self.errors: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def attach(self, store: S3ObjectStore) -> S3ObjectStore:
        store.client.meta.events.register("before-parameter-build.s3", self._record)
        store.client.meta.events.register("after-call.s3", self._answer)
        return store

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        kept = {k: v for k, v in params.items() if k != "Body"}  # chunks are up to 4 MiB: keep no bytes
        with self._lock:
            self.calls.append(Call(model.name, kept))

    def _answer(self, parsed: dict[str, Any], model: Any, **_: Any) -> None:
        code = (parsed.get("Error") or {}).get("Code")
        if code:
            with self._lock:
                self.errors.append((model.name, str(code)))

    def operations(self) -> set[str]:
        return {call.operation for call in self.calls}

    def of(self, *operations: str) -> list[Call]:
        return [call for call in self.calls if call.operation in operations]


# -- policy helpers ----------------------------------------------------------------------------------------
def as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def iam_like(pattern: str, text: str) -> bool:
    """IAM's wildcard match (ARNs and ``StringLike``): ``*`` any run of characters, ``?`` any one."""
    regex = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.fullmatch(regex, text, flags=re.DOTALL) is not None


def check_policy_shape(doc: Any, *, bucket_policy: bool) -> None:
    """The shape IAM accepts: Version 2012-10-17, a non-empty Statement list of Effect/Action/Resource."""
    assert isinstance(doc, dict) and set(doc) == {"Version", "Statement"}, doc
    assert doc["Version"] == "2012-10-17"
    statements = doc["Statement"]
    assert isinstance(statements, list) and statements
    sids = [s.get("Sid") for s in statements]
    assert len(set(sids)) == len(sids) and all(isinstance(s, str) and s.isalnum() for s in sids), sids
    allowed = {"Sid", "Effect", "Action", "Resource", "Condition"} | (
        {"Principal"} if bucket_policy else set()
    )
    for statement in statements:
        assert set(statement) <= allowed, statement
        assert statement["Effect"] in ("Allow", "Deny")
        assert ("Principal" in statement) is bucket_policy, statement
        for field in ("Action", "Resource"):
            values = as_list(statement[field])
            assert values and all(isinstance(v, str) and v for v in values), statement
        assert all(re.fullmatch(r"(s3|kms):[A-Za-z*]+", a) for a in as_list(statement["Action"]))
        assert all(r.startswith("arn:aws:") for r in as_list(statement["Resource"]))
        condition = statement.get("Condition", {})
        assert isinstance(condition, dict)
        assert all(isinstance(v, dict) and v for v in condition.values()), condition


def fill(doc: Any, **values: str) -> Any:
    """The document with its ``<PLACEHOLDER>``s replaced."""
    text = json.dumps(doc)
    for name, value in values.items():
        text = text.replace(f"<{name}>", value)
    assert "<" not in text, f"a placeholder is left: {text}"
    return json.loads(text)


def doc_json_blocks() -> dict[str, Any]:
    """The JSON blocks of docs/deploy.md, by the HTML comment naming each one (``<!-- policy: NAME -->``)."""
    text = DEPLOY_DOC.read_text()
    found = re.findall(r"<!-- policy: ([\w-]+) -->\s*```json\n(.*?)```", text, flags=re.DOTALL)
    return {name: json.loads(body) for name, body in found}


def allows(statements: list[dict[str, Any]], action: str, resource: str) -> list[dict[str, Any]]:
    return [
        s
        for s in statements
        if s["Effect"] == "Allow"
        and action in as_list(s["Action"])
        and any(iam_like(pattern, resource) for pattern in as_list(s["Resource"]))
    ]


# -- the workload ------------------------------------------------------------------------------------------
@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """``airflow-stateful`` run in-process on a given store (as ``open_store`` would return it)."""
    current: dict[str, S3ObjectStore] = {}

    def open_store(args: Any) -> S3ObjectStore:
        args.lease_grace = 60.0
        args.settings = StatefulSettings(backend_url=current["store"].url)  # the [stateful] defaults
        args.signer = args.marks = None  # no head signing configured, so no marks
        return current["store"]

    monkeypatch.setattr(cli_main, "open_store", open_store)

    def run(store: S3ObjectStore, *argv: str) -> Any:
        current["store"] = store
        code = cli_main.main([*argv, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, f"airflow-stateful {' '.join(argv)} exited {code}: {err}"
        return json.loads(out) if out.strip() else None

    yield run


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def digests(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_workload(store: S3ObjectStore, tmp_path: Path, cli: Any) -> None:
    """What a deployment does with its store, each step checked so the recording is of work that happened."""
    batch = Identity.for_task(dag_id="etl", task_id="crunch", run_id="manual__1")
    idle = Identity.for_task(dag_id="etl", task_id="old", name="watermark")
    big = os.urandom(12 * MIB)  # several chunks, and larger than the store's 8 MiB multipart threshold
    assert len(big) > store.part_size
    small = write_tree(
        tmp_path / "small", {"a.txt": b"a" * 100, "sub/b.json": b'{"b": 1}', "c.bin": b"c" * 5000}
    )
    large = write_tree(tmp_path / "large", {"model.bin": big, "notes.txt": b"notes"})

    # A task's writer session: a value alone, a value with its own manifest object (over 8 KiB), small files,
    # a large file, the same large file again (deduplicated), then restore. keep_last=2 makes retention drop
    # checkpoints, which the session's sweep deletes.
    cs = CheckpointStore(store=store, identity=batch, keep_last=2)
    with WriterSession(checkpoints=cs, writer=WriterInfo.current(task_id="crunch", try_number=1)) as session:
        session.commit({"next": 10})
        session.commit({"next": 20, "notes": "x" * 20_000})
        session.commit({"next": 30}, files=small)
        session.commit({"next": 40}, files=large)
        (large / "notes.txt").write_bytes(b"notes, changed")
        latest = session.commit({"next": 50}, files=large)
        restored = session.restore_files(tmp_path / "restored")
        assert restored and digests(tmp_path / "restored") == digests(large)
    cs.verify(latest)  # reads back and hashes every chunk

    # A retry's session resumes from the newest checkpoint.
    with WriterSession(checkpoints=cs, writer=WriterInfo.current(task_id="crunch", try_number=2)) as retry:
        assert retry.value == {"next": 50}

    # A task whose state is deleted when it succeeds (on_success="delete").
    done = CheckpointStore(store=store, identity=Identity.for_task(dag_id="etl", task_id="done", run_id="r"))
    with WriterSession(checkpoints=done, writer=WriterInfo.current(task_id="done")) as finishing:
        finishing.commit({"rows": 3}, files=small)
        assert finishing.purge() > 1
    assert done.head() is None and not list(store.list_objects("etl/done/"))

    # An identity nobody updated for 40 days, for GC's idle deletion.
    old = CheckpointStore(store=store, identity=idle, clock=lambda: time.time() - 40 * DAY)
    lease = old.acquire()
    old.commit(lease, {"watermark": "2026-10-01"}, files=small)
    old.release(lease)

    # The task state store backend's documents: written, updated, read, deleted, expired by GC.
    kv = KeyValueStore(store=store)
    prefix = task_prefix(dag_id="etl", run_id="manual__1", task_id="crunch", map_index=-1)
    past = datetime.now(timezone.utc) - timedelta(days=1)
    kv.write(object_key(prefix, "expired"), '"x"', expires_at=past)
    kv.write(object_key(prefix, "cursor"), '"a"')
    kv.write(object_key(prefix, "cursor"), '"b"')
    document = kv.read(object_key(prefix, "cursor"))
    assert document is not None and document.value == '"b"'
    kv.write(object_key(prefix, "scratch"), '"s"')
    kv.delete(object_key(prefix, "scratch"))
    assert collect_expired(store).deleted == [object_key(prefix, "expired")]

    # The CLI's verbs.
    rows = cli(store, "ls")
    assert {row["identity"] for row in rows} == {batch.key, idle.key}
    assert {row["identity"] for row in cli(store, "du")} >= {batch.key, idle.key, "TOTAL"}
    assert cli(store, "show", batch.key)["latest"]["seq"] == latest.seq
    history = cli(store, "history", batch.key)
    assert [row["seq"] for row in history] == [latest.seq, latest.seq - 1]
    cli(store, "cat", batch.key, "--files", str(tmp_path / "cat"))
    assert digests(tmp_path / "cat") == digests(large)
    assert all(row["status"] == "ok" for row in cli(store, "verify", "--all"))
    rolled = cli(store, "rollback", batch.key, "--to", str(latest.seq - 1))
    assert rolled[0]["copy_of"] == latest.seq - 1
    cli(store, "unlock", batch.key, "--force")
    gc_rows = {row["identity"]: row for row in cli(store, "gc", "--keep-last", "1", "--idle-for", "30d")}
    assert gc_rows[idle.key]["action"].startswith("deleted"), gc_rows
    assert CheckpointStore(store=store, identity=idle).head() is None
    assert len(CheckpointStore(store=store, identity=batch).history()) == 1


@pytest.fixture
def recorded(s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path, cli: Any) -> Recorder:
    recorder = Recorder()
    store = recorder.attach(s3_endpoint.store(s3_prefix))
    try:
        run_workload(store, tmp_path, cli)
    finally:
        store.close()
    return recorder


# -- the tests ---------------------------------------------------------------------------------------------
def test_policy_grants_exactly_the_actions_the_library_uses(
    recorded: Recorder, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    counts = {op: len(recorded.of(op)) for op in sorted(recorded.operations())}
    print(f"S3 operations recorded: {counts}")  # shown with -s, and on failure
    unknown = recorded.operations() - set(OPERATION_ACTIONS)
    assert not unknown, f"map these S3 operations to IAM actions first: {sorted(unknown)}"
    used = set().union(*(OPERATION_ACTIONS[op] for op in recorded.operations()))
    policy = json.loads(POLICY_FILE.read_text())
    check_policy_shape(policy, bucket_policy=False)
    granted = {a for s in policy["Statement"] if s["Effect"] == "Allow" for a in as_list(s["Action"])}
    assert {a for a in granted if a.startswith("s3:")} == used, (
        f"used {sorted(used)}; granted {sorted(granted)} (operations seen: {sorted(recorded.operations())})"
    )
    # The store sends no multipart request, even for a file above its part size: no s3:AbortMultipartUpload
    # and no lifecycle rule for incomplete uploads are needed.
    assert not recorded.operations() & MULTIPART
    assert recorded.operations() == {
        "GetObject",
        "PutObject",
        "ListObjectsV2",
        "DeleteObject",
        "DeleteObjects",
    }

    # Every request falls inside the statement that grants it.
    statements = fill(
        policy,
        BUCKET=s3_endpoint.bucket,
        PREFIX=s3_prefix,
        REGION="us-east-1",
        ACCOUNT_ID="111122223333",
        KMS_KEY_ID="k",
    )["Statement"]
    for call in recorded.calls:
        assert call.params["Bucket"] == s3_endpoint.bucket
        if call.operation in BUCKET_LEVEL:
            assert allows(statements, "s3:ListBucket", f"arn:aws:s3:::{call.params['Bucket']}"), call
            # Listings stay below the prefix (an s3:prefix condition "<PREFIX>/*" would allow every one).
            assert call.params.get("Prefix", "").startswith(f"{s3_prefix}/"), call
            continue
        if call.operation == "DeleteObjects":
            keys = [obj["Key"] for obj in call.params["Delete"]["Objects"]]
        else:
            keys = [call.params["Key"]]
        for key in keys:
            for action in OPERATION_ACTIONS[call.operation]:
                assert allows(statements, action, f"arn:aws:s3:::{s3_endpoint.bucket}/{key}"), (action, key)

    # Reading a key that does not exist is a normal step (the first head read of every new identity, a state
    # document not written yet). S3 answers it 404 NoSuchKey only to a caller allowed s3:ListBucket on the
    # bucket, 403 AccessDenied otherwise, which the library must treat as an error. That is why the listing
    # grant has no s3:prefix condition: whether S3 counts a prefix-conditioned grant for that answer could
    # not be checked here (moto evaluates no IAM), see docs/deploy.md.
    assert ("GetObject", "NoSuchKey") in recorded.errors
    (listing,) = [s for s in statements if "s3:ListBucket" in as_list(s["Action"])]
    assert "Condition" not in listing and as_list(listing["Resource"]) == [
        f"arn:aws:s3:::{s3_endpoint.bucket}"
    ]


def test_every_write_is_conditional_and_heads_are_deleted_only_conditionally(recorded: Recorder) -> None:
    """What the bucket policy of docs/deploy.md denies, the library never sends."""
    puts = recorded.of("PutObject", "CompleteMultipartUpload")
    assert puts
    unconditional = [c.params["Key"] for c in puts if not ({"IfMatch", "IfNoneMatch"} & set(c.params))]
    assert not unconditional, f"unconditional writes: {unconditional}"
    head_writes = [c for c in puts if c.params["Key"].endswith("/~head.json")]
    # Heads are created with If-None-Match: * and changed with If-Match: <the ETag read>, both seen here.
    assert {c.params.get("IfNoneMatch") for c in head_writes} >= {"*"}
    assert any(c.params.get("IfMatch") for c in head_writes)
    head_deletes = [c for c in recorded.of("DeleteObject") if c.params["Key"].endswith("/~head.json")]
    assert head_deletes, "GC's idle deletion deletes a head"
    assert all(c.params.get("IfMatch") for c in head_deletes), head_deletes
    batched = [obj["Key"] for c in recorded.of("DeleteObjects") for obj in c.params["Delete"]["Objects"]]
    assert batched and not [k for k in batched if k.endswith("/~head.json")]


def test_bucket_policy_denies_what_the_library_never_does(
    recorded: Recorder, s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    """The bucket policy's deny statements, evaluated the way AWS documents them, match no recorded request."""
    blocks = doc_json_blocks()
    bucket_policy = blocks["bucket-policy"]
    check_policy_shape(bucket_policy, bucket_policy=True)
    statements = fill(bucket_policy, BUCKET=s3_endpoint.bucket, PREFIX=s3_prefix)["Statement"]
    assert {s["Effect"] for s in statements} == {"Deny"}

    def denied(statement: dict[str, Any], call: Call, key: str) -> bool:
        actions = as_list(statement["Action"])
        if not OPERATION_ACTIONS[call.operation] & set(actions):
            return False
        if not any(
            iam_like(r, f"arn:aws:s3:::{call.params['Bucket']}/{key}") for r in as_list(statement["Resource"])
        ):
            return False
        headers = {"s3:if-match": "IfMatch", "s3:if-none-match": "IfNoneMatch"}
        for operator, tests in statement["Condition"].items():
            for condition_key, expected in tests.items():
                if operator == "Null":  # "true": the key is absent from the request
                    absent = headers[condition_key] not in call.params
                    if absent != (expected == "true"):
                        return False
                elif operator == "Bool" and condition_key == "s3:ObjectCreationOperation":
                    creates = call.operation in ("PutObject", "CompleteMultipartUpload")
                    if creates != (expected == "true"):
                        return False
                else:
                    raise AssertionError(f"condition {operator} {condition_key} is not modelled here")
        return True

    sids = {s["Sid"] for s in statements}
    assert sids == {"DenyUnconditionalWritesUnderThePrefix", "DenyUnconditionalDeletesOfHeads"}
    for call in recorded.of("PutObject", "DeleteObject"):
        for statement in statements:
            assert not denied(statement, call, call.params["Key"]), (statement["Sid"], call)

    # The evaluation above can deny: an unconditional overwrite of a head, and an unconditional head delete.
    head = f"{s3_prefix}/etl/crunch/run=manual__1/map=-1/~head.json"
    forged_put = Call("PutObject", {"Bucket": s3_endpoint.bucket, "Key": head})
    forged_delete = Call("DeleteObject", {"Bucket": s3_endpoint.bucket, "Key": head})
    by_sid = {s["Sid"]: s for s in statements}
    assert denied(by_sid["DenyUnconditionalWritesUnderThePrefix"], forged_put, head)
    assert denied(by_sid["DenyUnconditionalDeletesOfHeads"], forged_delete, head)
    chunk = Call("DeleteObject", {"Bucket": s3_endpoint.bucket, "Key": f"{s3_prefix}/x/~chunks/ab"})
    assert not denied(by_sid["DenyUnconditionalDeletesOfHeads"], chunk, chunk.params["Key"])


def test_sse_kms_writes_ask_for_the_key_the_policy_names(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """With SSE-KMS configured every write names the key (S3 then calls kms:GenerateDataKey for the writer)
    and reads get those objects back (kms:Decrypt): the two actions of the policy's KMS statement."""
    if s3_endpoint.kind != "moto":
        pytest.skip("the KMS key id here is made up: only moto accepts it without a real key")
    recorder = Recorder()
    store = recorder.attach(
        s3_endpoint.store(s3_prefix, server_side_encryption="aws:kms", sse_kms_key_id=KMS_KEY)
    )
    files = write_tree(tmp_path / "src", {"model.bin": os.urandom(5 * MIB), "a.txt": b"a"})
    cs = CheckpointStore(store=store, identity=Identity.for_task(dag_id="d", task_id="t", name="kms"))
    try:
        with WriterSession(checkpoints=cs, writer=WriterInfo.current()) as session:
            manifest = session.commit({"step": 1, "pad": "p" * 20_000}, files=files)
        cs.restore_files(manifest, tmp_path / "dest")
    finally:
        store.close()
    assert digests(tmp_path / "dest") == digests(files)
    puts = recorder.of("PutObject")
    assert puts and all(
        c.params.get("ServerSideEncryption") == "aws:kms" and c.params.get("SSEKMSKeyId") == KMS_KEY
        for c in puts
    ), puts
    assert recorder.of("GetObject")

    policy = json.loads(POLICY_FILE.read_text())
    kms = [s for s in policy["Statement"] if any(a.startswith("kms:") for a in as_list(s["Action"]))]
    assert len(kms) == 1 and set(as_list(kms[0]["Action"])) == KMS_ACTIONS, kms
    assert as_list(kms[0]["Resource"]) == ["arn:aws:kms:<REGION>:<ACCOUNT_ID>:key/<KMS_KEY_ID>"]
    assert kms[0]["Condition"] == {"StringEquals": {"kms:ViaService": "s3.<REGION>.amazonaws.com"}}


def test_docs_quote_the_policy_file() -> None:
    blocks = doc_json_blocks()
    assert set(blocks) == {"iam-policy", "bucket-policy"}, set(blocks)
    assert blocks["iam-policy"] == json.loads(POLICY_FILE.read_text())

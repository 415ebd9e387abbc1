"""Every record read from storage is untrusted: typed, bounded, size-capped before it is read.

Someone who can write to the bucket can write a head whose checksum is right (it is an unkeyed SHA-256) but
whose fields are anything: markup instead of a number, a manifest key inside another identity, a lease token
that is a script. Each such record must be refused with CheckpointCorruptError naming the record and the
field, before any value is used, and a writer must not write over it. Both stores.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from maintenance import BALLAST, rewrite_latest_tree
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    FormatVersionError,
    InvalidValueError,
    ObjectTooLargeError,
)
from airflow_stateful.core.protocol.state_documents import (
    MAX_VALUE_BYTES,
    KeyValueStore,
    object_key,
    task_prefix,
)
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.formats import HEAD_NAME, MAX_HEAD_BYTES
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="etl", task_id="load", run_id="manual__1")
OTHER = Identity.for_task(dag_id="payroll", task_id="pay", run_id="manual__1")
HEAD = f"{IDENTITY.key}/{HEAD_NAME}"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        with LocalObjectStore(root=tmp_path / "state") as local:
            yield local
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    with endpoint.store(request.getfixturevalue("s3_prefix")) as s3:
        yield s3


def seed(store: ObjectStore, tmp_path: Path, *, signer: HeadSigner | None = None) -> dict[str, Any]:
    """A real head with a lease and a checkpoint with one file; returns the head's JSON body."""
    cs = CheckpointStore(store=store, identity=IDENTITY, signer=signer)
    lease = cs.acquire(holder=WriterInfo(host="worker-1", try_number=1))
    (tmp_path / "f").mkdir(exist_ok=True)
    (tmp_path / "f" / "a.txt").write_text("a")
    cs.commit(lease, {"n": 1, "ledger": BALLAST}, files=tmp_path / "f")  # a manifest object, not inline
    return json.loads(store.get(HEAD).data)


def write_head(store: ObjectStore, body: dict[str, Any]) -> bytes:
    """Write ``body`` as the head with a *valid* checksum (what an attacker with bucket access can do)."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    body["checksum"] = sha256_hex(canonical_json(body))
    data = canonical_json(body)
    store.put(HEAD, data)
    return data


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        target: Any = body
        parts = path.split(".")
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return mutate


CRAFTED = {
    "seq is markup": (_set("checkpoints.0.seq", "<script>alert(1)</script>"), "'seq'"),
    "schema_version is text": (_set("checkpoints.0.schema_version", "1"), "'schema_version'"),
    "epoch is a boolean": (_set("epoch", True), "'epoch'"),
    "epoch is negative": (_set("epoch", -1), "'epoch'"),
    "manifest in another identity": (
        _set("checkpoints.0.manifest", f"{OTHER.key}/~manifests/000000000001-{'a' * 32}.json"),
        "'manifest'",
    ),
    "data_refs is not a list": (_set("checkpoints.0.data_refs", "../../payroll"), "'data_refs'"),
    "lease token is markup": (_set("lease.token", "<img src=x onerror=alert(1)>"), "'token'"),
    "lease holder is huge": (_set("lease.holder.host", "h" * 5000), "'host'"),
    "lease time is not a time": (_set("lease.expires_at", "tomorrow"), "'expires_at'"),
    "identity is another one": (_set("identity", OTHER.key), "'identity'"),
    "size is a float": (_set("checkpoints.0.total_size", 1.5), "'total_size'"),
    "checkpoints is a string": (_set("checkpoints", "all of them"), "'checkpoints'"),
    "lease epoch differs": (_set("lease.epoch", 99), "lease's epoch"),
}


@pytest.mark.parametrize("case", list(CRAFTED), ids=list(CRAFTED))
def test_a_crafted_head_with_a_valid_checksum_is_refused_field_by_field(
    store: ObjectStore, tmp_path: Path, case: str
) -> None:
    body = seed(store, tmp_path)
    mutate, field = CRAFTED[case]
    mutate(body)
    data = write_head(store, body)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    with pytest.raises(CheckpointCorruptError) as raised:
        cs.latest()
    message = str(raised.value)
    assert HEAD in message and field in message, message
    # A writer does not write over it either: the damage is reported, not papered over.
    with pytest.raises(CheckpointCorruptError):
        CheckpointStore(store=store, identity=IDENTITY).acquire(steal=True)
    assert store.get(HEAD).data == data


# -- format 1, no longer read ---------------------------------------------------------------------------------
# Pre-release builds wrote format 1 (whole-file objects under ~data/, named by the manifest's `files` and the head
# entry's `data_refs`). Read as if it had no files, such a record would lose them, and GC would collect them: so
# each shape is refused with FormatVersionError naming the record, and a writer does not write over it.
FORMAT_1_DATA = f"{IDENTITY.key}/~data/{'c' * 32}/0"
FORMAT_1_FILE = {"path": "a.txt", "key": FORMAT_1_DATA, "size": 1, "sha256": "a" * 64}


def _without_tree(body: dict[str, Any]) -> None:
    del body["checkpoints"][0]["tree"]


FORMAT_1_HEADS = {
    "head in format 1": _set("format", 1),
    "entry with data_refs": _set("checkpoints.0.data_refs", ["c" * 32]),
    "entry with files but no tree": _without_tree,
}


@pytest.mark.parametrize("case", list(FORMAT_1_HEADS), ids=list(FORMAT_1_HEADS))
def test_a_format_1_head_is_refused_loudly_and_left_as_it_is(
    store: ObjectStore, tmp_path: Path, case: str
) -> None:
    body = seed(store, tmp_path)
    FORMAT_1_HEADS[case](body)
    data = write_head(store, body)
    store.put(FORMAT_1_DATA, b"a")
    for read in (
        lambda cs: cs.head(),
        lambda cs: cs.latest(),
        lambda cs: cs.history(),
        lambda cs: cs.acquire(steal=True),
    ):
        with pytest.raises(FormatVersionError) as raised:
            read(CheckpointStore(store=store, identity=IDENTITY))
        message = str(raised.value)
        assert HEAD in message and "format 1" in message and "pre-release development build" in message, (
            message
        )
        assert f"every object under '{IDENTITY.key}/'" in message, "it says what to do"
    assert store.get(HEAD).data == data and store.get(FORMAT_1_DATA).data == b"a"


def _rewrite_manifest(
    store: ObjectStore, body: dict[str, Any], change: Callable[[dict[str, Any]], None]
) -> str:
    """Change the manifest object of the head's checkpoint 0 and record its new size and SHA-256 in the head."""
    entry = body["checkpoints"][0]
    manifest = json.loads(store.get(entry["manifest"]).data)
    change(manifest)
    raw = canonical_json(manifest)
    store.put(entry["manifest"], raw)
    entry.update(manifest_sha256=sha256_hex(raw), manifest_size=len(raw))
    write_head(store, body)
    return str(entry["manifest"])


def test_a_format_1_manifest_or_one_listing_format_1_files_is_refused(
    store: ObjectStore, tmp_path: Path
) -> None:
    body = seed(store, tmp_path)
    for change in (
        lambda m: m.update(format=1),
        lambda m: m.update(files=[dict(FORMAT_1_FILE)]),
    ):
        key = _rewrite_manifest(store, body, change)
        with pytest.raises(FormatVersionError, match="format 1") as raised:
            CheckpointStore(store=store, identity=IDENTITY).latest()
        assert key in str(raised.value) and "pre-release development build" in str(raised.value)
    # Inline in the head (a small checkpoint) the same: refused with the head.
    inline = {"n": 2}
    cs = CheckpointStore(store=store, identity=OTHER)
    lease = cs.acquire()
    cs.commit(lease, inline, files=tmp_path / "f")
    other_head = f"{OTHER.key}/{HEAD_NAME}"
    raw = json.loads(store.get(other_head).data)
    assert raw["checkpoints"][0]["inline"]["value"] == inline
    raw["checkpoints"][0]["inline"]["files"] = [dict(FORMAT_1_FILE, key=f"{OTHER.key}/~data/{'c' * 32}/0")]
    raw.pop("checksum")
    raw["checksum"] = sha256_hex(canonical_json(raw))
    store.put(other_head, canonical_json(raw))
    with pytest.raises(FormatVersionError, match=r"inline manifest lists its files in format 1"):
        cs.head()


def test_a_tree_naming_a_chunk_outside_its_identity_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    seed(store, tmp_path)

    def steal(tree: dict[str, Any]) -> None:  # point at another tenant's chunk (a loose one)
        chunk = tree["files"][0]["chunks"][0]
        chunk.pop("pack", None)
        chunk.pop("offset", None)
        chunk["key"] = f"{OTHER.key}/~chunks/{chunk['sha256']}"

    rewrite_latest_tree(store, IDENTITY, steal)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(CheckpointCorruptError, match=r"is not the ~chunks object of content .* in identity"):
        cs.restore_files(latest, tmp_path / "out")


def test_a_tree_naming_a_pack_outside_its_identity_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    seed(store, tmp_path)

    def steal(tree: dict[str, Any]) -> None:  # point at another tenant's pack
        chunk = tree["files"][0]["chunks"][0]
        assert "pack" in chunk, "the seeded checkpoint's small files are packed"
        chunk["pack"] = chunk["pack"].replace(IDENTITY.key, OTHER.key, 1)

    rewrite_latest_tree(store, IDENTITY, steal)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(CheckpointCorruptError, match=r"is not a pack of identity"):
        cs.restore_files(latest, tmp_path / "out")


def test_a_tree_with_a_nul_in_a_path_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    seed(store, tmp_path)
    rewrite_latest_tree(store, IDENTITY, lambda tree: tree["files"][0].update(path="a\x00.txt"))
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(CheckpointCorruptError, match=r"'path'"):
        cs.restore_files(latest, tmp_path / "out")


def test_an_oversized_head_is_refused_unread_with_bounded_memory(store: ObjectStore) -> None:
    store.put(HEAD, b" " * (20 * 1024 * 1024))
    tracemalloc.start()
    try:
        with pytest.raises(ObjectTooLargeError, match=rf"{HEAD}.* more than the {MAX_HEAD_BYTES} bytes"):
            CheckpointStore(store=store, identity=IDENTITY).head()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, f"reading the refused head allocated {peak} bytes"


def test_a_manifest_larger_than_its_head_says_is_refused_unread(store: ObjectStore, tmp_path: Path) -> None:
    body = seed(store, tmp_path)
    store.put(body["checkpoints"][0]["manifest"], b"{" + b" " * (5 * 1024 * 1024) + b"}")
    with pytest.raises(ObjectTooLargeError, match="manifests"):
        CheckpointStore(store=store, identity=IDENTITY).latest()


# -- task state documents -----------------------------------------------------------------------------------
DOC_KEY = object_key(task_prefix(dag_id="d", run_id="r", task_id="t", map_index=-1), "offset")


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (
            {"format": 1, "value": {"not": "text"}, "written_at": "2026-01-01T00:00:00+00:00", "version": 1},
            "'value'",
        ),
        ({"format": 1, "value": "1", "written_at": "2026-01-01T00:00:00+00:00", "version": "2"}, "'version'"),
        ({"format": 1, "value": "1", "written_at": "now", "version": 1}, "'written_at'"),
        (
            {
                "format": 1,
                "value": "1",
                "written_at": "2026-01-01T00:00:00+00:00",
                "version": 1,
                "by_ref": "yes",
            },
            "'by_ref'",
        ),
    ],
    ids=["value-not-text", "version-text", "written_at-not-a-time", "by_ref-text"],
)
def test_a_crafted_state_document_is_refused_by_field(
    store: ObjectStore, document: dict[str, Any], field: str
) -> None:
    store.put(DOC_KEY, json.dumps(document).encode())
    with pytest.raises(CheckpointCorruptError, match=field):
        KeyValueStore(store=store).read(DOC_KEY)


def test_an_oversized_value_is_refused_before_anything_is_written(store: ObjectStore) -> None:
    from airflow_stateful.core.protocol.state_documents import check_json_text

    with pytest.raises(InvalidValueError, match=r"'offset' is \d+ characters of JSON; the limit is"):
        check_json_text('"' + "x" * MAX_VALUE_BYTES + '"', key="offset")
    assert list(store.list_objects("")) == []


def test_keep_last_is_bounded_so_a_head_stays_readable() -> None:
    from airflow_stateful.core.protocol.retention import KeepLast

    with pytest.raises(ValueError, match="from 1 to 1000, not 5000"):
        KeepLast(5000)


# -- keyed integrity of heads ---------------------------------------------------------------------------------
KEY = b"0123456789abcdef-this-deployment"


def signer(*, required: bool, key: bytes = KEY, key_id: str = "prod-1") -> HeadSigner:
    return HeadSigner(key=key, key_id=key_id, required=required)


def test_signed_heads_verify_and_a_forged_one_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    policy = signer(required=True)
    body = seed(store, tmp_path, signer=policy)  # written with the deployment's signer: signed
    assert body["signature"]["key_id"] == "prod-1" and len(body["signature"]["hmac_sha256"]) == 64
    latest = CheckpointStore(store=store, identity=IDENTITY, signer=policy).latest()
    assert latest is not None and latest.value["n"] == 1
    # Someone with write access to the bucket, but not the key: a valid checksum is not enough any more.
    body["checkpoints"][0]["schema_version"] = 7
    write_head(store, body)
    with pytest.raises(CheckpointCorruptError, match=r"signature does not verify with key 'prod-1'"):
        CheckpointStore(store=store, identity=IDENTITY, signer=policy).latest()
    del body["signature"]
    write_head(store, body)
    with pytest.raises(CheckpointCorruptError, match=r"carries no signature, and this deployment requires"):
        CheckpointStore(store=store, identity=IDENTITY, signer=policy).latest()


def test_signing_is_optional_for_readers_without_the_key_and_when_not_required(
    store: ObjectStore, tmp_path: Path
) -> None:
    seed(store, tmp_path, signer=signer(required=True))
    # An older reader, or one without the key: a signed head reads as before.
    assert CheckpointStore(store=store, identity=IDENTITY, signer=None).latest() is not None
    other = signer(required=False, key=b"another-key-of-16-bytes", key_id="staging")
    assert CheckpointStore(store=store, identity=IDENTITY, signer=other).latest() is not None, (
        "another key id"
    )


def test_the_signing_key_never_shows(store: ObjectStore, tmp_path: Path) -> None:
    policy = signer(required=True)
    seed(store, tmp_path, signer=policy)
    assert KEY.decode() not in repr(policy)
    assert KEY.decode() not in repr(CheckpointStore(store=store, identity=IDENTITY, signer=policy))
    for info in store.list_objects(""):
        assert KEY not in store.get(info.key).data
    from airflow_stateful.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="at least 16 bytes") as raised:
        HeadSigner(key=b"short-secret", key_id="x")
    assert "short-secret" not in str(raised.value)


def test_the_deployment_key_comes_from_an_airflow_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_home: Path
) -> None:
    """``[stateful] signing_conn_id``: the key is a connection's password (any secrets backend can hold it)."""
    from airflow_stateful.core.errors import ConfigurationError
    from airflow_stateful.hooks.state import StateHook

    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "state").as_uri())
    monkeypatch.setenv("AIRFLOW__STATEFUL__SIGNING_CONN_ID", "stateful_signing")
    monkeypatch.setenv("AIRFLOW__STATEFUL__REQUIRE_SIGNED_HEADS", "true")
    with pytest.raises(ConfigurationError, match="'stateful_signing', which does not exist"):
        StateHook().get_store()
    monkeypatch.setenv(
        "AIRFLOW_CONN_STATEFUL_SIGNING",
        json.dumps({"conn_type": "generic", "password": KEY.decode(), "extra": {"key_id": "prod-1"}}),
    )
    hook = StateHook()
    cs = hook.checkpoint_store(IDENTITY)
    cs.commit(cs.acquire(), {"n": 1})
    raw = json.loads(hook.get_store().get(HEAD).data)
    assert raw["signature"]["key_id"] == "prod-1"
    assert KEY.decode() not in repr(hook.get_store())
    del raw["signature"]
    write_head(hook.get_store(), raw)
    with pytest.raises(CheckpointCorruptError, match="carries no signature"):
        StateHook().checkpoint_store(IDENTITY).latest()


def test_every_reader_of_a_signing_deployment_refuses_a_forged_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The signer is the protocol's, not the byte store's: the code that opens the store from ``[stateful]``
    hands it to every reader it builds. A reader that missed it would take an unsigned head for a good one, so
    each way in is tried with a forged head: the CLI verbs, GC, the stuck check, usage and the UI's rows."""
    from airflow_stateful.cli.main import main
    from airflow_stateful.core.fleet.catalog import read_head
    from airflow_stateful.hooks.state import StateHook
    from airflow_stateful.plugins.view.app import configured_store
    from airflow_stateful.plugins.view.rows import Bounds, collect

    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "state").as_uri())
    monkeypatch.setenv("AIRFLOW__STATEFUL__SIGNING_CONN_ID", "stateful_signing")
    monkeypatch.setenv("AIRFLOW__STATEFUL__REQUIRE_SIGNED_HEADS", "true")
    monkeypatch.setenv(
        "AIRFLOW_CONN_STATEFUL_SIGNING",
        json.dumps({"conn_type": "generic", "password": KEY.decode(), "extra": {"key_id": "prod-1"}}),
    )
    hook = StateHook()
    cs = hook.checkpoint_store(IDENTITY)
    cs.commit(cs.acquire(), {"n": 1})
    assert main(["show", IDENTITY.key, "--json"]) == 0, "the signed head reads"
    raw = json.loads(hook.get_store().get(HEAD).data)
    del raw["signature"]
    write_head(hook.get_store(), raw)
    capsys.readouterr()

    refused = "carries no signature, and this deployment requires heads signed with key 'prod-1'"
    for verb in (["show", IDENTITY.key], ["history", IDENTITY.key], ["gc", "--dry-run"]):
        assert main(verb) == 1, verb
        assert refused in capsys.readouterr().err, verb
    for verb in (["ls", "--json"], ["du", "--json"], ["stuck", "--json"]):
        main(verb)
        out = capsys.readouterr().out
        assert refused in out, f"{verb} showed the forged head as a good one: {out}"

    store, signer, _marks = configured_store()  # what the UI opens
    assert read_head(store, IDENTITY, signer=signer).error is not None
    listing = collect(
        store, prefixes=[""], may_read=lambda i: True, bounds=Bounds(), now=time.time(), signer=signer
    )
    assert [refused in str(e.row) for e in listing.entries] == [True]


# -- names end where they end (issue 23, LOW 7) ----------------------------------------------------------------
def _trailing_newline_cases() -> list[Any]:
    from airflow_stateful.core.records.outputs import check_output_name

    def codec(name: str) -> Any:
        from airflow_stateful.core.records.fields import Fields
        from airflow_stateful.core.records.formats import CODEC_NAME

        return Fields({"value_codec": name}, what="manifest").text(
            "value_codec", max_len=16, pattern=CODEC_NAME
        )

    def token(value: str) -> Any:
        from airflow_stateful.core.records.fields import Fields

        return Fields({"token": value}, what="lease").token("token")

    return [
        pytest.param(check_output_name, "daily-report", id="output name"),
        pytest.param(lambda v: HeadSigner(key=KEY, key_id=v), "prod-1", id="signing key id"),
        pytest.param(Identity.parse, "etl/crunch/name=model/map=-1", id="identity key"),
        pytest.param(codec, "json", id="value codec"),
        pytest.param(token, "a" * 40, id="lease token"),
    ]


@pytest.mark.parametrize(("check", "good"), _trailing_newline_cases())
def test_a_name_with_a_trailing_newline_is_refused(check: Any, good: str) -> None:
    """``re.match`` with ``$`` also accepts the string followed by one newline: a name that is not the one shown
    (an output ``'report\\n'`` beside ``'report'``, a key id that logs as two lines) must be refused."""
    check(good)
    with pytest.raises((ValueError, CheckpointCorruptError)):
        check(good + "\n")


# -- sizes are bounded by what the format can hold (issue 23, LOW 8) --------------------------------------------
def _one_huge_chunk(tree: dict[str, Any]) -> None:
    tree["files"][0]["chunks"][0]["size"] = 1 << 40
    tree["files"][0]["size"] = 1 << 40


def _a_petabyte_file(tree: dict[str, Any]) -> None:
    chunk = tree["files"][0]["chunks"][0]
    tree["files"][0]["chunks"] = [{**chunk, "size": 1 << 40} for _ in range(1024)]
    tree["files"][0]["size"] = 1 << 50


@pytest.mark.parametrize(
    ("inflate", "refused"),
    [
        # A download holds one chunk in memory: a tree may not claim one larger than the chunker ever cuts.
        pytest.param(_one_huge_chunk, r"chunk 0.*'size'.*an integer from 0 to 4194304", id="a 1 TiB chunk"),
        # 1,024 chunks of 1 TiB made a 1 PiB file whose staging file the restore sized first: "OSError: File too
        # large", which reads like a disk problem.
        pytest.param(_a_petabyte_file, r"~trees/.*'size'", id="a 1 PiB file"),
    ],
)
def test_a_forged_size_is_refused_before_the_restore_allocates_or_writes_anything(
    store: ObjectStore, tmp_path: Path, inflate: Any, refused: str
) -> None:
    seed(store, tmp_path)
    rewrite_latest_tree(store, IDENTITY, inflate)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(CheckpointCorruptError, match=refused):
        cs.restore_files(latest, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "nothing was written"


def test_a_tree_whose_totals_differ_from_what_its_checkpoint_records_is_refused(
    store: ObjectStore, tmp_path: Path
) -> None:
    seed(store, tmp_path)
    head = json.loads(store.get(HEAD).data)
    manifest_key = head["checkpoints"][-1]["manifest"]
    manifest = json.loads(store.get(manifest_key).data)
    manifest["tree"]["total_size"] = 1 << 50  # what `ls`, `du` and the restore cache's size check trust
    body = canonical_json(manifest) + b"\n"
    store.put(manifest_key, body)
    entry = head["checkpoints"][-1]
    entry["tree"] = manifest["tree"]
    entry["manifest_sha256"], entry["manifest_size"] = sha256_hex(body), len(body)
    write_head(store, head)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    latest = cs.latest()
    assert latest is not None
    with pytest.raises(CheckpointCorruptError, match=r"total_size"):
        cs.restore_files(latest, tmp_path / "out")


# -- a signed head written back (issue 23, MEDIUM 1) -----------------------------------------------------------
class DictMarks:
    """A mark store in a dict: the core's interface as the Airflow layer implements it over Airflow's database
    (tests/test_marks_airflow.py runs that one, on a real metadata database)."""

    where = "the test's mark store"

    def __init__(self) -> None:
        self.marks: dict[str, Any] = {}
        self.requests = 0

    def get(self, identity: Identity) -> Any:
        self.requests += 1
        return self.marks.get(identity.key)

    def put(self, identity: Identity, mark: Any) -> None:
        self.requests += 1
        self.marks[identity.key] = mark


def test_a_signed_head_written_back_is_refused_and_the_zombie_stays_fenced(store: ObjectStore) -> None:
    """An attacker who can write the bucket but has no key keeps a head from before a retry took over and
    writes it back. Signed heads alone accept it: readers resume from the older state and the fenced zombie's
    commit lands. With the high-water marks both are refused, naming identity, mark and head."""
    from airflow_stateful.core.protocol.marks import MarkStore, RolledBackError

    policy = signer(required=True)

    def attack(marks: MarkStore | None) -> tuple[CheckpointStore, Any, CheckpointStore, Any]:
        for info in list(store.list_objects("")):
            store.delete(info.key)
        zombie = CheckpointStore(store=store, identity=IDENTITY, signer=policy, marks=marks)
        zombie_lease = zombie.acquire(holder=WriterInfo(try_number=1))
        zombie.commit(zombie_lease, {"n": 1})
        kept = store.get(HEAD).data  # what the attacker keeps (or finds among the bucket's versions)
        retry = CheckpointStore(store=store, identity=IDENTITY, signer=policy, marks=marks)
        retry_lease = retry.acquire(holder=WriterInfo(try_number=2), steal=True)
        retry.commit(retry_lease, {"n": 2})
        store.put(HEAD, kept)  # written back: a valid signature, an older epoch
        return zombie, zombie_lease, retry, retry_lease

    # Without marks the attack works (this is what the marks are for): the older state reads as the newest,
    # and the fenced zombie commits on top of it.
    zombie, zombie_lease, _, _ = attack(None)
    assert CheckpointStore(store=store, identity=IDENTITY, signer=policy).latest().value == {"n": 1}  # type: ignore[union-attr]
    zombie.commit(zombie_lease, {"n": "zombie"})

    marks = DictMarks()
    zombie, zombie_lease, retry, retry_lease = attack(marks)
    replayed = store.get(HEAD).data
    refused = r"epoch 1, seq 1.*below the newest this deployment wrote \(epoch 2, seq 2, commit [0-9a-f]{32}"
    with pytest.raises(RolledBackError, match=refused):
        CheckpointStore(store=store, identity=IDENTITY, signer=policy, marks=marks).latest()
    with pytest.raises(RolledBackError, match=refused):
        zombie.commit(zombie_lease, {"n": "zombie"})  # from its cached head, whose ETag the replay matches
    with pytest.raises(RolledBackError, match=refused):
        retry.commit(retry_lease, {"n": 3})  # refused as a rollback, not taken for being fenced
    assert store.get(HEAD).data == replayed, "nothing was committed on top of the written-back head"
    assert marks.marks[IDENTITY.key].position == (2, 2)
    # GC would take the newer checkpoints' objects for unreferenced and make the rollback permanent: it keeps
    # the identity whole instead, and says why.
    from datetime import timedelta

    from airflow_stateful.core.fleet.gc import apply_gc
    from airflow_stateful.core.fleet.gc_plan import plan_gc

    before = sorted(i.key for i in store.list_objects(""))
    plan = plan_gc(store, min_age=timedelta(0), grace=0.0, keep_last=1, signer=policy, marks=marks)
    (item,) = [p for p in plan.identities if p.identity == IDENTITY.key]
    assert item.skipped and "written back" in item.skipped and not item.reasons
    apply_gc(plan)
    assert sorted(i.key for i in store.list_objects("")) == before


def test_marks_only_rise_even_when_the_head_is_deleted(store: ObjectStore) -> None:
    """A head deleted (by GC, or by someone) and started again goes on from the mark's epoch, so an old head
    written back afterwards is still below the mark. Renewals and releases move nothing: no mark write."""
    policy = signer(required=True)
    marks = DictMarks()
    cs = CheckpointStore(store=store, identity=IDENTITY, signer=policy, marks=marks)
    lease = cs.acquire()
    cs.commit(lease, {"n": 1})
    writes = dict(marks.marks)
    before = marks.requests
    cs.renew(lease)
    assert marks.marks == writes and marks.requests - before == 1, "a renewal reads the mark, writes none"
    cs.release(lease)
    store.delete(HEAD)
    again = CheckpointStore(store=store, identity=IDENTITY, signer=policy, marks=marks)
    assert again.acquire().epoch == 2, "the epochs go on from the mark"

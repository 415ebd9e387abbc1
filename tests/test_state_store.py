"""S3StateStoreBackend: Airflow 3.3's task/asset state store on our object stores.

First the backend's contract, run against a local directory and the real S3 endpoint (moto's server by
default): layout, conditional writes, scopes, expiry GC, the worker-side reference mode, async variants.
Then Airflow itself: the example DAG ``dags/task_state_store.py`` under ``dag.test()`` with the backend
configured through environment variables on the server side, the worker side and both, reading the S3
objects back with the raw boto3 client.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import random
import string
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
from dag_helpers import find_dag, load_dag_module
from s3_endpoint import S3Endpoint

from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    FormatVersionError,
    IdentityError,
    InvalidValueError,
)
from airflow_stateful.core.protocol.state_documents import StateDocument, collect_expired, validate_state_key
from airflow_stateful.core.stores.base import Blob, ObjectInfo, ObjectStore, StoredFile
from airflow_stateful.core.stores.local import LocalObjectStore

REPO = Path(__file__).resolve().parent.parent
REF_KEY = "__airflow_state_ref__"
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)
SEGMENT_CHARS = frozenset(string.ascii_letters + string.digits + "._-%")


def task_scope(**overrides: Any) -> Any:
    from airflow.sdk.state import TaskScope

    fields: dict[str, Any] = {
        "dag_id": "etl",
        "run_id": "manual__2026-01-01T00:00:00+00:00",
        "task_id": "load",
    }
    fields.update(overrides)
    return TaskScope(**fields)


def asset_scope(**fields: Any) -> Any:
    from airflow.sdk.state import AssetScope

    return AssetScope(**fields)


RUN_DIR = "~task-state/etl/manual__2026-01-01T00%3A00%3A00%2B00%3A00"


# -- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def object_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(root=tmp_path / "state", fsync=False)
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    prefix: str = request.getfixturevalue("s3_prefix")
    with endpoint.store(prefix) as store:
        yield store


@pytest.fixture
def backend(object_store: ObjectStore) -> Any:
    from airflow_stateful.state_store import S3StateStoreBackend

    return S3StateStoreBackend(store=object_store)


def keys_in(store: ObjectStore) -> list[str]:
    return [info.key for info in store.list_objects("")]


def document(store: ObjectStore, key: str) -> StateDocument:
    return StateDocument.from_bytes(store.get(key).data, where=key)


# -- get / set / delete -------------------------------------------------------------------------------------
def test_set_then_get_returns_the_json_text_verbatim_at_the_documented_key(
    backend: Any, object_store: ObjectStore
) -> None:
    scope = task_scope()
    assert backend.get(scope, "cursor") is None
    text = '{"b": 1,  "a": [1, 2.5, "x"]}'  # odd spacing and key order must survive unchanged
    backend.set(scope, "cursor", text)
    assert backend.get(scope, "cursor") == text
    assert keys_in(object_store) == [f"{RUN_DIR}/load/map=-1/cursor.json"]
    assert backend.object_key(scope, "cursor") == f"{RUN_DIR}/load/map=-1/cursor.json"

    backend.set(scope, "cursor", '"second"')
    assert backend.get(scope, "cursor") == '"second"'
    doc = document(object_store, f"{RUN_DIR}/load/map=-1/cursor.json")
    assert (doc.version, doc.expires_at, doc.by_ref) == (2, None, False)


def test_delete_removes_one_key_and_a_missing_key_is_not_an_error(
    backend: Any, object_store: ObjectStore
) -> None:
    scope = task_scope()
    backend.set(scope, "a", "1")
    backend.set(scope, "b", "2")
    backend.delete(scope, "a")
    backend.delete(scope, "never-set")
    assert backend.get(scope, "a") is None
    assert backend.get(scope, "b") == "2"
    assert keys_in(object_store) == [f"{RUN_DIR}/load/map=-1/b.json"]


def test_clear_removes_one_map_index_or_all_and_never_a_sibling_task_or_run(
    backend: Any, object_store: ObjectStore
) -> None:
    for map_index in (-1, 0, 1):
        backend.set(task_scope(map_index=map_index), "k", str(map_index))
    backend.set(task_scope(task_id="load2"), "k", '"sibling task whose id starts with load"')
    backend.set(task_scope(run_id="other-run"), "k", '"same task, other run"')

    backend.clear(task_scope(map_index=0))
    assert backend.get(task_scope(map_index=0), "k") is None
    assert backend.get(task_scope(map_index=1), "k") == "1"
    assert backend.get(task_scope(), "k") == "-1"

    backend.clear(task_scope(map_index=1), all_map_indices=True)
    assert [backend.get(task_scope(map_index=i), "k") for i in (-1, 0, 1)] == [None, None, None]
    assert sorted(keys_in(object_store)) == [
        f"{RUN_DIR}/load2/map=-1/k.json",
        "~task-state/etl/other-run/load/map=-1/k.json",
    ]


def test_asset_scopes_by_name_uri_and_id_are_separate_namespaces(
    backend: Any, object_store: ObjectStore
) -> None:
    by_name = asset_scope(name="orders")
    by_uri = asset_scope(uri="s3://lake/orders/")
    by_id = asset_scope(asset_id=7)
    backend.set(by_name, "watermark", '"name"')
    backend.set(by_uri, "watermark", '"uri"')
    backend.set(by_id, "watermark", '"id"')
    backend.set(by_name, "other", "1")
    assert [backend.get(s, "watermark") for s in (by_name, by_uri, by_id)] == ['"name"', '"uri"', '"id"']
    assert sorted(keys_in(object_store)) == [
        "~asset-state/id=7/watermark.json",
        "~asset-state/name=orders/other.json",
        "~asset-state/name=orders/watermark.json",
        "~asset-state/uri=s3%3A%2F%2Flake%2Forders%2F/watermark.json",
    ]
    backend.clear(by_name, all_map_indices=True)  # the flag has no effect on assets
    assert backend.get(by_name, "watermark") is None
    assert backend.get(by_name, "other") is None
    assert backend.get(by_uri, "watermark") == '"uri"'
    assert backend.get(by_id, "watermark") == '"id"'


# -- validation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("line\nbreak", "control character"),
        ("tab\there", "control character"),
        ("/" * 100, "305 bytes once encoded"),
        ("", "non-empty string"),
        ("k" * 201, "201 characters"),
    ],
)
def test_bad_keys_are_refused_with_the_key_named_and_nothing_written(
    backend: Any, object_store: ObjectStore, key: str, message: str
) -> None:
    with pytest.raises(IdentityError, match=message) as info:
        backend.set(task_scope(), key, "1")
    if key:
        assert repr(key)[:40] in str(info.value)
    with pytest.raises(IdentityError):
        backend.get(task_scope(), key)
    assert keys_in(object_store) == []


def test_keys_and_scope_parts_are_encoded_so_nothing_escapes_its_folder(
    backend: Any, object_store: ObjectStore
) -> None:
    scope = task_scope(dag_id="..", run_id="a/../../b", task_id="~head")
    backend.set(scope, "..", '"dots"')
    backend.set(scope, "key with spaces: ü", '"unicode"')
    assert backend.get(scope, "..") == '"dots"'
    assert backend.get(scope, "key with spaces: ü") == '"unicode"'
    for key in keys_in(object_store):
        parts = key.split("/")
        assert parts[:2] == ["~task-state", "%2E%2E"], key  # ".." is a valid dag_id, never a folder
        assert "/" not in parts[2] and parts[2] == quote("a/../../b", safe="")
        assert parts[3] == "%7Ehead"
    assert sorted(k.rsplit("/", 1)[1] for k in keys_in(object_store)) == [
        "...json",
        "key%20with%20spaces%3A%20%C3%BC.json",
    ]


# Keys that a naive encoding would confuse: "/" against its percent-encoded spelling and other separators,
# "%" itself, case, and the path segments "." and "..".
CONFUSABLE_KEYS = [
    "a/b", "a_b", "a%2Fb", "a%2fb", "a%252Fb", "a-b", "a.b", "a b", "a:b", "a//b", "/a/b/", "ab",
    "A/B", "a/B", "K", "k", ".", "..", "...", "./..", "%", "%25", "%2F", "/", "//", "k.json", "~k",
    "ü", "u\u0308",  # the same letter precomposed and decomposed: two keys
]  # fmt: skip


def test_keys_with_a_slash_round_trip_as_one_object_and_never_collide(
    backend: Any, object_store: ObjectStore
) -> None:
    """Airflow's own backends accept ``connector/offset``; each such key is one object, never a folder."""
    scope = task_scope()
    for key in CONFUSABLE_KEYS:
        backend.set(scope, key, json.dumps(key))
    assert [backend.get(scope, key) for key in CONFUSABLE_KEYS] == [json.dumps(k) for k in CONFUSABLE_KEYS]
    stored = keys_in(object_store)
    assert len(stored) == len(CONFUSABLE_KEYS), "one object per key: no two keys share an object"
    assert {key.rsplit("/", 1)[0] for key in stored} == {f"{RUN_DIR}/load/map=-1"}, "no key made a folder"
    assert backend.object_key(scope, "connector/offset") == f"{RUN_DIR}/load/map=-1/connector%2Foffset.json"

    backend.delete(scope, "a/b")
    assert (backend.get(scope, "a/b"), backend.get(scope, "a_b"), backend.get(scope, "a%2Fb")) == (
        None,
        '"a_b"',
        '"a%2Fb"',
    )
    ref = backend.serialize_task_state_store_to_ref(value={"offset": 7}, key="connector/offset", scope=scope)
    assert ref.endswith("/load/map=-1/connector%2Foffset.json")
    assert backend.deserialize_task_state_store_from_ref(ref) == {"offset": 7}
    backend.clear(scope)
    assert keys_in(object_store) == []


def generated_keys(count: int, *, seed: int) -> list[str]:
    """Random keys over an alphabet chosen to collide under a careless encoding (no hypothesis here)."""
    alphabet = [*"aAbBfF2%/._-~: +", "ü", "\u0308", "€", "😀", "\u00a0", "\u200b", "\\"]
    rng = random.Random(seed)
    keys = {"".join(rng.choices(alphabet, k=rng.randint(1, 12))) for _ in range(count)}
    return sorted(keys | set(CONFUSABLE_KEYS))


def test_the_key_encoding_is_injective_and_yields_one_safe_segment() -> None:
    keys = generated_keys(20000, seed=11)
    assert len(keys) > 15000
    names: dict[str, str] = {}
    for key in keys:
        name = validate_state_key(key)
        assert name.endswith(".json") and "/" not in name and name not in (".", ".."), (key, name)
        assert set(name) <= SEGMENT_CHARS, (key, name)
        # Decoding gives the key back, so no two keys can share a name (a left inverse proves injectivity).
        assert unquote(name[: -len(".json")], errors="strict") == key, (key, name)
        names[name] = key
    assert len(names) == len(keys)
    assert validate_state_key("K") != validate_state_key("k"), "case is kept (S3 keys are case-sensitive)"


def test_a_value_that_is_not_json_text_is_refused(backend: Any, object_store: ObjectStore) -> None:
    with pytest.raises(InvalidValueError, match="'k' is not valid JSON"):
        backend.set(task_scope(), "k", "{not json")
    with pytest.raises(InvalidValueError, match="must be JSON text"):
        backend.set(task_scope(), "k", {"a": 1})
    assert keys_in(object_store) == []


def test_damaged_or_newer_documents_are_named_on_read_and_replaced_on_write(
    backend: Any, object_store: ObjectStore
) -> None:
    key = backend.object_key(task_scope(), "k")
    object_store.put(key, b"{half a docu")
    with pytest.raises(CheckpointCorruptError, match=r"k\.json"):
        backend.get(task_scope(), "k")
    backend.set(task_scope(), "k", '"fresh"')
    assert backend.get(task_scope(), "k") == '"fresh"'

    object_store.put(key, json.dumps({"format": 99, "value": "1"}).encode())
    with pytest.raises(FormatVersionError, match="format 99"):
        backend.get(task_scope(), "k")


# -- expiry -------------------------------------------------------------------------------------------------
def test_collect_expired_deletes_only_documents_past_their_expiry(
    backend: Any, object_store: ObjectStore
) -> None:
    scope = task_scope()
    backend.set(scope, "old", '"o"', expires_at=NOW - timedelta(seconds=1))
    backend.set(scope, "at-now", '"n"', expires_at=NOW)
    backend.set(scope, "later", '"l"', expires_at=NOW + timedelta(hours=1))
    backend.set(scope, "forever", '"f"')
    backend.set(
        asset_scope(name="orders"), "old", '"a"', expires_at=(NOW - timedelta(days=1)).replace(tzinfo=None)
    )
    before = sorted(keys_in(object_store))

    dry = collect_expired(object_store, now=NOW, dry_run=True)
    expected = [
        "~asset-state/name=orders/old.json",
        f"{RUN_DIR}/load/map=-1/at-now.json",
        f"{RUN_DIR}/load/map=-1/old.json",
    ]
    assert (sorted(dry.deleted), dry.scanned, dry.dry_run) == (expected, 5, True)
    assert sorted(keys_in(object_store)) == before, "a dry run deletes nothing"

    report = collect_expired(object_store, now=NOW)
    assert sorted(report.deleted) == expected
    assert [backend.get(scope, k) for k in ("old", "at-now", "later", "forever")] == [
        None,
        None,
        '"l"',
        '"f"',
    ]
    assert backend.get(asset_scope(name="orders"), "old") is None
    assert collect_expired(object_store, now=NOW + timedelta(days=3650)).deleted == [
        f"{RUN_DIR}/load/map=-1/later.json"
    ], "a key without expires_at never expires"


class RewriteBeforeDelete(ObjectStore):
    """A real store whose conditional delete is preceded by another writer's write (a GC race, staged)."""

    def __init__(self, inner: ObjectStore, before_delete: Callable[[], None]) -> None:
        self.inner = inner
        self.url = inner.url
        self.before_delete = before_delete

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        return self.inner.get(key, max_bytes=max_bytes)

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        adopt_identical: bool = True,
    ) -> str:
        return self.inner.put(
            key, data, if_none_match=if_none_match, if_match=if_match, adopt_identical=adopt_identical
        )

    def upload_file(self, key: str, path: Path, *, progress: Any = None) -> StoredFile:
        return self.inner.upload_file(key, path, progress=progress)

    def download_file(self, key: str, dest: Path, *, size: int, sha256: str, progress: Any = None) -> None:
        self.inner.download_file(key, dest, size=size, sha256=sha256, progress=progress)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(list(self.inner.list_objects(prefix)))

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        self.before_delete()
        self.inner.delete(key, if_match=if_match)


def test_collect_expired_spares_a_value_rewritten_after_it_was_judged(
    backend: Any, object_store: ObjectStore
) -> None:
    scope = task_scope()
    backend.set(scope, "job", '"old"', expires_at=NOW - timedelta(hours=1))
    racing = RewriteBeforeDelete(
        object_store, lambda: backend.set(scope, "job", '"rewritten"', expires_at=NOW + timedelta(days=1))
    )
    report = collect_expired(racing, now=NOW)
    assert report.deleted == []
    assert report.changed == [backend.object_key(scope, "job")]
    assert backend.get(scope, "job") == '"rewritten"'


def test_cleanup_runs_the_expiry_gc(backend: Any) -> None:
    now = datetime.now(tz=timezone.utc)
    backend.set(task_scope(), "stale", "1", expires_at=now - timedelta(days=1))
    backend.set(task_scope(), "fresh", "2", expires_at=now + timedelta(days=1))
    backend.cleanup()
    assert backend.get(task_scope(), "stale") is None
    assert backend.get(task_scope(), "fresh") == "2"


def test_collect_expired_reports_unreadable_documents_and_leaves_them(object_store: ObjectStore) -> None:
    object_store.put(f"{RUN_DIR}/load/map=-1/broken.json", b"not json")
    report = collect_expired(object_store, now=NOW)
    assert report.unreadable == [f"{RUN_DIR}/load/map=-1/broken.json"]
    assert keys_in(object_store) == [f"{RUN_DIR}/load/map=-1/broken.json"]
    with pytest.raises(ValueError, match="timezone-aware"):
        collect_expired(object_store, now=NOW.replace(tzinfo=None))


# -- worker side: reference mode ----------------------------------------------------------------------------
def test_worker_side_writes_the_value_and_returns_a_deterministic_reference(
    backend: Any, object_store: ObjectStore
) -> None:
    scope = task_scope(map_index=3)
    value = {"job_id": "j-1", "attempts": [1, 2]}
    ref = backend.serialize_task_state_store_to_ref(value=value, key="job", scope=scope)
    assert ref == f"{object_store.url}/{RUN_DIR}/load/map=3/job.json"
    assert backend.serialize_task_state_store_to_ref(value=value, key="job", scope=scope) == ref
    assert backend.deserialize_task_state_store_from_ref(ref) == value
    assert document(object_store, f"{RUN_DIR}/load/map=3/job.json").expires_at is None

    asset_ref = backend.serialize_asset_state_store_to_ref(value=5, key="wm", scope=asset_scope(uri="x://y"))
    assert asset_ref == f"{object_store.url}/~asset-state/uri=x%3A%2F%2Fy/wm.json"
    assert backend.deserialize_asset_state_store_from_ref(asset_ref) == 5

    backend.delete(scope, "job")  # what Airflow calls on the worker after deleting the database row
    assert backend.deserialize_task_state_store_from_ref(ref) is None


def test_references_outside_this_backend_are_refused(backend: Any, object_store: ObjectStore) -> None:
    with pytest.raises(ConfigurationError, match="does not point into this backend's store"):
        backend.deserialize_task_state_store_from_ref("s3://elsewhere/~task-state/x.json")
    task_ref = backend.serialize_task_state_store_to_ref(value=1, key="k", scope=task_scope())
    with pytest.raises(ConfigurationError, match="not a ~asset-state document"):
        backend.deserialize_asset_state_store_from_ref(task_ref)
    with pytest.raises(ConfigurationError, match="not a ~task-state document"):
        backend.deserialize_task_state_store_from_ref(f"{object_store.url}/some/checkpoint/~head.json")
    with pytest.raises(InvalidValueError, match="'k' is not JSON-serialisable"):
        backend.serialize_task_state_store_to_ref(value=float("nan"), key="k", scope=task_scope())


def test_server_side_records_the_expiry_of_its_own_reference_instead_of_storing_it(
    backend: Any, object_store: ObjectStore
) -> None:
    """Both sides run this backend: the worker writes the value, then the server is asked to store the ref."""
    scope = task_scope()
    ref = backend.serialize_task_state_store_to_ref(value=[1, 2], key="k", scope=scope)
    expires = NOW + timedelta(days=30)
    backend.set(scope, "k", json.dumps({REF_KEY: ref}), expires_at=expires)
    doc = document(object_store, backend.object_key(scope, "k"))
    assert (json.loads(doc.value), doc.expires_at, doc.by_ref) == ([1, 2], expires, True)
    assert json.loads(backend.get(scope, "k")) == {REF_KEY: ref}, "the server hands the worker its reference"

    # A reference to another document (the worker's asset-by-name one, while the server has the asset id)
    # is an ordinary value there.
    asset_ref = backend.serialize_asset_state_store_to_ref(value=9, key="wm", scope=asset_scope(name="a"))
    backend.set(asset_scope(asset_id=1), "wm", json.dumps({REF_KEY: asset_ref}))
    assert json.loads(backend.get(asset_scope(asset_id=1), "wm")) == {REF_KEY: asset_ref}
    assert backend.deserialize_asset_state_store_from_ref(asset_ref) == 9

    # Then a plain server-side write replaces the value and the by_ref mark.
    backend.set(scope, "k", '"plain"')
    assert backend.get(scope, "k") == '"plain"'


# -- concurrency and async ----------------------------------------------------------------------------------
def test_concurrent_writers_never_lose_a_write_and_readers_never_see_a_torn_value(tmp_path: Path) -> None:
    from airflow_stateful.state_store import S3StateStoreBackend

    store = LocalObjectStore(root=tmp_path / "state", fsync=False)
    backend = S3StateStoreBackend(store=store, max_attempts=1000)
    scope = task_scope()
    writers, writes = 8, 25
    values = {
        json.dumps({"writer": w, "n": n, "pad": "x" * 2000}) for w in range(writers) for n in range(writes)
    }
    finals = {json.dumps({"writer": w, "n": writes - 1, "pad": "x" * 2000}) for w in range(writers)}
    errors: list[BaseException] = []
    seen: list[str] = []
    done = threading.Event()

    def write(w: int) -> None:
        try:
            for n in range(writes):
                backend.set(scope, "k", json.dumps({"writer": w, "n": n, "pad": "x" * 2000}))
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        try:
            while not done.is_set():
                value = backend.get(scope, "k")
                if value is not None:
                    seen.append(value)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()

    assert errors == []
    doc = document(store, backend.object_key(scope, "k"))
    assert doc.version == writers * writes, "every write landed as its own version: none was lost"
    assert doc.value in finals, "the last write to commit is some writer's last value"
    assert seen and set(seen) <= values, "readers only ever saw whole values that were written"


def test_async_variants(backend: Any, object_store: ObjectStore) -> None:
    async def scenario() -> list[Any]:
        scopes = [task_scope(map_index=i) for i in range(4)]
        await asyncio.gather(*(backend.aset(s, "k", str(i)) for i, s in enumerate(scopes)))
        got = await asyncio.gather(*(backend.aget(s, "k") for s in scopes))
        await backend.adelete(scopes[0], "k")
        await backend.aclear(scopes[1])
        after_clear = [await backend.aget(s, "k") for s in scopes]
        await backend.aclear(scopes[2], all_map_indices=True)
        return [got, after_clear, [await backend.aget(s, "k") for s in scopes]]

    got, after_clear, after_all = asyncio.run(scenario())
    assert got == ["0", "1", "2", "3"]
    assert after_clear == [None, None, "2", "3"]
    assert after_all == [None, None, None, None]
    assert keys_in(object_store) == []


@pytest.mark.s3
def test_a_write_whose_answer_was_lost_is_counted_once(s3_endpoint: S3Endpoint, s3_prefix: str) -> None:
    """botocore retries a PutObject that landed (forced here); the retry sees 412, which must not re-write."""
    from airflow_stateful.state_store import S3StateStoreBackend

    forced: list[int] = []

    def retry_once(response: Any, attempts: int, **_: Any) -> float | None:
        if response is None or response[0].status_code != 200 or attempts > 1:
            return None
        forced.append(attempts)
        return 0.0

    store = s3_endpoint.store(s3_prefix)
    backend = S3StateStoreBackend(store=store)
    backend.set(task_scope(), "k", '"v1"')
    store.client.meta.events.register("needs-retry.s3.PutObject", retry_once)
    try:
        backend.set(task_scope(), "k", '"v2"')
    finally:
        store.client.meta.events.unregister("needs-retry.s3.PutObject", retry_once)
    assert forced, "the retry was really forced"
    doc = document(store, backend.object_key(task_scope(), "k"))
    assert (doc.value, doc.version) == ('"v2"', 2), "the write landed once, although it was sent twice"


# -- configuration, Airflow's loaders, versions ------------------------------------------------------------
def test_built_without_arguments_it_opens_the_stateful_backend_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_stateful.state_store import S3StateStoreBackend

    url = (tmp_path / "kv").as_uri()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", url)
    backend = S3StateStoreBackend()
    assert backend.store.url == url
    backend.set(task_scope(), "k", "1")
    assert (tmp_path / "kv" / RUN_DIR / "load" / "map=-1" / "k.json").is_file()
    with pytest.raises(ConfigurationError, match="not both"):
        S3StateStoreBackend(store=backend.store, backend_url=url)


CONFIGURED_PATHS = [
    "airflow_stateful.state_store.S3StateStoreBackend",  # the path users have in airflow.cfg, and the class's module
]


@pytest.mark.parametrize("classpath", CONFIGURED_PATHS)
def test_airflow_server_and_worker_loaders_accept_the_backend_and_its_scopes(
    classpath: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reset_state_backends: None
) -> None:
    """The server checks the class against airflow-core's own copy of BaseStoreBackend and passes that copy's
    scopes; the worker uses the task SDK's. Both must work with this one class, by the configured dotted path."""
    import airflow._shared.state as core_state
    from airflow.sdk.execution_time.context import _get_worker_state_store_backend
    from airflow.state import get_state_backend, resolve_state_backend

    import airflow_stateful
    from airflow_stateful.state_store import S3StateStoreBackend

    assert S3StateStoreBackend is airflow_stateful.S3StateStoreBackend
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "kv").as_uri())
    monkeypatch.setenv("AIRFLOW__STATE_STORE__BACKEND", classpath)
    monkeypatch.setenv("AIRFLOW__WORKERS__STATE_STORE_BACKEND", classpath)
    assert resolve_state_backend() is S3StateStoreBackend
    assert issubclass(S3StateStoreBackend, core_state.BaseStoreBackend)
    server = get_state_backend()
    worker = _get_worker_state_store_backend()
    assert isinstance(server, S3StateStoreBackend) and isinstance(worker, S3StateStoreBackend)
    core_scope = core_state.TaskScope(
        dag_id="etl", run_id="manual__2026-01-01T00:00:00+00:00", task_id="load"
    )
    server.set(core_scope, "k", '"from the server"')
    assert worker.get(task_scope(), "k") == '"from the server"', "both copies of TaskScope name one folder"
    server.set(core_state.AssetScope(asset_id=3), "k", "1")
    assert worker.get(asset_scope(asset_id=3), "k") == "1"
    with pytest.raises(TypeError, match="TaskScope or an AssetScope"):
        server.get(object(), "k")


LOAD_COLD = """
import json
from airflow.sdk.execution_time.context import _get_worker_state_store_backend
from airflow.state import get_state_backend

server, worker = get_state_backend(), _get_worker_state_store_backend()
print(json.dumps([type(server).__module__, type(worker).__module__, type(server) is type(worker)]))
"""


def test_a_fresh_airflow_process_loads_the_backend_by_the_path_in_airflow_cfg(tmp_path: Path) -> None:
    """What an API server or worker does at start: nothing of ours imported yet, only the configured path."""
    classpath = CONFIGURED_PATHS[0]
    env = {
        **os.environ,
        "AIRFLOW__STATE_STORE__BACKEND": classpath,
        "AIRFLOW__WORKERS__STATE_STORE_BACKEND": classpath,
        "AIRFLOW__STATEFUL__BACKEND_URL": (tmp_path / "kv").as_uri(),
    }
    done = subprocess.run(
        [sys.executable, "-c", LOAD_COLD], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    module = "airflow_stateful.state_store"
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [module, module, True]


def test_importing_it_on_airflow_before_3_3_says_which_version_is_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Airflow < 3.3 has no airflow.sdk.state; a None entry in sys.modules makes its import fail the same way.
    monkeypatch.setitem(sys.modules, "airflow.sdk.state", None)
    for name in ("airflow_stateful.state_store",):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=r"needs Apache Airflow 3\.3 or newer.*apache-airflow 3\.\d+"):
        importlib.import_module("airflow_stateful.state_store")


@pytest.mark.s3
def test_backend_repr_and_errors_carry_no_credentials(s3_endpoint: S3Endpoint, s3_prefix: str) -> None:
    from airflow_stateful.core.stores.s3 import S3ObjectStore
    from airflow_stateful.state_store import S3StateStoreBackend

    options = s3_endpoint.options()
    if s3_endpoint.kind == "moto":
        options["aws_secret_access_key"] = f"do-not-show-{uuid.uuid4().hex}"  # moto accepts any secret
    secret = options.get("aws_secret_access_key")
    if not secret:
        pytest.skip("the endpoint's credentials come from boto3's chain, not from arguments")
    backend = S3StateStoreBackend(store=S3ObjectStore(bucket=s3_endpoint.bucket, prefix=s3_prefix, **options))
    backend.set(task_scope(), "k", "1")
    assert secret not in repr(backend)
    with pytest.raises(ConfigurationError) as info:
        backend.deserialize_task_state_store_from_ref("s3://elsewhere/~task-state/x.json")
    assert secret not in str(info.value)


# -- Airflow: the example DAG under dag.test() --------------------------------------------------------------
def forget_state_backends() -> None:
    """Forget the state store backends Airflow built earlier in this process.

    Airflow builds each side's backend once per process and keeps it: the server side in the module global
    ``airflow.state._backend_instance`` (airflow/state/__init__.py, ``get_state_backend``), the worker side
    in the ``functools.cache`` of ``_get_worker_state_store_backend`` (airflow/sdk/execution_time/context.py).
    ``dag.test()`` runs both sides in this process, so without this a test would get the backend (and the
    store URL) configured by an earlier test, and the one configured here would outlive it.
    """
    import airflow.state
    from airflow.sdk.execution_time.context import _get_worker_state_store_backend

    airflow.state._backend_instance = None
    _get_worker_state_store_backend.cache_clear()


@pytest.fixture
def reset_state_backends() -> Iterator[None]:
    """Airflow's cached state store backends forgotten before and after the test."""
    forget_state_backends()
    yield
    forget_state_backends()


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.csv"
    monkeypatch.setenv("STATEFUL_DEMO_LEDGER", str(path))
    return path


def returned(run: Any, task_id: str) -> list[Any]:
    """What a task of the run returned (one entry per map index), read back from Airflow's XCom table."""
    from airflow import settings
    from airflow.models.xcom import XComModel

    with settings.Session() as session:
        query = XComModel.get_many(
            run_id=run.run_id, dag_ids=run.dag_id, task_ids=task_id, key="return_value"
        )
        rows = sorted(session.scalars(query), key=lambda x: x.map_index)
        return [XComModel.deserialize_value(row) for row in rows]


def run_example(dags_folder: Path) -> Any:
    module = load_dag_module(dags_folder / "task_state_store.py")
    run = module.dag_object.test()
    assert run.state == "success"
    return run


def check_example_story(run: Any, ledger: Path) -> str:
    submissions = [row.split(",") for row in ledger.read_text().split()]
    assert len(submissions) == 1 and submissions[0][0] == "1", (
        "one submission, by try 1; the retry reattached"
    )
    job_id = submissions[0][1]
    assert returned(run, "run_job") == [{"job_id": job_id, "submitted_on_try": 1, "finished_on_try": 2}]
    assert returned(run, "count_rows") == [600, 900]
    return job_id


@pytest.mark.airflow
def test_example_dag_runs_on_airflows_default_backend(
    dags_folder: Path, ledger: Path, reset_state_backends: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AIRFLOW__STATE_STORE__BACKEND", raising=False)
    monkeypatch.delenv("AIRFLOW__WORKERS__STATE_STORE_BACKEND", raising=False)
    run = run_example(dags_folder)
    check_example_story(run, ledger)


BACKEND = "airflow_stateful.state_store.S3StateStoreBackend"
MODES = {"server": ("BACKEND",), "worker": ("WORKERS",), "both": ("BACKEND", "WORKERS")}


def configure(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The two settings Airflow reads: ``[state_store] backend`` and ``[workers] state_store_backend``."""
    monkeypatch.delenv("AIRFLOW__STATE_STORE__BACKEND", raising=False)
    monkeypatch.delenv("AIRFLOW__WORKERS__STATE_STORE_BACKEND", raising=False)
    if "BACKEND" in MODES[mode]:
        monkeypatch.setenv("AIRFLOW__STATE_STORE__BACKEND", BACKEND)
    if "WORKERS" in MODES[mode]:
        monkeypatch.setenv("AIRFLOW__WORKERS__STATE_STORE_BACKEND", BACKEND)


def s3_documents(s3_endpoint: S3Endpoint, prefix: str) -> dict[str, dict[str, Any]]:
    """Every object below ``prefix``, read with the raw boto3 client: key (without prefix) -> JSON body."""
    client = s3_endpoint.client()
    found: dict[str, dict[str, Any]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=s3_endpoint.bucket, Prefix=f"{prefix}/"
    ):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=s3_endpoint.bucket, Key=obj["Key"])["Body"].read()
            found[obj["Key"][len(prefix) + 1 :]] = json.loads(body)
    return found


@pytest.mark.airflow
@pytest.mark.s3
@pytest.mark.parametrize("mode", list(MODES))
def test_example_dag_keeps_its_state_across_a_retry_in_s3(
    mode: str,
    dags_folder: Path,
    ledger: Path,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    s3_backend: str,
    reset_state_backends: None,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    configure(monkeypatch, mode)
    run = run_example(dags_folder)
    job_id = check_example_story(run, ledger)

    run_dir = f"~task-state/task_state_store/{quote(run.run_id, safe='-_.')}"
    docs = s3_documents(s3_endpoint, s3_prefix)
    assert sorted(docs) == [
        f"{run_dir}/count_rows/map=0/rows.json",
        f"{run_dir}/count_rows/map=1/rows.json",
        f"{run_dir}/run_job/map=-1/job%2Fsubmitted_at.json",  # key job/submitted_at: one object
        f"{run_dir}/run_job/map=-1/job%2Fsubmitted_on_try.json",
        f"{run_dir}/run_job/map=-1/job_id.json",
        f"{run_dir}/run_job/map=-1/result.json",
        f"{run_dir}/run_job/map=-1/status.json",
    ]
    job = docs[f"{run_dir}/run_job/map=-1/job_id.json"]
    assert json.loads(job["value"]) == job_id
    assert json.loads(docs[f"{run_dir}/count_rows/map=1/rows.json"]["value"]) == {
        "table": "customers",
        "rows": 900,
    }
    assert job["expires_at"] is None, "NEVER_EXPIRE"
    status = docs[f"{run_dir}/run_job/map=-1/status.json"]
    if mode == "worker":
        # Airflow does not pass the expiry to a worker-side backend; the database row has it.
        assert status["expires_at"] is None and status["by_ref"] is False
    else:
        # [state_store] default_retention_days (30) from the time of the write.
        written = datetime.fromisoformat(status["written_at"])
        expires = datetime.fromisoformat(status["expires_at"])
        assert timedelta(days=29) < expires - written <= timedelta(days=30)
        assert status["by_ref"] is (mode == "both")

    out, err = capfd.readouterr()
    assert s3_backend not in out + err, "the connection's secret key leaked into the log"
    assert "was not written through the configured state backend" not in out + err


ASSET_DAG = """\
from __future__ import annotations

from datetime import datetime

from airflow.sdk import Asset, dag, task

WATERMARK = Asset(name="__DAG_ID___orders", uri="file:///data/__DAG_ID__/orders")


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def flow():
    @task(outlets=[WATERMARK])
    def advance(asset_state_store=None, task_state_store=None):
        before = asset_state_store.get("watermark", 0)
        asset_state_store.set("watermark", before + 10)
        task_state_store.set("scratch", "temporary")
        task_state_store.set("kept", "stays")
        task_state_store.delete("scratch")
        return {"before": before, "after": asset_state_store.get("watermark")}

    advance()


dag_object = flow()
"""


@pytest.mark.airflow
@pytest.mark.s3
@pytest.mark.parametrize("mode", list(MODES))
def test_asset_state_and_deletes_reach_s3(
    mode: str,
    dags_folder: Path,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    s3_backend: str,
    reset_state_backends: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow import settings
    from airflow.models.asset import AssetModel
    from sqlalchemy import select

    configure(monkeypatch, mode)
    dag_id = f"tss_{mode}_{uuid.uuid4().hex[:8]}"
    path = dags_folder / f"{dag_id}.py"
    path.write_text(textwrap.dedent(ASSET_DAG).replace("__DAG_ID__", dag_id))
    dag = find_dag(load_dag_module(path))
    first, second = dag.test(), dag.test()
    assert (first.state, second.state) == ("success", "success")
    assert returned(first, "advance") == [{"before": 0, "after": 10}]
    assert returned(second, "advance") == [{"before": 10, "after": 20}], "the asset's state outlived the run"

    with settings.Session() as session:
        asset_id = session.scalar(select(AssetModel.id).where(AssetModel.name == f"{dag_id}_orders"))
    docs = s3_documents(s3_endpoint, s3_prefix)
    asset_dir = {
        "server": f"~asset-state/id={asset_id}",  # the execution API knows the asset by id
        "worker": f"~asset-state/name={dag_id}_orders",  # the worker knows it by name
        "both": f"~asset-state/name={dag_id}_orders",
    }[mode]
    task_keys = sorted(k.rsplit("/", 1)[1] for k in docs if k.startswith(f"~task-state/{dag_id}/"))
    assert task_keys == ["kept.json", "kept.json"], "scratch was deleted in both runs"
    asset_keys = sorted(k for k in docs if k.startswith("~asset-state/"))
    if mode == "both":
        # The server stores the worker's reference (by asset id) next to the worker's value (by name).
        assert asset_keys == [f"~asset-state/id={asset_id}/watermark.json", f"{asset_dir}/watermark.json"]
        ref = json.loads(docs[f"~asset-state/id={asset_id}/watermark.json"]["value"])
        assert ref == {REF_KEY: f"s3://{s3_endpoint.bucket}/{s3_prefix}/{asset_dir}/watermark.json"}
    else:
        assert asset_keys == [f"{asset_dir}/watermark.json"]
    assert json.loads(docs[f"{asset_dir}/watermark.json"]["value"]) == 20
    path.unlink()  # later dag.test() calls of the session need not parse it


# -- docs ---------------------------------------------------------------------------------------------------
def test_the_docs_quote_the_example_dag_snippet() -> None:
    lines = (REPO / "dags" / "task_state_store.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# [START task_state_store]")
    end = next(i for i, line in enumerate(lines) if line.strip() == "# [END task_state_store]")
    snippet = textwrap.dedent("\n".join(lines[start + 1 : end])).strip()
    assert snippet and snippet in (REPO / "docs" / "state-store.md").read_text()

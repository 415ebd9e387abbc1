"""Identity rules: stable keys, scopes that never collide, and every way a key could escape its prefix.

Also the backend URL parser (``store_from_url``): a wrong URL must fail at configuration time, naming the
bad value, and never echo a credential.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.core.errors import ConfigurationError, IdentityError
from airflow_stateful.core.records.formats import HEAD_NAME, MANIFEST_DIR
from airflow_stateful.core.records.identity import MAX_KEY_BYTES, MAX_SEGMENT_BYTES, Identity
from airflow_stateful.core.records.trees import CHUNK_DIR, TREE_DIR
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.registry import store_from_url
from airflow_stateful.core.stores.s3 import S3ObjectStore

RUN_ID = "manual__2026-11-30T08:00:00+00:00"


def task(**overrides: Any) -> Identity:
    kwargs: dict[str, Any] = {"dag_id": "etl", "task_id": "enrich", "run_id": RUN_ID}
    kwargs.update(overrides)
    return Identity.for_task(**kwargs)


def assert_rejected(call: Any, bad: str) -> IdentityError:
    """``call`` raises IdentityError (a ValueError too) and the message shows ``bad`` as repr or text."""
    with pytest.raises(IdentityError) as info:
        call()
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    # The value itself, or its escaped form inside a larger repr (a control character shows as "\\n").
    shown = (repr(bad), bad, repr(bad)[1:-1])
    assert any(form in message for form in shown), f"{bad!r} not named in: {message}"
    return info.value


# -- stable keys -------------------------------------------------------------------------------------------
def test_same_inputs_give_the_same_key() -> None:
    assert task() == task()
    assert task().key == task().key
    assert hash(task()) == hash(task())


def test_run_id_is_percent_encoded_and_decodes_back() -> None:
    identity = task()
    assert identity.key == "etl/enrich/run=manual__2026-11-30T08%3A00%3A00%2B00%3A00/map=-1"
    assert str(identity) == identity.key
    assert identity.task_parts == {
        "dag_id": "etl",
        "task_id": "enrich",
        "scope_kind": "run",
        "scope": RUN_ID,
        "map_index": -1,
    }


def test_parse_accepts_what_for_task_makes() -> None:
    identity = task(map_index=7)
    parsed = Identity.parse(identity.key)
    assert parsed == identity
    assert parsed.task_parts == identity.task_parts


@pytest.mark.parametrize(
    ("dag_id", "task_id", "run_id"),
    [
        ("étl", "enrich", RUN_ID),  # non-ASCII
        ("a%2Fb", "x", "r"),  # looks already encoded: must not decode to "a/b"
        ("a/b", "c", "r"),  # a slash stays inside one segment
        ("a~b", "c~d", "run~1"),  # the reserved "~" is encoded, never literal
        ("a+b", "c=d", "scheduled__x y"),
        ("etl", "x", ".."),  # the scope segment is "run=..", never ".."
    ],
)
def test_odd_characters_are_encoded_into_one_segment_and_decode_back(
    dag_id: str, task_id: str, run_id: str
) -> None:
    identity = Identity.for_task(dag_id=dag_id, task_id=task_id, run_id=run_id, map_index=3)
    assert len(identity.key.split("/")) == 4
    assert "~" not in identity.key
    assert Identity.parse(identity.key) == identity
    assert identity.task_parts == {
        "dag_id": dag_id,
        "task_id": task_id,
        "scope_kind": "run",
        "scope": run_id,
        "map_index": 3,
    }


def test_non_ascii_and_pre_encoded_values_round_trip() -> None:
    for dag_id in ("étl", "a%2Fb", "a%25"):
        identity = Identity.for_task(dag_id=dag_id, task_id="t", run_id="r")
        assert identity.task_parts is not None
        assert identity.task_parts["dag_id"] == dag_id
    # "a/b" and "a%2Fb" are different dag_ids and must get different keys
    assert (
        Identity.for_task(dag_id="a/b", task_id="t", run_id="r").key
        != Identity.for_task(dag_id="a%2Fb", task_id="t", run_id="r").key
    )


# -- scopes and map indexes never collide ------------------------------------------------------------------
def test_named_scope_never_collides_with_a_run_scope_of_the_same_text() -> None:
    by_run = Identity.for_task(dag_id="etl", task_id="t", run_id="nightly")
    by_name = Identity.for_task(dag_id="etl", task_id="t", name="nightly")
    assert by_run.key != by_name.key
    assert by_run.task_parts is not None and by_name.task_parts is not None
    assert by_run.task_parts["scope_kind"] == "run"
    assert by_name.task_parts["scope_kind"] == "name"
    assert by_run.task_parts["scope"] == by_name.task_parts["scope"] == "nightly"


def test_named_scope_keeps_the_name_readable() -> None:
    identity = Identity.for_task(dag_id="etl", task_id="t", name="nightly-watermark.v2")
    assert identity.key == "etl/t/name=nightly-watermark.v2/map=-1"


def test_map_indexes_give_different_keys() -> None:
    keys = {task(map_index=i).key for i in (-1, 0, 1, 2, 10, 100)}
    assert len(keys) == 6
    assert task(map_index=0).key != task().key


def test_run_ids_that_differ_only_in_reserved_characters_do_not_collide() -> None:
    run_ids = ["a:b", "a+b", "a b", "a%3Ab", "a_b", "a-b", "a.b", "a~b", "a/b"]
    keys = {Identity.for_task(dag_id="d", task_id="t", run_id=r).key for r in run_ids}
    assert len(keys) == len(run_ids)


def test_identity_cannot_land_inside_another_identitys_private_folders() -> None:
    # Our object names start with "~", so no identity segment may: "etl/~chunks" as an identity would
    # read and delete the checkpoint files of the identity "etl" (and "etl/~data" its format-1 files, which
    # buckets written by pre-release builds still hold).
    for private in (HEAD_NAME, MANIFEST_DIR, TREE_DIR, CHUNK_DIR, "~data"):
        assert private.startswith("~")
        for key in (f"etl/{private}", f"etl/{private}/x"):
            with pytest.raises(IdentityError, match="~"):
                Identity.parse(key)
    assert_rejected(lambda: Identity.parse("etl/a~b"), "a~b")
    assert_rejected(lambda: Identity.parse("~"), "~")
    assert_rejected(lambda: task(name="n~x", run_id=None), "n~x")


def test_task_parts_is_none_for_other_shapes() -> None:
    for key in ("etl", "etl/t", "etl/t/run=r", "etl/t/other=r/map=-1", "etl/t/run=r/map=x", "a/b/c/d/e"):
        assert Identity.parse(key).task_parts is None


@pytest.mark.parametrize(
    "key",
    [
        "etl/t/run=r/map=05",  # int() accepts a leading zero; for_task writes map=5
        "etl/t/run=r/map=1_0",  # int() accepts digit separators; for_task writes map=10
        "etl/t/run=r%3a/map=-1",  # lower-case hex; for_task writes %3A
        "etl/t/run=a+b/map=-1",  # for_task encodes "+" as %2B
    ],
)
def test_task_parts_only_decodes_the_canonical_key_of_a_task(key: str) -> None:
    """task_parts is documented as the inverse of for_task ("None for any other shape"). A key that
    decodes to some task's parts but is not that task's key would let two storage locations claim the
    same task, so decoding must either return None or give back exactly this key."""
    parts = Identity.parse(key).task_parts
    if parts is None:
        return
    scope = {"run_id": parts["scope"]} if parts["scope_kind"] == "run" else {"name": parts["scope"]}
    rebuilt = Identity.for_task(
        dag_id=str(parts["dag_id"]), task_id=str(parts["task_id"]), map_index=int(parts["map_index"]), **scope
    )
    assert rebuilt.key == key, f"{key!r} decodes to the parts of a different key, {rebuilt.key!r}"


# -- rejection: keys ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("..", ".."),
        (".", "."),
        ("etl/../other", ".."),
        ("etl/./t", "etl/./t"),
        ("/etc/passwd", "/etc/passwd"),
        ("a//b", "a//b"),
        ("a/b/", "a/b/"),
        ("/a", "/a"),
        ("a\\b", "a\\b"),
        ("..\\..\\x", "..\\..\\x"),
        ("a/b\n", "a/b\n"),
        ("a\x00b", "a\x00b"),
        ("a\x7fb", "a\x7fb"),
        ("a\tb", "a\tb"),
        ("a b", "a b"),
        ("a/~head.json", "~head.json"),
        ("", ""),
    ],
)
def test_parse_rejects_keys_that_could_escape_or_collide(key: str, bad: str) -> None:
    if key == "":
        with pytest.raises(IdentityError, match="empty"):
            Identity.parse(key)
        return
    assert_rejected(lambda: Identity.parse(key), bad)


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(IdentityError, match="string"):
        Identity.parse(b"etl/t")  # type: ignore[arg-type]
    with pytest.raises(IdentityError, match="string"):
        Identity.parse(None)  # type: ignore[arg-type]


def test_parse_rejects_over_long_keys_and_segments() -> None:
    long_key = "/".join(["a" * 200] * 3 + ["b" * 101])  # 704 bytes, every segment short enough
    assert len(long_key.encode()) > MAX_KEY_BYTES
    error = assert_rejected(lambda: Identity.parse(long_key), "a" * 40)
    assert str(MAX_KEY_BYTES) in str(error)

    ok = "/".join(["a" * 200] * 3 + ["b" * 97])  # exactly 700 bytes
    assert len(ok.encode()) == MAX_KEY_BYTES
    assert Identity.parse(ok).key == ok

    long_segment = "x/" + "s" * (MAX_SEGMENT_BYTES + 1)
    error = assert_rejected(lambda: Identity.parse(long_segment), "s" * 40)
    assert str(MAX_SEGMENT_BYTES) in str(error)
    assert Identity.parse("x/" + "s" * MAX_SEGMENT_BYTES)


# -- rejection: task parts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["dag_id", "task_id", "run_id"])
@pytest.mark.parametrize("bad", ["a\nb", "a\x00b", "a\x7fb", "\r", "tab\there"])
def test_for_task_rejects_control_characters(field: str, bad: str) -> None:
    assert_rejected(lambda: task(**{field: bad}), bad)


@pytest.mark.parametrize("bad", ["a\nb", "a\x00b", "a\x7fb", "nightly\n"])
def test_for_task_rejects_control_characters_in_names(bad: str) -> None:
    assert_rejected(lambda: task(run_id=None, name=bad), bad)


@pytest.mark.parametrize("field", ["dag_id", "task_id"])
@pytest.mark.parametrize("bad", ["..", "."])
def test_for_task_rejects_dot_segments(field: str, bad: str) -> None:
    assert_rejected(lambda: task(**{field: bad}), bad)


@pytest.mark.parametrize("field", ["dag_id", "task_id", "run_id"])
def test_for_task_rejects_empty_parts(field: str) -> None:
    assert_rejected(lambda: task(**{field: ""}), "''")


@pytest.mark.parametrize(
    "name",
    [
        "has space",
        "-leading-dash",
        ".hidden",
        "..",
        ".",
        "a/b",
        "/etc/passwd",
        "a\\b",
        "n~x",
        "a%2F",
        "",
        "x" * 201,
    ],
)
def test_for_task_rejects_bad_names(name: str) -> None:
    assert_rejected(lambda: task(run_id=None, name=name), repr(name) if name else "''")


def test_for_task_rejects_over_long_segments_and_keys() -> None:
    long_dag = "d" * (MAX_SEGMENT_BYTES + 1)
    assert_rejected(lambda: task(dag_id=long_dag), "d" * 40)
    # Encoding counts: 100 "é" are 600 bytes once percent-encoded.
    assert_rejected(lambda: task(dag_id="é" * 100), "%C3%A9")
    assert task(dag_id="d" * MAX_SEGMENT_BYTES).task_parts is not None

    # Every segment fits, the whole key does not.
    parts = {"dag_id": "d" * 250, "task_id": "t" * 250, "run_id": "r" * 200}
    error = assert_rejected(lambda: task(**parts), "d" * 40)
    assert str(MAX_KEY_BYTES) in str(error)


@pytest.mark.parametrize("map_index", [True, False, -2, -100, 1.0, "0", None])
def test_for_task_rejects_bad_map_indexes(map_index: Any) -> None:
    assert_rejected(lambda: task(map_index=map_index), repr(map_index))


def test_for_task_needs_exactly_one_scope() -> None:
    error = assert_rejected(lambda: task(run_id=RUN_ID, name="nightly"), "nightly")
    assert RUN_ID in str(error)
    assert_rejected(lambda: task(run_id=None), "None")


@pytest.mark.parametrize("field", ["dag_id", "task_id"])
def test_for_task_rejects_non_string_parts(field: str) -> None:
    assert_rejected(lambda: task(**{field: 42}), "42")
    assert_rejected(lambda: task(**{field: None}), "None")


# -- backend URLs ------------------------------------------------------------------------------------------
def test_file_url_opens_a_local_store(tmp_path: Path) -> None:
    root = tmp_path / "state"
    store = store_from_url(root.as_uri())
    assert isinstance(store, LocalObjectStore)
    assert store.root == root
    assert not root.exists(), "opening a store to read it creates nothing (a mistyped path stays absent)"
    store.put("x/~head.json", b"{}")
    assert (root / "~stateful").is_dir() and (root / "x" / "~head.json").read_bytes() == b"{}"
    assert isinstance(store_from_url(f"file://localhost{root}"), LocalObjectStore)


def test_s3_url_opens_an_s3_store_with_the_prefix() -> None:
    store = store_from_url("s3://my-bucket/airflow/state/", region_name="us-east-1")
    assert isinstance(store, S3ObjectStore)
    assert (store.bucket, store.prefix, store.url) == (
        "my-bucket",
        "airflow/state",
        "s3://my-bucket/airflow/state",
    )


@pytest.mark.parametrize(
    ("url", "bad"),
    [
        ("file://relative/path", "file://relative/path"),
        ("file:relative/path", "file:relative/path"),
        ("file:./state", "file:./state"),
        ("s3:///prefix", "s3:///prefix"),
        ("s3://", "s3://"),
        ("ftp://host/path", "ftp"),
        ("gs://bucket/p", "gs"),
        ("/var/state", "/var/state"),
        ("s3://bucket/a/../b", "a/../b"),
        ("s3://bucket/../b", "../b"),
        ("s3://bucket/a/%2E%2E/b", "a/../b"),
        ("s3://bucket/a/./b", "a/./b"),
        ("s3://bucket/a//b", "a//b"),
    ],
)
def test_bad_backend_urls_are_configuration_errors_naming_the_value(url: str, bad: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        store_from_url(url)
    assert isinstance(info.value, ValueError)
    assert bad in str(info.value)


@pytest.mark.parametrize("url", ["", None, 42])
def test_empty_backend_url_is_a_configuration_error(url: Any) -> None:
    with pytest.raises(ConfigurationError, match="non-empty"):
        store_from_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@my-bucket/prefix",
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@my-bucket",
        "s3://:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@my-bucket/prefix",
        # AWS secret keys often contain "/" (this is AWS's documented example key). The URL parser then
        # ends the host at the first "/", so the "@" is no longer in it.
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@my-bucket/prefix",
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI%2FK7MDENG%2FbPxRfiCYEXAMPLEKEY@my-bucket/prefix",
    ],
)
def test_credentials_in_the_url_are_refused_without_echoing_the_secret(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        store_from_url(url)
    message = str(info.value)
    assert "credentials" in message
    for secret_part in ("wJalrXUtnFEMI", "K7MDENG", "bPxRfiCYEXAMPLEKEY"):
        assert secret_part not in message
        assert secret_part not in repr(info.value)
    assert "my-bucket" in message.lower() or "AKIAIOSFODNN7EXAMPLE".lower() in message.lower()


@pytest.mark.parametrize("url", ["s3://bucket/p?versionId=1", "s3://bucket/p#frag"])
def test_query_and_fragment_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="query or a fragment"):
        store_from_url(url)

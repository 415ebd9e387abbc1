"""Schema migrations and value codecs: upgrade-safe reads that never guess, pickle only by name."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_stateful.core.errors import IncompatibleStateError, InvalidValueError, MigrationError
from airflow_stateful.core.protocol.migrations import migrate, migration_path, validate_schema
from airflow_stateful.core.records.codecs import decode_value, encode_value


def v1_to_v2(value: dict[str, Any]) -> dict[str, Any]:
    return {"items": value["done"], "version": 2}


def v2_to_v3(value: dict[str, Any]) -> dict[str, Any]:
    return {**value, "version": 3, "count": len(value["items"])}


MIGRATIONS = {1: v1_to_v2, 2: v2_to_v3}


def test_migrations_apply_step_by_step() -> None:
    assert migration_path(1, 3, MIGRATIONS) == [1, 2]
    assert migrate({"done": [1, 2]}, 1, 3, MIGRATIONS) == {"items": [1, 2], "version": 3, "count": 2}
    assert migrate({"items": [7], "version": 2}, 2, 3, MIGRATIONS)["count"] == 1
    assert migrate({"x": 1}, 3, 3, MIGRATIONS) == {"x": 1}


def test_newer_checkpoint_than_code_names_both_versions() -> None:
    with pytest.raises(IncompatibleStateError, match=r"schema_version 4, newer than this task's 3"):
        migration_path(4, 3, MIGRATIONS)


def test_missing_step_names_the_gap_and_the_fix() -> None:
    with pytest.raises(
        IncompatibleStateError, match=r"expects 3.*no migration from version 2.*migrations=\{2: fn\}"
    ):
        migration_path(1, 3, {1: v1_to_v2})


def test_migration_returning_none_or_raising_is_refused() -> None:
    with pytest.raises(MigrationError, match=r"migration 1 -> 2 \(forgot_return\) returned None"):

        def forgot_return(value: Any) -> None:
            value["x"] = 1

        migrate({}, 1, 2, {1: forgot_return})
    with pytest.raises(MigrationError, match=r"migration 1 -> 2 .* failed: KeyError"):
        migrate({}, 1, 2, {1: v1_to_v2})


@pytest.mark.parametrize(
    ("schema_version", "migrations", "match"),
    [
        (0, None, "schema_version must be an integer >= 1, not 0"),
        (True, None, "schema_version must be an integer >= 1, not True"),
        ("2", None, "schema_version must be an integer >= 1, not '2'"),
        (2, {2: v1_to_v2}, r"migrations\[2\] upgrades 2 -> 3, beyond schema_version 2"),
        (2, {0: v1_to_v2}, "not 0"),
        (2, {1: "not callable"}, r"migrations\[1\] must be callable"),
    ],
)
def test_bad_schema_declarations_are_refused(schema_version: Any, migrations: Any, match: str) -> None:
    with pytest.raises(InvalidValueError, match=match):
        validate_schema(schema_version, migrations)


def test_json_codec_refuses_what_json_cannot_hold() -> None:
    assert encode_value({"a": [1, "x", None]}, "json") == {"a": [1, "x", None]}
    with pytest.raises(InvalidValueError, match="not JSON-serializable"):
        encode_value({1, 2}, "json")
    with pytest.raises(InvalidValueError, match="value_codec must be one of json, pickle, not 'yaml'"):
        encode_value({}, "yaml")


def test_pickle_only_when_both_sides_opt_in() -> None:
    value = {"a set": {1, 2}, "bytes": b"\x00\x01"}
    stored = encode_value(value, "pickle")
    assert isinstance(stored, str)
    assert decode_value(stored, "pickle", allowed="pickle", where="checkpoint 3") == value
    with pytest.raises(InvalidValueError, match=r"checkpoint 3 holds a pickled value.*value_codec='pickle'"):
        decode_value(stored, "pickle", allowed="json", where="checkpoint 3")

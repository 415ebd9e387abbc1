"""Upgrade-safe resume: bringing a checkpoint written by old code to the schema the new code expects.

A task declares ``schema_version`` (an integer that only grows) and ``migrations``, a mapping from a version
``v`` to a function that turns a value of version ``v`` into one of version ``v + 1``. A checkpoint of
version 1 read by code of version 3 is migrated 1 -> 2 -> 3, step by step. A checkpoint newer than the code
(a rollback of the DAG), or a version with no path, is *incompatible*: the task either fails with an error
naming both versions (``on_incompatible="fail"``, the default) or starts afresh (``"restart"``), keeping
the old checkpoint in history. Nothing is ever guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from airflow_stateful.core.errors import IncompatibleStateError, InvalidValueError, MigrationError

Migration = Callable[[Any], Any]


def validate_schema(schema_version: Any, migrations: Mapping[Any, Any] | None) -> dict[int, Migration]:
    """Check a task's schema declaration when the task is defined, before anything runs."""
    if isinstance(schema_version, bool) or not isinstance(schema_version, int) or schema_version < 1:
        raise InvalidValueError(f"schema_version must be an integer >= 1, not {schema_version!r}")
    checked: dict[int, Migration] = {}
    for version, fn in (migrations or {}).items():
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise InvalidValueError(
                f"migrations keys are the versions they upgrade from (int >= 1), not {version!r}"
            )
        if version >= schema_version:
            raise InvalidValueError(
                f"migrations[{version}] upgrades {version} -> {version + 1}, beyond schema_version {schema_version}"
            )
        if not callable(fn):
            raise InvalidValueError(f"migrations[{version}] must be callable, not {fn!r}")
        checked[version] = fn
    return checked


def migration_path(from_version: int, to_version: int, migrations: Mapping[int, Migration]) -> list[int]:
    """The versions to migrate from, in order; IncompatibleStateError when there is no path."""
    if from_version > to_version:
        raise IncompatibleStateError(
            f"the checkpoint has schema_version {from_version}, newer than this task's {to_version}: it was "
            "written by newer code. Deploy that code again, or set on_incompatible='restart' to start afresh "
            "(the checkpoint stays in history)."
        )
    missing = [v for v in range(from_version, to_version) if v not in migrations]
    if missing:
        raise IncompatibleStateError(
            f"the checkpoint has schema_version {from_version} but this task expects {to_version}, and there is "
            f"no migration from version {missing[0]} (add migrations={{{missing[0]}: fn}} that turns a version "
            f"{missing[0]} value into a version {missing[0] + 1} one), or set on_incompatible='restart'."
        )
    return list(range(from_version, to_version))


def migrate(value: Any, from_version: int, to_version: int, migrations: Mapping[int, Migration]) -> Any:
    """Apply the migrations step by step. Each must return the new value (``None`` is refused)."""
    for version in migration_path(from_version, to_version, migrations):
        fn = migrations[version]
        try:
            value = fn(value)
        except Exception as exc:
            raise MigrationError(
                f"migration {version} -> {version + 1} ({getattr(fn, '__name__', fn)}) failed: {exc!r}. "
                "The stored checkpoint is unchanged."
            ) from exc
        if value is None:
            raise MigrationError(
                f"migration {version} -> {version + 1} ({getattr(fn, '__name__', fn)}) returned None; a migration "
                "must return the upgraded value. The stored checkpoint is unchanged."
            )
    return value

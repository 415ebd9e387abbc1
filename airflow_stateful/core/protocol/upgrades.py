"""Where a writer starts: the newest checkpoint, unless upgrade rules say otherwise.

A writer that opens an identity reads its newest checkpoint, verified, and then decides, by rules the task
declared, what its code may do with it:

* a **schema** it can read: resume it as it is, or migrate it step by step to this code's ``schema_version``
  (the session commits the migrated value before any user code runs);
* a schema it cannot read: fail (``on_incompatible="fail"``, the checkpoint untouched) or start fresh and *pin*
  the checkpoint, so retention keeps it for the code that wrote it (``"restart"``);
* a checkpoint **pinned** for this code by an older deploy (a rollback, then forward again): resume from it,
  committing a copy as the newest and releasing the pin;
* other **code** (another fingerprint, same schema): ``on_code_change`` resume, warn, restart or fail.

Every decision is logged in one line that names the checkpoint (:func:`describe_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_stateful.core import events
from airflow_stateful.core.errors import CodeChangedError, IncompatibleStateError, InvalidValueError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.lease import Lease
from airflow_stateful.core.protocol.migrations import migrate, migration_path, validate_schema
from airflow_stateful.core.records.code_identity import ON_CODE_CHANGE, CodeIdentity
from airflow_stateful.core.records.codecs import check_codec, decode_value
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
from airflow_stateful.core.records.lineage import CopyOf
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.pins import pin_to_resume
from airflow_stateful.core.records.writer import WriterInfo

log = logging.getLogger("airflow_stateful")

ON_INCOMPATIBLE = ("fail", "restart")


@dataclass(frozen=True)
class UpgradeRules:
    """What a writer's code declares about the checkpoints it may meet."""

    schema_version: int
    migrations: Mapping[int, Callable[[Any], Any]]
    on_incompatible: str
    value_codec: str
    code: CodeIdentity | None
    on_code_change: str

    @classmethod
    def checked(
        cls,
        *,
        schema_version: int,
        migrations: Mapping[int, Callable[[Any], Any]] | None,
        on_incompatible: str,
        value_codec: str,
        code: CodeIdentity | None,
        on_code_change: str,
    ) -> UpgradeRules:
        """The rules, once each is valid (InvalidValueError naming the bad one, before anything is read)."""
        checked = validate_schema(schema_version, migrations)
        if on_code_change not in ON_CODE_CHANGE:
            raise InvalidValueError(
                f"on_code_change must be one of {', '.join(map(repr, ON_CODE_CHANGE))}, not {on_code_change!r}"
            )
        if on_incompatible not in ON_INCOMPATIBLE:
            raise InvalidValueError(
                f"on_incompatible must be one of {', '.join(map(repr, ON_INCOMPATIBLE))}, not {on_incompatible!r}"
            )
        check_codec(value_codec)
        return cls(schema_version, checked, on_incompatible, value_codec, code, on_code_change)


@dataclass
class Start:
    """Where a writer starts: its newest checkpoint and value, and what it set aside or came back to."""

    latest: Manifest | None = None
    value: Any = None
    #: The checkpoint it resumes (verified, before migration).
    start: Manifest | None = None
    #: The checkpoint skipped by ``on_incompatible="restart"`` (pinned) or ``on_code_change="restart"``.
    restarted_from: Manifest | None = None
    #: The pinned checkpoint it resumed (a rollforward after a rollback).
    resumed_pin: Manifest | None = None
    #: A migrated value the writer must commit before its code runs, and the ``extra`` it carries.
    migrated: Any = None
    carried: dict[str, Any] | None = None


def describe_checkpoint(manifest: Manifest) -> str:
    """``checkpoint 7 (written by try 2, at ..., schema 1, dag version ...)`` for task logs."""
    writer = manifest.writer
    parts = [f"try {writer.try_number}" if writer.try_number is not None else writer.describe()]
    parts.append(f"at {manifest.created_at}")
    parts.append(f"schema {manifest.schema_version}")
    if writer.dag_version_id:
        parts.append(f"dag version {writer.dag_version_id}")
    if manifest.code is not None and manifest.code.fingerprint:
        parts.append(f"code {manifest.code.fingerprint}")
    return f"checkpoint {manifest.seq} (written by {', '.join(parts)})"


def carried_extra(source: Manifest, *, run_id: str | None) -> dict[str, Any] | None:
    """What a checkpoint committed on a writer's behalf before its code runs (a migration, a pinned checkpoint's
    copy) carries over from ``source``'s ``extra``: a resume position or the pod's image belong to ``source``'s
    run, so only within the same run (``run_id``), and never the mark of an earlier rollback."""
    if source.writer.run_id != run_id:
        return None
    return {k: v for k, v in source.extra.items() if k != "rolled_back_from"}


def code_allows(latest: Manifest, rules: UpgradeRules, origin: str) -> bool:
    """Apply ``on_code_change`` to a checkpoint of this schema; False: start fresh instead (``restart``).

    One line says what changed from the checkpoint's code to this try's: the task's code (its fingerprint)
    decides; the DAG version, bundle version and provider version are said beside it.
    """
    code = rules.code
    if code is None or latest.code is None:
        return True
    changes = latest.code.changes(code)
    if not changes:
        return True
    line = f"{origin} was written by other code: {'; '.join(changes)}"
    if not latest.code.code_changed(code):
        log.info("%s (the task's own code is unchanged)", line)
        return True
    if rules.on_code_change == "fail":
        raise CodeChangedError(f"cannot resume: {line}; on_code_change='fail'. The checkpoint is untouched.")
    if rules.on_code_change == "restart":
        log.warning("%s; on_code_change='restart': starting fresh, it stays in history", line)
        return False
    (log.warning if rules.on_code_change == "warn" else log.info)("%s; resuming from it", line)
    return True


def find_start(
    checkpoints: CheckpointStore,
    lease: Lease,
    rules: UpgradeRules,
    *,
    writer: WriterInfo,
    check: Callable[[], None],
) -> Start:
    """Where the writer holding ``lease`` starts, by ``rules``; what it set aside is pinned or logged."""
    # The head just read or written to take the lease: an inline manifest costs no further request.
    head = checkpoints.heads.cached()
    latest = checkpoints.latest(head=head)
    identity = checkpoints.identity
    if latest is None:
        log.info("no checkpoint for %s yet: starting fresh", identity)
        return Start()
    assert head is not None
    pinned = pin_to_resume(head, schema_version=rules.schema_version)
    if pinned is not None:
        return _resume_pinned(checkpoints, lease, rules, head, pinned, latest, writer=writer, check=check)
    value = decode_value(
        latest.value, latest.value_codec, allowed=rules.value_codec, where=f"checkpoint {latest.seq}"
    )
    origin = describe_checkpoint(latest)
    try:
        migration_path(latest.schema_version, rules.schema_version, rules.migrations)
    except IncompatibleStateError as exc:
        if rules.on_incompatible == "fail":
            raise IncompatibleStateError(
                f"cannot resume from {origin}: {exc} The checkpoint is untouched."
            ) from exc
        checkpoints.pin(
            lease,
            latest.seq,
            reason=f"schema {latest.schema_version} cannot be read by schema-{rules.schema_version} code ({exc})",
            by=f"{writer.describe()}, schema {rules.schema_version}",
        )
        log.warning(
            "%s is incompatible (%s); on_incompatible='restart': starting fresh. It is pinned: retention keeps "
            "it, and schema-%d code resumes from it when it runs again.",
            origin,
            exc,
            latest.schema_version,
        )
        return Start(restarted_from=latest)
    if latest.schema_version == rules.schema_version and not code_allows(latest, rules, origin):
        return Start(restarted_from=latest)
    if latest.schema_version == rules.schema_version:
        log.info("resuming from %s", origin)
        events.emit(
            events.RESUME, identity=identity.key, seq=latest.seq, schema_version=latest.schema_version
        )
        return Start(latest=latest, value=value, start=latest)
    migrated = migrate(value, latest.schema_version, rules.schema_version, rules.migrations)
    # What the checkpoint's extra records (a resume position, the pod's image) belongs to its run.
    return Start(
        latest=latest,
        start=latest,
        migrated=migrated,
        carried=carried_extra(latest, run_id=writer.run_id),
    )


def _resume_pinned(
    checkpoints: CheckpointStore,
    lease: Lease,
    rules: UpgradeRules,
    head: HeadRecord,
    entry: CheckpointEntry,
    latest: Manifest,
    *,
    writer: WriterInfo,
    check: Callable[[], None],
) -> Start:
    """Resume from a pinned checkpoint this code wrote and older code set aside: commit a copy of it as the
    newest (files by reference, the value as stored), releasing its pin in the same write."""
    pinned = checkpoints.read_manifest(entry)
    value = decode_value(
        pinned.value, pinned.value_codec, allowed=rules.value_codec, where=f"checkpoint {pinned.seq}"
    )
    carried = carried_extra(pinned, run_id=writer.run_id) or {}
    copy = checkpoints.commit(
        lease,
        pinned.value,
        encoded=True,
        schema_version=pinned.schema_version,
        writer=writer,
        value_codec=pinned.value_codec,
        keep_files_from=pinned,
        previous=pinned,
        extra={**carried, "resumed_from_pin": pinned.seq},
        check=check,
        code=rules.code,
        unpin=[entry.commit_id],
        copy_of=CopyOf(seq=pinned.seq, commit_id=pinned.commit_id),  # history: "copy of seq N"
    )
    newer = [e.seq for e in head.checkpoints if e.seq > entry.seq]
    log.warning(
        "resuming from pinned %s, which code of schema %d set aside (checkpoint %d is its newest; %s "
        "stay in history); committed its copy as checkpoint %d and released the pin",
        describe_checkpoint(pinned),
        latest.schema_version,
        latest.seq,
        f"checkpoints {newer[0]}-{newer[-1]}" if len(newer) > 1 else f"checkpoint {newer[0]}",
        copy.seq,
    )
    events.emit(
        events.RESUME, identity=checkpoints.identity.key, seq=pinned.seq, schema_version=pinned.schema_version
    )
    return Start(latest=copy, value=value, start=pinned, resumed_pin=pinned)

"""The state documents of Airflow's task and asset state store: small JSON objects, written conditionally.

This is the format under :class:`airflow_stateful.state_store.S3StateStoreBackend` (Airflow's
task and asset state store backend) and it never imports Airflow, so the garbage collector can run anywhere.
Layout, relative to the store's root (the ``s3://bucket/prefix`` or directory of ``[stateful] backend_url``)::

    ~task-state/<dag_id>/<run_id>/<task_id>/map=<map_index>/<key>.json
    ~asset-state/name=<asset name>/<key>.json
    ~asset-state/uri=<asset uri>/<key>.json
    ~asset-state/id=<asset id>/<key>.json

Names, ids and keys are percent-encoded with :func:`~airflow_stateful.core.records.identity.encode_segment`
(``manual__2026-01-01T00:00:00+00:00`` becomes ``manual__2026-01-01T00%3A00%3A00%2B00%3A00``), so no part can
escape its folder. A key is always ONE object name, whatever it holds: ``connector/offset`` is stored as
``connector%2Foffset.json`` (``/`` is encoded like every character outside letters, digits and ``._-``, and
``%`` itself as ``%25``), so the encoding is injective: ``a/b``, ``a_b`` and ``a%2Fb`` are three objects.
``~`` cannot start a checkpoint identity, so these folders never collide with checkpoints.

Each object is one JSON document::

    {"format": 1, "value": "<the value as JSON text>", "expires_at": "<ISO 8601 UTC>" | null,
     "written_at": "<ISO 8601 UTC>", "version": 3, "write_id": "<uuid4 hex>", "by_ref": false}

``value`` is kept verbatim (Airflow hands backends JSON text and expects it back unchanged). ``version``
counts the writes of the key. ``by_ref`` marks a value written on a worker whose server side stores only a
reference to it (see :mod:`airflow_stateful.state_store`).

Every write is conditional: create-if-absent when the key has no object, else compare-and-swap on the ETag
just read, repeated when another writer got in first. Concurrent writers therefore never tear or silently
drop a write: each one lands as its own version and the last to commit is what readers see.
:func:`collect_expired` deletes documents whose ``expires_at`` has passed, each with a delete conditional on
the ETag it judged, so a value rewritten meanwhile (perhaps with a later expiry) is never removed.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    FormatVersionError,
    IdentityError,
    InvalidValueError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from airflow_stateful.core.protocol.cas import DEFAULT_BACKOFF, Backoff, compare_and_swap
from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.records.identity import encode_segment
from airflow_stateful.core.stores.base import ObjectStore

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
TASK_STATE_DIR = "~task-state"
ASSET_STATE_DIR = "~asset-state"
SUFFIX = ".json"

MAX_KEY_CHARS = 200
"""Longest state key, in characters."""
MAX_SEGMENT_BYTES = 255
"""Longest encoded path segment (NAME_MAX of common filesystems), so the local store holds every key."""
MAX_OBJECT_KEY_BYTES = 900
"""Longest object key below the store's root; S3 allows 1024 bytes, the rest is left for the prefix."""
MAX_CAS_ATTEMPTS = DEFAULT_BACKOFF.attempts
MAX_VALUE_BYTES = 4 * 1024 * 1024
"""Longest value (its JSON text, in characters) one key may hold; the task state store is for small state."""
MAX_DOCUMENT_BYTES = 2 * MAX_VALUE_BYTES
"""Largest stored document a reader accepts (the value, escaped, plus its metadata); larger is refused unread."""


def _reject_control(what: str, value: str) -> None:
    for ch in value:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0:
            raise IdentityError(f"{what} {value!r} contains the control character {ch!r}; remove it.")


def _segment(what: str, value: object) -> str:
    if not isinstance(value, str) or value == "":
        raise IdentityError(f"{what} must be a non-empty string, not {value!r}.")
    _reject_control(what, value)
    encoded = encode_segment(value)
    if encoded in (".", ".."):
        encoded = encoded.replace(".", "%2E")  # a "." or ".." folder would escape; "%" is never literal
    if len(encoded) > MAX_SEGMENT_BYTES:
        raise IdentityError(
            f"{what} {value[:60]!r}... is {len(encoded)} bytes once encoded; the limit is {MAX_SEGMENT_BYTES}."
        )
    return encoded


def _map_index(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise IdentityError(f"map_index must be an integer >= -1, not {value!r}.")
    return value


def validate_state_key(key: object) -> str:
    """Check a state key and return its object name: the key percent-encoded as ONE segment, plus ``.json``.

    Any key Airflow's own backends accept is accepted here too (a team moving from the database or the
    common-io object-storage backend keeps its keys), as long as it is 1-200 characters without control
    characters and at most 255 bytes once encoded (a file name on the local store). ``/``, spaces, ``:``,
    ``%`` and Unicode are percent-encoded, never interpreted: ``connector/offset`` is the single object
    ``connector%2Foffset.json``, not a folder, and distinct keys always give distinct names (the encoding is
    injective and the suffix fixed, so ``.`` and ``..`` become the harmless names ``..json`` and ``...json``).
    """
    if not isinstance(key, str) or key == "":
        raise IdentityError(f"state key must be a non-empty string, not {key!r}.")
    _reject_control("state key", key)
    if len(key) > MAX_KEY_CHARS:
        raise IdentityError(
            f"state key {key[:60]!r}... is {len(key)} characters; the limit is {MAX_KEY_CHARS}."
        )
    name = encode_segment(key) + SUFFIX
    if len(name) > MAX_SEGMENT_BYTES:
        raise IdentityError(
            f"state key {key[:60]!r}... is {len(name)} bytes once encoded; the limit is {MAX_SEGMENT_BYTES}. "
            "Use a shorter or ASCII key."
        )
    return name


def task_prefix(*, dag_id: str, run_id: str, task_id: str, map_index: int | None) -> str:
    """The folder of one task instance's state (``map_index=None``: every map index of the task)."""
    parts = [
        TASK_STATE_DIR,
        _segment("dag_id", dag_id),
        _segment("run_id", run_id),
        _segment("task_id", task_id),
    ]
    if map_index is not None:
        parts.append(f"map={_map_index(map_index)}")
    return "/".join(parts) + "/"


def asset_prefix(*, name: str | None = None, uri: str | None = None, asset_id: int | None = None) -> str:
    """The folder of one asset's state, by name, else by URI, else by Airflow's asset id."""
    if name is not None:
        return f"{ASSET_STATE_DIR}/name={_segment('asset name', name)}/"
    if uri is not None:
        return f"{ASSET_STATE_DIR}/uri={_segment('asset uri', uri)}/"
    if isinstance(asset_id, bool) or not isinstance(asset_id, int) or asset_id < 0:
        raise IdentityError(f"an asset scope needs a name, a uri or an integer asset_id, not {asset_id!r}.")
    return f"{ASSET_STATE_DIR}/id={asset_id}/"


def object_key(prefix: str, key: str) -> str:
    """The object that holds ``key`` in the folder ``prefix``."""
    full = prefix + validate_state_key(key)
    if len(full.encode()) > MAX_OBJECT_KEY_BYTES:
        raise IdentityError(
            f"state key {key!r} in {prefix!r} makes an object key of {len(full.encode())} bytes; the limit "
            f"is {MAX_OBJECT_KEY_BYTES}. Use shorter ids or keys."
        )
    return full


def _iso(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)  # Airflow passes UTC; a naive datetime is taken as UTC
    return value.astimezone(timezone.utc).isoformat(timespec="microseconds")


def _now() -> datetime:
    return datetime.now(tz=timezone.utc)


def check_json_text(value: object, *, key: str) -> str:
    """``value`` must be JSON text (what Airflow hands a backend); return it unchanged."""
    if not isinstance(value, str):
        raise InvalidValueError(
            f"the value of state key {key!r} must be JSON text, not {type(value).__name__}."
        )
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidValueError(
            f"the value of state key {key!r} is {len(value)} characters of JSON; the limit is {MAX_VALUE_BYTES}. "
            "Keep large data in a stateful task's checkpoint files instead."
        )
    try:
        json.loads(value)
    except ValueError:
        raise InvalidValueError(f"the value of state key {key!r} is not valid JSON text.") from None
    return value


@dataclass(frozen=True)
class StateDocument:
    """One stored value with its expiry and write history."""

    value: str
    expires_at: datetime | None = None
    written_at: datetime = field(default_factory=_now)
    version: int = 1
    write_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    by_ref: bool = False

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT_VERSION,
            "value": self.value,
            "expires_at": _iso(self.expires_at) if self.expires_at is not None else None,
            "written_at": _iso(self.written_at),
            "version": self.version,
            "write_id": self.write_id,
            "by_ref": self.by_ref,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> StateDocument:
        if len(data) > MAX_DOCUMENT_BYTES:
            raise CheckpointCorruptError(
                f"state document {where} is {len(data)} bytes, more than the {MAX_DOCUMENT_BYTES} allowed"
            )
        try:
            body: Any = json.loads(data)
        except (ValueError, RecursionError):
            raise CheckpointCorruptError(f"state document {where} is not JSON.") from None
        fmt = body.get("format") if isinstance(body, dict) else None
        if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
            raise CheckpointCorruptError(f"state document {where} has no valid 'format' field.")
        if fmt > FORMAT_VERSION:
            raise FormatVersionError(
                f"state document {where} uses format {fmt}, newer than the {FORMAT_VERSION} this "
                "version of airflow-provider-stateful reads. Upgrade airflow-provider-stateful here."
            )
        f = Fields(body, what=f"state document {where}")
        expires = f.optional_time("expires_at")
        return cls(
            value=f.text("value", max_len=MAX_VALUE_BYTES),
            expires_at=datetime.fromisoformat(expires) if expires else None,
            written_at=datetime.fromisoformat(f.time("written_at")),
            version=f.integer("version", minimum=1),
            write_id=f.text("write_id", max_len=64, default=""),
            by_ref=f.boolean("by_ref"),
        )


Change = Callable[[StateDocument | None], StateDocument | None]
"""Given the current document (or ``None``), the one to store, or ``None`` to leave the object alone."""


class KeyValueStore:
    """State documents in an object store. Safe to share between threads.

    :param store: where the documents live (any :class:`ObjectStore`: S3, a directory, ...).
    :param max_attempts: compare-and-swap rounds before a write gives up on a key other writers keep changing.
    """

    def __init__(self, *, store: ObjectStore, max_attempts: int = MAX_CAS_ATTEMPTS) -> None:
        self.store = store
        self.backoff = Backoff(attempts=max_attempts)

    def __repr__(self) -> str:
        return f"KeyValueStore(store={self.store!r})"

    def _where(self, key: str) -> str:
        return f"{key!r} in {self.store.url}"

    def read(self, key: str) -> StateDocument | None:
        """The document at object ``key``, or ``None``. A damaged document raises CheckpointCorruptError."""
        try:
            blob = self.store.get(key, max_bytes=MAX_DOCUMENT_BYTES)
        except ObjectNotFoundError:
            return None
        return StateDocument.from_bytes(blob.data, where=self._where(key))

    def update(self, key: str, change: Change) -> StateDocument | None:
        """Apply ``change`` to the current document and store the result with a conditional write.

        ``change`` is called again with the fresh document whenever another writer got in first. The stored
        document gets ``version`` = previous + 1 and a new ``write_id``. Returns what is stored afterwards.
        """
        write_id = uuid.uuid4().hex

        def read(data: bytes) -> StateDocument | None:
            try:
                return StateDocument.from_bytes(data, where=self._where(key))
            except CheckpointCorruptError as exc:
                # The new value is authoritative; replace the damaged object (still conditionally).
                log.warning("replacing a damaged state document: %s", exc)
                return None

        def decide(current: StateDocument | None) -> StateDocument | None:
            if current is not None and current.write_id == write_id:
                return current  # an earlier attempt landed but its answer was lost (retried request)
            new = change(current)
            if new is None:
                return current
            return replace(
                new,
                version=(current.version if current else 0) + 1,
                write_id=write_id,
                written_at=_now(),
            )

        stored, _ = compare_and_swap(
            self.store,
            key,
            decide,
            read=read,
            encode=StateDocument.to_bytes,
            backoff=self.backoff,
            what="state document",
            max_bytes=MAX_DOCUMENT_BYTES,
        )
        return stored

    def write(self, key: str, value: str, *, expires_at: datetime | None = None) -> StateDocument:
        """Store ``value`` (JSON text) at object ``key``; ``expires_at`` ``None`` never expires."""
        stored = self.update(key, lambda _current: StateDocument(value=value, expires_at=expires_at))
        assert stored is not None
        return stored

    def delete(self, key: str) -> None:
        """Remove one document; a missing one is not an error."""
        self.store.delete(key)

    def clear(self, prefix: str) -> list[str]:
        """Remove every document below ``prefix``; returns their keys."""
        keys = [info.key for info in self.store.list_objects(prefix)]
        if keys:
            self.store.delete_many(keys)
        return keys


@dataclass
class ExpiryReport:
    """What :func:`collect_expired` found and (unless ``dry_run``) deleted."""

    deleted: list[str] = field(default_factory=list)
    scanned: int = 0
    changed: list[str] = field(default_factory=list)
    """Expired when read, but rewritten or deleted before the delete: left alone."""
    unreadable: list[str] = field(default_factory=list)
    """Not a state document this version can read (damaged or a newer format): left alone."""
    dry_run: bool = False


def collect_expired(
    store: ObjectStore, *, now: datetime | None = None, dry_run: bool = False
) -> ExpiryReport:
    """Delete every task and asset state document whose ``expires_at`` is at or before ``now``.

    Documents without ``expires_at`` never expire. Each delete is conditional on the ETag of the document
    judged expired. With ``dry_run`` nothing is deleted and ``deleted`` lists what would be.
    """
    if now is None:
        now = _now()
    elif now.tzinfo is None:
        raise ValueError("now must be a timezone-aware datetime (UTC)")
    report = ExpiryReport(dry_run=dry_run)
    for top in (TASK_STATE_DIR, ASSET_STATE_DIR):
        for info in store.list_objects(f"{top}/"):
            if not info.key.endswith(SUFFIX):
                continue
            report.scanned += 1
            try:
                blob = store.get(info.key, max_bytes=MAX_DOCUMENT_BYTES)
            except ObjectNotFoundError:
                continue
            except CheckpointCorruptError as exc:  # too large to be ours: left alone, reported
                log.warning("gc: skipping %s", exc)
                report.unreadable.append(info.key)
                continue
            try:
                doc = StateDocument.from_bytes(blob.data, where=f"{info.key!r} in {store.url}")
            except (CheckpointCorruptError, FormatVersionError) as exc:
                log.warning("gc: skipping %s", exc)
                report.unreadable.append(info.key)
                continue
            if not doc.expired(now):
                continue
            if dry_run:
                report.deleted.append(info.key)
                continue
            try:
                store.delete(info.key, if_match=blob.etag)
            except PreconditionFailedError:
                report.changed.append(info.key)
                continue
            report.deleted.append(info.key)
    if not dry_run and report.deleted:
        log.info("gc: deleted %d expired state document(s) from %s", len(report.deleted), store.url)
    return report

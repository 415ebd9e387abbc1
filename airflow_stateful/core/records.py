"""The JSON records of the commit protocol: head, lease, history entry and manifest.

Each identity has one mutable object, the head record (``~head.json``), advanced only by compare-and-swap.
Everything else is immutable: one manifest per checkpoint (value + metadata + file list) and the data
objects it names. See docs/adr/0001-commit-protocol.md for how they are written and why.

Records carry ``format`` (this library's on-disk format version). A reader refuses a newer format with a
clear error instead of guessing, so an old worker never misreads state written by new code.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime, timezone
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError, FormatVersionError

FORMAT_VERSION = 1

HEAD_NAME = "~head.json"
MANIFEST_DIR = "~manifests"
DATA_DIR = "~data"
# `~` cannot occur in an identity segment, so these names can never collide with a nested identity.


def data_commit_of(key: str) -> str:
    """The commit id in a data object key ``<identity>/~data/<commit_id>/<n>``."""
    return key.split(f"/{DATA_DIR}/", 1)[1].split("/", 1)[0]


def utcnow_iso(ts: float) -> str:
    """An epoch timestamp as an ISO 8601 UTC string with microseconds."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="microseconds")


def parse_iso(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no NaN/Infinity (they are not JSON)."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_format(record: dict[str, Any], *, what: str) -> None:
    fmt = record.get("format")
    if not isinstance(fmt, int):
        raise CheckpointCorruptError(
            f"{what} has no valid 'format' field; it was not written by this library."
        )
    if fmt > FORMAT_VERSION:
        raise FormatVersionError(
            f"{what} uses format {fmt}, newer than the {FORMAT_VERSION} this version of "
            "airflow-provider-stateful reads. Upgrade airflow-provider-stateful on this worker."
        )


@dataclass(frozen=True)
class WriterInfo:
    """Who wrote a checkpoint or holds a lease. Every field is optional outside Airflow."""

    dag_id: str | None = None
    task_id: str | None = None
    run_id: str | None = None
    map_index: int | None = None
    try_number: int | None = None
    dag_version_id: str | None = None
    host: str | None = None
    pod: str | None = None
    pid: int | None = None

    @classmethod
    def current(cls, **known: Any) -> WriterInfo:
        """This process: host name, pid and, inside Kubernetes, the pod name; plus what the caller knows."""
        in_pod = "KUBERNETES_SERVICE_HOST" in os.environ
        base: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pod": os.environ.get("POD_NAME") or (os.environ.get("HOSTNAME") if in_pod else None),
        }
        base.update({k: v for k, v in known.items() if v is not None})
        return cls(**base)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> WriterInfo:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})

    def describe(self) -> str:
        parts = []
        if self.try_number is not None:
            parts.append(f"try {self.try_number}")
        if self.run_id:
            parts.append(f"run {self.run_id}")
        if self.pod:
            parts.append(f"pod {self.pod}")
        elif self.host:
            parts.append(f"host {self.host}")
        return ", ".join(parts) or "an unknown writer"


@dataclass(frozen=True)
class LeaseRecord:
    """The lease as stored in the head record.

    ``expires_at`` is the last renewal (or commit, or the acquisition) plus the lease's ttl, on the clock of
    the writer that renewed it; ``renewed_at`` is that renewal's time, for people and tools (records written
    before renewals were recorded read it as ``acquired_at``).
    """

    token: str
    epoch: int
    holder: WriterInfo
    acquired_at: str
    expires_at: str
    renewed_at: str = ""

    @property
    def last_renewed(self) -> str:
        return self.renewed_at or self.acquired_at

    def expired(self, now: float) -> bool:
        """Past its expiry: another writer may take it without stealing."""
        return parse_iso(self.expires_at) <= now

    def dead(self, now: float, *, grace: float) -> bool:
        """Unrenewed for longer than its ttl plus ``grace``: maintenance may break it."""
        return parse_iso(self.expires_at) + grace <= now

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "token": self.token,
            "epoch": self.epoch,
            "holder": self.holder.to_json(),
            "acquired_at": self.acquired_at,
            "expires_at": self.expires_at,
        }
        if self.renewed_at:
            body["renewed_at"] = self.renewed_at
        return body

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LeaseRecord:
        return cls(
            token=data["token"],
            epoch=int(data["epoch"]),
            holder=WriterInfo.from_json(data.get("holder")),
            acquired_at=data["acquired_at"],
            expires_at=data["expires_at"],
            renewed_at=data.get("renewed_at") or "",
        )


@dataclass(frozen=True)
class CheckpointEntry:
    """One committed checkpoint as listed in the head record: enough to find and verify its manifest."""

    seq: int
    commit_id: str
    manifest: str
    manifest_sha256: str
    manifest_size: int
    created_at: str
    schema_version: int
    epoch: int
    total_size: int
    file_count: int
    #: commit ids whose ``~data/<commit_id>/`` objects this checkpoint's files live in. A checkpoint that
    #: keeps the previous checkpoint's files refers to that commit's data instead of copying it.
    data_refs: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["data_refs"] = list(self.data_refs)
        return body

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointEntry:
        body = {f.name: data[f.name] for f in fields(cls) if f.name != "data_refs"}
        refs = data.get("data_refs", [data["commit_id"]] if data["file_count"] else [])
        return cls(**body, data_refs=tuple(refs))


@dataclass(frozen=True)
class HeadRecord:
    """The one mutable record of an identity. ``epoch`` rises with every lease taken or broken."""

    identity: str
    epoch: int = 0
    next_seq: int = 1
    lease: LeaseRecord | None = None
    checkpoints: tuple[CheckpointEntry, ...] = ()
    updated_at: str = ""
    format: int = FORMAT_VERSION

    @property
    def latest(self) -> CheckpointEntry | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def evolve(self, **changes: Any) -> HeadRecord:
        return replace(self, **changes)

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "format": self.format,
            "identity": self.identity,
            "epoch": self.epoch,
            "next_seq": self.next_seq,
            "lease": self.lease.to_json() if self.lease else None,
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "updated_at": self.updated_at,
        }
        # A self-checksum: a bit flip in the one mutable object must not go unnoticed.
        body["checksum"] = sha256_hex(canonical_json(body))
        return canonical_json(body) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str) -> HeadRecord:
        what = f"head record {key!r}"
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise TypeError("not an object")
        except (ValueError, TypeError) as exc:
            raise CheckpointCorruptError(
                f"{what} is not valid JSON ({exc}); the identity's state is unreadable."
            ) from exc
        _check_format(body, what=what)
        checksum = body.pop("checksum", None)
        if checksum != sha256_hex(canonical_json(body)):
            raise CheckpointCorruptError(
                f"{what} does not match its checksum; it was altered or damaged. "
                "Do not write to this identity until it is inspected (`airflow-stateful show`)."
            )
        try:
            return cls(
                identity=body["identity"],
                epoch=int(body["epoch"]),
                next_seq=int(body["next_seq"]),
                lease=LeaseRecord.from_json(body["lease"]) if body.get("lease") else None,
                checkpoints=tuple(CheckpointEntry.from_json(c) for c in body.get("checkpoints", [])),
                updated_at=body.get("updated_at", ""),
                format=body["format"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{what} is missing a field ({exc}).") from exc


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its path relative to the saved directory and its immutable object."""

    path: str
    key: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Everything about one checkpoint except the file bytes. Immutable once written."""

    identity: str
    seq: int
    commit_id: str
    epoch: int
    schema_version: int
    created_at: str
    writer: WriterInfo
    value: Any
    files: tuple[FileEntry, ...] = ()
    value_codec: str = "json"
    library_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT_VERSION

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        body = {
            "format": self.format,
            "library_version": self.library_version,
            "identity": self.identity,
            "seq": self.seq,
            "commit_id": self.commit_id,
            "epoch": self.epoch,
            "schema_version": self.schema_version,
            "created_at": self.created_at,
            "writer": self.writer.to_json(),
            "value_codec": self.value_codec,
            "value": self.value,
            "files": [asdict(f) for f in self.files],
            "total_size": self.total_size,
            "extra": self.extra,
        }
        return canonical_json(body) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str) -> Manifest:
        what = f"manifest {key!r}"
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise CheckpointCorruptError(f"{what} is not valid JSON ({exc}).") from exc
        _check_format(body, what=what)
        try:
            return cls(
                identity=body["identity"],
                seq=int(body["seq"]),
                commit_id=body["commit_id"],
                epoch=int(body["epoch"]),
                schema_version=int(body["schema_version"]),
                created_at=body["created_at"],
                writer=WriterInfo.from_json(body.get("writer")),
                value=body.get("value"),
                files=tuple(FileEntry(**f) for f in body.get("files", [])),
                value_codec=body.get("value_codec", "json"),
                library_version=body.get("library_version", ""),
                extra=body.get("extra") or {},
                format=body["format"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{what} is missing a field ({exc}).") from exc

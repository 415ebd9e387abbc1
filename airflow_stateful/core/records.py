"""The JSON records of the commit protocol: head, lease, history entry and manifest.

Each identity has one mutable object, the head record (``~head.json``), advanced only by compare-and-swap.
Everything else is immutable: one manifest per checkpoint (value + metadata + file list) and the data
objects it names. See docs/adr/0001-commit-protocol.md for how they are written and why.

Records carry ``format`` (this library's on-disk format version). A reader refuses a newer format with a
clear error instead of guessing, so an old worker never misreads state written by new code.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from airflow_stateful.core.canonical import (
    canonical_json as canonical_json,  # re-exported: every record's form
)
from airflow_stateful.core.canonical import sha256_hex as sha256_hex
from airflow_stateful.core.code_identity import CodeIdentity
from airflow_stateful.core.errors import CheckpointCorruptError, FormatVersionError
from airflow_stateful.core.fields import Fields
from airflow_stateful.core.integrity import SIGNATURE_FIELD, HeadSigner
from airflow_stateful.core.outcomes import TryOutcome
from airflow_stateful.core.outputs import OutputRecord, outputs_from_json
from airflow_stateful.core.timestamps import parse_iso
from airflow_stateful.core.timestamps import utcnow_iso as utcnow_iso  # re-exported: records' one time format
from airflow_stateful.core.trees import (
    MAX_FILES as MAX_FILES,  # re-exported: the limits of a checkpoint's files
)
from airflow_stateful.core.trees import MAX_PATH as MAX_PATH
from airflow_stateful.core.trees import TreeRef

FORMAT_VERSION = 4
"""The newest format this library reads and writes (docs/formats.md). 2: content-addressed trees and chunks,
inline manifests. 3: published outputs (an outputs tree every kept checkpoint references). 4: pinned checkpoints
(a head that lists a checkpoint retention must never evict). A record is written in the lowest format that can
hold it, so a writer that never publishes or pins stays readable by the releases that read 2; a release that
reads less refuses a newer record instead of collecting objects it cannot see are referenced, or dropping a pin
when it rewrites the head."""
PLAIN_FORMAT = 2
"""The format of a head or manifest without outputs or pins."""
OUTPUTS_FORMAT = 3
"""The format of a head or manifest that carries outputs (and of a head with outputs but no pins)."""
PINS_FORMAT = 4
"""The format of a head that lists a pinned checkpoint."""
MAX_PINS = 10
"""Most pinned checkpoints one head keeps; pinning another releases the oldest pin (with a warning)."""

MAX_HEAD_BYTES = 2 * 1024 * 1024
"""A head record larger than this is refused unread (a thousand kept checkpoints take about 1.2 MiB)."""
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
"""Largest manifest a head may point at; a reader also never reads more than the size the head recorded."""
MAX_KEPT = 1000
"""Most checkpoints one head may list (``keep_last`` is capped at this)."""
MAX_EXPECTED_INTERVAL = 366 * 86400.0
"""Longest ``expected_checkpoint_interval`` a lease may declare (a year, in seconds)."""

_CODEC = re.compile(r"^[a-z][a-z0-9_-]{0,15}$")

HEAD_NAME = "~head.json"
MANIFEST_DIR = "~manifests"
DATA_DIR = "~data"
# `~` cannot occur in an identity segment, so these names can never collide with a nested identity.


def data_commit_of(key: str) -> str:
    """The commit id in a data object key ``<identity>/~data/<commit_id>/<n>``."""
    return key.split(f"/{DATA_DIR}/", 1)[1].split("/", 1)[0]


def _check_format(record: dict[str, Any], *, what: str) -> None:
    fmt = record.get("format")
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
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
    #: The Kubernetes node the writer ran on (``NODE_NAME``, from the downward API): where its restore cache is.
    node: str | None = None

    @classmethod
    def current(cls, **known: Any) -> WriterInfo:
        """This process: host name, pid and, inside Kubernetes, the pod name; plus what the caller knows."""
        in_pod = "KUBERNETES_SERVICE_HOST" in os.environ
        base: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pod": os.environ.get("POD_NAME") or (os.environ.get("HOSTNAME") if in_pod else None),
            "node": os.environ.get("NODE_NAME") or None,
        }
        base.update({k: v for k, v in known.items() if v is not None})
        return cls(**base)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None, *, what: str = "writer") -> WriterInfo:
        """Known fields only, each typed (unknown ones, from a newer writer, are ignored)."""
        f = Fields(data or {}, what=what)
        return cls(
            dag_id=f.optional_text("dag_id", max_len=250),
            task_id=f.optional_text("task_id", max_len=250),
            run_id=f.optional_text("run_id", max_len=250),
            map_index=f.optional_integer("map_index", minimum=-1),
            try_number=f.optional_integer("try_number"),
            dag_version_id=f.optional_text("dag_version_id", max_len=64),
            host=f.optional_text("host", max_len=255),
            pod=f.optional_text("pod", max_len=253),
            pid=f.optional_integer("pid"),
            node=f.optional_text("node", max_len=253),
        )

    def describe(self) -> str:
        parts = []
        if self.try_number is not None:
            parts.append(f"try {self.try_number}")
        if self.run_id:
            parts.append(f"run {self.run_id}")
        if self.pod:
            parts.append(f"pod {self.pod}" + (f" on node {self.node}" if self.node else ""))
        elif self.host:
            parts.append(f"host {self.host}")
        return ", ".join(parts) or "an unknown writer"


@dataclass(frozen=True)
class LeaseRecord:
    """The lease as stored in the head record.

    ``expires_at`` is the last renewal (or commit, or the acquisition) plus the lease's ttl, on the clock of
    the writer that renewed it; ``renewed_at`` is that renewal's time, for people and tools (records written
    before renewals were recorded read it as ``acquired_at``). ``expected_interval`` is how often the holder
    declared it commits (seconds; its task's ``expected_checkpoint_interval``), so that anyone reading the head
    can tell a holder that is alive but makes no progress (*stuck*, :mod:`airflow_stateful.core.status`).
    """

    token: str
    epoch: int
    holder: WriterInfo
    acquired_at: str
    expires_at: str
    renewed_at: str = ""
    expected_interval: float | None = None

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
        if self.expected_interval is not None:
            body["expected_checkpoint_interval"] = self.expected_interval
        return body

    @classmethod
    def from_json(cls, data: Any, *, what: str = "lease") -> LeaseRecord:
        f = Fields(data, what=what)
        return cls(
            token=f.token("token"),
            epoch=f.integer("epoch", minimum=1),
            holder=WriterInfo.from_json(f.optional_mapping("holder"), what=f"{what} holder"),
            acquired_at=f.time("acquired_at"),
            expires_at=f.time("expires_at"),
            renewed_at=f.optional_time("renewed_at") or "",
            expected_interval=f.optional_number(
                "expected_checkpoint_interval", minimum=1.0, maximum=MAX_EXPECTED_INTERVAL
            ),
        )


@dataclass(frozen=True)
class PinRecord:
    """Why a kept checkpoint is pinned: retention never evicts it while the pin stands.

    A pin is set when code that cannot read a checkpoint (an older ``schema_version``: a deploy rolled back)
    starts fresh with ``on_incompatible="restart"``: the newer code's progress must survive until that code comes
    back, however many checkpoints the older code commits meanwhile. The code that wrote the pinned checkpoint
    resumes from it when it runs again (:mod:`airflow_stateful.core.pins`), and the pin is released then.
    """

    at: str
    reason: str
    #: who set it aside: the writer (try, run) and its schema version, for people.
    by: str = ""

    def to_json(self) -> dict[str, Any]:
        body = {"at": self.at, "reason": self.reason}
        if self.by:
            body["by"] = self.by
        return body

    @classmethod
    def from_json(cls, data: Any, *, what: str = "pin") -> PinRecord:
        f = Fields(data, what=what)
        return cls(
            at=f.time("at"), reason=f.text("reason", max_len=500), by=f.text("by", max_len=500, default="")
        )


@dataclass(frozen=True)
class CheckpointEntry:
    """One committed checkpoint as listed in the head record: enough to find and verify its manifest.

    A small manifest rides *inline* in the entry (``inline``: its body, protected by the head's own checksum and
    signature), so a small commit is one conditional write of the head; a larger one is an object
    (``manifest``, with its SHA-256 and size). ``tree`` names the content-addressed file tree (format 2);
    ``data_refs`` the commit folders of format-1 file data. ``outputs_tree`` names the tree of the outputs
    committed so far (format 3), so that GC, reading only heads, keeps their chunks.
    """

    seq: int
    commit_id: str
    manifest: str | None
    manifest_sha256: str | None
    manifest_size: int | None
    created_at: str
    schema_version: int
    epoch: int
    total_size: int
    file_count: int
    #: commit ids whose ``~data/<commit_id>/`` objects this checkpoint's (format-1) files live in.
    data_refs: tuple[str, ...] = ()
    tree: TreeRef | None = None
    inline: dict[str, Any] | None = None
    outputs_tree: TreeRef | None = None
    #: Set while retention must keep this checkpoint (format 4; see :class:`PinRecord`).
    pinned: PinRecord | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "seq": self.seq,
            "commit_id": self.commit_id,
            "created_at": self.created_at,
            "schema_version": self.schema_version,
            "epoch": self.epoch,
            "total_size": self.total_size,
            "file_count": self.file_count,
            "data_refs": list(self.data_refs),
        }
        if self.inline is not None:
            body["inline"] = self.inline
        else:
            body.update(
                manifest=self.manifest, manifest_sha256=self.manifest_sha256, manifest_size=self.manifest_size
            )
        if self.tree is not None:
            body["tree"] = self.tree.to_json()
        if self.outputs_tree is not None:
            body["outputs_tree"] = self.outputs_tree.to_json()
        if self.pinned is not None:
            body["pinned"] = self.pinned.to_json()
        return body

    @classmethod
    def from_json(cls, data: Any, *, identity: str, what: str = "checkpoint entry") -> CheckpointEntry:
        """Typed, and bound to ``identity``: a manifest key is exactly the one this entry's seq and commit id
        name inside that identity, and a tree is named by its content inside it, so a crafted head cannot point
        a reader at another identity's objects."""
        f = Fields(data, what=what)
        seq, commit_id = f.integer("seq", minimum=1), f.hex32("commit_id")
        file_count = f.integer("file_count", maximum=MAX_FILES)
        tree_body = f.optional_mapping("tree")
        tree = TreeRef.from_json(tree_body, identity=identity, what=f"{what} tree") if tree_body else None
        default_refs = [commit_id] if file_count and tree is None else []
        refs = f.items("data_refs", max_items=MAX_KEPT + 1, default=default_refs)
        for ref in refs:
            Fields({"data_refs": ref}, what=what).hex32("data_refs")
        outputs_body = f.optional_mapping("outputs_tree")
        outputs_tree = (
            TreeRef.from_json(outputs_body, identity=identity, what=f"{what} outputs tree")
            if outputs_body
            else None
        )
        pinned = f.optional_mapping("pinned")
        inline = f.optional_mapping("inline")
        if inline is not None:
            if f.has("manifest"):
                raise CheckpointCorruptError(f"{what} has both an inline manifest and a manifest object")
            manifest = Manifest.from_json(inline, identity=identity, what=f"{what} inline manifest")
            if (manifest.seq, manifest.commit_id) != (seq, commit_id):
                raise CheckpointCorruptError(f"{what}: its inline manifest is of another checkpoint")
            if manifest.outputs_tree != outputs_tree:
                raise CheckpointCorruptError(
                    f"{what}: its inline manifest names other outputs than the entry"
                )
            key = sha = size = None
        else:
            key = f.equal("manifest", manifest_key(identity, seq, commit_id))
            sha = f.sha256("manifest_sha256")
            size = f.integer("manifest_size", maximum=MAX_MANIFEST_BYTES)
        return cls(
            seq=seq,
            commit_id=commit_id,
            manifest=key,
            manifest_sha256=sha,
            manifest_size=size,
            created_at=f.time("created_at"),
            schema_version=f.integer("schema_version", minimum=1),
            epoch=f.integer("epoch"),
            total_size=f.integer("total_size"),
            file_count=file_count,
            data_refs=tuple(refs),
            tree=tree,
            inline=inline,
            outputs_tree=outputs_tree,
            pinned=PinRecord.from_json(pinned, what=f"{what} pin") if pinned is not None else None,
        )


@dataclass(frozen=True)
class HeadRecord:
    """The one mutable record of an identity. ``epoch`` rises with every lease taken or broken."""

    identity: str
    epoch: int = 0
    next_seq: int = 1
    lease: LeaseRecord | None = None
    checkpoints: tuple[CheckpointEntry, ...] = ()
    updated_at: str = ""
    format: int = PLAIN_FORMAT
    #: How the newest try of the task ended (or that it is running): what lifetimes are judged by.
    outcome: TryOutcome | None = None

    @property
    def written_format(self) -> int:
        """The format this head must be written in: 4 while a kept checkpoint is pinned, else 3 while one has
        outputs, else 2."""
        if any(e.pinned for e in self.checkpoints):
            return PINS_FORMAT
        return OUTPUTS_FORMAT if any(e.outputs_tree for e in self.checkpoints) else PLAIN_FORMAT

    @property
    def pinned(self) -> tuple[CheckpointEntry, ...]:
        """The kept checkpoints retention may not evict, oldest first."""
        return tuple(e for e in self.checkpoints if e.pinned is not None)

    @property
    def latest(self) -> CheckpointEntry | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def evolve(self, **changes: Any) -> HeadRecord:
        return replace(self, **changes)

    def to_bytes(self, signer: HeadSigner | None = None) -> bytes:
        """The stored form; with ``signer`` it also carries an HMAC of the body (see core/integrity.py)."""
        body: dict[str, Any] = {
            "format": self.format,
            "identity": self.identity,
            "epoch": self.epoch,
            "next_seq": self.next_seq,
            "lease": self.lease.to_json() if self.lease else None,
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "updated_at": self.updated_at,
        }
        if self.outcome is not None:
            body["outcome"] = self.outcome.to_json()
        if signer is not None:
            body[SIGNATURE_FIELD] = signer.sign(canonical_json(body))
        # A self-checksum (over the signature too): a bit flip in the one mutable object must not go unnoticed.
        body["checksum"] = sha256_hex(canonical_json(body))
        return canonical_json(body) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, signer: HeadSigner | None = None) -> HeadRecord:
        """Parse and check a head read from ``key`` (``<identity>/~head.json``): JSON, format, checksum, then
        every field typed and bounded. Anything else raises CheckpointCorruptError naming the key."""
        what = f"head record {key!r}"
        if len(data) > MAX_HEAD_BYTES:
            raise CheckpointCorruptError(
                f"{what} is {len(data)} bytes, more than the {MAX_HEAD_BYTES} allowed"
            )
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise TypeError("not an object")
        except (ValueError, TypeError, RecursionError) as exc:
            raise CheckpointCorruptError(
                f"{what} is not valid JSON ({exc}); the identity's state is unreadable."
            ) from exc
        _check_format(body, what=what)
        checksum = body.pop("checksum", None)
        try:
            intact = checksum == sha256_hex(canonical_json(body))
        except ValueError:  # NaN or Infinity: not JSON this library writes
            intact = False
        if not intact:
            raise CheckpointCorruptError(
                f"{what} does not match its checksum; it was altered or damaged. "
                "Do not write to this identity until it is inspected (`airflow-stateful show`)."
            )
        signature = body.pop(SIGNATURE_FIELD, None)
        if signer is not None:
            signer.verify(signature, canonical_json(body), what=what)
        identity = key[: -len(HEAD_NAME) - 1] if key.endswith(f"/{HEAD_NAME}") else key
        f = Fields(body, what=what)
        f.equal("identity", identity)
        lease = f.optional_mapping("lease")
        outcome = f.optional_mapping("outcome")
        entries = f.items("checkpoints", max_items=MAX_KEPT + MAX_PINS, default=[])
        head = cls(
            identity=identity,
            epoch=f.integer("epoch"),
            next_seq=f.integer("next_seq", minimum=1),
            lease=LeaseRecord.from_json(lease, what=f"{what} lease") if lease is not None else None,
            checkpoints=tuple(
                CheckpointEntry.from_json(c, identity=identity, what=f"{what} checkpoint {n}")
                for n, c in enumerate(entries)
            ),
            updated_at=f.time("updated_at", default=""),
            format=f.integer("format", minimum=1),
            outcome=TryOutcome.from_json(outcome, what=f"{what} outcome") if outcome is not None else None,
        )
        if head.lease is not None and head.lease.epoch != head.epoch:
            raise CheckpointCorruptError(
                f"{what}: the lease's epoch {head.lease.epoch} is not the head's {head.epoch}"
            )
        seqs = [e.seq for e in head.checkpoints]
        if seqs != sorted(set(seqs)) or (seqs and seqs[-1] >= head.next_seq):
            raise CheckpointCorruptError(f"{what}: checkpoint numbers {seqs} do not increase below next_seq")
        return head


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its path relative to the saved directory and its immutable object."""

    path: str
    key: str
    size: int
    sha256: str

    @classmethod
    def from_json(cls, data: Any, *, identity: str, what: str = "file entry") -> FileEntry:
        """Typed; ``key`` must be a data object of ``identity`` (``<identity>/~data/<commit_id>/<n>``)."""
        f = Fields(data, what=what)
        key = f.text("key", max_len=2048)
        if not re.fullmatch(re.escape(f"{identity}/{DATA_DIR}/") + r"[0-9a-f]{32}/(0|[1-9][0-9]{0,6})", key):
            raise CheckpointCorruptError(
                f"{what}: key {key[:200]!r} is not a data object of identity {identity!r}; a checkpoint may only "
                "name its own identity's data"
            )
        return cls(
            path=f.text("path", max_len=MAX_PATH),
            key=key,
            size=f.integer("size"),
            sha256=f.sha256("sha256"),
        )


def manifest_key(identity: str, seq: int, commit_id: str) -> str:
    """Where checkpoint ``seq`` (commit ``commit_id``) of ``identity`` keeps its manifest."""
    return f"{identity}/{MANIFEST_DIR}/{seq:012d}-{commit_id}.json"


@dataclass(frozen=True)
class Manifest:
    """Everything about one checkpoint except the file bytes. Immutable once written.

    Its files are either a content-addressed ``tree`` (format 2: read with
    :meth:`~airflow_stateful.core.checkpoint_store.CheckpointStore.tree`) or, in checkpoints written by format 1
    (or keeping such a checkpoint's files), the list ``files`` of whole-file data objects.
    """

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
    format: int = PLAIN_FORMAT
    tree: TreeRef | None = None
    #: Outputs committed so far (:mod:`airflow_stateful.core.outputs`), by name; their files are in ``outputs_tree``.
    outputs: dict[str, OutputRecord] = field(default_factory=dict)
    outputs_tree: TreeRef | None = None
    #: What code wrote it (:mod:`airflow_stateful.core.code_identity`); ``None`` when it was not recorded.
    code: CodeIdentity | None = None

    @property
    def total_size(self) -> int:
        return self.tree.total_size if self.tree else sum(f.size for f in self.files)

    @property
    def file_count(self) -> int:
        return self.tree.file_count if self.tree else len(self.files)

    @property
    def has_files(self) -> bool:
        return self.file_count > 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
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
        if self.tree is not None:
            body["tree"] = self.tree.to_json()
        if self.outputs_tree is not None:
            body["outputs_tree"] = self.outputs_tree.to_json()
            body["outputs"] = {name: record.to_json() for name, record in sorted(self.outputs.items())}
        if self.code is not None:
            body["code"] = self.code.to_json()
        return body

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_json()) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str) -> Manifest:
        """Parse a manifest read from ``key`` (``<identity>/~manifests/<seq>-<commit_id>.json``)."""
        what = f"manifest {key!r}"
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise CheckpointCorruptError(f"{what} is not valid JSON ({exc}).") from exc
        return cls.from_json(body, identity=key.split(f"/{MANIFEST_DIR}/", 1)[0], what=what)

    @classmethod
    def from_json(cls, body: Any, *, identity: str, what: str) -> Manifest:
        """Every field typed; its files (a tree, or format-1 data objects) must be objects of ``identity``."""
        if not isinstance(body, dict):
            raise CheckpointCorruptError(f"{what} is not a JSON object")
        _check_format(body, what=what)
        f = Fields(body, what=what)
        f.equal("identity", identity)
        files = f.items("files", max_items=MAX_FILES, default=[])
        tree = f.optional_mapping("tree")
        outputs_tree = f.optional_mapping("outputs_tree")
        code = f.optional_mapping("code")
        outputs = outputs_from_json(f.mapping("outputs", default={}), what=what)
        if bool(outputs) != (outputs_tree is not None):
            raise CheckpointCorruptError(
                f"{what}: 'outputs' and 'outputs_tree' must be both present or both absent"
            )
        return cls(
            identity=identity,
            seq=f.integer("seq", minimum=1),
            commit_id=f.hex32("commit_id"),
            epoch=f.integer("epoch"),
            schema_version=f.integer("schema_version", minimum=1),
            created_at=f.time("created_at"),
            writer=WriterInfo.from_json(f.optional_mapping("writer"), what=f"{what} writer"),
            value=body.get("value"),
            files=tuple(
                FileEntry.from_json(entry, identity=identity, what=f"{what} file {n}")
                for n, entry in enumerate(files)
            ),
            value_codec=f.text("value_codec", max_len=16, default="json", pattern=_CODEC),
            library_version=f.text("library_version", max_len=64, default=""),
            extra=f.mapping("extra", default={}),
            format=f.integer("format", minimum=1),
            tree=TreeRef.from_json(tree, identity=identity, what=f"{what} tree")
            if tree is not None
            else None,
            outputs=outputs,
            outputs_tree=TreeRef.from_json(outputs_tree, identity=identity, what=f"{what} outputs tree")
            if outputs_tree is not None
            else None,
            code=CodeIdentity.from_json(code, what=f"{what} code") if code is not None else None,
        )

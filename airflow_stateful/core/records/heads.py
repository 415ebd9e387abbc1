"""The head record (``~head.json``) and what it holds: the writer, the lease, pins and the kept checkpoints.

Each identity has one mutable object, the head, advanced only by compare-and-swap (docs/adr/0001-commit-protocol.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.records.formats import (
    HEAD_NAME,
    MAX_EXPECTED_INTERVAL,
    MAX_HEAD_BYTES,
    MAX_KEPT,
    MAX_MANIFEST_BYTES,
    MAX_PINS,
    OUTPUTS_FORMAT,
    PACKS_FORMAT,
    PINS_FORMAT,
    PLAIN_FORMAT,
    check_format,
    format_1_refused,
    is_manifest_key,
    manifest_key,
)
from airflow_stateful.core.records.integrity import SIGNATURE_FIELD, HeadSigner
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outcomes import TryOutcome
from airflow_stateful.core.records.trees import MAX_FILES, TreeRef
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.timestamps import parse_iso


@dataclass(frozen=True)
class LeaseRecord:
    """The lease as stored in the head record.

    ``expires_at`` is the last renewal (or commit, or the acquisition) plus the lease's ttl, on the clock of
    the writer that renewed it; ``renewed_at`` is that renewal's time, for people and tools (records written
    before renewals were recorded read it as ``acquired_at``). ``expected_interval`` is how often the holder
    declared it commits (seconds; its task's ``expected_checkpoint_interval``), so that anyone reading the head
    can tell a holder that is alive but makes no progress (*stuck*, :mod:`airflow_stateful.core.fleet.status`).
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
    resumes from it when it runs again (:mod:`airflow_stateful.core.records.pins`), and the pin is released then.
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
    (``manifest``, with its SHA-256 and size). ``tree`` names the content-addressed file tree (format 2;
    ``None``: no files). ``outputs_tree`` names the tree of the outputs committed so far (format 3), so that GC,
    reading only heads, keeps their chunks. An entry whose files are format-1 data objects (``data_refs``, or
    files without a tree) is refused when read: GC could not see what it references.
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
        a reader at another identity's objects. Format-1 files raise FormatVersionError (see the class)."""
        f = Fields(data, what=what)
        seq, commit_id = f.integer("seq", minimum=1), f.hex32("commit_id")
        file_count = f.integer("file_count", maximum=MAX_FILES)
        tree_body = f.optional_mapping("tree")
        tree = TreeRef.from_json(tree_body, identity=identity, what=f"{what} tree") if tree_body else None
        # ``data_refs`` named the ``~data/<commit_id>/`` folders of format-1 files (written empty by the format-2
        # releases that still read format 1; absent since). Files without a tree were format 1 as well.
        if f.items("data_refs", max_items=MAX_KEPT + 1, default=[]):
            raise format_1_refused(
                what,
                identity=identity,
                how="keeps its files in format 1 ('data_refs': whole-file objects under '~data/')",
            )
        if file_count and tree is None:
            raise format_1_refused(
                what,
                identity=identity,
                how=f"lists {file_count} file(s) without a tree: format-1 whole-file objects under '~data/'",
            )
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
            key = f.text("manifest", max_len=2048)
            if not is_manifest_key(key, identity, seq, commit_id):
                expected = manifest_key(identity, seq, commit_id)
                raise f.bad("manifest", f"{expected!r} (or that name rewritten by a repack)")
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
        """The format this head must be written in: 5 while a kept checkpoint names packed chunks, else 4 while
        one is pinned, else 3 while one has outputs, else 2."""
        if any(t is not None and t.packed for e in self.checkpoints for t in (e.tree, e.outputs_tree)):
            return PACKS_FORMAT
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
        """The stored form; with ``signer`` it also carries an HMAC of the body (see core/records/integrity.py).

        ``canonical_json`` of the body with its ``checksum``, built so that the checkpoints (the bulk: the inline
        manifests) are encoded once, not once for the signature, once for the checksum and once for the
        record: ``checkpoints`` sorts first and ``checksum`` second, so each form is the same checkpoints text
        spliced before the other fields' (tests/test_head_encoding.py holds it to ``canonical_json``)."""
        rest: dict[str, Any] = {
            "format": self.format,
            "identity": self.identity,
            "epoch": self.epoch,
            "next_seq": self.next_seq,
            "lease": self.lease.to_json() if self.lease else None,
            "updated_at": self.updated_at,
        }
        if self.outcome is not None:
            rest["outcome"] = self.outcome.to_json()
        checkpoints = b'{"checkpoints":' + canonical_json([c.to_json() for c in self.checkpoints]) + b","

        def whole(others: bytes, checksum: str | None = None) -> bytes:
            # ``others`` is the other fields' canonical JSON, an object: its "{" gives way to the checkpoints.
            middle = b"" if checksum is None else b'"checksum":"' + checksum.encode() + b'",'
            return checkpoints + middle + others[1:]

        if signer is not None:
            rest[SIGNATURE_FIELD] = signer.sign(whole(canonical_json(rest)))
        # A self-checksum (over the signature too): a bit flip in the one mutable object must not go unnoticed.
        others = canonical_json(rest)
        return whole(others, sha256_hex(whole(others))) + b"\n"

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
        identity = key[: -len(HEAD_NAME) - 1] if key.endswith(f"/{HEAD_NAME}") else key
        check_format(body, what=what, identity=identity)
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
            format=f.integer("format", minimum=PLAIN_FORMAT),
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

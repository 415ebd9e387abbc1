"""The manifest: one immutable record per checkpoint (value, metadata and the tree of its files)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.records.canonical import canonical_json
from airflow_stateful.core.records.code_identity import CodeIdentity
from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.records.formats import (
    CODEC_NAME,
    MANIFEST_DIR,
    OUTPUTS_FORMAT,
    PACKS_FORMAT,
    PLAIN_FORMAT,
    check_format,
    format_1_refused,
)
from airflow_stateful.core.records.lineage import COPY_OF_FIELD, CopyOf
from airflow_stateful.core.records.outputs import OutputRecord, outputs_from_json
from airflow_stateful.core.records.trees import MAX_FILES, TreeRef
from airflow_stateful.core.records.writer import WriterInfo


def manifest_format(tree: TreeRef | None, outputs_tree: TreeRef | None) -> int:
    """The lowest format that holds a manifest with these trees: 5 if one names packed chunks, 3 with outputs,
    else 2 (docs/formats.md: a record is written in the lowest format that can hold it)."""
    if any(t is not None and t.packed for t in (tree, outputs_tree)):
        return PACKS_FORMAT
    return OUTPUTS_FORMAT if outputs_tree is not None else PLAIN_FORMAT


@dataclass(frozen=True)
class Manifest:
    """Everything about one checkpoint except the file bytes. Immutable once written.

    Its files are a content-addressed ``tree`` (read with
    :meth:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore.tree`; ``None``: no files). Format 1's
    list ``files`` of whole-file data objects is refused when read (:func:`~.formats.format_1_refused`).
    """

    identity: str
    seq: int
    commit_id: str
    epoch: int
    schema_version: int
    created_at: str
    writer: WriterInfo
    value: Any
    value_codec: str = "json"
    library_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = PLAIN_FORMAT
    tree: TreeRef | None = None
    #: Outputs committed so far (:mod:`airflow_stateful.core.records.outputs`), by name; their files are in ``outputs_tree``.
    outputs: dict[str, OutputRecord] = field(default_factory=dict)
    outputs_tree: TreeRef | None = None
    #: What code wrote it (:mod:`airflow_stateful.core.records.code_identity`); ``None`` when it was not recorded.
    code: CodeIdentity | None = None
    #: The earlier checkpoint this one is a copy of (``airflow-stateful rollback``); ``None``: not a copy.
    copy_of: CopyOf | None = None

    @property
    def total_size(self) -> int:
        return self.tree.total_size if self.tree else 0

    @property
    def file_count(self) -> int:
        return self.tree.file_count if self.tree else 0

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
        if self.copy_of is not None:
            body[COPY_OF_FIELD] = self.copy_of.to_json()
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
        """Every field typed; its tree must be an object of ``identity``. A format-1 manifest, or one that lists
        format-1 files (a format-2 checkpoint that kept an older one's files), raises FormatVersionError."""
        if not isinstance(body, dict):
            raise CheckpointCorruptError(f"{what} is not a JSON object")
        check_format(body, what=what, identity=identity)
        f = Fields(body, what=what)
        f.equal("identity", identity)
        # Written empty by the format-2 releases that still read format 1; absent since.
        if f.items("files", max_items=MAX_FILES, default=[]):
            raise format_1_refused(
                what,
                identity=identity,
                how="lists its files in format 1 ('files': whole-file objects under '~data/')",
            )
        tree = f.optional_mapping("tree")
        outputs_tree = f.optional_mapping("outputs_tree")
        code = f.optional_mapping("code")
        copy_of = f.optional_mapping(COPY_OF_FIELD)
        seq = f.integer("seq", minimum=1)
        outputs = outputs_from_json(f.mapping("outputs", default={}), what=what)
        if bool(outputs) != (outputs_tree is not None):
            raise CheckpointCorruptError(
                f"{what}: 'outputs' and 'outputs_tree' must be both present or both absent"
            )
        return cls(
            identity=identity,
            seq=seq,
            commit_id=f.hex32("commit_id"),
            epoch=f.integer("epoch"),
            schema_version=f.integer("schema_version", minimum=1),
            created_at=f.time("created_at"),
            writer=WriterInfo.from_json(f.optional_mapping("writer"), what=f"{what} writer"),
            value=body.get("value"),
            value_codec=f.text("value_codec", max_len=16, default="json", pattern=CODEC_NAME),
            library_version=f.text("library_version", max_len=64, default=""),
            extra=f.mapping("extra", default={}),
            format=f.integer("format", minimum=PLAIN_FORMAT),
            tree=TreeRef.from_json(tree, identity=identity, what=f"{what} tree")
            if tree is not None
            else None,
            outputs=outputs,
            outputs_tree=TreeRef.from_json(outputs_tree, identity=identity, what=f"{what} outputs tree")
            if outputs_tree is not None
            else None,
            code=CodeIdentity.from_json(code, what=f"{what} code") if code is not None else None,
            copy_of=CopyOf.from_json(copy_of, copy_seq=seq, what=f"{what} {COPY_OF_FIELD}")
            if copy_of is not None
            else None,
        )

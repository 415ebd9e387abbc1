"""Outputs published with a checkpoint: files a task hands to downstream readers, visible only once committed.

A stateful task that writes a result for others (a file for a downstream DAG, a model, a report) has the same
problem as its state: a try that dies half-way must not leave a half-written or duplicated result behind, and a
zombie try must never publish over its retry's. So an output is published the way a checkpoint is committed:

1. :meth:`~airflow_stateful.core.protocol.session.WriterSession.publish` (``TaskState.publish(name, path)``) *stages* it:
   it snapshots the file or directory by uploading its chunks (content-addressed, deduplicated, fenced by the
   lease like any upload). Nothing is visible yet: staged chunks are unreferenced objects;
2. the next commit writes one *outputs tree* (every output committed so far: the newest checkpoint's outputs,
   with the staged ones added or replaced by name) and names it in the manifest and in the head entry, so the
   outputs become visible in the same compare-and-swap that makes the checkpoint visible.

A try killed between the two steps, or fenced, leaves only unreferenced chunks, which GC (and the writer's own
sweep) collects like any crash garbage; its retry publishes again and commits, so each output name is
committed exactly once per retry chain, with the content of the try that committed it. Outputs carry over from
checkpoint to checkpoint (a later commit that publishes nothing keeps them), so retention never drops the
outputs of the newest checkpoint.

Readers use :meth:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore.outputs` (a mapping from output name
to :class:`OutputInfo`), ``TaskState.outputs()`` inside the task and ``airflow-stateful outputs`` outside it.
This module holds the records and the pure functions; the store does the I/O. It imports no Airflow.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from airflow_stateful.core.errors import CheckpointCorruptError, InvalidValueError
from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.records.trees import TreeFile

MAX_OUTPUTS = 1000
"""Most outputs one checkpoint may carry (each is a line of the manifest and of every listing)."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
"""An output name: a letter or digit first, then letters, digits, ``.``, ``_`` and ``-``; at most 200 characters.
It is a path segment in the outputs tree and a column in every listing, so nothing else is allowed."""

Kind = Literal["file", "directory"]


def check_output_name(name: Any) -> str:
    """``name`` if it is a valid output name; InvalidValueError naming it otherwise (before anything is sent)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise InvalidValueError(
            f"output name {shown} is not valid: use 1-200 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (for example 'daily-report' or 'part-0007.parquet')"
        )
    return name


def content_sha256(kind: Kind, files: Iterable[tuple[str, int, str]]) -> str:
    """The SHA-256 a reader can check an output against.

    For a file: the SHA-256 of its bytes (what ``sha256sum`` prints). For a directory: the SHA-256 of its listing,
    one ``<sha256>  <size>  <path>\\n`` line per file sorted by path, the file hashes being of their bytes.
    ``files`` is ``(path relative to the output, size, sha256 of the bytes)``.
    """
    listed = sorted(files)
    if kind == "file":
        if len(listed) != 1:
            raise ValueError(f"a file output has exactly one file, not {len(listed)}")
        return listed[0][2]
    digest = hashlib.sha256()
    for path, size, sha in listed:
        digest.update(f"{sha}  {size}  {path}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class StagedOutput:
    """An output uploaded by ``publish`` and waiting for the next commit: its tree files (paths relative to the
    output's own root; a file output is one file named ``""``) and what the manifest will say of it."""

    name: str
    kind: Kind
    files: tuple[TreeFile, ...]
    sha256: str

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def tree_files(self) -> list[TreeFile]:
        """Its files as they sit in the outputs tree: under ``<name>/`` (a file output: at ``<name>``)."""
        if self.kind == "file":
            return [replace(self.files[0], path=self.name)]
        return [replace(f, path=f"{self.name}/{f.path}") for f in self.files]


@dataclass(frozen=True)
class OutputRecord:
    """One committed output as its checkpoint's manifest records it.

    ``seq`` is the checkpoint that committed it (an output carried over keeps its first checkpoint's number), and
    ``try_number``/``run_id`` say which try published it.
    """

    name: str
    kind: Kind
    size: int
    file_count: int
    sha256: str
    seq: int
    committed_at: str
    try_number: int | None = None
    run_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": self.kind,
            "size": self.size,
            "file_count": self.file_count,
            "sha256": self.sha256,
            "seq": self.seq,
            "committed_at": self.committed_at,
        }
        if self.try_number is not None:
            body["try_number"] = self.try_number
        if self.run_id is not None:
            body["run_id"] = self.run_id
        return body

    @classmethod
    def from_json(cls, name: str, data: Any, *, what: str) -> OutputRecord:
        try:
            check_output_name(name)
        except InvalidValueError as exc:
            raise CheckpointCorruptError(f"{what}: {exc}") from None
        f = Fields(data, what=f"{what} output {name!r}")
        kind = f.text("kind", max_len=16)
        if kind not in ("file", "directory"):
            raise CheckpointCorruptError(
                f"{what} output {name!r}: kind must be 'file' or 'directory', not {kind!r}"
            )
        file_count = f.integer("file_count", maximum=1_000_000)
        if kind == "file" and file_count != 1:
            raise CheckpointCorruptError(
                f"{what} output {name!r}: a file output holds 1 file, not {file_count}"
            )
        return cls(
            name=name,
            kind=kind,  # type: ignore[arg-type]  # checked just above
            size=f.integer("size", maximum=1 << 50),
            file_count=file_count,
            sha256=f.sha256("sha256"),
            seq=f.integer("seq", minimum=1),
            committed_at=f.time("committed_at"),
            try_number=f.optional_integer("try_number"),
            run_id=f.optional_text("run_id", max_len=250),
        )


def outputs_from_json(data: Any, *, what: str) -> dict[str, OutputRecord]:
    """The ``outputs`` field of a manifest, every entry typed; at most :data:`MAX_OUTPUTS`."""
    if not isinstance(data, Mapping) or len(data) > MAX_OUTPUTS:
        raise CheckpointCorruptError(
            f"{what}: field 'outputs' must be a JSON object of at most {MAX_OUTPUTS} outputs"
        )
    return {name: OutputRecord.from_json(name, body, what=what) for name, body in sorted(data.items())}


def files_of_output(record: OutputRecord, tree_files: Iterable[TreeFile]) -> list[TreeFile]:
    """The files of ``record`` in an outputs tree, with paths relative to the output (``""`` for a file output).

    Raises CheckpointCorruptError when the tree does not hold what the record says (count or size)."""
    if record.kind == "file":
        found = [replace(f, path="") for f in tree_files if f.path == record.name]
    else:
        prefix = f"{record.name}/"
        found = [replace(f, path=f.path[len(prefix) :]) for f in tree_files if f.path.startswith(prefix)]
    if len(found) != record.file_count or sum(f.size for f in found) != record.size:
        raise CheckpointCorruptError(
            f"the outputs tree does not hold output {record.name!r} as its checkpoint recorded it "
            f"({record.file_count} file(s), {record.size} bytes; found {len(found)} file(s), "
            f"{sum(f.size for f in found)} bytes)"
        )
    return found


def merged_tree_files(
    kept: Iterable[TreeFile], kept_records: Mapping[str, OutputRecord], staged: Mapping[str, StagedOutput]
) -> list[TreeFile]:
    """The files of the next outputs tree: the kept outputs' files minus those the staged ones replace, plus the
    staged ones; sorted by path (a tree's order)."""
    replaced = set(staged)
    keep = [
        f
        for f in kept
        if f.path.partition("/")[0] not in replaced and f.path.partition("/")[0] in kept_records
    ]
    new = [tf for output in staged.values() for tf in output.tree_files()]
    return sorted([*keep, *new], key=lambda f: f.path)


@dataclass(frozen=True)
class OutputInfo(OutputRecord):
    """What a reader gets for one committed output: its record, and where its bytes are.

    ``location`` is the outputs tree object that lists the output's chunks, with ``#<name>``; read the bytes with
    :meth:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore.restore_output` (or ``airflow-stateful
    outputs IDENTITY --get NAME --to DIR``), which verifies every chunk.
    """

    location: str = ""

    @classmethod
    def of(cls, record: OutputRecord, *, location: str) -> OutputInfo:
        return cls(**{f.name: getattr(record, f.name) for f in fields(record)}, location=location)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **super().to_json(), "location": self.location}

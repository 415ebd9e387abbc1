"""The records of content-addressed file data: chunks, the file tree of a checkpoint, and references to trees.

A checkpoint's files are a *tree*: for each file its relative path, its size and the list of *chunks* that
make up its bytes, in order. A chunk is an immutable object named by the SHA-256 of its bytes, so a chunk the
identity already holds (because an earlier checkpoint it keeps references it) is never uploaded again, and a
file that changed in one place re-uploads only the chunks around that place. The tree itself is an immutable
JSON object named by its own SHA-256, so a checkpoint that keeps the previous checkpoint's files just refers to
the same tree. See docs/adr/0004-content-addressed-checkpoints.md.

Layout, per identity::

    <identity>/~trees/<sha256>[-<commit_id>].json
    <identity>/~chunks/<sha256>[-<commit_id>]

The ``-<commit_id>`` suffix is used only when an object of the plain name already exists but no checkpoint
the writer keeps references it (garbage, which maintenance may be deleting right now): the writer then never
adopts that object and writes its own copy under a name nobody else can have (the ADR explains the race).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.records.canonical import canonical_json
from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.records.formats import MAX_CHUNK_BYTES

MAX_FILES = 1_000_000
"""Most files one checkpoint may hold."""
MAX_PATH = 4096
"""Longest relative file path inside a checkpoint (PATH_MAX)."""

TREE_DIR = "~trees"
CHUNK_DIR = "~chunks"
TREE_FORMAT = 2
MAX_CHUNKS_PER_FILE = 1 << 20
MAX_FILE_BYTES = MAX_CHUNKS_PER_FILE * MAX_CHUNK_BYTES
"""The largest file a tree can hold (4 TiB): as many chunks as a file may have, each as large as a chunk may be."""
PERMISSION_BITS = 0o777
"""What a tree records of a file's mode, and a restore applies: read, write and execute for owner, group, others."""
MAX_TREE_BYTES = 512 * 1024 * 1024
"""Largest tree a reader accepts (also capped by the size its checkpoint recorded)."""


def chunk_key(identity: str, sha256: str, *, unique: str | None = None) -> str:
    """Where a chunk with this SHA-256 lives (``unique``: a commit id, for a copy of its own)."""
    return f"{identity}/{CHUNK_DIR}/{sha256}" + (f"-{unique}" if unique else "")


def tree_key(identity: str, sha256: str, *, unique: str | None = None) -> str:
    return f"{identity}/{TREE_DIR}/{sha256}" + (f"-{unique}" if unique else "") + ".json"


def _content_key(f: Fields, name: str, *, identity: str, folder: str, sha256: str, suffix: str = "") -> str:
    """A key that must be ``<identity>/<folder>/<sha256>[-<commit id>]<suffix>``, for this very sha256."""
    key = f.text(name, max_len=2048)
    pattern = re.escape(f"{identity}/{folder}/{sha256}") + r"(-[0-9a-f]{32})?" + re.escape(suffix)
    if not re.fullmatch(pattern, key):
        raise CheckpointCorruptError(
            f"{f.what}: key {key[:200]!r} is not the {folder} object of content {sha256} in identity "
            f"{identity!r}; a checkpoint may only name its own identity's objects, by their content"
        )
    return key


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a file: where it is stored, its SHA-256 and its size."""

    key: str
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, data: Any, *, identity: str, what: str) -> ChunkRef:
        f = Fields(data, what=what)
        sha256 = f.sha256("sha256")
        return cls(
            key=_content_key(f, "key", identity=identity, folder=CHUNK_DIR, sha256=sha256),
            sha256=sha256,
            size=f.integer("size", maximum=MAX_CHUNK_BYTES),
        )


@dataclass(frozen=True)
class TreeFile:
    """One file of a tree: its path below the saved directory, its size, its chunks in order and its permission
    bits (``mode``: ``0o777`` at most; ``None`` in trees written before modes were kept: restored owner-only)."""

    path: str
    size: int
    chunks: tuple[ChunkRef, ...]
    mode: int | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "path": self.path,
            "size": self.size,
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.mode is not None:  # an older reader ignores it (and restores the file with its own default)
            body["mode"] = self.mode
        return body

    @classmethod
    def from_json(cls, data: Any, *, identity: str, what: str) -> TreeFile:
        f = Fields(data, what=what)
        path, size = f.text("path", max_len=MAX_PATH), f.integer("size", maximum=MAX_FILE_BYTES)
        chunks = tuple(
            ChunkRef.from_json(c, identity=identity, what=f"{what} chunk {n}")
            for n, c in enumerate(f.items("chunks", max_items=MAX_CHUNKS_PER_FILE))
        )
        if sum(c.size for c in chunks) != size:
            raise CheckpointCorruptError(
                f"{what}: its chunks hold {sum(c.size for c in chunks)} bytes, not {size}"
            )
        # Permission bits only: a setuid, setgid or sticky bit is never recorded, so never restored.
        return cls(
            path=path, size=size, chunks=chunks, mode=f.optional_integer("mode", maximum=PERMISSION_BITS)
        )


@dataclass(frozen=True)
class Tree:
    """The files of a checkpoint (sorted by path). Immutable once written; shared by every checkpoint that
    keeps the same files."""

    identity: str
    files: tuple[TreeFile, ...]

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_keys(self) -> set[str]:
        return {c.key for f in self.files for c in f.chunks}

    def to_bytes(self) -> bytes:
        body = {"format": TREE_FORMAT, "identity": self.identity, "files": [f.to_json() for f in self.files]}
        return canonical_json(body) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, identity: str) -> Tree:
        what = f"tree {key!r}"
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise CheckpointCorruptError(f"{what} is not valid JSON ({exc}).") from exc
        f = Fields(body, what=what)
        f.integer("format", minimum=TREE_FORMAT, maximum=TREE_FORMAT)
        f.equal("identity", identity)
        files = tuple(
            TreeFile.from_json(entry, identity=identity, what=f"{what} file {n}")
            for n, entry in enumerate(f.items("files", max_items=MAX_FILES))
        )
        return cls(identity=identity, files=files)


@dataclass(frozen=True)
class TreeRef:
    """How a checkpoint names its tree: the object, its SHA-256 and size (verified on read), and totals."""

    key: str
    sha256: str
    size: int
    file_count: int
    total_size: int

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "sha256": self.sha256,
            "size": self.size,
            "file_count": self.file_count,
            "total_size": self.total_size,
        }

    @classmethod
    def from_json(cls, data: Any, *, identity: str, what: str) -> TreeRef:
        f = Fields(data, what=what)
        sha256 = f.sha256("sha256")
        return cls(
            key=_content_key(f, "key", identity=identity, folder=TREE_DIR, sha256=sha256, suffix=".json"),
            sha256=sha256,
            size=f.integer("size", maximum=MAX_TREE_BYTES),
            file_count=f.integer("file_count", maximum=MAX_FILES),
            total_size=f.integer("total_size", maximum=MAX_FILES * MAX_FILE_BYTES),
        )

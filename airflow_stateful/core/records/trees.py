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
    <identity>/~packs/<commit_id>-<n>          (format 5)

The ``-<commit_id>`` suffix is used only when an object of the plain name already exists but no checkpoint
the writer keeps references it (garbage, which maintenance may be deleting right now): the writer then never
adopts that object and writes its own copy under a name nobody else can have (the ADR explains the race).

Small chunks (format 5, docs/adr/0006-packs.md) are not objects of their own: they are appended to *packs*,
objects of many chunks named by the commit that wrote them (so no other writer can ever hold the name, and
none is ever adopted). A packed chunk records its pack, its offset in it, its size and its SHA-256; a reader
fetches it with a ranged GET and checks the SHA-256 like any chunk. A tree holding a packed chunk is tree
format 3, and the checkpoint naming it format 5: a release that cannot read packs refuses it instead of
collecting the packs as garbage.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any

from airflow_stateful.core.collector import paused_collector
from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.records.formats import MAX_CHUNK_BYTES
from airflow_stateful.core.records.tree_text import entry_texts

MAX_FILES = 1_000_000
"""Most files one checkpoint may hold."""
MAX_PATH = 4096
"""Longest relative file path inside a checkpoint (PATH_MAX)."""

TREE_DIR = "~trees"
CHUNK_DIR = "~chunks"
PACK_DIR = "~packs"
TREE_FORMAT = 2
PACKED_TREE_FORMAT = 3
"""The format of a tree that holds a packed chunk (a tree without one is still written in :data:`TREE_FORMAT`)."""
MAX_PACK_BYTES = 256 * 1024 * 1024
"""The largest pack a reader accepts an offset into (writers target far less: :mod:`~airflow_stateful.core.data.packs`)."""
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


def pack_key(identity: str, commit_id: str, n: int) -> str:
    """Where pack ``n`` of commit ``commit_id`` lives: a name only that commit ever writes."""
    return f"{identity}/{PACK_DIR}/{commit_id}-{n:06d}"


def tree_key(identity: str, sha256: str, *, unique: str | None = None) -> str:
    return f"{identity}/{TREE_DIR}/{sha256}" + (f"-{unique}" if unique else "") + ".json"


@functools.lru_cache(maxsize=256)
def _content_shape(identity: str, folder: str, suffix: str) -> re.Pattern[str]:
    """``<identity>/<folder>/<sha256>[-<commit id>]<suffix>``, compiled once per identity and folder rather
    than once per chunk (a tree of 10,000 small files names 10,000 chunks); group 1 is the SHA-256."""
    return re.compile(
        re.escape(f"{identity}/{folder}/") + r"([0-9a-f]{64})(?:-[0-9a-f]{32})?" + re.escape(suffix)
    )


@functools.lru_cache(maxsize=256)
def _pack_shape(identity: str) -> re.Pattern[str]:
    """``<identity>/~packs/<commit id>-<n>``, compiled once per identity."""
    return re.compile(re.escape(f"{identity}/{PACK_DIR}/") + r"[0-9a-f]{32}-[0-9]{6}")


_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_KEY = 2048
"""Longest object key a tree may name (S3 allows 1,024 bytes; a local store's paths may be longer)."""


def _content_key(f: Fields, name: str, *, identity: str, folder: str, sha256: str, suffix: str = "") -> str:
    """A key that must be ``<identity>/<folder>/<sha256>[-<commit id>]<suffix>``, for this very sha256."""
    key = f.text(name, max_len=MAX_KEY)
    match = _content_shape(identity, folder, suffix).fullmatch(key)
    if match is None or match.group(1) != sha256:
        raise CheckpointCorruptError(
            f"{f.what}: key {key[:200]!r} is not the {folder} object of content {sha256} in identity "
            f"{identity!r}; a checkpoint may only name its own identity's objects, by their content"
        )
    return key


def _pack_key(f: Fields, name: str, *, identity: str) -> str:
    """A key that must be ``<identity>/~packs/<commit id>-<n>``: a pack of this identity."""
    key = f.text(name, max_len=MAX_KEY)
    if not _pack_shape(identity).fullmatch(key):
        raise CheckpointCorruptError(
            f"{f.what}: pack {key[:200]!r} is not a pack of identity {identity!r}; a checkpoint may only name its "
            "own identity's objects"
        )
    return key


_NEW = object.__new__
"""How the tree reader's fast path makes its records: the frozen dataclasses' ``__init__`` sets each field
through ``object.__setattr__``, a microsecond an entry (a tenth of a 10,000-file parse); the fields are set
all at once instead, the same fields with the same values (tests/test_tree_parse.py compares the records)."""


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a file: where it is stored, its SHA-256 and its size.

    ``offset`` is ``None`` for a chunk that is an object of its own (``key``: under ``~chunks/``) and the
    chunk's first byte in pack ``key`` (under ``~packs/``) for a packed one."""

    key: str
    sha256: str
    size: int
    offset: int | None = None

    @property
    def packed(self) -> bool:
        return self.offset is not None

    def to_json(self) -> dict[str, Any]:
        if self.offset is not None:
            return {"pack": self.key, "offset": self.offset, "sha256": self.sha256, "size": self.size}
        return {"key": self.key, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, data: Any, *, identity: str, what: str) -> ChunkRef:
        f = Fields(data, what=what)
        sha256 = f.sha256("sha256")
        size = f.integer("size", maximum=MAX_CHUNK_BYTES)
        if f.has("pack"):
            return cls(
                key=_pack_key(f, "pack", identity=identity),
                sha256=sha256,
                size=size,
                offset=f.integer("offset", maximum=MAX_PACK_BYTES - size),
            )
        return cls(
            key=_content_key(f, "key", identity=identity, folder=CHUNK_DIR, sha256=sha256),
            sha256=sha256,
            size=size,
        )


Seen = tuple[int, int, int, int]
"""A file's status when it was saved: device, inode, modification and change time (ns); with the size, what
a later save compares to take the file as unchanged (:mod:`~airflow_stateful.core.data.file_index`)."""
_U64 = (1 << 64) - 1
_I64 = 1 << 63


def _seen(value: Any) -> Seen | None:
    """``value`` as a :data:`Seen` if it is one (four integers in their system types' bounds), else ``None``."""
    if type(value) is not list or len(value) != 4:
        return None
    device, inode, mtime_ns, ctime_ns = value
    if (type(device), type(inode), type(mtime_ns), type(ctime_ns)) != _FOUR_INTS:
        return None
    if not (
        0 <= device <= _U64 and 0 <= inode <= _U64 and -_I64 <= mtime_ns < _I64 and -_I64 <= ctime_ns < _I64
    ):
        return None
    return (device, inode, mtime_ns, ctime_ns)


_FOUR_INTS = (int, int, int, int)


@dataclass(frozen=True)
class TreeFile:
    """One file of a tree: its path below the saved directory, its size, its chunks in order and its permission
    bits (``mode``: ``0o777`` at most; ``None`` in trees written before modes were kept: restored owner-only).

    ``seen``: the file's status when it was saved, recorded only for a file that had settled (not modified in
    the :data:`~airflow_stateful.core.data.file_index.RACY_SECONDS` before it was read) and did not change
    while it was read; ``None`` otherwise and in trees written before it was kept. A later writer, in another
    process, takes such an entry as it is for a file with the very same status and size, as restic does with
    its parent snapshot (docs/adr/0006-packs.md). Older readers ignore it."""

    path: str
    size: int
    chunks: tuple[ChunkRef, ...]
    mode: int | None = None
    seen: Seen | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "path": self.path,
            "size": self.size,
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.mode is not None:  # an older reader ignores it (and restores the file with its own default)
            body["mode"] = self.mode
        if self.seen is not None:  # an older reader ignores it too (and reads every file again)
            body["status"] = list(self.seen)
        return body

    def encoded(self) -> str:
        """This entry as canonical JSON text (what :func:`canonical_json` makes of :meth:`to_json`), made once
        per object: a re-save takes the entries of unchanged files from the writer's index, so encoding the
        new tree re-uses 99 % of the text (tests/test_tree_parse.py holds it to ``canonical_json``)."""
        text: str | None = self.__dict__.get("_encoded")
        if text is None:
            chunks = ",".join(_encoded_chunk(c) for c in self.chunks)
            mode = "" if self.mode is None else f',"mode":{int(self.mode)}'
            at = self.seen
            seen = "" if at is None else f',"status":[{int(at[0])},{int(at[1])},{int(at[2])},{int(at[3])}]'
            text = f'{{"chunks":[{chunks}]{mode},"path":{encode_basestring(self.path)},"size":{int(self.size)}{seen}}}'
            object.__setattr__(self, "_encoded", text)  # a cache beside the fields: not compared, not hashed
        return text

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
        seen = None
        if f.has("status"):
            seen = _seen(f.body["status"])
            if seen is None:
                raise f.bad("status", "a list of four integers (device, inode, mtime_ns, ctime_ns)")
        # Permission bits only: a setuid, setgid or sticky bit is never recorded, so never restored.
        return cls(
            path=path,
            size=size,
            chunks=chunks,
            mode=f.optional_integer("mode", maximum=PERMISSION_BITS),
            seen=seen,
        )


def _encoded_chunk(c: ChunkRef) -> str:
    """:meth:`ChunkRef.to_json` as canonical JSON text (sorted keys, no spaces)."""
    if c.offset is not None:
        return (
            f'{{"offset":{int(c.offset)},"pack":{_encoded_key(c.key)},"sha256":{encode_basestring(c.sha256)},'
            f'"size":{int(c.size)}}}'
        )
    return f'{{"key":{_encoded_key(c.key)},"sha256":{encode_basestring(c.sha256)},"size":{int(c.size)}}}'


@functools.lru_cache(maxsize=1024)
def _encoded_key(key: str) -> str:
    """A pack's key as JSON text, made once per pack (10,000 small files share a handful of packs)."""
    return encode_basestring(key)


def _quick_file(data: Any, *, identity: str, packs: dict[str, str] | None = None) -> TreeFile | None:
    """:meth:`TreeFile.from_json` for an entry in exactly the shape this library writes, with the same checks
    (types, bounds, keys of this identity named by their content, the chunks' sizes adding up) but no
    :class:`Fields` and no error context built per chunk; ``None`` for anything else, which the full reader then
    accepts or refuses with an error naming the field. Either way an entry is accepted only if the full reader
    accepts it, with the same result (tests/test_tree_parse.py holds the two readers to that).

    ``packs``: the pack keys already checked in this tree (a pack holds hundreds of its chunks), each mapped to
    one copy of the key that every chunk in it then shares."""
    if type(data) is not dict:
        return None
    if packs is None:
        packs = {}
    path, size, chunks, mode = data.get("path"), data.get("size"), data.get("chunks"), data.get("mode")
    status = data.get("status")
    seen = None
    if status is not None:
        seen = _seen(status)
        if seen is None:
            return None
    if (
        type(path) is not str
        or len(path) > MAX_PATH
        or "\x00" in path
        or type(size) is not int
        or not 0 <= size <= MAX_FILE_BYTES
        or type(chunks) is not list
        or len(chunks) > MAX_CHUNKS_PER_FILE
        or (mode is not None and (type(mode) is not int or not 0 <= mode <= PERMISSION_BITS))
    ):
        return None
    refs: list[ChunkRef] = []
    total = 0
    for c in chunks:
        if type(c) is not dict:
            return None
        sha, csize, pack = c.get("sha256"), c.get("size"), c.get("pack")
        if type(sha) is not str or not _SHA256.fullmatch(sha) or type(csize) is not int:
            return None
        if not 0 <= csize <= MAX_CHUNK_BYTES:
            return None
        if pack is not None:
            offset = c.get("offset")
            if type(pack) is not str:
                return None
            checked = packs.get(pack)
            if checked is None:
                if len(pack) > MAX_KEY or not _pack_shape(identity).fullmatch(pack):
                    return None
                packs[pack] = pack
            else:
                pack = checked
            if type(offset) is not int or not 0 <= offset <= MAX_PACK_BYTES - csize:
                return None
            ref = _NEW(ChunkRef)
            ref.__dict__.update(key=pack, sha256=sha, size=csize, offset=offset)
            refs.append(ref)
        else:
            key = c.get("key")
            if type(key) is not str or len(key) > MAX_KEY:
                return None
            match = _content_shape(identity, CHUNK_DIR, "").fullmatch(key)
            if match is None or match.group(1) != sha:
                return None
            refs.append(ChunkRef(key=key, sha256=sha, size=csize))
        total += csize
    if total != size:
        return None
    entry = _NEW(TreeFile)
    entry.__dict__.update(path=path, size=size, chunks=tuple(refs), mode=mode, seen=seen)
    return entry


@dataclass(frozen=True)
class Tree:
    """The files of a checkpoint (sorted by path). Immutable once written; shared by every checkpoint that
    keeps the same files."""

    identity: str
    files: tuple[TreeFile, ...]

    @functools.cached_property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_keys(self) -> set[str]:
        """Every object holding this tree's bytes: chunk objects, and the packs its packed chunks live in."""
        return {c.key for f in self.files for c in f.chunks}

    @functools.cached_property
    def packed(self) -> bool:
        """Whether a chunk of it lives in a pack (format 5: older releases must refuse it)."""
        return any(c.offset is not None for f in self.files for c in f.chunks)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PACKED_TREE_FORMAT if self.packed else TREE_FORMAT,
            "identity": self.identity,
            "files": [f.to_json() for f in self.files],
        }

    def to_bytes(self) -> bytes:
        """``canonical_json(self.to_json())`` and a newline, joined from each entry's :meth:`TreeFile.encoded`
        text rather than encoded whole (the same bytes: tests/test_tree_parse.py)."""
        fmt = PACKED_TREE_FORMAT if self.packed else TREE_FORMAT
        files = ",".join([f.encoded() for f in self.files])
        return (
            f'{{"files":[{files}],"format":{fmt},"identity":{encode_basestring(self.identity)}}}\n'.encode()
        )

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, identity: str) -> Tree:
        what = f"tree {key!r}"
        # Three objects or more per file, none in a cycle: the collector would only walk them (collector.py).
        with paused_collector():
            try:
                body = json.loads(data)
            except (ValueError, RecursionError) as exc:
                raise CheckpointCorruptError(f"{what} is not valid JSON ({exc}).") from exc
            f = Fields(body, what=what)
            fmt = f.integer("format", minimum=TREE_FORMAT, maximum=PACKED_TREE_FORMAT)
            f.equal("identity", identity)
            packs: dict[str, str] = {}
            files = tuple(
                _quick_file(entry, identity=identity, packs=packs)
                or TreeFile.from_json(entry, identity=identity, what=f"{what} file {n}")
                for n, entry in enumerate(f.items("files", max_items=MAX_FILES))
            )
        texts = entry_texts(data, body["files"], fmt=fmt, identity=identity)
        # What each entry's encoded() then answers: a re-save writes it into the next tree as it is.
        for entry, text in zip(files, texts, strict=True) if texts else ():
            object.__setattr__(entry, "_encoded", text)
        tree = cls(identity=identity, files=files)
        if tree.packed and fmt < PACKED_TREE_FORMAT:
            raise CheckpointCorruptError(
                f"{what} is in tree format {fmt} but names packed chunks (tree format {PACKED_TREE_FORMAT})"
            )
        return tree


@dataclass(frozen=True)
class TreeRef:
    """How a checkpoint names its tree: the object, its SHA-256 and size (verified on read), and totals.

    ``packed``: the tree names packed chunks, so the head and manifest that name it are written in format 5
    without reading the tree (and a reader checks the tree says the same)."""

    key: str
    sha256: str
    size: int
    file_count: int
    total_size: int
    packed: bool = False

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "key": self.key,
            "sha256": self.sha256,
            "size": self.size,
            "file_count": self.file_count,
            "total_size": self.total_size,
        }
        if self.packed:
            body["packed"] = True
        return body

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
            packed=f.boolean("packed"),
        )

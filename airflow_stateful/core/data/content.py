"""ContentStore: the bytes of one identity's checkpoints, and nothing of who may write them.

A checkpoint is a manifest (value and metadata) that names a file tree, and a tree names content-addressed
chunks (docs/adr/0004). This class moves those bytes: it cuts files into chunks and uploads the ones the identity
does not hold yet, writes trees and large manifests (create-if-absent), reads them back verified against the
sizes and SHA-256 their parents record, stages outputs, restores and verifies files. It never decides what is
current: that is the head, which only :class:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore`
advances, fenced by the lease. So a writer's uploads are invisible until the protocol layer commits them, and
this module imports nothing from that layer.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from airflow_stateful.core.collector import paused_collector
from airflow_stateful.core.data.destinations import check_destination
from airflow_stateful.core.data.file_index import FileIndex
from airflow_stateful.core.data.files import LocalFile, check_restore_directory, collect_files
from airflow_stateful.core.data.packs import mostly_small
from airflow_stateful.core.data.restore import ChunkCache, restore_files, restore_tree_files
from airflow_stateful.core.data.restore import prepare as restore_prepare
from airflow_stateful.core.data.restore_modes import (
    EMPTY,
    EXACT,
    MERGE,
    RestoreResult,
    check_mode,
    refuse_unless_empty,
)
from airflow_stateful.core.data.transfer import upload_files
from airflow_stateful.core.data.transfer_progress import TransferProgress, human_bytes
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    InvalidValueError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from airflow_stateful.core.records.canonical import sha256_hex
from airflow_stateful.core.records.heads import CheckpointEntry
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import (
    MAX_OUTPUTS,
    Kind,
    OutputInfo,
    OutputRecord,
    StagedOutput,
    check_output_name,
    content_sha256,
    files_of_output,
    merged_tree_files,
)
from airflow_stateful.core.records.trees import ChunkRef, Tree, TreeFile, TreeRef, tree_key
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import Blob, ObjectStore

log = logging.getLogger("airflow_stateful")

PROGRESS_MIN_BYTES = 64 * 1024 * 1024
"""A save of at least this many bytes logs its progress (a task log shows a long upload is alive)."""
TREE_CACHE = 8
"""Trees kept in memory (a writer reads its previous tree on every save; a listing reads a few)."""


@dataclass(frozen=True)
class StoredFileInfo:
    """One file of a checkpoint as a listing shows it: its path, size and the objects that hold its bytes."""

    path: str
    size: int
    keys: tuple[str, ...]


class ContentStore:
    """The bytes of one identity in one object store: chunks, trees, manifest objects, outputs, restores.

    :param store: where the objects live.
    :param identity: whose bytes these are (every key read or written is below it).
    :param parallelism: chunks moved at once; default: what the store suits.
    """

    def __init__(self, *, store: ObjectStore, identity: Identity, parallelism: int | None = None) -> None:
        self.store, self.identity = store, identity
        self.parallelism = parallelism or store.parallelism
        self._trees: dict[str, Tree] = {}
        self._ahead: tuple[str, Blob] | None = None  # a tree read ahead (read_ahead), for the next tree_of
        #: The files this writer saved last, so a re-save reads only the files that changed (:mod:`.file_index`).
        self.file_index = FileIndex()
        #: The worker's restore cache, if any: every chunk uploaded is kept there too (set by the writer session).
        self.chunk_cache: ChunkCache | None = None

    def __repr__(self) -> str:
        return f"ContentStore(identity={self.identity.key!r}, store={self.store!r})"

    # -- trees -----------------------------------------------------------------------------------------------
    def tree(self, manifest: Manifest) -> Tree | None:
        """The file tree of a checkpoint, verified against its recorded SHA-256 (``None``: it has no files)."""
        return self.tree_of(manifest.tree) if manifest.tree is not None else None

    def tree_of(self, ref: TreeRef) -> Tree:
        """The tree ``ref`` names, read (or taken from memory) and verified against its size and SHA-256."""
        cached, ahead, self._ahead = self._trees.get(ref.key), self._ahead, None
        if cached is not None:
            return cached
        try:
            blob = ahead[1] if ahead and ahead[0] == ref.key else self.store.get(ref.key, max_bytes=ref.size)
        except ObjectNotFoundError as exc:
            raise CheckpointCorruptError(
                f"tree {ref.key!r} of {self.identity} is missing from {self.store.url}: {exc}. Roll back to an "
                "older checkpoint with `airflow-stateful rollback`."
            ) from exc
        got = sha256_hex(blob.data)
        if got != ref.sha256 or len(blob.data) != ref.size:
            raise CheckpointCorruptError(
                f"tree {ref.key!r} in {self.store.url} is corrupt: expected {ref.size} bytes with SHA-256 "
                f"{ref.sha256}, read {len(blob.data)} bytes with SHA-256 {got}. Its files were not used."
            )
        tree = Tree.from_bytes(blob.data, key=ref.key, identity=self.identity.key)
        if tree.total_size != ref.total_size or len(tree.files) != ref.file_count:
            # What `ls`, `du`, the restore log and the restore cache's size check read without the tree.
            raise CheckpointCorruptError(
                f"tree {ref.key!r} in {self.store.url} holds {len(tree.files)} file(s) of {tree.total_size} bytes, "
                f"but its checkpoint records file_count {ref.file_count} and total_size {ref.total_size}: the "
                "record was altered. Its files were not used."
            )
        if tree.packed != ref.packed:
            # What decides the format of the head and manifest naming it, so what an older release refuses.
            raise CheckpointCorruptError(
                f"tree {ref.key!r} in {self.store.url} {'names' if tree.packed else 'names no'} packed chunks, but "
                f"its checkpoint records packed={ref.packed}: the record was altered. Its files were not used."
            )
        self._keep(ref.key, tree)
        return tree

    def read_ahead(self, ref: TreeRef) -> None:
        """Read (not verify) the tree ``ref`` names for the next :meth:`tree_of`, which verifies it (one slot)."""
        if ref.key not in self._trees:
            self._ahead = (ref.key, self.store.get(ref.key, max_bytes=ref.size))

    def _keep(self, key: str, tree: Tree) -> None:
        if len(self._trees) >= TREE_CACHE:
            self._trees.pop(next(iter(self._trees)))
        self._trees[key] = tree

    def write_tree(self, tree: Tree, commit_id: str, *, same_as: TreeRef | None) -> TreeRef:
        """Write ``tree`` (create-if-absent, never adopting garbage) unless it is ``same_as``, a kept tree."""
        data = tree.to_bytes()
        sha = sha256_hex(data)
        if same_as is not None and same_as.sha256 == sha:
            return same_as  # the same files as before: the same tree, already kept
        key = tree_key(self.identity.key, sha)
        try:
            self.store.put(key, data, if_none_match=True, adopt_identical=False)
        except PreconditionFailedError:
            key = tree_key(self.identity.key, sha, unique=commit_id)  # never adopt somebody's garbage
            self.store.put(key, data, if_none_match=True)
        self._keep(key, tree)
        return TreeRef(
            key=key,
            sha256=sha,
            size=len(data),
            file_count=len(tree.files),
            total_size=tree.total_size,
            packed=tree.packed,
        )

    def upload_tree(
        self,
        local_files: list[LocalFile],
        commit_id: str,
        previous: Manifest | None,
        check: Callable[[], None] | None,
    ) -> TreeRef:
        """Upload the chunks ``previous`` does not already hold, and the tree (unless it is ``previous``'s) while
        the last packs are still being uploaded.

        A tree of small files (:func:`~airflow_stateful.core.data.packs.mostly_small`) is saved with the cyclic
        garbage collector paused (:mod:`airflow_stateful.core.collector`)."""
        total = sum(f.size for f in local_files)
        with paused_collector(when=mostly_small(len(local_files), total)):
            before = self.tree(previous) if previous is not None else None
            known = {c.sha256: c for f in (before.files if before else ()) for c in f.chunks}
            # The tree is written while the last packs are uploaded: it is invisible until the head names it.
            written: list[TreeRef] = []
            same = previous.tree if previous is not None else None
            progress = None
            if total >= PROGRESS_MIN_BYTES:
                progress = TransferProgress(
                    label=f"saving {len(local_files)} file(s) for {self.identity}",
                    total_bytes=total,
                    logger=log,
                )
            result = upload_files(
                self.store,
                identity=self.identity.key,
                files=local_files,
                known=known,
                commit_id=commit_id,
                workers=self.parallelism,
                check=check,
                progress=progress,
                index=self.file_index,
                remember=self._remember(total),
                prior={f.path: f for f in before.files} if before is not None else None,
                while_packs_land=lambda files: written.append(
                    self.write_tree(
                        Tree(identity=self.identity.key, files=tuple(files)), commit_id, same_as=same
                    )
                ),
            )
            if progress:
                progress.finish()
            log.info(
                "%s: uploaded %d new chunk(s) (%s), reused %d (%s)",
                self.identity,
                result.chunks_sent,
                human_bytes(result.bytes_sent),
                result.chunks_reused,
                human_bytes(result.bytes_reused),
            )
            return written[0]

    def _remember(self, total: int) -> Callable[[ChunkRef, bytes], None] | None:
        """What keeps uploaded chunks in the worker's restore cache, if there is one and ``total`` bytes fit
        in it (a larger checkpoint would only churn the cache: each chunk evicted before a restore needs it).
        The cache must never fail a commit, so its errors are logged and dropped."""
        cache = self.chunk_cache
        cap = getattr(cache, "max_bytes", None)
        if cache is None or (isinstance(cap, int) and total > cap):
            return None

        def remember(chunk: ChunkRef, data: bytes) -> None:
            try:
                cache.put(chunk, data)
            except Exception as exc:
                log.warning(
                    "%s: restore cache not filled with chunk %s: %s", self.identity, chunk.sha256, exc
                )

        return remember

    # -- manifests -------------------------------------------------------------------------------------------
    def read_manifest(self, entry: CheckpointEntry) -> Manifest:
        """The manifest of ``entry``, one of the checkpoints of a head record of this identity, verified.

        An inline manifest was verified with the head that carries it; a manifest object must have the size and
        SHA-256 the entry records and name this checkpoint of this identity, else
        :class:`~airflow_stateful.core.errors.CheckpointCorruptError`. A missing object raises the store's
        :class:`~airflow_stateful.core.errors.ObjectNotFoundError` as it is (the protocol layer tells a pruned
        checkpoint from a lost one).
        """
        if entry.inline is not None:  # verified with the head that carries it
            # A deep copy: whoever gets this manifest may change its value (a migration does), and that must
            # never change the head record this process would write back.
            return Manifest.from_json(
                copy.deepcopy(entry.inline),
                identity=self.identity.key,
                what=f"checkpoint {entry.seq} of {self.identity}",
            )
        assert entry.manifest is not None and entry.manifest_size is not None
        blob = self.store.get(entry.manifest, max_bytes=entry.manifest_size)
        got = sha256_hex(blob.data)
        if got != entry.manifest_sha256 or len(blob.data) != entry.manifest_size:
            raise CheckpointCorruptError(
                f"manifest {entry.manifest!r} of checkpoint {entry.seq} in {self.store.url} is corrupt: expected "
                f"{entry.manifest_size} bytes with SHA-256 {entry.manifest_sha256}, read {len(blob.data)} bytes "
                f"with SHA-256 {got}. Its value was not used; roll back to an older checkpoint."
            )
        manifest = Manifest.from_bytes(blob.data, key=entry.manifest)
        if manifest.seq != entry.seq or manifest.identity != self.identity.key:
            raise CheckpointCorruptError(
                f"manifest {entry.manifest!r} says seq {manifest.seq} of {manifest.identity!r}, but the head lists "
                f"it as seq {entry.seq} of {self.identity.key!r}."
            )
        return manifest

    def write_manifest(self, key: str, raw: bytes) -> None:
        """Write a manifest too large to ride inline in the head (create-if-absent: a commit id is never reused)."""
        self.store.put(key, raw, if_none_match=True)

    def files(self, manifest: Manifest) -> list[StoredFileInfo]:
        """The files of a checkpoint (its tree's): path, size and the chunks holding its bytes."""
        tree = self.tree(manifest)
        files = tree.files if tree is not None else ()
        return [StoredFileInfo(f.path, f.size, tuple(c.key for c in f.chunks)) for f in files]

    # -- outputs ---------------------------------------------------------------------------------------------
    def stage_output(
        self,
        name: str,
        path: str | Path,
        *,
        known: Mapping[str, ChunkRef] | None = None,
        follow_symlinks: bool = False,
        check: Callable[[], None] | None = None,
        before_upload: Callable[[], None] | None = None,
    ) -> StagedOutput:
        """Upload the chunks of output ``name`` (the file or directory ``path``) for a later commit to publish.

        The name and the path are checked, and the files hashed, before anything is sent; ``before_upload`` runs
        then (the protocol layer checks the lease there, so a fenced writer uploads nothing). ``known``: chunks
        the identity's kept checkpoints hold (not sent again). The record carries the SHA-256 of the content.
        """
        check_output_name(name)
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidValueError(f"output {name!r}: path must be a file or directory path, not {path!r}")
        given = Path(path)
        if not given.is_file() and not given.is_dir():
            raise InvalidValueError(
                f"output {name!r}: {str(given)!r} is not a file or a directory (does it exist?); nothing was published"
            )
        kind: Kind = "file" if given.is_file() else "directory"
        local_files = collect_files(given, follow_symlinks=follow_symlinks)
        if kind == "directory" and not local_files:
            raise InvalidValueError(
                f"output {name!r}: directory {str(given)!r} holds no files; nothing was published"
            )
        hashes = {f.rel: file_sha256(f.path) for f in local_files}
        if before_upload is not None:
            before_upload()
        result = upload_files(
            self.store,
            identity=self.identity.key,
            files=local_files,
            known=dict(known or {}),
            commit_id=uuid.uuid4().hex,
            workers=self.parallelism,
            check=check,
        )
        by_rel = {f.rel: f for f in local_files}
        files: list[TreeFile] = []
        for tf in result.files:
            if tf.size != by_rel[tf.path].size or tf.size != os.stat(by_rel[tf.path].path).st_size:
                raise InvalidValueError(
                    f"output {name!r}: {tf.path!r} changed while it was being published; publish it again once it "
                    "is complete"
                )
            files.append(replace(tf, path="" if kind == "file" else tf.path))
        sha = content_sha256(kind, [(f.path, f.size, hashes[f.path or local_files[0].rel]) for f in files])
        log.info(
            "%s: staged output %r (%s, %d file(s), %s; uploaded %d new chunk(s)); visible with the next checkpoint",
            self.identity,
            name,
            kind,
            len(files),
            human_bytes(sum(f.size for f in files)),
            result.chunks_sent,
        )
        return StagedOutput(name=name, kind=kind, files=tuple(files), sha256=sha)

    def outputs_tree(
        self,
        base: Manifest | None,
        staged: Mapping[str, StagedOutput],
        *,
        seq: int,
        created_at: str,
        writer: WriterInfo,
        commit_id: str,
    ) -> tuple[TreeRef | None, dict[str, OutputRecord]]:
        """The outputs tree and records of the checkpoint being committed: ``base``'s, with ``staged`` merged in."""
        kept = dict(base.outputs) if base is not None else {}
        kept_ref = base.outputs_tree if base is not None else None
        if not staged:
            return kept_ref, kept
        records = {name: record for name, record in kept.items() if name not in staged}
        for name, output in staged.items():
            records[name] = OutputRecord(
                name=name,
                kind=output.kind,
                size=output.size,
                file_count=len(output.files),
                sha256=output.sha256,
                seq=seq,
                committed_at=created_at,
                try_number=writer.try_number,
                run_id=writer.run_id,
            )
        if len(records) > MAX_OUTPUTS:
            raise InvalidValueError(
                f"{self.identity} would carry {len(records)} outputs, more than the {MAX_OUTPUTS} allowed; "
                "publish fewer, larger outputs (a directory is one output)"
            )
        kept_files = self.tree_of(kept_ref).files if kept_ref is not None else ()
        tree = Tree(identity=self.identity.key, files=tuple(merged_tree_files(kept_files, kept, staged)))
        return self.write_tree(tree, commit_id, same_as=kept_ref), dict(sorted(records.items()))

    def outputs(self, manifest: Manifest | None) -> dict[str, OutputInfo]:
        """The outputs ``manifest`` carries, by name, each with where it lives; ``{}`` for none."""
        if manifest is None or manifest.outputs_tree is None:
            return {}
        location = f"{self.store.url.rstrip('/')}/{manifest.outputs_tree.key}"
        return {
            name: OutputInfo.of(record, location=f"{location}#{name}")
            for name, record in sorted(manifest.outputs.items())
        }

    def output_files(self, manifest: Manifest, name: str) -> list[TreeFile]:
        """The files of committed output ``name`` of ``manifest`` (paths relative to the output; a file output
        is one file with path ``""``), verified against its record. CheckpointNotFoundError if it has none."""
        record = manifest.outputs.get(name)
        if record is None or manifest.outputs_tree is None:
            have = ", ".join(sorted(manifest.outputs)) or "none"
            raise CheckpointNotFoundError(
                f"checkpoint {manifest.seq} of {self.identity} has no output {name!r}; its outputs: {have}"
            )
        return files_of_output(record, self.tree_of(manifest.outputs_tree).files)

    def restore_output(
        self,
        name: str,
        dest: str | Path,
        *,
        manifest: Manifest,
        mode: str = EXACT,
        cache: ChunkCache | None = None,
        shared_dest: bool = False,
    ) -> RestoreResult:
        """Download output ``name`` of ``manifest`` to ``dest/<name>``, every chunk verified, all or nothing.

        ``mode`` applies to the output's own path, never to the rest of ``dest``: for a directory output
        ``dest/<name>`` ends holding exactly its files (``"exact"``) or is refused unless missing or empty
        (``"empty"``); a file output replaces ``dest/<name>`` (``"exact"``, ``"merge"``) or is refused if that
        exists (``"empty"``)."""
        check_output_name(name)
        mode = check_mode(mode)
        record = manifest.outputs.get(name)
        if record is None:
            self.output_files(manifest, name)  # raises, naming the outputs it has
        target = Path(dest) / name
        label = f"output {name!r} of {self.identity}"
        restore = functools.partial(
            restore_tree_files,
            self,
            where=label,
            label=label,
            seq=manifest.seq,
            what=f"output {name!r} of checkpoint",
            cache=cache,
            shared_dest=shared_dest,
            prepared=True,  # just below, for the path the mode applies to
        )
        if record is not None and record.kind == "directory":
            # Restored into its own path, so the mode's check and exact's clean-up apply there and only there.
            check_restore_directory(target)
            check_destination(Path(dest), shared_dest=shared_dest)
            # Before the outputs tree is read: "empty" refuses before any download.
            restore_prepare(target, mode, shared_dest=shared_dest)
            return restore(self.output_files(manifest, name), target, mode=mode)
        # A single file: "empty" refuses an existing one; otherwise it is replaced and nothing else in dest is
        # touched (a merge of one file is exactly that).
        restore_prepare(Path(dest), MERGE, shared_dest=shared_dest)
        if mode == EMPTY:
            refuse_unless_empty(target)
        placed = [replace(f, path=name) for f in self.output_files(manifest, name)]
        result = restore(placed, dest, mode=MERGE)
        return replace(result, mode=mode, dest=target)

    # -- restores ----------------------------------------------------------------------------------------------
    def restore_files(
        self,
        manifest: Manifest,
        dest: str | Path,
        *,
        mode: str = EXACT,
        cache: ChunkCache | None = None,
        shared_dest: bool = False,
        durable: bool = False,
    ) -> RestoreResult:
        """Download a checkpoint's files into directory ``dest``, verified, all or nothing; what it did
        (:meth:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore.restore_files` says how)."""
        return restore_files(
            self, manifest, dest, mode=mode, cache=cache, shared_dest=shared_dest, durable=durable
        )

    def verify(self, manifest: Manifest) -> None:
        """Read back every byte of a checkpoint and check every hash (its tree's chunks); raise
        CheckpointCorruptError naming the first bad object. Nothing is kept."""
        with tempfile.TemporaryDirectory(prefix="stateful-verify-") as scratch:
            restore_files(self, manifest, scratch, verb="verifying")  # its progress lines say what this is


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (what ``sha256sum`` prints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()

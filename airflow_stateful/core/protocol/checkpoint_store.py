"""CheckpointStore: leases, atomic fenced commits, verified reads and retention for one identity.

The commit protocol (docs/adr/0001-commit-protocol.md, content-addressed since docs/adr/0004), in order:

1. check the writer still holds the lease (fail fast before uploading gigabytes);
2. cut the files into chunks, hash them, and upload the chunks the identity does not hold yet (in parallel,
   create-if-absent, ``<identity>/~chunks/<sha256>``); write the file tree (``~trees/<sha256>.json``) unless
   it is the tree of the checkpoint the writer started from;
3. build the manifest (value, metadata, tree reference); a small one rides inline in the head entry, a larger
   one is written as ``~manifests/<seq>-<commit_id>.json`` (create-if-absent);
4. compare-and-swap the head record: append the entry, drop entries past ``keep_last``, renew the lease,
   succeeding only while the head carries this writer's epoch and token.

Until step 4 the new objects are invisible garbage; after it the checkpoint is whole. A crash between any
two steps leaves the previous checkpoint intact and, at worst, unreferenced objects. Objects no kept
checkpoint needs any more are deleted off the commit path: by :meth:`CheckpointStore.sweep` (the writer, under
its lease) or by GC (:mod:`airflow_stateful.core.fleet.gc`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from airflow_stateful.core import events
from airflow_stateful.core.data.file_index import FileIndex
from airflow_stateful.core.data.files import LocalFile, check_restore_directory, collect_files
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
    CommitOutcomeUnknownError,
    ConcurrentCommitError,
    FencedError,
    InvalidValueError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StatefulError,
    StoreError,
)
from airflow_stateful.core.protocol.heads import HeadStore
from airflow_stateful.core.protocol.lease import (
    Lease,
    acquire_decision,
    break_decision,
    check_holder,
    lease_of,
    renewed,
)
from airflow_stateful.core.protocol.retention import KeepLast, RetentionPolicy, references, unreferenced
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.code_identity import CodeIdentity
from airflow_stateful.core.records.codecs import JSON, encode_value, encoded_form
from airflow_stateful.core.records.formats import (
    MAX_EXPECTED_INTERVAL,
    MAX_PINS,
    OUTPUTS_FORMAT,
    PLAIN_FORMAT,
    data_commit_of,
    manifest_key,
)
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord, PinRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import FileEntry, Manifest
from airflow_stateful.core.records.outcomes import TryOutcome
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
from airflow_stateful.core.settings import KEEP_LAST, LEASE_TTL
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import utcnow_iso
from airflow_stateful.version import __version__

log = logging.getLogger("airflow_stateful")

DEFAULT_LEASE_TTL = float(LEASE_TTL)
DEFAULT_KEEP_LAST = KEEP_LAST
_PROGRESS_MIN_BYTES = 64 * 1024 * 1024
_TREE_CACHE = 8
INLINE_MANIFEST_BYTES = 8 * 1024
"""A manifest up to this size rides inline in the head (a small commit is one conditional write)."""
INLINE_HEAD_BUDGET = 512 * 1024
"""...as long as the head stays below this size (heads are read by every reader: keep them small)."""


@dataclass(frozen=True)
class StoredFileInfo:
    """One file of a checkpoint as a listing shows it: its path, size and the objects that hold its bytes."""

    path: str
    size: int
    keys: tuple[str, ...]


class CheckpointStore:
    """Checkpoints of one identity in one object store.

    :param store: where the objects live.
    :param identity: whose checkpoints these are.
    :param keep_last: how many committed checkpoints to keep (or pass ``retention``).
    :param lease_ttl: seconds a lease lives without a commit or renewal.
    :param clock: seconds since the epoch; injectable for tests of expiry.
    :param parallelism: chunks moved at once by a commit or a restore; default: what the store suits.
    """

    def __init__(
        self,
        *,
        store: ObjectStore,
        identity: Identity,
        keep_last: int = DEFAULT_KEEP_LAST,
        retention: RetentionPolicy | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        clock: Callable[[], float] = time.time,
        parallelism: int | None = None,
    ) -> None:
        if not isinstance(identity, Identity):
            raise TypeError(f"identity must be an Identity, not {type(identity).__name__}")
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be a positive number of seconds, not {lease_ttl!r}")
        self.store = store
        self.identity = identity
        self.retention: RetentionPolicy = retention or KeepLast(keep_last)
        self.lease_ttl = float(lease_ttl)
        self.clock = clock
        self.heads = HeadStore(store=store, identity=identity, clock=clock)
        self.parallelism = parallelism or store.parallelism
        self._trees: dict[str, Tree] = {}
        #: The files this writer saved last, so a re-save reads only the files that changed (:mod:`.file_index`).
        self.file_index = FileIndex()
        #: The worker's restore cache, if the task has one: every chunk this writer uploads is kept there too,
        #: from memory, so a retry on this machine need not download it (set by ``TaskState``).
        self.chunk_cache: ChunkCache | None = None
        #: Checkpoints with objects of their own that retention dropped since the last :meth:`sweep`.
        self.cleanup_due = 0

    def __repr__(self) -> str:
        return f"CheckpointStore(identity={self.identity.key!r}, store={self.store!r})"

    # -- leases --------------------------------------------------------------------------------------------
    def acquire(
        self,
        *,
        holder: WriterInfo | None = None,
        steal: bool = False,
        grace: float = 0.0,
        expected_interval: float | None = None,
        outcome: TryOutcome | None = None,
    ) -> Lease:
        """Take the lease, raising the epoch so every earlier writer is fenced.

        :param steal: take it even from a live holder (an Airflow retry knows its earlier try is over).
        :param grace: without ``steal``, also respect a lease expired less than this long ago (maintenance
            passes the lease grace, so it never takes over a lease whose holder may still be renewing it).
        :param expected_interval: seconds within which this holder means to commit; recorded in the lease so
            that readers can tell it stuck (alive, no progress) from active (:mod:`airflow_stateful.core.fleet.status`).
        :param outcome: the try's ``running`` outcome (:mod:`airflow_stateful.core.records.outcomes`), recorded in the same
            write: what maintenance assumes of the try if it dies without recording its end.
        """
        if expected_interval is not None and not 1 <= expected_interval <= MAX_EXPECTED_INTERVAL:
            raise InvalidValueError(
                f"expected_checkpoint_interval must be from 1 s to {MAX_EXPECTED_INTERVAL:g} s, not {expected_interval!r}"
            )
        holder = holder or WriterInfo.current()
        token = uuid.uuid4().hex
        head = self.heads.update(
            lambda h: acquire_decision(
                h,
                identity=self.identity,
                holder=holder,
                now=self.clock(),
                ttl=self.lease_ttl,
                steal=steal,
                token=token,
                grace=grace,
                expected_interval=expected_interval,
                outcome=outcome,
            )
        )
        assert head.lease is not None
        previous = f"; fenced epoch {head.epoch - 1}" if head.epoch > 1 else ""
        log.info("took the lease on %s at epoch %d%s", self.identity, head.epoch, previous)
        return lease_of(self.identity, head.lease)

    def renew(self, lease: Lease) -> Lease:
        """Extend the lease to ``lease_ttl`` from now; FencedError if it was taken over or broken."""

        def decide(head: HeadRecord | None) -> HeadRecord:
            head = check_holder(head, lease, action="renew the lease on")
            return renewed(head, now=self.clock(), ttl=self.lease_ttl)

        head = self.heads.update(decide, fresh=False)
        assert head.lease is not None
        return replace(lease, expires_at=head.lease.expires_at)

    def release(self, lease: Lease, *, outcome: TryOutcome | None = None) -> bool:
        """Give the lease up (the epoch stays). Returns False, without error, if it was already taken over.

        :param outcome: how the try ended, recorded in the same write (the head's outcome is kept otherwise).
        """

        def decide(head: HeadRecord | None) -> HeadRecord:
            current = check_holder(head, lease, action="release")
            return current.evolve(lease=None, outcome=outcome or current.outcome)

        try:
            self.heads.update(decide, fresh=False)
        except FencedError:
            return False
        return True

    def pin(self, lease: Lease, seq: int, *, reason: str, by: str = "") -> HeadRecord:
        """Pin kept checkpoint ``seq`` so that retention never evicts it (fenced like a commit).

        Already pinned: nothing changes. At :data:`~airflow_stateful.core.records.formats.MAX_PINS` pins the oldest pin is
        released (logged as a warning): a head must stay small enough for every reader.
        """
        at = utcnow_iso(self.clock())

        def decide(head: HeadRecord | None) -> HeadRecord:
            head = check_holder(head, lease, action="pin a checkpoint of")
            entries = list(head.checkpoints)
            index = next((n for n, e in enumerate(entries) if e.seq == seq), None)
            if index is None:
                raise CheckpointNotFoundError(f"identity {self.identity} keeps no checkpoint {seq} to pin")
            if entries[index].pinned is not None:
                return head
            entries[index] = replace(entries[index], pinned=PinRecord(at=at, reason=reason, by=by))
            pinned = [n for n, e in enumerate(entries) if e.pinned is not None]
            if len(pinned) > MAX_PINS:
                oldest = entries[pinned[0]]
                log.warning(
                    "%s: more than %d pinned checkpoints; releasing the pin of the oldest, %d (%s)",
                    self.identity,
                    MAX_PINS,
                    oldest.seq,
                    oldest.pinned.reason if oldest.pinned else "",
                )
                entries[pinned[0]] = replace(oldest, pinned=None)
            changed = head.evolve(checkpoints=tuple(entries))
            return changed.evolve(format=changed.written_format)

        head = self.heads.update(decide)
        log.warning("%s: pinned checkpoint %d (%s); retention will keep it", self.identity, seq, reason)
        return head

    def break_lease(self, *, grace: float | None = None, token: str | None = None) -> HeadRecord | None:
        """Remove the lease and raise the epoch, fencing its holder. ``None`` if the identity has no head.

        :param grace: ``None`` breaks any lease (``airflow-stateful unlock --force``). A number breaks it only
            if it has gone unrenewed for longer than its ttl plus ``grace`` (judged inside the
            compare-and-swap, so a renewal that lands first wins) and raises LeaseHeldError otherwise.
        :param token: break only this lease (the one the caller judged), never a newer one.
        """
        if self.heads.load()[0] is None:
            return None
        head = self.heads.update(
            lambda h: break_decision(h, identity=self.identity, now=self.clock(), grace=grace, token=token)
        )
        log.warning("broke the lease on %s; epoch is now %d", self.identity, head.epoch)
        return head

    # -- commit --------------------------------------------------------------------------------------------
    def commit(
        self,
        lease: Lease,
        value: Any,
        *,
        files: str | Path | None = None,
        schema_version: int = 1,
        writer: WriterInfo | None = None,
        extra: dict[str, Any] | None = None,
        value_codec: str = JSON,
        keep_files_from: Manifest | None = None,
        previous: Manifest | None = None,
        exclude: Collection[str] = (),
        follow_symlinks: bool = False,
        encoded: bool = False,
        check: Callable[[], None] | None = None,
        outputs: Mapping[str, StagedOutput] | None = None,
        code: CodeIdentity | None = None,
        unpin: Collection[str] = (),
    ) -> Manifest:
        """Make ``value`` (and the files below ``files``) the identity's newest checkpoint, atomically.

        Everything the caller passed is checked before the first byte is written. Raises FencedError if the
        lease was taken over; in that case nothing this writer uploaded becomes visible.

        :param keep_files_from: with ``files=None``, the new checkpoint keeps this earlier checkpoint's
            files (by reference: the same tree, nothing is copied).
        :param previous: the checkpoint this writer started from or last committed (still kept by the head):
            the chunks it references are not uploaded again. Default: the newest checkpoint.
        :param exclude: relative paths below ``files`` not to checkpoint.
        :param follow_symlinks: save what links inside ``files`` point to (never outside it); default: refuse
            links, naming them.
        :param encoded: ``value`` is already in its stored form (a manifest's ``value``, as ``value_codec``
            wrote it): it is copied as it is, never decoded (a rollback must not unpickle anything).
        :param check: called before each upload and before the head is advanced; raising there aborts the
            commit with nothing made visible (a :class:`WriterSession` stops a writer that lost its lease).
        :param outputs: outputs staged by :meth:`stage_output`, made visible with this checkpoint (added to, or
            replacing by name, the outputs of the newest checkpoint, which every commit carries over).
        :param code: what code writes it (:mod:`airflow_stateful.core.records.code_identity`), recorded in the manifest.
        :param unpin: commit ids of pinned checkpoints whose pin this commit releases (in the same write).
        """
        if lease.identity != self.identity:
            raise ValueError(f"lease is for {lease.identity}, not {self.identity}")
        if isinstance(schema_version, bool) or not isinstance(schema_version, int) or schema_version < 1:
            raise InvalidValueError(f"schema_version must be an integer >= 1, not {schema_version!r}")
        stored_value = encoded_form(value, value_codec) if encoded else encode_value(value, value_codec)
        if extra is not None:
            encode_value(extra, JSON)
        local_files = collect_files(files, exclude=exclude, follow_symlinks=follow_symlinks)
        for earlier in (keep_files_from, previous):
            if earlier is not None and earlier.identity != self.identity.key:
                raise ValueError(
                    f"{earlier.identity} is not {self.identity}: a checkpoint of another identity"
                )

        # Fail fast before uploading files: a fenced zombie must not push gigabytes first. A value-only
        # commit trusts the head this process last saw (the CAS below re-checks it anyway).
        try:
            head = check_holder(
                self.heads.load()[0] if local_files else self.heads.cached(), lease, action="commit to"
            )
        except FencedError:
            try:
                # Re-read to name the current holder in the error.
                head = check_holder(self.heads.load()[0], lease, action="commit to")
            except FencedError:
                events.emit(events.FENCED, identity=self.identity.key, epoch=lease.epoch, action="commit")
                raise
        outputs_base = self._outputs_base(head, keep_files_from, previous)
        if (
            local_files
            and previous is not None
            and all(e.commit_id != previous.commit_id for e in head.checkpoints)
        ):
            # Retention (or a commit whose answer was lost) dropped it: its chunks may be collected any time,
            # so they must not be assumed present. Deduplicate against what the head keeps instead.
            previous = None
        if local_files and previous is None and keep_files_from is None:
            previous = self._dedup_base(head)
        started = time.monotonic()
        seq = head.next_seq
        commit_id = uuid.uuid4().hex
        tree_ref: TreeRef | None = None
        legacy_files: tuple[FileEntry, ...] = ()
        if files is None and keep_files_from is not None:
            tree_ref, legacy_files = keep_files_from.tree, keep_files_from.files
        elif local_files:
            tree_ref = self._upload_tree(local_files, commit_id, previous or keep_files_from, check)
        created_at = utcnow_iso(self.clock())
        writer = writer or lease.holder
        outputs_tree, output_records = self._outputs_tree(
            outputs_base, outputs or {}, seq=seq, created_at=created_at, writer=writer, commit_id=commit_id
        )

        manifest = Manifest(
            identity=self.identity.key,
            seq=seq,
            commit_id=commit_id,
            epoch=lease.epoch,
            schema_version=schema_version,
            created_at=created_at,
            writer=writer,
            value=stored_value,
            value_codec=value_codec,
            files=legacy_files,
            library_version=__version__,
            extra=dict(extra or {}),
            tree=tree_ref,
            outputs=output_records,
            outputs_tree=outputs_tree,
            format=OUTPUTS_FORMAT if outputs_tree is not None else PLAIN_FORMAT,
            code=code,
        )
        body = manifest.to_json()
        raw = canonical_json(body) + b"\n"
        inline = len(raw) <= INLINE_MANIFEST_BYTES and len(head.to_bytes()) + len(raw) <= INLINE_HEAD_BUDGET
        if check is not None:
            check()
        key = manifest_key(self.identity.key, seq, commit_id)
        if not inline:
            self.store.put(key, raw, if_none_match=True)
        entry = CheckpointEntry(
            seq=seq,
            commit_id=commit_id,
            manifest=None if inline else key,
            manifest_sha256=None if inline else sha256_hex(raw),
            manifest_size=None if inline else len(raw),
            created_at=manifest.created_at,
            schema_version=schema_version,
            epoch=lease.epoch,
            total_size=manifest.total_size,
            file_count=manifest.file_count,
            data_refs=tuple(sorted({data_commit_of(f.key) for f in legacy_files})),
            tree=tree_ref,
            # A copy made of the stored bytes: the caller's value object must never alias the head's record.
            inline=json.loads(raw) if inline else None,
            outputs_tree=outputs_tree,
        )

        freed: list[CheckpointEntry] = []

        def decide(current: HeadRecord | None) -> HeadRecord:
            current = check_holder(current, lease, action="commit to")
            if any(e.commit_id == commit_id for e in current.checkpoints):
                return current  # our write landed; its answer was lost and a retry saw 412
            if current.next_seq != seq:
                raise ConcurrentCommitError(
                    f"identity {self.identity} advanced to seq {current.next_seq - 1} while this commit "
                    f"(seq {seq}) was in flight with the same lease; commit from one thread at a time."
                )
            kept = [replace(e, pinned=None) if e.commit_id in unpin else e for e in current.checkpoints]
            keep, drop = self.retention.split([*kept, entry])
            freed[:] = [e for e in drop if e.manifest or e.tree or e.data_refs or e.outputs_tree]
            advanced = current.evolve(next_seq=seq + 1, checkpoints=tuple(keep))
            return renewed(
                advanced.evolve(format=advanced.written_format), now=self.clock(), ttl=self.lease_ttl
            )

        try:
            self.heads.update(decide, fresh=False)
        except FencedError:
            events.emit(events.FENCED, identity=self.identity.key, epoch=lease.epoch, action="commit")
            raise
        except StoreError as exc:
            # The write may have landed with its answer lost (a reset or timeout after the request was
            # sent, retries exhausted). The head says which: report the commit as done exactly when it is.
            if not self._landed(manifest, lease, exc):
                raise
            log.warning(
                "the answer to the commit of checkpoint %d of %s was lost (%s); the head shows it landed",
                seq,
                self.identity,
                exc,
            )
        self.cleanup_due += len(freed)
        if outputs:
            events.emit(
                events.PUBLISHED,
                identity=self.identity.key,
                seq=seq,
                outputs=len(outputs),
                bytes=sum(o.size for o in outputs.values()),
            )
            log.info(
                "%s: checkpoint %d made %d output(s) visible: %s",
                self.identity,
                seq,
                len(outputs),
                ", ".join(sorted(outputs)),
            )
        events.emit(
            events.COMMIT,
            identity=self.identity.key,
            seq=seq,
            bytes=manifest.total_size,
            files=manifest.file_count,
            duration=time.monotonic() - started,
        )
        log.info(
            "committed checkpoint %d of %s (%d file(s), %s, schema %d)",
            seq,
            self.identity,
            manifest.file_count,
            human_bytes(manifest.total_size),
            schema_version,
        )
        return manifest

    def _landed(self, manifest: Manifest, lease: Lease, error: StoreError) -> bool:
        """Whether ``manifest``'s commit is in the head after its head write failed with ``error``.

        "Not in the head" is not yet "failed": an attempt held up in the network (past every read timeout)
        still carries ``If-Match`` with the ETag the head has now, and could land after this returns. So the
        head is sealed first: rewritten conditionally (the lease renewed), which changes its ETag, so that a
        held write can only ever get 412. Only then is the commit reported as failed.
        """

        def ours(head: HeadRecord | None) -> bool:
            return head is not None and any(e.commit_id == manifest.commit_id for e in head.checkpoints)

        def seal(current: HeadRecord | None) -> HeadRecord:
            if ours(current):
                return current  # type: ignore[return-value]  # it landed meanwhile: nothing to write
            return renewed(
                check_holder(current, lease, action="commit to"), now=self.clock(), ttl=self.lease_ttl
            )

        try:
            # FencedError passes: another writer took the head (so the held write can no longer land either).
            return ours(self.heads.update(seal))
        except FencedError:
            raise
        except StatefulError as again:
            raise CommitOutcomeUnknownError(
                f"could not tell whether checkpoint {manifest.seq} of {self.identity} was committed: writing "
                f"the head failed ({error}) and reading it back failed too ({again}). The previous checkpoint "
                "is intact either way; the next save reads the head again and goes on from the newest.",
                manifest=manifest,
            ) from error

    # -- outputs ---------------------------------------------------------------------------------------------
    def stage_output(
        self,
        lease: Lease,
        name: str,
        path: str | Path,
        *,
        known: Mapping[str, ChunkRef] | None = None,
        follow_symlinks: bool = False,
        check: Callable[[], None] | None = None,
    ) -> StagedOutput:
        """Upload the chunks of output ``name`` (the file or directory ``path``) for the next commit to publish.

        Nothing becomes visible: the chunks are unreferenced until a commit names them (:meth:`commit` with
        ``outputs``), and a writer that dies or is fenced first leaves them for GC. The name and the path are
        checked before anything is sent, and the lease is checked before uploading (a fenced writer gets
        FencedError and uploads nothing). ``known``: chunks the identity's kept checkpoints hold (not sent
        again). The returned record carries the SHA-256 of the content (:func:`~.outputs.content_sha256`).
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
        hashes = {f.rel: _file_sha256(f.path) for f in local_files}
        check_holder(self.heads.load()[0], lease, action="publish to")
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
            files.append(TreeFile(path="" if kind == "file" else tf.path, size=tf.size, chunks=tf.chunks))
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

    def outputs(self, manifest: Manifest | None = None) -> dict[str, OutputInfo]:
        """The outputs committed so far (by the newest checkpoint, or by ``manifest``), by name; ``{}`` before
        the first commit that carried outputs. Only committed outputs are ever listed."""
        if manifest is None:
            manifest = self.latest()
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
        return files_of_output(record, self._tree_of_ref(manifest.outputs_tree).files)

    def restore_output(
        self,
        name: str,
        dest: str | Path,
        *,
        manifest: Manifest | None = None,
        mode: str = EXACT,
        cache: ChunkCache | None = None,
    ) -> RestoreResult:
        """Download committed output ``name`` to ``dest/<name>`` (a file, or a directory of its files), every chunk
        verified, all or nothing; what it did. Default: the output as the newest checkpoint has it.

        ``mode`` (as for :meth:`restore_files`) applies to the output's own path, never to the rest of ``dest``:
        for a directory output ``dest/<name>`` ends holding exactly its files (``"exact"``) or is refused unless
        missing or empty (``"empty"``); a file output replaces ``dest/<name>`` (``"exact"``, ``"merge"``) or is
        refused if that exists (``"empty"``)."""
        check_output_name(name)
        mode = check_mode(mode)
        manifest = manifest or self.latest()
        if manifest is None:
            raise CheckpointNotFoundError(f"identity {self.identity} has no checkpoint, so no outputs")
        record = manifest.outputs.get(name)
        if record is None:
            self.output_files(manifest, name)  # raises, naming the outputs it has
        target = Path(dest) / name
        label = f"output {name!r} of {self.identity}"
        what = f"output {name!r} of checkpoint"
        if record is not None and record.kind == "directory":
            # Restored into its own path, so the mode's check and exact's clean-up apply there and only there.
            check_restore_directory(target)
            restore_prepare(
                target, mode
            )  # before the outputs tree is read: "empty" refuses before any download
            files = self.output_files(manifest, name)
            return restore_tree_files(
                self,
                files,
                target,
                where=label,
                label=label,
                seq=manifest.seq,
                mode=mode,
                what=what,
                cache=cache,
            )
        # A single file: "empty" refuses an existing one; otherwise it is replaced and nothing else in dest is
        # touched (a merge of one file is exactly that).
        restore_prepare(Path(dest), MERGE)
        if mode == EMPTY:
            refuse_unless_empty(target)
        files = self.output_files(manifest, name)
        placed = [TreeFile(path=name, size=f.size, chunks=f.chunks) for f in files]
        result = restore_tree_files(
            self, placed, dest, where=label, label=label, seq=manifest.seq, mode=MERGE, what=what, cache=cache
        )
        return replace(result, mode=mode, dest=target)

    def _outputs_base(self, head: HeadRecord, *known: Manifest | None) -> Manifest | None:
        """The newest checkpoint's manifest, whose outputs a commit carries over; ``None`` if it has none.

        Usually one of ``known`` (the writer's newest checkpoint): no request. Otherwise it is read."""
        newest = head.latest
        if newest is None or newest.outputs_tree is None:
            return None
        for manifest in known:
            if manifest is not None and manifest.commit_id == newest.commit_id:
                return manifest
        return self._read_manifest(newest)

    def _outputs_tree(
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
        kept_files = self._tree_of_ref(kept_ref).files if kept_ref is not None else ()
        tree = Tree(identity=self.identity.key, files=tuple(merged_tree_files(kept_files, kept, staged)))
        return self._write_tree(tree, commit_id, same_as=kept_ref), dict(sorted(records.items()))

    def _dedup_base(self, head: HeadRecord) -> Manifest | None:
        """The newest checkpoint, whose chunks a commit that was not told its ``previous`` need not upload.

        Best effort: a checkpoint that cannot be read (or has no readable tree) only means every chunk is
        uploaded again, never a failed commit.
        """
        if head.latest is None:
            return None
        try:
            manifest = self._read_manifest(head.latest)
            self.tree(manifest)
        except StatefulError as exc:
            log.warning(
                "%s: not deduplicating against checkpoint %d: %s", self.identity, head.latest.seq, exc
            )
            return None
        return manifest

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

    def _upload_tree(
        self,
        local_files: list[LocalFile],
        commit_id: str,
        previous: Manifest | None,
        check: Callable[[], None] | None,
    ) -> TreeRef:
        """Upload the chunks ``previous`` does not already hold, then the tree (unless it is ``previous``'s)."""
        before = self.tree(previous) if previous is not None else None
        known = {c.sha256: c for f in (before.files if before else ()) for c in f.chunks}
        total = sum(f.size for f in local_files)
        progress = None
        if total >= _PROGRESS_MIN_BYTES:
            progress = TransferProgress(
                label=f"saving {len(local_files)} file(s) for {self.identity}", total_bytes=total, logger=log
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
        tree = Tree(identity=self.identity.key, files=tuple(result.files))
        return self._write_tree(tree, commit_id, same_as=previous.tree if previous is not None else None)

    def _write_tree(self, tree: Tree, commit_id: str, *, same_as: TreeRef | None) -> TreeRef:
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
        self._trees[key] = tree
        return TreeRef(
            key=key, sha256=sha, size=len(data), file_count=len(tree.files), total_size=tree.total_size
        )

    def sweep(self, lease: Lease, *, keep: Collection[str] = ()) -> list[str]:
        """Delete this identity's objects no kept checkpoint needs (dropped checkpoints, crash garbage).

        Fenced like a commit, and in this order: list the identity's objects, *then* confirm (by renewing the
        lease) that this writer still holds it, then delete what the confirmed head does not reference. Any
        object in the listing was therefore written before the confirmation; a newer writer can only have
        written after it took the lease, which the confirmation would have seen. Returns the deleted keys.
        ``keep``: keys this writer uploaded for its next commit (staged outputs), unreferenced until then.
        """
        listed = [
            info for info in self.store.list_objects(f"{self.identity.key}/~") if info.key != self.heads.key
        ]

        def decide(head: HeadRecord | None) -> HeadRecord:
            return renewed(check_holder(head, lease, action="clean up"), now=self.clock(), ttl=self.lease_ttl)

        head = self.heads.update(decide, fresh=False)
        self.cleanup_due = 0
        refs = references(head, trees=self._tree_of_ref)
        kept = set(keep)
        garbage = [
            info.key
            for info in unreferenced(self.identity.key, listed, head, refs=refs)
            if info.key not in kept
        ]
        if garbage:
            self.store.delete_many(garbage)
            log.info("%s: deleted %d object(s) no kept checkpoint needs", self.identity, len(garbage))
        return garbage

    def purge(self, lease: Lease) -> int:
        """Delete the identity's state entirely (``on_success="delete"``), fenced like a commit.

        The head goes first, by a conditional delete, so the state disappears atomically for readers; the
        manifests and data follow. A crash in between only leaves unreferenced objects for GC. Returns the
        number of objects deleted.
        """
        for _ in range(10):
            head, etag = self.heads.load()
            check_holder(head, lease, action="delete the state of")
            assert etag is not None
            try:
                self.store.delete(self.heads.key, if_match=etag)
            except PreconditionFailedError:
                continue  # the head changed (a renewal?): decide again on the fresh one
            break
        else:
            raise ConcurrentCommitError(
                f"the head of {self.identity} kept changing while it was being deleted"
            )
        keys = [info.key for info in self.store.list_objects(f"{self.identity.key}/~")]
        self.store.delete_many(keys)
        log.info("deleted the state of %s (%d objects)", self.identity, len(keys) + 1)
        return len(keys) + 1

    # -- reads ---------------------------------------------------------------------------------------------
    def head(self) -> HeadRecord | None:
        return self.heads.load()[0]

    def history(self) -> list[CheckpointEntry]:
        """Committed checkpoints still kept, newest first."""
        head = self.head()
        return list(reversed(head.checkpoints)) if head else []

    def latest(self, head: HeadRecord | None = None) -> Manifest | None:
        """The newest checkpoint, verified, or ``None`` when nothing was committed yet.

        :param head: a head this process just read or wrote (after taking the lease): with an inline manifest
            that costs no request at all.
        """
        for attempt in range(5):
            if head is None or attempt:
                head = self.head()
            if head is None or head.latest is None:
                return None
            try:
                return self._read_manifest(head.latest)
            except ObjectNotFoundError:
                # Pruned between our head read and the manifest read? Re-read the head and try again.
                if self._still_listed(head.latest):
                    raise self._missing(head.latest) from None
        raise CheckpointNotFoundError(f"identity {self.identity} kept changing while it was read; try again.")

    def get(self, seq: int) -> Manifest:
        """A kept checkpoint by number, verified."""
        head = self.head()
        entries = {e.seq: e for e in (head.checkpoints if head else ())}
        if seq not in entries:
            kept = ", ".join(str(s) for s in sorted(entries)) or "none"
            raise CheckpointNotFoundError(f"identity {self.identity} has no checkpoint {seq}; kept: {kept}.")
        try:
            return self._read_manifest(entries[seq])
        except ObjectNotFoundError:
            if self._still_listed(entries[seq]):
                raise self._missing(entries[seq]) from None
            raise CheckpointNotFoundError(
                f"checkpoint {seq} of {self.identity} was pruned while it was read."
            ) from None

    def _still_listed(self, entry: CheckpointEntry) -> bool:
        head = self.head()
        return head is not None and any(e.commit_id == entry.commit_id for e in head.checkpoints)

    def _missing(self, entry: CheckpointEntry) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"checkpoint {entry.seq} of {self.identity} is listed in the head record but its manifest "
            f"{entry.manifest!r} is missing from {self.store.url}. Something deleted it outside this library; "
            "roll back to an older checkpoint with `airflow-stateful rollback`."
        )

    def read_manifest(self, entry: CheckpointEntry) -> Manifest:
        """The manifest of ``entry``, one of the checkpoints of a head record of this identity, verified.

        An inline manifest was verified with the head that carries it; a manifest object must have the size and
        SHA-256 the entry records and name this checkpoint of this identity, else
        :class:`~airflow_stateful.core.errors.CheckpointCorruptError`. A missing object raises the store's
        :class:`~airflow_stateful.core.errors.ObjectNotFoundError` as it is (:meth:`get` and :meth:`latest`
        tell a pruned checkpoint from a lost one).
        """
        return self._read_manifest(entry)

    def _read_manifest(self, entry: CheckpointEntry) -> Manifest:
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

    def files(self, manifest: Manifest) -> list[StoredFileInfo]:
        """The files of a checkpoint, whatever its format: path, size and the objects holding its bytes."""
        tree = self.tree(manifest)
        if tree is not None:
            return [StoredFileInfo(f.path, f.size, tuple(c.key for c in f.chunks)) for f in tree.files]
        return [StoredFileInfo(f.path, f.size, (f.key,)) for f in manifest.files]

    def tree(self, manifest: Manifest) -> Tree | None:
        """The file tree of a format-2 checkpoint, verified against its recorded SHA-256 (``None``: format 1)."""
        return self._tree_of_ref(manifest.tree) if manifest.tree is not None else None

    def _tree_of_ref(self, ref: TreeRef) -> Tree:
        cached = self._trees.get(ref.key)
        if cached is not None:
            return cached
        try:
            blob = self.store.get(ref.key, max_bytes=ref.size)
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
        if len(self._trees) >= _TREE_CACHE:
            self._trees.pop(next(iter(self._trees)))
        self._trees[ref.key] = tree
        return tree

    def restore_files(
        self,
        manifest: Manifest,
        dest: str | Path,
        *,
        mode: str = EXACT,
        cache: ChunkCache | None = None,
    ) -> RestoreResult:
        """Download a checkpoint's files into directory ``dest``, verified, all or nothing; what it did.

        Files land in a staging directory first; only when every file is verified are they moved into
        ``dest``. On any error (or a kill: the next restore undoes it) ``dest`` is left as it was. ``mode``
        says what happens to what ``dest`` already holds (:mod:`airflow_stateful.core.data.restore_modes`):
        ``"exact"`` (default) makes it hold exactly the checkpoint's files, the others moved out within the same
        all-or-nothing swap; ``"merge"`` replaces same-named files and keeps the others; ``"empty"`` refuses a
        ``dest`` that is not missing or empty (DestinationNotEmptyError, before anything is downloaded). A
        checkpoint without files leaves ``dest`` alone. ``cache`` may supply chunks without downloading them
        (verified like downloaded ones).
        """
        return restore_files(self, manifest, dest, mode=mode, cache=cache)

    def verify(self, manifest: Manifest) -> None:
        """Read back every byte of a checkpoint and check every hash (chunks, or format-1 files); raise
        CheckpointCorruptError naming the first bad object. Nothing is kept."""
        with tempfile.TemporaryDirectory(prefix="stateful-verify-") as scratch:
            self.restore_files(manifest, scratch)


def _file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (what ``sha256sum`` prints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()

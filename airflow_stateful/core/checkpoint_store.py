"""CheckpointStore: leases, atomic fenced commits, verified reads and retention for one identity.

The commit protocol (docs/adr/0001-commit-protocol.md), in order:

1. check the writer still holds the lease (fail fast before uploading gigabytes);
2. upload each file to a new immutable object ``<identity>/~data/<commit_id>/<n>`` (create-if-absent),
   hashing it on the way;
3. write the manifest ``<identity>/~manifests/<seq>-<commit_id>.json`` (create-if-absent): value, metadata,
   file list with sizes and SHA-256;
4. compare-and-swap the head record: append the entry (with the manifest's SHA-256), drop entries past
   ``keep_last``, renew the lease, succeeding only while the head carries this writer's epoch and token;
5. delete the objects of the dropped entries.

Until step 4 the new objects are invisible garbage; after it the checkpoint is whole. A crash between any
two steps therefore leaves the previous checkpoint intact and, at worst, unreferenced objects that
:func:`~airflow_stateful.core.gc.collect_garbage` removes later.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from airflow_stateful.core import config, events
from airflow_stateful.core.codecs import JSON, encode_value, encoded_form
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConcurrentCommitError,
    FencedError,
    InvalidValueError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from airflow_stateful.core.files import LocalFile, check_restore_targets, collect_files, safe_relative
from airflow_stateful.core.head import HeadStore
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.lease import (
    Lease,
    acquire_decision,
    break_decision,
    check_holder,
    lease_of,
    renewed,
)
from airflow_stateful.core.progress import TransferProgress, human_bytes
from airflow_stateful.core.records import (
    DATA_DIR,
    MANIFEST_DIR,
    CheckpointEntry,
    FileEntry,
    HeadRecord,
    Manifest,
    WriterInfo,
    data_commit_of,
    manifest_key,
    sha256_hex,
    utcnow_iso,
)
from airflow_stateful.core.retention import KeepLast, RetentionPolicy
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.version import __version__

log = logging.getLogger("airflow_stateful")

DEFAULT_LEASE_TTL = float(config.LEASE_TTL)
DEFAULT_KEEP_LAST = config.KEEP_LAST
_PROGRESS_MIN_BYTES = 64 * 1024 * 1024
_DELETE_BATCH = 16


class CheckpointStore:
    """Checkpoints of one identity in one object store.

    :param store: where the objects live.
    :param identity: whose checkpoints these are.
    :param keep_last: how many committed checkpoints to keep (or pass ``retention``).
    :param lease_ttl: seconds a lease lives without a commit or renewal.
    :param clock: seconds since the epoch; injectable for tests of expiry.
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
        self._pending_deletes: list[CheckpointEntry] = []

    def __repr__(self) -> str:
        return f"CheckpointStore(identity={self.identity.key!r}, store={self.store!r})"

    # -- leases --------------------------------------------------------------------------------------------
    def acquire(self, *, holder: WriterInfo | None = None, steal: bool = False, grace: float = 0.0) -> Lease:
        """Take the lease, raising the epoch so every earlier writer is fenced.

        :param steal: take it even from a live holder (an Airflow retry knows its earlier try is over).
        :param grace: without ``steal``, also respect a lease expired less than this long ago (maintenance
            passes the lease grace, so it never takes over a lease whose holder may still be renewing it).
        """
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

    def release(self, lease: Lease) -> bool:
        """Give the lease up (the epoch stays). Returns False, without error, if it was already taken over."""
        try:
            self.heads.update(
                lambda h: check_holder(h, lease, action="release").evolve(lease=None), fresh=False
            )
        except FencedError:
            return False
        finally:
            self.flush_deletes()
        return True

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
        exclude: Collection[str] = (),
        follow_symlinks: bool = False,
        encoded: bool = False,
        check: Callable[[], None] | None = None,
    ) -> Manifest:
        """Make ``value`` (and the files below ``files``) the identity's newest checkpoint, atomically.

        Everything the caller passed is checked before the first byte is written. Raises FencedError if the
        lease was taken over; in that case nothing this writer uploaded becomes visible.

        :param keep_files_from: with ``files=None``, the new checkpoint keeps this earlier checkpoint's
            files (by reference, nothing is copied); retention keeps their data while any kept checkpoint
            refers to it.
        :param exclude: relative paths below ``files`` not to checkpoint.
        :param follow_symlinks: save what links inside ``files`` point to (never outside it); default: refuse
            links, naming them.
        :param encoded: ``value`` is already in its stored form (a manifest's ``value``, as ``value_codec``
            wrote it): it is copied as it is, never decoded (a rollback must not unpickle anything).
        :param check: called before each upload and before the manifest is written; raising there aborts the
            commit with nothing made visible (a :class:`WriterSession` stops a writer that lost its lease).
        """
        if lease.identity != self.identity:
            raise ValueError(f"lease is for {lease.identity}, not {self.identity}")
        if isinstance(schema_version, bool) or not isinstance(schema_version, int) or schema_version < 1:
            raise InvalidValueError(f"schema_version must be an integer >= 1, not {schema_version!r}")
        stored_value = encoded_form(value, value_codec) if encoded else encode_value(value, value_codec)
        if extra is not None:
            encode_value(extra, JSON)
        local_files = collect_files(files, exclude=exclude, follow_symlinks=follow_symlinks)
        if keep_files_from is not None and keep_files_from.identity != self.identity.key:
            raise ValueError(
                f"keep_files_from is a checkpoint of {keep_files_from.identity}, not {self.identity}"
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
        started = time.monotonic()
        seq = head.next_seq
        commit_id = uuid.uuid4().hex
        if files is None and keep_files_from is not None:
            entries = list(keep_files_from.files)
        else:
            entries = self._upload(local_files, commit_id, check)

        manifest = Manifest(
            identity=self.identity.key,
            seq=seq,
            commit_id=commit_id,
            epoch=lease.epoch,
            schema_version=schema_version,
            created_at=utcnow_iso(self.clock()),
            writer=writer or lease.holder,
            value=stored_value,
            value_codec=value_codec,
            files=tuple(entries),
            library_version=__version__,
            extra=dict(extra or {}),
        )
        body = manifest.to_bytes()
        if check is not None:
            check()
        key = manifest_key(self.identity.key, seq, commit_id)
        self.store.put(key, body, if_none_match=True)
        entry = CheckpointEntry(
            seq=seq,
            commit_id=commit_id,
            manifest=key,
            manifest_sha256=sha256_hex(body),
            manifest_size=len(body),
            created_at=manifest.created_at,
            schema_version=schema_version,
            epoch=lease.epoch,
            total_size=manifest.total_size,
            file_count=len(entries),
            data_refs=tuple(sorted({data_commit_of(f.key) for f in entries})),
        )
        dropped: list[CheckpointEntry] = []
        kept: list[CheckpointEntry] = []

        def decide(current: HeadRecord | None) -> HeadRecord:
            current = check_holder(current, lease, action="commit to")
            if any(e.commit_id == commit_id for e in current.checkpoints):
                return current  # our write landed; its answer was lost and a retry saw 412
            if current.next_seq != seq:
                raise ConcurrentCommitError(
                    f"identity {self.identity} advanced to seq {current.next_seq - 1} while this commit "
                    f"(seq {seq}) was in flight with the same lease; commit from one thread at a time."
                )
            keep, drop = self.retention.split([*current.checkpoints, entry])
            dropped[:], kept[:] = drop, keep
            return renewed(
                current.evolve(next_seq=seq + 1, checkpoints=tuple(keep)),
                now=self.clock(),
                ttl=self.lease_ttl,
            )

        try:
            self.heads.update(decide, fresh=False)
        except FencedError:
            events.emit(events.FENCED, identity=self.identity.key, epoch=lease.epoch, action="commit")
            raise
        events.emit(
            events.COMMIT,
            identity=self.identity.key,
            seq=seq,
            bytes=manifest.total_size,
            files=len(entries),
            duration=time.monotonic() - started,
        )
        log.info(
            "committed checkpoint %d of %s (%d file(s), %s, schema %d)",
            seq,
            self.identity,
            len(entries),
            human_bytes(manifest.total_size),
            schema_version,
        )
        self._pending_deletes.extend(dropped)
        if any(e.data_refs for e in dropped) or len(self._pending_deletes) >= _DELETE_BATCH:
            self.flush_deletes(kept)
        return manifest

    def _upload(
        self, local_files: list[LocalFile], commit_id: str, check: Callable[[], None] | None
    ) -> list[FileEntry]:
        total = sum(f.size for f in local_files)
        progress = None
        if total >= _PROGRESS_MIN_BYTES:
            progress = TransferProgress(
                label=f"uploading {len(local_files)} file(s) for {self.identity}",
                total_bytes=total,
                logger=log,
            )
        entries = []
        for index, local in enumerate(local_files):
            if check is not None:
                check()
            key = f"{self.identity.key}/{DATA_DIR}/{commit_id}/{index}"
            try:
                stored = self.store.upload_file(key, local.path, progress=progress)
            except FileNotFoundError:
                raise InvalidValueError(
                    f"file {local.rel!r} disappeared while the checkpoint was being saved; nothing was committed "
                    "(the previous checkpoint is intact). Do not change the directory while it is saved."
                ) from None
            entries.append(FileEntry(path=local.rel, key=key, size=stored.size, sha256=stored.sha256))
        if progress:
            progress.finish()
        return entries

    def flush_deletes(self, kept: list[CheckpointEntry] | None = None) -> None:
        """Remove the objects of checkpoints the head no longer lists.

        Value-only checkpoints are deleted in batches (one request per ``_DELETE_BATCH`` commits) so a
        small commit costs two requests; checkpoints with files are deleted at once to free space. A
        failure or a crash only leaves unreferenced garbage that :func:`collect_garbage` removes.
        """
        entries, self._pending_deletes = self._pending_deletes, []
        if not entries:
            return
        if kept is None:
            # A fresh read, never a cached copy: a newer kept checkpoint may share data with the dropped ones.
            head = self.heads.load()[0]
            kept = list(head.checkpoints) if head else []
        protected = {ref for e in kept for ref in e.data_refs}
        try:
            keys = [e.manifest for e in entries]
            for ref in sorted({ref for e in entries for ref in e.data_refs} - protected):
                keys.extend(
                    info.key for info in self.store.list_objects(f"{self.identity.key}/{DATA_DIR}/{ref}/")
                )
            self.store.delete_many(keys)
        except Exception as exc:
            log.warning(
                "could not delete %d old checkpoint(s) of %s (%s); `airflow-stateful gc` will remove them",
                len(entries),
                self.identity,
                exc,
            )

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
        self._pending_deletes = []
        keys = [
            info.key
            for folder in (MANIFEST_DIR, DATA_DIR)
            for info in self.store.list_objects(f"{self.identity.key}/{folder}/")
        ]
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

    def latest(self) -> Manifest | None:
        """The newest checkpoint, verified, or ``None`` when nothing was committed yet."""
        for _ in range(5):
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
        return head is not None and any(e.manifest == entry.manifest for e in head.checkpoints)

    def _missing(self, entry: CheckpointEntry) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"checkpoint {entry.seq} of {self.identity} is listed in the head record but its manifest "
            f"{entry.manifest!r} is missing from {self.store.url}. Something deleted it outside this library; "
            "roll back to an older checkpoint with `airflow-stateful rollback`."
        )

    def _read_manifest(self, entry: CheckpointEntry) -> Manifest:
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

    def restore_files(self, manifest: Manifest, dest: str | Path) -> list[Path]:
        """Download a checkpoint's files into directory ``dest``, verified, all or nothing.

        Files land in a staging directory first; only when every file is verified are they moved into
        ``dest`` (existing files of the same name are replaced). On any error ``dest`` is left as it was.
        """
        started = time.monotonic()
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        staging = dest / f".stateful-restore-{uuid.uuid4().hex[:12]}"
        total = sum(f.size for f in manifest.files)
        progress = None
        if total >= _PROGRESS_MIN_BYTES:
            progress = TransferProgress(
                label=f"restoring {len(manifest.files)} file(s) of {self.identity}",
                total_bytes=total,
                logger=log,
            )
        where = manifest_key(self.identity.key, manifest.seq, manifest.commit_id)
        try:
            rels = [safe_relative(f.path, manifest_key=where) for f in manifest.files]
            check_restore_targets(dest, rels)
            for rel, entry in zip(rels, manifest.files, strict=True):
                try:
                    self.store.download_file(
                        entry.key, staging / rel, size=entry.size, sha256=entry.sha256, progress=progress
                    )
                except ObjectNotFoundError as exc:
                    raise CheckpointCorruptError(
                        f"file {entry.path!r} of checkpoint {manifest.seq} of {self.identity} is missing: {exc}. "
                        "Nothing was restored."
                    ) from exc
            restored = []
            for rel in rels:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                (staging / rel).replace(target)
                restored.append(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if progress:
            progress.finish()
        events.emit(
            events.RESTORE,
            identity=self.identity.key,
            seq=manifest.seq,
            bytes=total,
            files=len(restored),
            duration=time.monotonic() - started,
        )
        return restored

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

import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from airflow_stateful.core import events
from airflow_stateful.core.collector import paused_collector
from airflow_stateful.core.data.files import collect_files
from airflow_stateful.core.errors import (
    CheckpointNotFoundError,
    ConcurrentCommitError,
    FencedError,
    InvalidValueError,
    PreconditionFailedError,
    StatefulError,
)
from airflow_stateful.core.protocol.commit_point import (
    advance_head,
    announce,
    entry_for,
)
from airflow_stateful.core.protocol.lease import (
    Lease,
    acquire_decision,
    break_decision,
    check_holder,
    lease_of,
    renewed,
)
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.protocol.prefetch import SavePrefetch
from airflow_stateful.core.protocol.reader import CheckpointReader
from airflow_stateful.core.protocol.retention import KeepLast, RetentionPolicy, references, unreferenced
from airflow_stateful.core.records.code_identity import CodeIdentity
from airflow_stateful.core.records.codecs import JSON, encode_value, encoded_form
from airflow_stateful.core.records.formats import MAX_EXPECTED_INTERVAL, MAX_PINS
from airflow_stateful.core.records.heads import HeadRecord, PinRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.lineage import CopyOf
from airflow_stateful.core.records.manifests import Manifest, manifest_format
from airflow_stateful.core.records.outcomes import TryOutcome
from airflow_stateful.core.records.outputs import (
    StagedOutput,
)
from airflow_stateful.core.records.trees import ChunkRef, TreeRef
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.settings import KEEP_LAST, LEASE_TTL
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import utcnow_iso
from airflow_stateful.version import __version__

log = logging.getLogger("airflow_stateful")

DEFAULT_LEASE_TTL = float(LEASE_TTL)
DEFAULT_KEEP_LAST = KEEP_LAST


class CheckpointStore(CheckpointReader):
    """Checkpoints of one identity in one object store: the reads of :class:`CheckpointReader`, and the only
    way to change them (leases, the fenced commit, pins, clean-up).

    :param store: where the objects live.
    :param identity: whose checkpoints these are.
    :param signer: the deployment's head signing policy (``None``: no signing).
    :param marks: where the identity's high-water mark is kept (``None``: not checked; see
        :mod:`~airflow_stateful.core.protocol.marks`).
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
        signer: HeadSigner | None = None,
        marks: MarkStore | None = None,
        keep_last: int = DEFAULT_KEEP_LAST,
        retention: RetentionPolicy | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        clock: Callable[[], float] = time.time,
        parallelism: int | None = None,
    ) -> None:
        super().__init__(
            store=store, identity=identity, signer=signer, marks=marks, clock=clock, parallelism=parallelism
        )
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be a positive number of seconds, not {lease_ttl!r}")
        self.retention: RetentionPolicy = retention or KeepLast(keep_last)
        self.lease_ttl = float(lease_ttl)
        #: Checkpoints with objects of their own that retention dropped since the last :meth:`sweep`.
        self.cleanup_due = 0

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
                epoch_floor=self.heads.epoch_floor() if h is None else 0,
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
        copy_of: CopyOf | None = None,
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
        :param copy_of: the earlier checkpoint this one copies (a rollback, :mod:`.rollback`), recorded in the
            manifest so that the copy says where its state came from after retention drops the original.
        """
        stored_value = self._checked_value(lease, value, schema_version, extra, value_codec, encoded)
        for earlier in (keep_files_from, previous):
            if earlier is not None and earlier.identity != self.identity.key:
                raise ValueError(
                    f"{earlier.identity} is not {self.identity}: a checkpoint of another identity"
                )
        # The head and the tree to deduplicate against are read while the files are listed (prefetch.py).
        ahead = SavePrefetch(
            heads=self.heads, content=self.content, previous=previous, enabled=files is not None
        )
        with ahead, paused_collector():  # a record per file, none in a cycle (collector.py)
            local_files = collect_files(files, exclude=exclude, follow_symlinks=follow_symlinks)
        loaded, read_head, latest = ahead.result()
        head = self._holder_head(lease, fresh=bool(local_files), read=(read_head,) if loaded else None)
        outputs_base = self._outputs_base(head, keep_files_from, previous, latest)
        if (
            local_files
            and previous is not None
            and all(e.commit_id != previous.commit_id for e in head.checkpoints)
        ):
            # Retention (or a commit whose answer was lost) dropped it: its chunks may be collected any time,
            # so they must not be assumed present. Deduplicate against what the head keeps instead.
            previous = None
        if local_files and previous is None and keep_files_from is None:
            previous = self._dedup_base(head, latest)
        started = time.monotonic()
        seq, commit_id = head.next_seq, uuid.uuid4().hex
        tree_ref: TreeRef | None = None
        if files is None and keep_files_from is not None:
            tree_ref = keep_files_from.tree
        elif local_files:
            tree_ref = self.content.upload_tree(local_files, commit_id, previous or keep_files_from, check)
        created_at = utcnow_iso(self.clock())
        writer = writer or lease.holder
        outputs_tree, output_records = self.content.outputs_tree(
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
            library_version=__version__,
            extra=dict(extra or {}),
            tree=tree_ref,
            outputs=output_records,
            outputs_tree=outputs_tree,
            format=manifest_format(tree_ref, outputs_tree),
            code=code,
            copy_of=copy_of,
        )
        if check is not None:
            check()
        entry = entry_for(self, manifest, head)
        self.cleanup_due += advance_head(self, lease, manifest, entry, unpin=unpin)
        announce(self.identity, manifest, outputs or {}, started)
        return manifest

    def _checked_value(
        self, lease: Lease, value: Any, schema_version: int, extra: Any, value_codec: str, encoded: bool
    ) -> Any:
        """The value in its stored form, once the lease's identity, the schema version and ``extra`` are valid."""
        if lease.identity != self.identity:
            raise ValueError(f"lease is for {lease.identity}, not {self.identity}")
        if isinstance(schema_version, bool) or not isinstance(schema_version, int) or schema_version < 1:
            raise InvalidValueError(f"schema_version must be an integer >= 1, not {schema_version!r}")
        stored = encoded_form(value, value_codec) if encoded else encode_value(value, value_codec)
        if extra is not None:
            encode_value(extra, JSON)
        return stored

    def _holder_head(
        self, lease: Lease, *, fresh: bool, read: tuple[HeadRecord | None] | None = None
    ) -> HeadRecord:
        """The head, checked to be ``lease``'s, before anything is uploaded: a fenced zombie must not push
        gigabytes first. A value-only commit (``fresh=False``) trusts the head this process last saw (the CAS
        re-checks it anyway); ``read``: the head as this commit read it already; a refusal re-reads it to name the
        current holder."""
        try:
            if read is not None:
                return check_holder(read[0], lease, action="commit to")
            return check_holder(
                self.heads.load()[0] if fresh else self.heads.cached(), lease, action="commit to"
            )
        except FencedError:
            try:
                return check_holder(self.heads.load()[0], lease, action="commit to")
            except FencedError:
                events.emit(events.FENCED, identity=self.identity.key, epoch=lease.epoch, action="commit")
                raise

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

        def holder() -> None:
            check_holder(self.heads.load()[0], lease, action="publish to")

        return self.content.stage_output(
            name, path, known=known, follow_symlinks=follow_symlinks, check=check, before_upload=holder
        )

    def _outputs_base(self, head: HeadRecord, *known: Manifest | None) -> Manifest | None:
        """The newest checkpoint's manifest, whose outputs a commit carries over; ``None`` if it has none.

        Usually one of ``known`` (the writer's newest checkpoint): no request. Otherwise it is read."""
        newest = head.latest
        if newest is None or newest.outputs_tree is None:
            return None
        for manifest in known:
            if manifest is not None and manifest.commit_id == newest.commit_id:
                return manifest
        return self.content.read_manifest(newest)

    def _dedup_base(self, head: HeadRecord, read: Manifest | None = None) -> Manifest | None:
        """The newest checkpoint, whose chunks a commit that was not told its ``previous`` need not upload
        (``read``: its manifest if this commit read it already).

        Best effort: a checkpoint that cannot be read (or has no readable tree) only means every chunk is
        uploaded again, never a failed commit.
        """
        if head.latest is None:
            return None
        try:
            if read is not None and read.commit_id == head.latest.commit_id:
                manifest = read
            else:
                manifest = self.content.read_manifest(head.latest)
            self.content.tree(manifest)
        except StatefulError as exc:
            log.warning(
                "%s: not deduplicating against checkpoint %d: %s", self.identity, head.latest.seq, exc
            )
            return None
        return manifest

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
        refs = references(head, trees=self.content.tree_of)
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

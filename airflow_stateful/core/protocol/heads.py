"""Reading and advancing an identity's head record.

All state changes of an identity (taking, renewing, releasing or breaking a lease; committing a checkpoint;
retention) go through :meth:`HeadStore.update`, a compare-and-swap (:mod:`airflow_stateful.core.protocol.cas`): a pure
function decides the new head from the current one, and a lost race decides again on the fresh head.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from airflow_stateful.core.errors import ObjectNotFoundError
from airflow_stateful.core.protocol.cas import DEFAULT_BACKOFF, Backoff, compare_and_swap
from airflow_stateful.core.protocol.marks import HighWaterMark, MarkStore, check_mark
from airflow_stateful.core.records.formats import HEAD_NAME, MAX_HEAD_BYTES
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import utcnow_iso


class HeadStore:
    """The head record of one identity in one object store.

    Safe to share between the threads of one writer (a task and its lease heartbeat): updates from one
    process are serialised by a lock, so they never race each other for the ETag.

    :param signer: signs every head this writes and verifies every head this reads (``None``: no signing).
        It belongs to the protocol, not to the byte store: whoever opens the store from configuration passes
        the deployment's signer to every reader and writer it builds, so they all apply the same policy.
    :param marks: where the identity's high-water mark is kept (:mod:`~airflow_stateful.core.protocol.marks`):
        every head read is checked against it, and every write that moves the head on raises it. ``None``: not
        checked (a reader that cannot reach the marks).
    """

    def __init__(
        self,
        *,
        store: ObjectStore,
        identity: Identity,
        signer: HeadSigner | None = None,
        marks: MarkStore | None = None,
        clock: Callable[[], float] = time.time,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.store = store
        # Every identity's heads are signed with a key of its own, derived from the deployment's.
        self.signer = signer.for_identity(identity.key) if signer is not None else None
        self.marks = marks
        self.identity = identity
        self.clock = clock
        self.backoff = backoff
        self.key = f"{identity.key}/{HEAD_NAME}"
        self._cached: tuple[HeadRecord, str] | None = None
        #: The size of the stored form of ``_cached``'s head (what :meth:`stored_size` answers without encoding).
        self._cached_size = 0
        self._mark_seen: HighWaterMark | None = None
        self._lock = threading.RLock()

    def _read(self, data: bytes) -> HeadRecord:
        return HeadRecord.from_bytes(data, key=self.key, signer=self.signer)

    def _encode(self, head: HeadRecord) -> bytes:
        return head.to_bytes(self.signer)

    def load(self) -> tuple[HeadRecord | None, str | None]:
        """The current head and its ETag, or ``(None, None)`` when the identity has never been used."""
        with self._lock:
            try:
                blob = self.store.get(self.key, max_bytes=MAX_HEAD_BYTES)
            except ObjectNotFoundError:
                self._cached = None
                return None, None
            head = self._read(blob.data)
            self._check_mark(head)
            self._cached, self._cached_size = (head, blob.etag), len(blob.data)
            return head, blob.etag

    def cached(self) -> HeadRecord | None:
        """The head as this process last read or wrote it (maybe stale), or a fresh read if there is none."""
        cached = self._cached
        if cached is None:
            return self.load()[0]
        return cached[0]

    def stored_size(self, head: HeadRecord) -> int:
        """The size of ``head``'s stored form: known without encoding it again when it is the head this process
        last read or wrote (a commit asks, to decide whether its manifest fits inline)."""
        cached = self._cached
        if cached is not None and cached[0] is head:
            return self._cached_size
        return len(self._encode(head))

    def update(self, decide: Callable[[HeadRecord | None], HeadRecord], *, fresh: bool = True) -> HeadRecord:
        """Apply ``decide`` to the current head and store the result atomically.

        ``decide`` may raise to abort (nothing is written), or return ``current`` itself to say the change is
        already there (nothing is written; e.g. an earlier attempt's write landed but its answer was lost).
        With ``fresh=False`` the first attempt starts from the head this process last saw, saving a request;
        a refusal on that copy is re-judged on a fresh read. Decisions that can *refuse* on old data (taking
        a lease) should still use ``fresh=True`` so the common case does not pay for a wasted write.
        """

        def stamped(current: HeadRecord | None) -> HeadRecord | None:
            # Every decision, also one on this process's cached head: a head written back byte for byte has
            # the ETag this process last saw, so only the mark tells it from the newest.
            if current is not None:
                self._check_mark(current)
            decided = decide(current)
            if decided is current:
                return current
            return decided.evolve(updated_at=utcnow_iso(self.clock()))

        # The size of every head read or encoded here, so the one stored afterwards is known without encoding it
        # again (:meth:`stored_size`).
        sizes: list[tuple[HeadRecord, int]] = []

        def read(data: bytes) -> HeadRecord:
            head = self._read(data)
            sizes.append((head, len(data)))
            return head

        def encode(head: HeadRecord) -> bytes:
            data = self._encode(head)
            sizes.append((head, len(data)))
            return data

        with self._lock:
            start = self._cached if not fresh and self._cached is not None else None
            if start is not None:
                sizes.append((start[0], self._cached_size))
            try:
                head, etag = compare_and_swap(
                    self.store,
                    self.key,
                    stamped,
                    read=read,
                    encode=encode,
                    start=start,
                    backoff=self.backoff,
                    what="head record",
                    max_bytes=MAX_HEAD_BYTES,
                )
            except BaseException:
                self._cached = None
                raise
            if head is None or etag is None:
                # ``decide`` accepted a missing head as it is (it never does today); nothing to cache.
                self._cached = None
                raise ObjectNotFoundError(f"identity {self.identity} has no head record in {self.store.url}")
            self._cached = (head, etag)
            known = [size for seen, size in sizes if seen is head]
            self._cached_size = known[-1] if known else len(self._encode(head))
            self._raise_mark(head)
            return head

    # -- high-water marks -------------------------------------------------------------------------------------
    def _check_mark(self, head: HeadRecord) -> None:
        if self.marks is not None:
            self._mark_seen = self.marks.get(self.identity)
            check_mark(head, self._mark_seen, identity=self.identity, where=self.marks.where)

    def _raise_mark(self, head: HeadRecord) -> None:
        """Record ``head``'s position if it is past the mark (a renewal or a release moves nothing)."""
        if self.marks is None:
            return
        new = HighWaterMark.of(head)
        # The mark read when this write was decided (one request less per commit). Without a compare-and-swap
        # on the marks, a writer slow between its head write and its mark write can lower a mark another writer
        # raised meanwhile, to its own (older) position: the window is that one request.
        seen = self._mark_seen
        if seen is None or new.position > seen.position:
            self.marks.put(self.identity, new)
            self._mark_seen = new

    def epoch_floor(self) -> int:
        """The epoch a head started from nothing must exceed: the mark's, if the identity had one (its head was
        deleted, by GC or otherwise), so the marks only ever rise."""
        mark = self.marks.get(self.identity) if self.marks is not None else None
        self._mark_seen = mark
        return mark.epoch if mark is not None else 0

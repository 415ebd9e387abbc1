"""Reading and advancing an identity's head record with compare-and-swap.

All state changes of an identity (taking, renewing, releasing or breaking a lease; committing a checkpoint)
go through :meth:`HeadStore.update`, which reads the head and its ETag, lets a pure function compute the
new head, and writes it back only if nobody changed it in between. A lost race re-reads and re-decides, so
the decision (for example "is this writer still the lease holder?") is always made on the current head.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from airflow_stateful.core.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    StatefulError,
    StoreError,
)
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.records import HEAD_NAME, HeadRecord, utcnow_iso
from airflow_stateful.core.stores.base import ObjectStore

log = logging.getLogger(__name__)

MAX_CAS_ATTEMPTS = 20


class HeadStore:
    """The head record of one identity in one object store."""

    def __init__(
        self, *, store: ObjectStore, identity: Identity, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.identity = identity
        self.clock = clock
        self.key = f"{identity.key}/{HEAD_NAME}"
        self._cached: tuple[HeadRecord, str] | None = None

    def load(self) -> tuple[HeadRecord | None, str | None]:
        """The current head and its ETag, or ``(None, None)`` when the identity has never been used."""
        try:
            blob = self.store.get(self.key)
        except ObjectNotFoundError:
            self._cached = None
            return None, None
        head = HeadRecord.from_bytes(blob.data, key=self.key)
        self._cached = (head, blob.etag)
        return head, blob.etag

    def cached(self) -> HeadRecord | None:
        """The head as this process last read or wrote it (maybe stale), or a fresh read if there is none."""
        if self._cached is None:
            return self.load()[0]
        return self._cached[0]

    def update(self, decide: Callable[[HeadRecord | None], HeadRecord], *, fresh: bool = True) -> HeadRecord:
        """Apply ``decide`` to the current head and store the result atomically.

        ``decide`` may raise to abort (nothing is written), or return ``current`` itself to say the change is
        already there (nothing is written). It is called again with the fresh head each time another writer
        changed it first. With ``fresh=False`` the first attempt starts from the head
        this process last saw, saving a request; that is safe because the write is conditional on the
        ETag, so a stale guess only costs one failed attempt. Decisions that can *refuse* on old data
        (taking a lease) must use ``fresh=True``.
        """
        for attempt in range(MAX_CAS_ATTEMPTS):
            current: HeadRecord | None
            etag: str | None
            from_cache = attempt == 0 and not fresh and self._cached is not None
            if from_cache:
                assert self._cached is not None
                current, etag = self._cached
            else:
                current, etag = self.load()
            try:
                decided = decide(current)
            except StatefulError:
                if not from_cache:
                    raise
                # A refusal must be judged on the current head, not on our possibly stale copy (its
                # message names the epoch and holder): read it and decide again.
                self._cached = None
                continue
            if current is not None and decided is current:
                # Already applied: an earlier attempt's write landed but its answer was lost (a retried
                # request then sees 412). ``decide`` recognised its own change in the head.
                return current
            new = decided.evolve(updated_at=utcnow_iso(self.clock()))
            body = new.to_bytes()
            try:
                if etag is None:
                    new_etag = self.store.put(self.key, body, if_none_match=True)
                else:
                    new_etag = self.store.put(self.key, body, if_match=etag)
            except PreconditionFailedError:
                log.debug("head %s changed under us (attempt %d); re-reading", self.key, attempt + 1)
                self._cached = None
                if attempt:
                    time.sleep(random.uniform(0, 0.01 * attempt))
                continue
            self._cached = (new, new_etag)
            return new
        raise StoreError(
            f"head record {self.key!r} in {self.store.url} kept changing for {MAX_CAS_ATTEMPTS} attempts; "
            "too many writers are contending for this identity."
        )

"""Compare-and-swap on one small object: the only way this library changes an object in place.

Every mutable object (an identity's head record, a task state document) is changed the same way: read it
with its ETag, let a pure function decide the new content, write it back only if the ETag is unchanged
(create-if-absent when there was nothing), and on a lost race read again and decide again. So a decision
("is this writer still the lease holder?", "has this value expired?") is always made on the current
content, never on a copy another writer has replaced meanwhile.

Lost races back off with bounded, jittered delays ("full jitter": a random wait between 0 and an
exponentially growing cap) so writers that keep colliding spread out instead of retrying in lock-step.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from airflow_stateful.core.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    StatefulError,
    StoreError,
)
from airflow_stateful.core.stores.base import ObjectStore

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """How often, and how patiently, a compare-and-swap retries after losing a race.

    :param attempts: writes tried before giving up (at least 1).
    :param base: cap of the first delay, in seconds; each later cap doubles, up to ``cap``.
    :param cap: the longest single delay, in seconds.
    """

    attempts: int = 40
    base: float = 0.005
    cap: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")
        if self.base < 0 or self.cap < self.base:
            raise ValueError(f"need 0 <= base <= cap, not base={self.base} cap={self.cap}")

    def delays(self) -> Iterator[float]:
        """The wait before each retry: uniform in ``[0, min(cap, base * 2**n)]``."""
        for n in range(self.attempts - 1):
            yield random.uniform(0, min(self.cap, self.base * (2**n)))


DEFAULT_BACKOFF = Backoff()
"""Worst case about 15 s of waiting over 40 attempts; a handful of contenders need two or three."""


def compare_and_swap(
    store: ObjectStore,
    key: str,
    decide: Callable[[T | None], T | None],
    *,
    read: Callable[[bytes], T | None],
    encode: Callable[[Any], bytes],
    start: tuple[T | None, str | None] | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
    what: str = "object",
    max_bytes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[T | None, str | None]:
    """Apply ``decide`` to the current content of ``key`` and store the result atomically.

    :param decide: given the current content (``None`` when the object does not exist), returns the content to
        store, or ``current`` itself to store nothing (the change is already there, or there is nothing to
        do). It may raise to abort; nothing is written then. It is called again with fresh content whenever
        another writer changed the object first, so it must be a pure function of its argument.
    :param read: parses the stored bytes. It may return ``None`` to treat a damaged object as absent; the
        replacement is still conditional on that object's ETag.
    :param encode: serialises a decided content.
    :param start: ``(content, etag)`` this process read earlier, tried first to save a request. Safe because
        the write is conditional: a stale guess costs one lost attempt. A refusal (``decide`` raising a
        :class:`StatefulError`) on this guess is re-judged on a fresh read, so an error never describes
        out-of-date content.
    :param max_bytes: the most a stored record of this kind may hold; a larger one is refused unread.
    :returns: ``(content, etag)`` as stored afterwards (the decided content, or the unchanged current one).
    :raises StoreError: when other writers kept winning for ``backoff.attempts`` attempts.
    """
    delays = backoff.delays()
    guess = start
    for attempt in range(1, backoff.attempts + 1):
        from_guess = guess is not None
        if guess is not None:
            current, etag = guess
            guess = None
        else:
            try:
                blob = store.get(key, max_bytes=max_bytes)
            except ObjectNotFoundError:
                current, etag = None, None
            else:
                current, etag = read(blob.data), blob.etag
        try:
            decided = decide(current)
        except StatefulError:
            if not from_guess:
                raise
            continue  # judge the refusal again on the current content
        if decided is current:
            return current, etag
        assert decided is not None
        body = encode(decided)
        try:
            if etag is None:
                new_etag = store.put(key, body, if_none_match=True)
            else:
                new_etag = store.put(key, body, if_match=etag)
        except PreconditionFailedError:
            log.debug("%s %s changed under us (attempt %d); deciding again", what, key, attempt)
            if not from_guess:
                sleep(next(delays, 0.0))
            continue
        return decided, new_etag
    raise StoreError(
        f"{what} {key!r} in {store.url} kept changing for {backoff.attempts} attempts; too many writers are "
        "contending for it. Nothing was changed; try again."
    )

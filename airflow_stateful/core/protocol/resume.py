"""Where a ``resume()`` loop starts again, and how it tells that its iterable changed under its cursor.

A retry must skip exactly the items earlier tries finished. Two ways to find them, chosen by the loop:

* **By position** (no ``key=``): skip the first ``position`` items. Right only if the iterable yields the same
  items in the same order. To catch the common ways that breaks silently (rows inserted, deleted or sorted
  differently), the cursor records a **fingerprint**: a SHA-256 over the first :data:`FINGERPRINT_ITEMS`
  finished items (fewer if fewer were finished). A resume recomputes it over the new iterable's first items,
  which it skips anyway (a fingerprint never covers more than the position), so nothing is read ahead. A
  mismatch refuses the resume (``on_change="fail"``: :class:`CursorMismatchError`) or logs one WARNING and
  resumes at the position anyway (``on_change="warn"``).
* **By key** (``key=lambda row: row["id"]``): the cursor records the last finished item's key; a resume
  consumes items (without yielding them) up to and including the one with that key and goes on after it. Items
  may be removed, and items after the last key may change or be added, without skipping or redoing anything.
  What it assumes: **the items before the last key are finished**. That holds when the order is stable up to
  it (sort by a key that grows; new items come last). Two cases break it, and neither is skipped silently:

  - the key is not in the iterable any more: refused (``"fail"``), or one WARNING and the loop starts again at
    the first item (``"warn"``): that redoes work, while skipping could lose it;
  - more items come before the key than the loop had finished (something was inserted before it, or the order
    changed): at least that many of them were never finished. Refused (``"fail"``), or one WARNING and the
    loop goes on after the key, taking them as done (``"warn"``).

  Keys should be unique. A resume stops at the first item with the last key, so a duplicate earlier in the
  iterable makes it redo the items between the two (never skip them); a duplicate cannot be told from the real
  one in general. The fingerprint (over the first keys) then only informs: a change logs an INFO line.

Items whose encoding is not stable across processes cannot be fingerprinted: anything whose ``repr`` shows a
memory address (``<Row object at 0x...>``) and sets (their order follows the hash seed). Then no fingerprint
is stored and an INFO line says so: pass ``key=`` to resume such items safely.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from airflow_stateful.core.errors import CursorMismatchError
from airflow_stateful.core.records.cursors import Cursor, Fingerprint, ItemKey, check_item_key, shown_key

log = logging.getLogger("airflow_stateful")

T = TypeVar("T")

ON_CHANGE = ("fail", "warn")
FINGERPRINT_ITEMS = 8
"""Items (or keys) a new cursor's fingerprint covers: enough to see a reorder or an insert at the front."""
_DOMAIN = b"airflow-stateful cursor fingerprint 1\n"


def item_digest(item: Any) -> bytes | None:
    """SHA-256 of ``item``'s canonical encoding; None when no encoding of it is stable across processes.

    JSON-able items (str, int, float, bool, None, lists/tuples and str-keyed dicts of those) are encoded as
    canonical JSON (sorted keys); anything else as its type's name and its ``repr``, unless that ``repr`` holds
    a memory address or the item is a set.
    """
    try:
        text = "j" + json.dumps(item, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        if isinstance(item, (set, frozenset)):
            return None
        try:
            shown = repr(item)
        except Exception:
            return None
        if " at 0x" in shown:
            return None
        kind = type(item)
        text = f"r{kind.__module__}.{kind.__qualname__}:{shown}"
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).digest()


def fingerprint_of(digests: list[bytes | None], items: int) -> Fingerprint | None:
    """The fingerprint of the first ``items`` digests; None when one of them could not be encoded."""
    head = digests[:items]
    if not head or any(d is None for d in head):
        return None
    sha = hashlib.sha256(_DOMAIN + b"".join(d for d in head if d is not None))
    return Fingerprint(items=len(head), sha256=sha.hexdigest())


class Walk(Generic[T]):
    """One ``resume()`` loop's way through its iterable: skips what is finished, tracks what gets finished.

    :param iterable: the loop's items.
    :param name: the cursor's name (in messages).
    :param stored: the cursor the loop resumes from, or None for a fresh start.
    :param key: the item's key, or None to resume by position.
    :param on_change: ``"fail"`` or ``"warn"`` (see the module's docstring).
    :param where: the checkpoint the cursor comes from, for messages (``"checkpoint 7"``).

    Iterate :meth:`remaining`; call :meth:`finished` after each item's work; :meth:`cursor` is the record to
    commit. Every item's key and digest are taken when it is read, before the loop body can change it.
    """

    def __init__(
        self,
        iterable: Iterable[T],
        *,
        name: str,
        stored: Cursor | None,
        key: Callable[[T], ItemKey] | None,
        on_change: str,
        where: str,
    ) -> None:
        self._iterable = iterable
        self._name = name
        self._stored = stored
        self._key = key
        self._on_change = on_change
        self._where = where
        self.position = 0
        self.last_key: ItemKey | None = None
        self._read = 0  # items read from the iterable in this pass
        # Digests of the first items read (of their keys, with key=): what the cursor records. And of the items
        # themselves when a stored fingerprint over items is checked by a loop that now has key=.
        self._digests: list[bytes | None] = []
        self._item_digests: list[bytes | None] = []
        self._check: Fingerprint | None = None  # a stored fingerprint still to compare
        self._check_items = False  # the stored fingerprint is over items (a position-only cursor)
        self._said_unprintable = False
        self._pending_key: ItemKey | None = None
        self._keep = FINGERPRINT_ITEMS  # digests kept: the first items, as many as a check or a record needs

    # -- what the loop calls -------------------------------------------------------------------------------
    def remaining(self) -> Iterator[T]:
        """The items not finished yet, after skipping (and checking) the finished ones."""
        it = iter(self._iterable)
        stored = self._stored
        if stored is not None and stored.fingerprint is not None:
            self._keep = max(FINGERPRINT_ITEMS, stored.fingerprint.items)
        if stored is not None and stored.last_key is not None and self._key is not None:
            it = self._skip_to_key(it, stored.last_key, stored, one_shot=it is self._iterable)
        elif stored is not None:
            self._skip_positions(it, stored)
        for item in it:
            self._take(item)
            yield item
        self._at_end()

    def finished(self) -> None:
        """The item last handed out is done: the cursor moves past it."""
        self.position += 1
        self.last_key = self._pending_key

    def cursor(self) -> Cursor:
        """The record to commit now."""
        items = min(self.position, FINGERPRINT_ITEMS)
        return Cursor(
            position=self.position,
            last_key=self.last_key if self._key is not None else None,
            fingerprint=fingerprint_of(self._digests, items) if items else None,
        )

    # -- reading items -------------------------------------------------------------------------------------
    def _take(self, item: T) -> ItemKey | None:
        """Read one item: its key (checked), its digest if among the first; compare a stored fingerprint."""
        index = self._read
        self._read += 1
        key = None
        if self._key is not None:
            key = check_item_key(self._key(item), position=index, cursor=self._name)
        if index < self._keep:
            digest = item_digest(item if key is None else key)
            self._digests.append(digest)
            if self._check_items:
                self._item_digests.append(digest if key is None else item_digest(item))
            if digest is None and not self._said_unprintable:
                self._said_unprintable = True
                log.info(
                    "cursor %r: item %d (%s) has no stable encoding (its repr shows a memory address, or it is "
                    "a set): no fingerprint is stored, so a change of the iterable cannot be detected; pass "
                    "key= to resume by each item's key",
                    self._name,
                    index,
                    type(item).__name__,
                )
        if self._check is not None and self._read == self._check.items:
            self._compare()
        self._pending_key = key
        return key

    def _at_end(self) -> None:
        if self._check is not None:
            self._compare()

    # -- by position ---------------------------------------------------------------------------------------
    def _skip_positions(self, it: Iterator[T], stored: Cursor) -> None:
        self.position = stored.position
        if stored.last_key is not None:  # stored by key; this loop has no key= (the code changed)
            log.warning(
                "cursor %r was stored by key (last %s) in %s, but this loop has no key=: resuming at item %d "
                "without checking that the iterable is unchanged",
                self._name,
                shown_key(stored.last_key),
                self._where,
                stored.position,
            )
        else:
            self._check = stored.fingerprint
            self._check_items = self._key is not None and stored.fingerprint is not None
            if self._key is not None:
                log.info(
                    "cursor %r was stored without a key in %s: resuming at item %d this once, by key from now on",
                    self._name,
                    self._where,
                    stored.position,
                )
        if stored.position:
            log.info("skipping %d finished items (cursor %r)", stored.position, self._name)
        for _ in range(stored.position):
            try:
                item = next(it)
            except StopIteration:
                break
            self._take(item)
        self.last_key = self._pending_key

    # -- by key --------------------------------------------------------------------------------------------
    def _skip_to_key(
        self, it: Iterator[T], target: ItemKey, stored: Cursor, *, one_shot: bool
    ) -> Iterator[T]:
        """Consume items up to the one with the stored last key ``target``; the iterator to go on with."""
        self._check = stored.fingerprint  # over keys: a change only informs
        kept: list[T] | None = [] if self._on_change == "warn" and one_shot else None
        for item in it:
            if kept is not None:
                kept.append(item)
            if self._take(item) == target:
                self._found(target, stored, at=self._read)
                return it
        self._check = None
        if self._on_change == "fail":
            raise CursorMismatchError(
                f"cursor {self._name!r}: the last finished item's key {shown_key(target)} (stored in "
                f"{self._where}) is not among the {self._read} items of the iterable, so where to resume is "
                "unknown. Make the iterable yield that key again, or pass on_change='warn' to start again from "
                "the first item (redoing work, never skipping it), or delete the task's state."
            )
        log.warning(
            "cursor %r: the last finished item's key %s (stored in %s) is not among the %d items of the "
            "iterable; on_change='warn': starting again from the first item (redoing work, never skipping it)",
            self._name,
            shown_key(target),
            self._where,
            self._read,
        )
        self._read, self._digests, self._item_digests = 0, [], []
        return iter(kept) if kept is not None else iter(self._iterable)

    def _found(self, target: ItemKey, stored: Cursor, *, at: int) -> None:
        """The stored key is item ``at - 1``: the loop goes on after it, unless that would skip unfinished items."""
        self.position, self.last_key = at, target
        if at <= stored.position:
            if at < stored.position:
                log.info(
                    "cursor %r: the last finished key %s is item %d now (it was item %d): items before it were "
                    "removed or reordered",
                    self._name,
                    shown_key(target),
                    at - 1,
                    stored.position - 1,
                )
            log.info("skipped %d finished items by key (cursor %r)", at, self._name)
            return
        unfinished = at - stored.position
        message = (
            f"cursor {self._name!r}: the last finished key {shown_key(target)} is item {at - 1} now, "
            f"but only {stored.position} items were finished up to it when {self._where} was stored: at least "
            f"{unfinished} item(s) before it are new (inserted, or the order changed) and were never finished."
        )
        if self._on_change == "fail":
            raise CursorMismatchError(
                f"{message} Keep the order stable up to the last key (new items last, e.g. sorted by a growing "
                "key), or pass on_change='warn' to take the items before it as done."
            )
        log.warning("%s on_change='warn': taking them as done, resuming after it", message)

    # -- the fingerprint -----------------------------------------------------------------------------------
    def _compare(self) -> None:
        stored, self._check = self._check, None
        assert stored is not None
        digests = self._item_digests if self._check_items else self._digests
        now = fingerprint_of(digests, stored.items)
        if now is not None and now == stored:
            return
        by_key = self._stored is not None and self._stored.last_key is not None and self._key is not None
        what = "keys" if by_key else "items"
        change = (
            f"cursor {self._name!r}: the first {stored.items} {what} of the iterable are not those of {self._where}"
            + (f" (it has only {len(digests)})" if len(digests) < stored.items else "")
        )
        if by_key:
            log.info("%s; resuming by key, which does not depend on them", change)
            return
        position = self.position
        if self._on_change == "fail":
            raise CursorMismatchError(
                f"{change}, so resuming at stored position {position} would skip the wrong items. Pass key= (a "
                "function giving each item's unique key, e.g. key=lambda row: row['id']) to resume by key, or "
                f"on_change='warn' to resume at item {position} anyway, or delete the task's state to start over."
            )
        log.warning("%s; on_change='warn': resuming at stored position %d anyway", change, position)

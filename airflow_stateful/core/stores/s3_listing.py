"""S3 listings that hold on servers which are not S3: ListObjectsV2 pages, checked as they come.

S3 lists keys in byte order and each key or common prefix once. Not every S3-compatible server does, and the
library must not depend on it:

* **Order.** SeaweedFS lists in directory-walk order (``a/b`` before ``a-b``), across pages too. No caller
  depends on the order (see :meth:`~airflow_stateful.core.stores.base.ObjectStore.list_objects`).
* **Delimited paging.** SeaweedFS 4.48, asked for a delimiter other than ``/`` (the catalog lists identities
  with ``/~``) in pages smaller than the listing, answered wrong: the same common prefix on page after page
  (duplicates, a loop that never ends, botocore's "the same next token was received twice") and, with some
  delimiters, keys left out with no sign of it. A listing that fits in one page was right; so were plain
  listings and ``/`` listings of any length.

So a delimited listing is checked as it comes. When its first page is not the whole listing, the delimiter is
not ``/`` and the server (its ``Server`` header) is one of :data:`PAGES_DELIMITERS_WRONG`, the listing is
made from the plain listing of every key, rolled up here (the rule of
:meth:`~airflow_stateful.core.stores.base.ObjectStore.list_delimited`): more requests, the right answer. On
any server, a key or prefix listed twice, a page with nothing new, or a pagination error means its paging
cannot be trusted for this listing, which then goes on from the plain listing, skipping what was yielded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from airflow_stateful.core.stores.base import CommonPrefix, ObjectInfo

log = logging.getLogger(__name__)

Entry = ObjectInfo | CommonPrefix


PAGES_DELIMITERS_WRONG = ("SeaweedFS",)
"""Servers (the start of their ``Server`` response header) whose paged listings with a delimiter other than
``/`` were seen to be wrong (see the module's docstring)."""


class ListingInconsistent(Exception):
    """The server's pages of a delimited listing contradict each other (see the module's docstring)."""


class KnownWrongPages(ListingInconsistent):
    """The server is one of :data:`PAGES_DELIMITERS_WRONG` and the listing needs more than one page."""


def entry_key(entry: Entry) -> str:
    return entry.prefix if isinstance(entry, CommonPrefix) else entry.key


def delimited_pages(
    pages: Iterator[dict[str, Any]], *, strip: int
) -> Iterator[tuple[list[Entry], dict[str, Any]]]:
    """Each ListObjectsV2 page with a delimiter as one list, with the page itself: its objects and common
    prefixes merged into key order (S3 returns them in two lists), keys relative to the store's prefix
    (``strip`` characters off)."""
    for page in pages:
        entries: list[Entry] = [
            ObjectInfo(key=obj["Key"][strip:], size=obj["Size"], last_modified=obj["LastModified"])
            for obj in page.get("Contents", [])
        ]
        entries += [CommonPrefix(common["Prefix"][strip:]) for common in page.get("CommonPrefixes", [])]
        entries.sort(key=entry_key)
        yield entries, page


def pages_right(page: dict[str, Any], delimiter: str) -> bool:
    """Whether the rest of a delimited listing can come from the server's pages (see the module's
    docstring): always for ``/`` or a complete first page, otherwise unless the server is known to get it wrong."""
    if delimiter == "/" or not page.get("IsTruncated"):
        return True
    server = str(page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("server", ""))
    return not server.startswith(PAGES_DELIMITERS_WRONG)


def checked(
    pages: Iterator[tuple[list[Entry], dict[str, Any]]],
    *,
    delimiter: str,
    rolled_up: Callable[[], Iterator[Entry]],
    where: str,
    is_pagination_error: Callable[[Exception], bool],
) -> Iterator[Entry]:
    """The entries of ``pages``, each once; from ``rolled_up()`` (the plain listing rolled up, sorted into key
    order) instead, without what was already yielded, where the server's pages cannot be trusted."""
    seen: set[str] = set()
    try:
        first = True
        for page, raw in pages:
            if first and not pages_right(raw, delimiter):
                raise ListingInconsistent(
                    f"{raw['ResponseMetadata']['HTTPHeaders']['server']} pages it wrongly"
                )
            first = False
            fresh = [entry for entry in page if entry_key(entry) not in seen]
            if len(fresh) < len(page) or (page and not fresh):
                again = sorted({entry_key(e) for e in page} & seen)[:3]
                raise ListingInconsistent(f"the server listed {', '.join(again)} again on a later page")
            for entry in fresh:
                seen.add(entry_key(entry))
                yield entry
    except Exception as exc:
        if not isinstance(exc, ListingInconsistent) and not is_pagination_error(exc):
            raise
        # Expected on a known server; on any other, worth a warning (and a report of the server's version).
        level = logging.INFO if isinstance(exc, KnownWrongPages) else logging.WARNING
        log.log(level, "the delimited listing of %s comes from the plain listing: %s", where, exc)
    else:
        return
    # The plain listing comes in the server's order; sorted here (its keys are held anyway, in ``seen``), the
    # rest of the listing is in key order, as S3's would be: a whole listing when the first page gave it away.
    rest: dict[str, Entry] = {}
    for entry in rolled_up():
        rest.setdefault(entry_key(entry), entry)
    for key in sorted(rest.keys() - seen):
        yield rest[key]

"""Finding the identities of a backend and reading their heads: what fleet commands (``ls``, ``du``,
``verify --all``, GC's plan, the UI) are built on, so that they cost what the fleet is, not what it stores.

Why a delimited listing: every object of an identity lives under ``<identity>/~`` (``~head.json``,
``~manifests/``, ``~trees/``, ``~chunks/``, and whatever other layouts put there), and ``~`` never occurs in an
identity segment, so a listing with the delimiter ``/~`` rolls each identity up into one common prefix. One
request lists 1,000 identities however many checkpoints and files each one holds (S3 accepts any string as a
delimiter; so does moto).

Why threads for the heads: a head is one small GET whose time is mostly the round trip, so reading a few at
once hides the latency; the results still come back in key order, as soon as each one and all before it
are read, so a command prints its first rows while the rest are still being read.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from airflow_stateful.core.protocol.heads import HeadStore
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import CommonPrefix, ObjectStore

IDENTITY_DELIMITER = "/~"
"""Ends an identity inside every key of its objects, and nowhere before (no identity segment holds ``~``)."""
HEAD_READERS = 16
"""Heads read at once: enough to hide S3's round trips, within the 16 connections the store's client pools.
Measured in benchmarks/bench_fleet.py on moto (2,000 heads): 1 reader 9.9 s, 4 7.8 s, 8 6.8 s, 16 6.2 s; there
the time per head is moto's CPU (3.5 ms a GET), on S3 it is the round trip, which more readers hide better."""

_HEAD_SUFFIX = f"/{HEAD_NAME}"
_NOT_AN_IDENTITY = "~"
"""Every identity key sorts before this (its characters are letters, digits and ``._%=+-``): an entry at or past
it (the library's ``~task-state/`` and ``~asset-state/`` documents, anything non-ASCII) is no identity's. They
are skipped, not taken as the end of the listing: not every server lists in byte order (SeaweedFS does not)."""

T = TypeVar("T")
R = TypeVar("R")


def list_identities(
    store: ObjectStore, prefix: str = "", *, on_entry: Callable[[], None] | None = None
) -> Iterator[Identity]:
    """The identities whose key starts with ``prefix``, from one delimited listing, in the store's listing order
    (key order on S3 and the local store; see :meth:`~airflow_stateful.core.stores.base.ObjectStore.list_objects`).

    An identity is listed when any object of its own lies under ``<identity>/~``: one whose head was deleted
    (an orphan, or a purge in progress) is listed too, and its head read says so. Keys that are not valid
    identities (written by something else) are skipped.

    :param on_entry: called once per entry the listing returns (identities, objects that are no identity's,
        and the objects of an identity whose own folder ``prefix`` names, which the delimiter cannot roll
        up); it may raise to stop the listing, which is how the UI bounds what a request reads.
    """
    for entry in store.list_delimited(prefix, IDENTITY_DELIMITER):
        if on_entry is not None:
            on_entry()
        if isinstance(entry, CommonPrefix):
            key = entry.prefix[: -len(IDENTITY_DELIMITER)]
        elif entry.key.endswith(_HEAD_SUFFIX) and len(entry.key) > len(_HEAD_SUFFIX):
            # ``prefix`` ends inside ``<identity>/~``, past where the delimiter could roll it up.
            key = entry.key[: -len(_HEAD_SUFFIX)]
        else:
            continue  # an object no identity owns
        if key >= _NOT_AN_IDENTITY:
            continue
        try:
            yield Identity.parse(key)
        except ValueError:
            continue


@dataclass(frozen=True)
class HeadRead:
    """One identity's head as read: ``head`` (``None`` when it has none), or the ``error`` that kept it from
    being read (a corrupt, forged, oversized or newer-format head; a request the store refused)."""

    identity: Identity
    head: HeadRecord | None = None
    error: Exception | None = None


def read_head(
    store: ObjectStore,
    identity: Identity,
    *,
    signer: HeadSigner | None = None,
    marks: MarkStore | None = None,
) -> HeadRead:
    """One identity's head through :meth:`HeadStore.load` (its size cap, typed parsing, checksum, and the
    signature ``signer`` checks).

    Any failure, of the record or of its request, becomes the ``error`` of the result instead of being raised:
    one bad record must not hide the fleet.
    """
    try:
        return HeadRead(
            identity=identity,
            head=HeadStore(store=store, identity=identity, signer=signer, marks=marks).load()[0],
        )
    except Exception as exc:  # reported on its own row; the caller decides what it means
        return HeadRead(identity=identity, error=exc)


def read_heads(
    store: ObjectStore,
    identities: Iterable[Identity],
    *,
    signer: HeadSigner | None = None,
    marks: MarkStore | None = None,
    readers: int = HEAD_READERS,
) -> Iterator[HeadRead]:
    """:func:`read_head` of each identity, ``readers`` at a time, in the order of ``identities``, as they are
    read (:func:`ordered_map`)."""
    return ordered_map(
        functools.partial(read_head, store, signer=signer, marks=marks), identities, workers=readers
    )


def ordered_map(fn: Callable[[T], R], items: Iterable[T], *, workers: int) -> Iterator[R]:
    """``fn`` over ``items`` on up to ``workers`` threads, results in the order of ``items``, lazily.

    ``items`` is consumed only a few steps ahead of the results taken (at most ``4 * workers`` in flight), so
    a listing feeding it is read as it goes, memory stays bounded, and the first result is ready long before
    the last item is listed. If ``fn`` raises, the result in its place raises (those before it are
    delivered). If ``items`` itself raises (a listing fails, or a caller's bound stops it), the results of
    what it yielded before are delivered first, then its exception is raised. The threads belong to this
    call and end with it.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    return _ordered(fn, iter(items), workers)


def _ordered(fn: Callable[[T], R], source: Iterator[T], workers: int) -> Iterator[R]:
    pending: deque[Future[R]] = deque()
    failure: Exception | None = None
    exhausted = False
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stateful-fleet") as pool:
        try:
            while True:
                while not exhausted and len(pending) < 4 * workers:
                    try:
                        item = next(source)
                    except StopIteration:
                        exhausted = True
                    except Exception as exc:
                        failure, exhausted = exc, True
                    else:
                        pending.append(pool.submit(fn, item))
                if not pending:
                    break
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
    if failure is not None:
        raise failure

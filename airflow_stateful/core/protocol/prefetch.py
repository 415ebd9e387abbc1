"""Reading what a save needs from the bucket while the save lists its files.

A save of a directory first lists it (one ``lstat`` per file), then reads the head, the manifest and the tree of
the checkpoint it deduplicates against. In a new process's re-save of 10,000 small files those reads were ~25 ms
of waiting after a ~45 ms listing (docs/performance.md, issue 32); here they run on a thread while the caller
lists, so the two overlap.

Only requests run on the thread. Parsing the tree there would hold the GIL against the listing's ``lstat`` calls
(each release of the GIL then costs the listing a switch interval), so the tree's bytes are handed to the
:class:`~airflow_stateful.core.data.content.ContentStore`, which verifies and parses them when the save asks for
the tree. Nothing is written on the thread, and a failure there changes nothing: the save then reads the same
itself and reports what it finds, as it would have without the prefetch.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from airflow_stateful.core.errors import StatefulError

if TYPE_CHECKING:
    from airflow_stateful.core.data.content import ContentStore
    from airflow_stateful.core.protocol.heads import HeadStore
    from airflow_stateful.core.records.heads import HeadRecord
    from airflow_stateful.core.records.manifests import Manifest


class SavePrefetch:
    """The head, the manifest of its newest checkpoint and the bytes of the tree a save will deduplicate
    against, read on a thread while the ``with`` block runs; :meth:`result` gives what was read.

    :param previous: the checkpoint the caller said to deduplicate against (its tree is read if the head still
        keeps it); otherwise the newest checkpoint's is.
    :param enabled: off, nothing is read (a value-only save lists no files, so there is nothing to overlap).

    A :class:`~airflow_stateful.core.errors.StatefulError` on the thread (a missing, corrupt or unreachable
    object) leaves the rest unread, and the save meets it again on its own read, reported there. Anything else
    (a bug, an interrupt, a test's simulated crash) is raised again when the block ends, unless the block
    itself raised: the thread must not hide that the process is going down.
    """

    def __init__(
        self, *, heads: HeadStore, content: ContentStore, previous: Manifest | None, enabled: bool = True
    ) -> None:
        self._heads, self._content, self._previous = heads, content, previous
        self._head: HeadRecord | None = None
        self._loaded = False
        self._latest: Manifest | None = None
        self._error: BaseException | None = None
        self._thread = (
            threading.Thread(target=self._run, name="stateful-prefetch", daemon=True) if enabled else None
        )

    def __enter__(self) -> SavePrefetch:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._thread is not None:
            self._thread.join()
        error, self._error = self._error, None
        if error is not None and exc_type is None:
            raise error

    def _run(self) -> None:
        try:
            head, _ = self._heads.load()
            self._head, self._loaded = head, True
            if head is None or head.latest is None:
                return
            base = self._previous
            if base is None or all(e.commit_id != base.commit_id for e in head.checkpoints):
                base = self._latest = self._content.read_manifest(head.latest)
            if base.tree is not None:
                self._content.read_ahead(base.tree)
        except StatefulError:
            pass  # the save reads it again itself and reports what it finds
        except BaseException as exc:  # handed to the thread that asked, raised there
            self._error = exc

    def result(self) -> tuple[bool, HeadRecord | None, Manifest | None]:
        """After the block: whether the head was read, the head (``None``: the identity is new) and the
        manifest of its newest checkpoint if it was read."""
        return self._loaded, self._head, self._latest

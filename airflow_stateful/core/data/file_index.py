"""Which local files a writer already chunked and hashed: a re-save reads only the files that changed.

Why: a content-addressed save learns what changed by hashing, and hashing every byte of a 512 MiB tree to
find the one file of 32 that changed costs more than uploading that file. So, like git's index and restic's
and borg's file caches, a writer remembers for each file it saved the file's status (device, inode, size,
modification and change times, in nanoseconds) and the chunks its bytes were cut into. When a later save of
the same writer finds a file with the very same status, and the identity still holds every one of those
chunks (they are in the tree the save deduplicates against), it takes the chunks without reading the file.

Why it is safe:

* any write to a file changes its modification time and its change time (``ctime``), and no call lets a
  program set ``ctime`` (``touch``, ``os.utime`` and ``cp -p`` restore ``mtime`` only); a file replaced by
  a rename has another inode. So a file whose status is unchanged holds the bytes it held;
* *racily clean* files (git's term) are never remembered: a file changed within the timestamp granularity
  of the moment it was hashed could change again without its times moving. A file is remembered only if
  both its times are older than :data:`RACY_SECONDS` before the hashing started (coarse file systems stamp
  to the second or two), and its status after reading equals its status before;
* the index lives in the writer's memory only (never on disk), so whoever can write the worker's temp dir
  cannot forge it, and it dies with the process.

A new process (a retry, a restarted pod) has no index. For it, the tree records the status of each file that
was remembered (``TreeFile.seen``), and the save trusts the tree it deduplicates against the same way: a file
whose device, inode, size and both times equal those its entry recorded is taken as it is, as restic takes a
file from its parent snapshot. The same rules make that safe (the status is recorded only under the settled
rule above, and the change time cannot be set back), and it trusts the bucket no further than a restore does:
the tree is the one the checkpoint names, verified by its SHA-256 (and the head's signature, with a signer),
and whoever could forge it could forge the checkpoint's files themselves. A status recorded on another machine
names another device and inode, or another change time to the nanosecond, so it matches nothing there; files
put back by a restore are new files with new statuses, so the save after a restore reads them once.

The index is kept for the files of the latest save only, so its size is that of one checkpoint's file list.
It holds each file's tree entry itself (:class:`~airflow_stateful.core.records.trees.TreeFile`): a re-save takes
that very object into the new tree, with its encoding already made, and builds nothing per unchanged file.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

from airflow_stateful.core.records.trees import TreeFile

RACY_SECONDS = 2.0
"""A file modified this recently before it was hashed is hashed again next time (see the module doc)."""


class FileStatus(NamedTuple):
    """What must be the same for a file to be taken as unchanged. A tuple, so that making one per file and
    comparing two cost what a tuple does (a save of 10,000 small files makes and compares 10,000 of them)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStatus:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def settled_before(self, started_ns: int) -> bool:
        """Both times lie well before ``started_ns`` (wall clock): not racily clean."""
        limit = started_ns - int(RACY_SECONDS * 1e9)
        return self.mtime_ns < limit and self.ctime_ns < limit


def vouched(before: FileStatus, after: FileStatus, started_ns: int) -> bool:
    """Whether a file read between ``before`` and ``after`` (reading started at ``started_ns``, wall clock) may
    be remembered, in the index or as the status its tree entry records: it had settled and did not change."""
    return before == after and before.settled_before(started_ns)


class FileIndex:
    """The status and tree entry of the files one writer saved last. Thread-safe; see the module doc.

    Keys are the files' absolute paths as read; the tree entry names the file's path in the checkpoint and its
    chunks, which the caller must still find in the tree it deduplicates against before taking them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[FileStatus, TreeFile]] = {}
        self._next: dict[str, tuple[FileStatus, TreeFile]] = {}

    def lookup(self, path: str, status: FileStatus) -> TreeFile | None:
        """The tree entry of ``path`` if it was saved with exactly this status, else ``None``."""
        entry = self._entries.get(path)  # one dict read is atomic; only publish() replaces the dict
        if entry is None or entry[0] != status:
            return None
        return entry[1]

    def stage(
        self, path: str, before: FileStatus, after: FileStatus, entry: TreeFile, started_ns: int
    ) -> None:
        """Note what the save in progress found for ``path`` (``started_ns``: ``time.time_ns()`` before it was
        read; file times are wall-clock times); kept only if the file was settled and did not change while it
        was read. Takes effect at :meth:`publish` (a failed save leaves the index as it was)."""
        if not vouched(before, after, started_ns):
            return
        with self._lock:
            self._next[path] = (before, entry)

    def keep(self, path: str, status: FileStatus, entry: TreeFile) -> None:
        """The save in progress took ``path`` from the index (:meth:`lookup`): it stays known."""
        with self._lock:
            self._next[path] = (status, entry)

    def publish(self) -> None:
        """The save succeeded: what it staged becomes the index (files no longer saved are forgotten)."""
        with self._lock:
            self._entries, self._next = self._next, {}

    def discard(self) -> None:
        """The save failed: forget what it staged."""
        with self._lock:
            self._next = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

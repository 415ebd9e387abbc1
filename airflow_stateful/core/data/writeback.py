"""Starting the write-back of restored bytes early, so the fsync before a file is moved into place is short.

A restore fsyncs every staged file before it renames it into the destination (a crash must never leave a
renamed file without its bytes). With one large file that fsync waits, at the very end, for the kernel to
write every dirty page of it. Asking the kernel to start writing each chunk's pages as soon as they are
written (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which returns without waiting) spreads that work
over the download. It changes nothing about durability: the fsync still runs, and still decides. Where the
call is missing (not Linux, no libc), nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has it
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int

    def start(fd: int, offset: int, length: int) -> None:
        call(fd, offset, length, SYNC_FILE_RANGE_WRITE)  # advisory: a failure only leaves it to the fsync

    return start


_START = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Let the kernel start writing ``length`` bytes at ``offset`` of ``fd`` to disk, without waiting."""
    if _START is not None and length > 0:
        _START(fd, offset, length)

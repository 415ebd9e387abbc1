"""Pausing Python's cyclic garbage collector while a save, a restore or a tree's parse builds its records.

Why: a tree of 10,000 small files is 10,000 file records, chunk references and statuses, built in a few hundred
milliseconds. CPython's cyclic collector runs every 700 net container allocations and, every tenth and
hundredth time, walks every object the older generations hold. In a task that already holds a few hundred
thousand objects (Airflow's own, the task's data), those walks cost more than the work: measured on SeaweedFS
with 10,000 x 4 KiB files (2026-12-07, docs/performance.md), a first save took 0.77-1.09 s with the collector
and 0.64-0.65 s without it, and parsing the tree 0.12-0.20 s against 0.08-0.11 s. These records hold no
reference cycles, so the collector would find nothing to free in them; reference counting frees them as
always. Cyclic garbage made elsewhere meanwhile (by another thread) waits until the pause ends, which is the
length of one save.

:func:`paused_collector` is safe to nest and to use from several threads at once (a background save beside
the task's own restore): the first to enter turns the collector off, the last to leave turns it back on, and
only if it was on when the first entered (a process that turned it off itself keeps it off). Nothing in here
imports Airflow.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_collector(*, when: bool = True) -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (see the module doc for why and how it nests);
    ``when=False``: run it as it is (a caller that pauses only for some inputs)."""
    global _depth, _was_enabled
    if not when:
        yield
        return
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

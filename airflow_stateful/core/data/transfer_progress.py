"""Progress lines for long transfers, so a task log shows a 20-minute upload is alive and how far it got."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop always returns


class TransferProgress:
    """A thread-safe byte counter that logs at most every ``interval`` seconds. Pass it as ``progress=``."""

    def __init__(
        self,
        *,
        label: str,
        total_bytes: int,
        logger: logging.Logger,
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total_bytes
        self.log = logger
        self.interval = interval
        self.clock = clock
        self.done_bytes = 0
        self._lock = threading.Lock()
        self._start = clock()
        self._last = self._start

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done_bytes += nbytes
            now = self.clock()
            if now - self._last < self.interval:
                return
            self._last = now
            done = self.done_bytes
        pct = 100.0 * done / self.total if self.total else 100.0
        rate = done / max(now - self._start, 1e-9)
        self.log.info(
            "%s: %s of %s (%.0f%%) at %s/s",
            self.label,
            human_bytes(done),
            human_bytes(self.total),
            pct,
            human_bytes(rate),
        )

    def finish(self) -> None:
        elapsed = max(self.clock() - self._start, 1e-9)
        self.log.info(
            "%s: %s in %.1f s (%s/s)",
            self.label,
            human_bytes(self.done_bytes),
            elapsed,
            human_bytes(self.done_bytes / elapsed),
        )

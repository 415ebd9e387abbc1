"""Progress over many items (identities): a bar on a terminal, periodic log lines anywhere else.

``gc``, ``du`` and ``verify --all`` walk hundreds of identities, one or more requests each. A person at a
terminal wants a live bar; a task log or a CI job wants a few lines that prove the walk is alive, not a
stream of carriage returns. The choice is made once, from ``stream.isatty()``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

_BAR_WIDTH = 30


class ItemProgress:
    """Count items done out of ``total``; call it once per item, then :meth:`finish`.

    :param label: what is being walked, e.g. ``"gc: planning"``.
    :param total: how many items there are (``0`` is fine: nothing is printed until ``finish``).
    :param stream: where a bar goes when it is a TTY (default ``sys.stderr``, keeping stdout for results).
    :param logger: where lines go otherwise.
    :param interval: seconds between log lines (a bar redraws at most ten times a second).
    :param clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self,
        *,
        label: str,
        total: int,
        stream: TextIO | None = None,
        logger: logging.Logger | None = None,
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.log = logger or logging.getLogger("airflow_stateful")
        self.interval = interval
        self.clock = clock
        self.done = 0
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._start = clock()
        self._last = self._start

    def __call__(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self._last < (0.1 if self.tty else self.interval):
            return
        self._last = now
        self._show(final=False)

    def _show(self, *, final: bool) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        if self.tty:
            filled = int(_BAR_WIDTH * min(pct, 100.0) / 100)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
            if final:
                self.stream.write("\n")
            self.stream.flush()
        else:
            self.log.info("%s: %d/%d (%.0f%%)", self.label, self.done, self.total, pct)

    def finish(self) -> None:
        """Draw the final state (a bar ends its line; a log gets a closing line with the elapsed time)."""
        if self.tty:
            self._show(final=True)
        else:
            self.log.info(
                "%s: %d/%d done in %.1f s", self.label, self.done, self.total, self.clock() - self._start
            )

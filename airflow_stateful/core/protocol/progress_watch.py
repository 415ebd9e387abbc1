"""ProgressWatch: whether a writer that is alive (its lease renewed) still commits, or is stuck.

A lease proves a writer's process is alive, not that its work moves: a task blocked on a lock or a dead database
renews its lease for ever. So after every renewal the writer reports how long ago it last committed (the
``progress`` event, for metrics and alerts) and, the first time that is longer than its expected checkpoint
interval, says so in the task log with what to check (see :mod:`airflow_stateful.core.fleet.status`, which judges
the same from the head for readers).
"""

from __future__ import annotations

import logging
import time

from airflow_stateful.core import events
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.settings import EXPECTED_CHECKPOINT_INTERVAL

log = logging.getLogger("airflow_stateful")


class ProgressWatch:
    """When one writer last made progress, and whether it has been reported stuck since.

    :param identity: whose writer it is.
    :param expected: seconds within which the writer means to commit; default ``[stateful]
        expected_checkpoint_interval`` as readers apply it.
    """

    def __init__(self, *, identity: Identity, expected: float | None) -> None:
        self.identity = identity
        self.expected = expected or EXPECTED_CHECKPOINT_INTERVAL.total_seconds()
        self.at = time.monotonic()  # the last commit, or the start
        self._reported = False

    def progressed(self, at: float | None = None) -> None:
        """The writer committed (or started) at monotonic time ``at`` (default: now)."""
        self.at, self._reported = time.monotonic() if at is None else at, False

    def after_renewal(self) -> None:
        """Report the time since the last progress; warn once when it passes the expected interval."""
        since = time.monotonic() - self.at
        stuck = since > self.expected
        events.emit(
            events.PROGRESS,
            identity=self.identity.key,
            since_progress=round(since, 3),
            expected_interval=self.expected,
            stuck=int(stuck),
        )
        if stuck and not self._reported:
            self._reported = True
            log.warning(
                "STUCK? %s: no checkpoint committed for %.0f s, longer than the expected %.0f s "
                "(expected_checkpoint_interval). The lease is still renewed, so nothing else will notice: check "
                "what this task is waiting for.",
                self.identity,
                since,
                self.expected,
            )

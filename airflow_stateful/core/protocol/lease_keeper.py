"""LeaseKeeper: a writer's lease, kept alive by a heartbeat thread, and the moment it is known to be lost.

A try may compute for hours between two saves, so a daemon thread renews the lease every ``renew_every``
seconds (jittered down by up to 20 %, so writers started together do not renew in lock-step). If a renewal finds
the lease taken over or broken, or none succeeds before the lease would expire (S3 unreachable for longer than
the ttl), the keeper marks it lost and logs it at ERROR level; the writer's next commit then fails before it
uploads anything. Deadlines are kept on the monotonic clock: the moment a renewal was *sent* plus the ttl, never
later than the expiry the store records (docs/adr/0003-lease-renewal-and-maintenance.md).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from airflow_stateful.core import events
from airflow_stateful.core.errors import FencedError
from airflow_stateful.core.protocol.lease import Lease
from airflow_stateful.core.records.identity import Identity

log = logging.getLogger("airflow_stateful")


class LeaseKeeper:
    """The lease one writer holds, its renewal thread, and whether it was lost.

    :param identity: whose lease it is.
    :param ttl: the lease's time to live, in seconds.
    :param renew: renews a lease (a checkpoint store's ``renew``), raising FencedError if it was taken over.
    :param renew_every: seconds between renewals (below ``ttl``).
    :param on_renewed: called after every renewal that landed (the writer reports its progress there).
    """

    def __init__(
        self,
        *,
        identity: Identity,
        ttl: float,
        renew: Callable[[Lease], Lease],
        renew_every: float,
        on_renewed: Callable[[], None] = lambda: None,
    ) -> None:
        self.identity = identity
        self.ttl = ttl
        self.renew_every = renew_every
        self._renew = renew
        self._on_renewed = on_renewed
        self.lease: Lease | None = None
        #: Why the lease is lost (``None`` while it is held, or was given up cleanly).
        self.lost: str | None = None
        self.deadline = 0.0
        self.last_error: str | None = None
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, lease: Lease, *, sent: float) -> None:
        """Hold ``lease``, taken or renewed by a request sent at monotonic time ``sent``."""
        self.lease = lease
        self.deadline = sent + self.ttl

    def release(self) -> Lease | None:
        """Stop holding the lease (the caller gives it up or lets it expire); the lease it held, if any."""
        with self.lock:
            lease, self.lease = self.lease, None
        return lease

    def confirmed(self, sent: float) -> None:
        """A renewal (or commit) sent at monotonic time ``sent`` landed: the lease lives until ``sent + ttl``."""
        with self.lock:
            self.deadline = max(self.deadline, sent + self.ttl)
            self.last_error = None

    def check_deadline(self) -> None:
        """Mark the lease lost if no renewal landed within its ttl."""
        if self.lost is None and self.lease is not None and time.monotonic() > self.deadline:
            reason = self.last_error or "no renewal succeeded"
            self.mark_lost(
                f"the lease on {self.identity} was not renewed within its ttl of {self.ttl:g} s "
                f"({reason}); another writer or maintenance may take it over now"
            )

    def mark_lost(self, reason: str, *, epoch: int | None = None) -> None:
        """Record (once) that the lease is lost and why, at ERROR level, and report it as fenced."""
        with self.lock:
            if self.lost is not None:
                return
            self.lost = reason
        log.error(
            "LEASE LOST on %s: %s%s The next save of this writer will fail.",
            self.identity,
            reason,
            "" if reason.endswith(".") else ".",
        )
        if epoch is None:
            epoch = self.lease.epoch if self.lease else 0
        events.emit(events.FENCED, identity=self.identity.key, epoch=epoch, action="renew")

    def start(self) -> None:
        """Start renewing in a daemon thread."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat, name=f"stateful-lease-{self.identity.key[:40]}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing; wait (bounded) for a renewal in flight."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            # A renewal in flight finishes within the store client's timeouts; the thread is a daemon anyway.
            thread.join(timeout=min(self.ttl, 30.0))

    def _beat(self) -> None:
        wait = self.renew_every * random.uniform(0.8, 1.0)
        while not self._stop.wait(wait):
            lease = self.lease
            if lease is None or self.lost is not None:
                return
            sent = time.monotonic()
            try:
                renewed = self._renew(lease)
            except FencedError as exc:
                if not self._stop.is_set():  # not a release or purge that overtook this renewal
                    self.mark_lost(str(exc))
                return
            except Exception as exc:  # unreachable store, throttling, ...: retry until the deadline
                left = self.deadline - time.monotonic()
                self.last_error = f"last renewal error: {type(exc).__name__}: {exc}"
                if left <= 0:
                    self.check_deadline()
                    return
                wait = min(self.renew_every, max(0.2, left / 4))
                log.warning(
                    "could not renew the lease on %s (%s); retrying in %.1f s, it expires in %.0f s",
                    self.identity,
                    self.last_error,
                    wait,
                    left,
                )
                continue
            with self.lock:
                if self._stop.is_set():
                    return  # closed meanwhile (a renewal slower than the join): do not reopen the session
                self.lease = renewed
            self.confirmed(sent)
            self._on_renewed()
            wait = self.renew_every * random.uniform(0.8, 1.0)

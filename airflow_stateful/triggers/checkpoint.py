"""CheckpointTrigger: waits in the triggerer, not in a worker slot, until an identity's state meets a condition.

The deferrable mode of :class:`~airflow_stateful.sensors.checkpoint.CheckpointSensor` and
:class:`~airflow_stateful.sensors.checkpoint.LeaseReleasedSensor`. It polls the identity's head record
(one small GET), waiting ``poll_interval`` seconds after a change and doubling the wait up to
``max_poll_interval`` while nothing changes.

Its arguments are stored in Airflow's metadata database, so they hold no credentials: only the backend URL
(which may never carry credentials, see :func:`~airflow_stateful.core.stores.registry.store_from_url`) and
the connection id, which the trigger resolves itself in the triggerer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_stateful.core.errors import StatefulError
from airflow_stateful.core.fleet.conditions import CheckpointCondition, Verdict
from airflow_stateful.core.protocol.reader import CheckpointReader
from airflow_stateful.core.records.identity import Identity


class CheckpointTrigger(BaseTrigger):
    """Fires once when an identity's checkpoint (or lease) meets a condition, or when it cannot be read.

    Yields ``TriggerEvent({"status": "success", "result": {...}, "reason": ...})`` when the condition holds,
    ``TriggerEvent({"status": "error", "message": ...})`` when the store fails (a missing bucket, denied
    credentials, a corrupt head record): those do not heal by waiting.

    :param identity: the identity key to watch, e.g. ``"etl/export/name=orders/map=-1"``.
    :param condition: a :class:`~airflow_stateful.core.fleet.conditions.CheckpointCondition` as ``to_dict()``.
    :param backend_url: ``s3://bucket/prefix`` or ``file:///path``; default ``[stateful] backend_url`` as
        configured on the triggerer (the sensors pass the URL their worker resolved).
    :param conn_id: Airflow connection for S3; default ``[stateful] conn_id``.
    :param poll_interval: seconds to wait after the first check and after every check that saw a change.
    :param max_poll_interval: the longest wait between checks while nothing changes.
    """

    def __init__(
        self,
        *,
        identity: str,
        condition: dict[str, Any],
        backend_url: str | None = None,
        conn_id: str | None = None,
        poll_interval: float = 5.0,
        max_poll_interval: float = 60.0,
    ) -> None:
        super().__init__()
        # Refuse a bad identity or condition when the task defers, not later in the triggerer.
        Identity.parse(identity)
        CheckpointCondition.from_dict(condition)
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be a positive number of seconds, not {poll_interval!r}")
        if not max_poll_interval >= poll_interval:
            raise ValueError(
                f"max_poll_interval ({max_poll_interval!r}) must be at least poll_interval ({poll_interval!r})"
            )
        self.identity = identity
        self.condition = dict(condition)
        self.backend_url = backend_url
        self.conn_id = conn_id
        self.poll_interval = float(poll_interval)
        self.max_poll_interval = float(max_poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        cls = self.__class__
        return (
            f"{cls.__module__}.{cls.__qualname__}",
            {
                "identity": self.identity,
                "condition": dict(self.condition),
                "backend_url": self.backend_url,
                "conn_id": self.conn_id,
                "poll_interval": self.poll_interval,
                "max_poll_interval": self.max_poll_interval,
            },
        )

    def _open(self) -> CheckpointReader:
        """The identity's checkpoint store, with credentials resolved here, in the triggerer.

        This runs in a worker thread (``asyncio.to_thread``) and goes through the sync StateHook, so the
        connection is read exactly as a poking sensor reads it (same extras allowlist, same fallback to
        boto3's credential chain). The sync path is the one that works everywhere: the triggerer's comms
        answer a sync request from a thread other than the event loop's, and ``dag.test()``'s inline
        trigger run offers *only* sync comms (its in-process channel has no ``asend``, so
        ``BaseHook.aget_connection`` cannot read a connection stored in the metadata database there).
        Calling the sync hook on the event loop's own thread would block the loop, or fail in the triggerer.
        """
        from airflow_stateful.hooks.state import StateHook

        hook = StateHook(backend_url=self.backend_url, conn_id=self.conn_id)
        return hook.checkpoint_store(Identity.parse(self.identity))

    @staticmethod
    def _poll(checkpoints: CheckpointReader, condition: CheckpointCondition) -> tuple[Verdict, str | None]:
        head = checkpoints.head()
        verdict = condition.evaluate(head, checkpoints.latest, now=time.time())
        return verdict, head.updated_at if head is not None else None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        condition = CheckpointCondition.from_dict(self.condition)
        checkpoints: CheckpointReader | None = None
        where = self.backend_url or "[stateful] backend_url"
        try:
            # boto3 is synchronous: every store call runs in a thread so the triggerer's loop stays free.
            checkpoints = await asyncio.to_thread(self._open)
            where = checkpoints.store.url
            delay: float | None = None
            last_change: str | None = None
            while True:
                verdict, change = await asyncio.to_thread(self._poll, checkpoints, condition)
                if verdict:
                    self.log.info("%s: %s", self.identity, verdict.reason)
                    yield TriggerEvent(
                        {
                            "status": "success",
                            "result": verdict.result(self.identity),
                            "reason": verdict.reason,
                        }
                    )
                    return
                if delay is None or change != last_change:
                    delay = self.poll_interval  # something moved: look again soon
                else:
                    delay = min(delay * 2, self.max_poll_interval)
                last_change = change
                self.log.info(
                    "waiting for %s of %s: %s; next check in %g s",
                    condition.describe(),
                    self.identity,
                    verdict.reason,
                    delay,
                )
                await asyncio.sleep(delay)
        except Exception as exc:
            detail = str(exc) if isinstance(exc, StatefulError) else f"{type(exc).__name__}: {exc}"
            message = f"cannot check identity {self.identity} in {where}: {detail}"
            self.log.error("%s", message)
            yield TriggerEvent({"status": "error", "message": message})
        finally:
            if checkpoints is not None:
                checkpoints.store.close()

"""A tiny observer hook so the storage core can report what it did without importing Airflow.

The core runs in Kubernetes pods that only have boto3, so it cannot call Airflow's ``Stats`` itself.
Instead it calls :func:`emit` at a few points (a commit landed, files were restored, a write was fenced,
a task resumed) and whoever runs inside Airflow registers a listener (see ``airflow_stateful.metrics``).
With no listener registered, :func:`emit` costs one empty loop.

Events and their fields (all fields are plain ``str``/``int``/``float``):

* ``commit``: ``identity``, ``seq``, ``bytes`` (total size of the checkpoint's files), ``files``,
  ``duration`` (seconds, monotonic clock);
* ``restore``: ``identity``, ``seq``, ``bytes``, ``files``, ``duration``;
* ``fenced``: ``identity``, ``epoch`` (the refused writer's), ``action``;
* ``resume``: ``identity``, ``seq``, ``schema_version``;
* ``commit_failed``: ``identity``, ``error`` (the exception's class name) — a commit that raised for any reason
  but fencing (fencing is ``fenced``);
* ``progress``: ``identity``, ``since_progress`` (seconds since this writer last committed, or took the lease),
  ``expected_interval`` (seconds), ``stuck`` (1 when ``since_progress`` is past ``expected_interval``, else 0) —
  sent by a writer's heartbeat after every renewal, so a live writer that stopped committing is seen;
* ``published``: ``identity``, ``seq``, ``outputs`` (how many outputs that commit made visible), ``bytes``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("airflow_stateful")

COMMIT = "commit"
RESTORE = "restore"
FENCED = "fenced"
RESUME = "resume"
COMMIT_FAILED = "commit_failed"
PROGRESS = "progress"
PUBLISHED = "published"
EVENTS = (COMMIT, RESTORE, FENCED, RESUME, COMMIT_FAILED, PROGRESS, PUBLISHED)

Listener = Callable[[str, Mapping[str, Any]], None]

#: Registered listeners, called in order. Module-level on purpose: one process, one set of observers.
listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    """Register ``listener`` (once: adding an equal listener again is a no-op)."""
    if listener not in listeners:
        listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    """Unregister ``listener``; unknown listeners are ignored."""
    if listener in listeners:
        listeners.remove(listener)


def emit(name: str, **fields: Any) -> None:
    """Tell every listener that ``name`` happened.

    A failing listener is logged and skipped: metrics must never fail a commit that already landed.
    """
    for listener in list(listeners):
        try:
            listener(name, fields)
        except Exception:
            log.warning("stateful event listener %r failed on %r", listener, name, exc_info=True)

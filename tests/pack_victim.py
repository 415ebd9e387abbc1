"""A process that saves, restores or garbage-collects packs on a local store and SIGKILLs itself at a chosen
step: the victim of tests/test_repack.py's kill tests.

Usage: ``python pack_victim.py MODE STORE_ROOT ARG KILL_AT`` with MODE ``gc`` (ARG: keep_last), ``save`` (ARG:
the directory to save) or ``restore`` (ARG: the directory to restore the newest checkpoint into). ``KILL_AT``
is ``before:N`` or ``after:N``: the process kills itself with SIGKILL right before or right after its N-th
step (0-based); a step is a write or delete on the store (``gc``, ``save``) or a ranged GET (``restore``).
``-`` runs to the end and prints ``steps=<count>`` (how many kill points there are).

A real SIGKILL of a real process, at a step the test picks instead of a moment it hopes for: nothing runs after
it (no ``finally``, no atexit), exactly as when a worker is lost.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from typing import Any

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.fleet.gc import apply_gc, plan_gc
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="packs", task_id="kill", run_id="manual__2026-12-06T20:00:00+00:00")


def arm(store: LocalObjectStore, methods: tuple[str, ...], kill_at: str) -> list[str]:
    """Count the calls of ``methods`` as steps, killing the process at ``kill_at``."""
    steps: list[str] = []
    when, _, n = kill_at.partition(":")
    target = int(n) if n else -1

    def wrap(name: str) -> None:
        real = getattr(store, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            number = len(steps)
            steps.append(f"{name} {args[0] if args else ''}")
            if when == "before" and number == target:
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if when == "after" and number == target:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(store, name, step)

    for name in methods:
        wrap(name)
    return steps


def main(mode: str, root: str, arg: str, kill_at: str) -> None:
    store = LocalObjectStore(root=root)
    if mode == "gc":
        steps = arm(store, ("put", "delete", "delete_many"), kill_at)
        plan = plan_gc(store, min_age=timedelta(0), grace=0.0, keep_last=int(arg), expired_state=False)
        apply_gc(plan)
    elif mode == "save":
        steps = arm(store, ("put", "delete", "delete_many"), kill_at)
        cs = CheckpointStore(store=store, identity=IDENTITY)
        lease = cs.acquire(steal=True)
        cs.commit(lease, {"saved": arg}, files=arg)
        cs.release(lease)
    elif mode == "restore":
        steps = arm(store, ("get_range",), kill_at)
        cs = CheckpointStore(store=store, identity=IDENTITY)
        latest = cs.latest()
        assert latest is not None
        cs.restore_files(latest, arg)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(f"steps={len(steps)}")
    for line in steps:
        print(line)


if __name__ == "__main__":
    main(*sys.argv[1:5])

"""What several commands need and none owns: the store opened as tasks open it, stdout kept for results, one
identity's checkpoints, a progress line, and the lifetimes GC judges by.

In one place so that every verb opens, logs, reports progress and reads ``--idle-for`` and the other lifetime
options the same way (``gc`` and ``du`` must agree on what a lifetime is).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

from airflow_stateful.core.errors import CheckpointNotFoundError
from airflow_stateful.core.fleet.lifetimes import Lifetimes
from airflow_stateful.core.fleet.walk_progress import ItemProgress
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import ObjectStore

_log = logging.getLogger("airflow_stateful")


def open_store(args: argparse.Namespace) -> ObjectStore:
    """The store through :class:`~airflow_stateful.hooks.state.StateHook`, as tasks open it.

    ``--backend`` else ``[stateful] backend_url`` (``AIRFLOW__STATEFUL__BACKEND_URL`` included); S3 credentials
    and endpoint from the connection (``--conn-id`` else ``[stateful] conn_id``; a missing connection falls
    back to boto3's standard chain); ``--endpoint-url`` (or ``STATEFUL_S3_ENDPOINT_URL``) overrides the
    endpoint. The lease grace GC honours is read from the same settings.
    """
    from airflow_stateful.hooks.state import StateHook

    hook = StateHook(
        backend_url=args.backend,
        conn_id=args.conn_id,
        endpoint_url=args.endpoint_url or os.environ.get("STATEFUL_S3_ENDPOINT_URL") or None,
    )
    args.lease_grace = hook.lease_grace
    args.settings = hook.settings
    if getattr(args, "default_interval", None) is None:
        args.default_interval = timedelta(seconds=hook.settings.expected_checkpoint_interval)
    logs_to_stderr()  # after Airflow (imported above) configured logging, before boto3 logs anything
    store = hook.get_store()
    #: The deployment's head signing policy: every verb reads (and writes) heads with it.
    args.signer = hook.get_signer()
    args.marks = cli_marks(args.signer)
    return store


def cli_marks(signer: HeadSigner | None) -> MarkStore | None:
    """The high-water marks, when heads are signed and this machine can read Airflow's metadata database (where
    they are kept); else ``None``, said once on stderr when signing is on (a laptop: no database here)."""
    if signer is None:
        return None
    from airflow_stateful.cli.airflow_db import metadata_db_run_states

    reachable, where = metadata_db_run_states()
    if reachable is None:
        print(
            f"airflow-stateful: heads are not checked against their high-water marks: {where}",
            file=sys.stderr,
        )
        return None
    from airflow_stateful.marks import VariableMarks

    return VariableMarks()


def logs_to_stderr() -> None:
    """Keep stdout for results (tables, JSON): importing Airflow points logging at stdout."""
    for name in ("botocore", "boto3", "s3transfer", "urllib3", "airflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    ours = logging.getLogger("airflow_stateful")
    if not any(getattr(h, "_stateful_cli", False) for h in ours.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._stateful_cli = True  # type: ignore[attr-defined]
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def checkpoints_of(
    store: ObjectStore, key: str, *, signer: HeadSigner | None, marks: MarkStore | None = None
) -> CheckpointStore:
    """The identity's checkpoints; an identity without a head is not found (exit 4), not an empty one."""
    cs = CheckpointStore(store=store, identity=Identity.parse(key), signer=signer, marks=marks)
    if cs.head() is None:
        raise CheckpointNotFoundError(f"identity {key!r} has no state in {store.url}")
    return cs


def progress(label: str, total: int) -> ItemProgress:
    """A progress line on stderr (through the ``airflow_stateful`` logger) for a walk over ``total`` items."""
    return ItemProgress(label=label, total=total, logger=_log)


def lifetimes(args: argparse.Namespace) -> Lifetimes:
    """The options (``--idle-for``, ``--release-after-success``, ``--keep-failed-for``), else ``[stateful]``."""
    return Lifetimes.configured(
        args.settings,
        idle_for=args.idle_for,
        release_after_success=args.release_after_success,
        keep_failed_for=args.keep_failed_for,
    )

"""Opening the store a command works on: without Airflow when the environment says all it needs, else as tasks
open it (through :class:`~airflow_stateful.hooks.state.StateHook`).

Importing Airflow costs seconds per command (it configures itself, its logging, its providers). A command that
only reads the store needs three things from the installation: the ``[stateful]`` options, the connection with
the S3 credentials, and whether heads are signed. When all three can be read exactly as Airflow would read them
(:mod:`airflow_stateful.cli.environment`), Airflow is not imported; when any needs Airflow (a connection kept in
its database or a secrets backend, an option given by ``_cmd``/``_secret``, signed heads, whose high-water marks
live in its database), the command goes through Airflow, the same as before. Commands that change the store
always do.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from airflow_stateful.cli.environment import READ_ONLY_VERBS, airflow_cfg, light_connection, light_settings
from airflow_stateful.core.errors import StoreUnavailableError
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.settings import StatefulSettings
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.registry import store_from_url

_log = logging.getLogger("airflow_stateful")


def open_store(args: argparse.Namespace) -> ObjectStore:
    """The store for ``args``: ``--backend`` else ``[stateful] backend_url`` (``AIRFLOW__STATEFUL__BACKEND_URL``
    included); S3 credentials and endpoint from the connection (``--conn-id`` else ``[stateful] conn_id``; a
    missing connection falls back to boto3's standard chain); ``--endpoint-url`` (or
    ``STATEFUL_S3_ENDPOINT_URL``) overrides the endpoint. Sets ``args.settings``, ``args.lease_grace``,
    ``args.default_interval``, ``args.signer``, ``args.marks`` and ``args.airflow_imported``.

    A ``file://`` store whose directory does not exist is refused (:class:`StoreUnavailableError`, exit 2):
    nothing was written there, or the path is mistyped, and opening it creates nothing.
    """
    endpoint_url = args.endpoint_url or os.environ.get("STATEFUL_S3_ENDPOINT_URL") or None
    opened = _open_without_airflow(args, endpoint_url) if args.verb in READ_ONLY_VERBS else None
    args.airflow_imported = opened is None
    if opened is None:
        opened = _open_with_airflow(args, endpoint_url)
    store, settings, signer = opened
    args.settings = settings
    args.lease_grace = settings.lease_grace
    if getattr(args, "default_interval", None) is None:
        args.default_interval = timedelta(seconds=settings.expected_checkpoint_interval)
    args.signer = signer
    args.marks = cli_marks(signer)
    if isinstance(store, LocalObjectStore) and not store.exists():
        store.close()
        where = "--backend" if args.backend else "[stateful] backend_url"
        raise StoreUnavailableError(
            f"there is no state directory at {store.root}: nothing was ever written there, or {where} is "
            "mistyped; nothing was created"
        )
    return store


def _open_without_airflow(
    args: argparse.Namespace, endpoint_url: str | None
) -> tuple[ObjectStore, StatefulSettings, HeadSigner | None] | None:
    cfg = airflow_cfg()
    settings = light_settings(cfg)
    if cfg is None or settings is None or settings.signing_conn_id or settings.require_signed_heads:
        # An option only Airflow can resolve, or signed heads (their marks are in its database; a policy without
        # a key is refused by StateHook, with the one message for it).
        return None
    backend_url = args.backend or settings.backend_url
    options: dict[str, Any] = {}
    if urlparse(backend_url).scheme == "s3":
        conn_id = args.conn_id or settings.conn_id
        found = light_connection(conn_id, cfg) if conn_id else {}
        if found is None:
            return None  # the connection may be in Airflow's database or a secrets backend
        options = found
        if endpoint_url:
            options["endpoint_url"] = endpoint_url
    logs_to_stderr()
    return store_from_url(backend_url, **options), settings, None


def _open_with_airflow(
    args: argparse.Namespace, endpoint_url: str | None
) -> tuple[ObjectStore, StatefulSettings, HeadSigner | None]:
    from airflow_stateful.hooks.state import StateHook

    hook = StateHook(backend_url=args.backend, conn_id=args.conn_id, endpoint_url=endpoint_url)
    logs_to_stderr()  # after Airflow (imported above) configured logging, before boto3 logs anything
    store = hook.get_store()
    return store, hook.settings, hook.get_signer()


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

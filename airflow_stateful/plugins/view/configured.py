"""What the view reads from Airflow's configuration, on its first request (never at import: Airflow imports
plugins while it starts up): the store and its head-checking policy, and when a lease counts as stuck."""

from __future__ import annotations

from datetime import timedelta

from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import ObjectStore


def configured_store() -> tuple[ObjectStore, HeadSigner | None, MarkStore | None]:
    """The store of ``[stateful] backend_url``, with S3 credentials from ``[stateful] conn_id`` if any, and the
    head signing policy of ``[stateful] signing_conn_id`` every head shown is verified with, and the high-water
    marks it is checked against (the api-server reads them from the metadata database)."""
    from airflow_stateful.hooks.state import StateHook

    hook = StateHook()
    return hook.get_store(), hook.get_signer(), hook.get_marks()


def configured_interval() -> timedelta:
    """``[stateful] expected_checkpoint_interval``: when a lease holder that declared none counts as stuck."""
    from airflow_stateful.config import load_settings

    return timedelta(seconds=load_settings().expected_checkpoint_interval)

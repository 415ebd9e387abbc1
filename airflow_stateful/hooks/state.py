"""StateHook: the bridge from Airflow (config, connections, task context) to the storage core."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

from airflow.sdk import BaseHook

from airflow_stateful.config import load_settings
from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.records import WriterInfo
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.registry import store_from_url
from airflow_stateful.metrics import install as install_stats_listener

log = logging.getLogger(__name__)

# Connection extras we read, key by key; anything else in the extra is ignored (never passed through).
_EXTRA_KEYS = ("endpoint_url", "region_name", "aws_session_token", "addressing_style")


class StateHook(BaseHook):
    """Opens the checkpoint store configured in ``[stateful]``: the one way Airflow-side code (operators,
    sensors, triggers, the CLI, the UI, the state store backend) gets a store.

    :param backend_url: ``s3://bucket/prefix`` or ``file:///path``; default ``[stateful] backend_url``.
    :param conn_id: Airflow connection (type ``aws``) with S3 credentials and, for S3-compatible stores,
        ``endpoint_url`` in its extra; default ``[stateful] conn_id``. If the connection does not exist,
        boto3's standard credential chain is used.
    :param lease_ttl: seconds a lease lives after its last renewal; default ``[stateful] lease_ttl``.
    :param keep_last: checkpoints kept per identity; default ``[stateful] keep_last``.
    :param endpoint_url: an S3 endpoint that overrides the connection's (the CLI's ``--endpoint-url``).
    """

    conn_name_attr = "conn_id"
    default_conn_name = "aws_default"
    conn_type = "aws"
    hook_name = "Stateful checkpoint store"

    def __init__(
        self,
        *,
        backend_url: str | None = None,
        conn_id: str | None = None,
        lease_ttl: float | None = None,
        keep_last: int | None = None,
        endpoint_url: str | None = None,
    ) -> None:
        super().__init__()
        install_stats_listener()  # report commits, restores, fencing to Airflow's [metrics] backend
        settings = load_settings()
        self.backend_url = backend_url or settings.backend_url
        self.conn_id = conn_id or settings.conn_id
        self.lease_ttl = lease_ttl or settings.lease_ttl
        self.lease_grace = settings.lease_grace
        self.keep_last = keep_last or settings.keep_last
        self.endpoint_url = endpoint_url
        self._store: ObjectStore | None = None

    def s3_options(self) -> dict[str, Any]:
        """boto3 options from the Airflow connection, or ``{}`` to use the standard credential chain."""
        if not self.conn_id:
            return {}
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = self.get_connection(self.conn_id)
        except AirflowNotFoundException:
            log.debug("connection %r not found; using boto3's standard credential chain", self.conn_id)
            return {}
        extra = conn.extra_dejson or {}
        options: dict[str, Any] = {}
        if conn.login:
            options["aws_access_key_id"] = conn.login
        if conn.password:
            options["aws_secret_access_key"] = conn.password
        for key in _EXTRA_KEYS:
            if extra.get(key):
                options[key] = extra[key]
        # The amazon provider also accepts the endpoint in service_config.s3 or (older) the host field.
        service = extra.get("service_config")
        if "endpoint_url" not in options and isinstance(service, dict):
            endpoint = (service.get("s3") or {}).get("endpoint_url")
            if endpoint:
                options["endpoint_url"] = endpoint
        if "endpoint_url" not in options and conn.host and urlparse(conn.host).scheme in ("http", "https"):
            options["endpoint_url"] = conn.host
        return options

    def get_store(self) -> ObjectStore:
        """The configured store (opened once per hook)."""
        if self._store is None:
            options: dict[str, Any] = {}
            if urlparse(self.backend_url).scheme == "s3":
                options = self.s3_options()
                if self.endpoint_url:
                    options["endpoint_url"] = self.endpoint_url
            self._store = store_from_url(self.backend_url, **options)
        return self._store

    def get_conn(self) -> ObjectStore:
        return self.get_store()

    def close(self) -> None:
        """Release the store's connections and threads (a no-op if it was never opened)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def checkpoint_store(self, identity: Identity) -> CheckpointStore:
        return CheckpointStore(
            store=self.get_store(), identity=identity, keep_last=self.keep_last, lease_ttl=self.lease_ttl
        )

    @staticmethod
    def identity_for(context: Any, *, name: str | None = None) -> Identity:
        """The identity of the running task: per DAG run, or across runs when ``name`` is given."""
        ti = context["ti"]
        run_id = None if name else context["dag_run"].run_id
        return Identity.for_task(
            dag_id=ti.dag_id, task_id=ti.task_id, map_index=ti.map_index, run_id=run_id, name=name
        )

    @staticmethod
    def writer_for(context: Any) -> WriterInfo:
        """Who is writing: dag, run, try, map index, Airflow's dag_version_id (when known) and host."""
        ti = context["ti"]
        version = getattr(ti, "dag_version_id", None)
        return WriterInfo.current(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            run_id=context["dag_run"].run_id,
            map_index=ti.map_index,
            try_number=ti.try_number,
            dag_version_id=str(version) if version else None,
        )

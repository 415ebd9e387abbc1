"""StateHook: the bridge from Airflow (config, connections, task context) to the storage core."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

from airflow.sdk import BaseHook

from airflow_stateful.config import load_settings
from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.registry import store_from_url
from airflow_stateful.metrics import install as install_stats_listener
from airflow_stateful.s3_connection import (
    ConnectionFields,
    connection_source,
    missing_connection_source,
    s3_options,
)

log = logging.getLogger(__name__)


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
        settings = self.settings = load_settings()
        self.backend_url = backend_url or settings.backend_url
        self.conn_id = conn_id or settings.conn_id
        self.lease_ttl = lease_ttl or settings.lease_ttl
        self.lease_grace = settings.lease_grace
        self.keep_last = keep_last or settings.keep_last
        self.endpoint_url = endpoint_url
        self._store: ObjectStore | None = None
        self._signer: HeadSigner | None = None
        self._credential_source: str | None = None  # set by s3_options(), in words, for the store's errors

    @property
    def credential_source(self) -> str | None:
        """Where the S3 credentials come from, in words (never a secret), once :meth:`s3_options` has run:
        the connection, or boto3's chain because the connection holds no key or does not exist. ``None``
        before, or without ``conn_id``. Errors and ``airflow-stateful check`` name it."""
        return self._credential_source

    def s3_options(self) -> dict[str, Any]:
        """S3 store options from the ``aws`` connection (:func:`airflow_stateful.s3_connection.s3_options`: the
        amazon provider's keys, each checked), or ``{}`` to use boto3's standard credential chain when there is
        no connection. The result holds the connection's secrets: it goes to the store's constructor only."""
        if not self.conn_id:
            return {}
        from airflow_stateful.compat import AirflowNotFoundException

        try:
            conn = self.get_connection(self.conn_id)
        except AirflowNotFoundException:
            log.debug("connection %r not found; using boto3's standard credential chain", self.conn_id)
            self._credential_source = missing_connection_source(self.conn_id)
            return {}
        extra = conn.extra_dejson or {}
        if not isinstance(extra, dict):
            raise ConfigurationError(f"connection {self.conn_id!r}: the extra must be a JSON object")
        options = s3_options(
            ConnectionFields(
                conn_id=self.conn_id, login=conn.login, password=conn.password, host=conn.host, extra=extra
            )
        )
        self._credential_source = connection_source(self.conn_id, options)
        return options

    def get_store(self) -> ObjectStore:
        """The configured store (opened once per hook, with its head signing policy: :meth:`get_signer`)."""
        if self._store is None:
            options: dict[str, Any] = {}
            if urlparse(self.backend_url).scheme == "s3":
                options = self.s3_options()
                if self._credential_source is not None:
                    # Named by every error of missing or refused credentials: a mistyped conn_id shows there.
                    options["credential_source"] = self._credential_source
                if self.endpoint_url:
                    options["endpoint_url"] = self.endpoint_url
            store = store_from_url(self.backend_url, **options)
            # Read with the store, so a signing policy that is misconfigured fails where the store opens.
            self._signer = self.head_signer()
            self._store = store
        return self._store

    def get_signer(self) -> HeadSigner | None:
        """The head signing policy every reader and writer on :meth:`get_store` must use (``None``: none).

        Signing is a protocol concern, not the byte store's: pass this as ``signer=`` to whatever reads heads
        from the store (:meth:`checkpoint_store` does), or a required signature is not checked there.
        """
        self.get_store()
        return self._signer

    def head_signer(self) -> HeadSigner | None:
        """The deployment's head signing key from ``[stateful] signing_conn_id`` (its password), or ``None``.

        The key id is the connection's extra ``key_id``, else the connection id. A configured connection that
        is missing or has no password is an error: silently not signing would defeat the point.
        """
        conn_id = self.settings.signing_conn_id
        if not conn_id:
            if self.settings.require_signed_heads:
                raise ConfigurationError(
                    "[stateful] require_signed_heads is set but signing_conn_id is empty: name the connection "
                    "whose password is the signing key"
                )
            return None
        from airflow_stateful.compat import AirflowNotFoundException

        try:
            conn = self.get_connection(conn_id)
        except AirflowNotFoundException:
            raise ConfigurationError(
                f"[stateful] signing_conn_id names the connection {conn_id!r}, which does not exist"
            ) from None
        if not conn.password:
            raise ConfigurationError(f"connection {conn_id!r} has no password to sign head records with")
        key_id = (conn.extra_dejson or {}).get("key_id") or conn_id
        return HeadSigner(
            key=conn.password.encode("utf-8"), key_id=str(key_id), required=self.settings.require_signed_heads
        )

    def get_marks(self) -> MarkStore | None:
        """Where the identities' high-water marks are kept, when heads are signed (:mod:`airflow_stateful.marks`:
        Airflow's metadata database); ``None`` without signing, where a mark would stop nothing."""
        if self.get_signer() is None:
            return None
        from airflow_stateful.marks import VariableMarks

        return VariableMarks()

    def get_conn(self) -> ObjectStore:
        return self.get_store()

    def close(self) -> None:
        """Release the store's connections and threads (a no-op if it was never opened)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def checkpoint_store(self, identity: Identity) -> CheckpointStore:
        return CheckpointStore(
            store=self.get_store(),
            identity=identity,
            signer=self.get_signer(),
            marks=self.get_marks(),
            keep_last=self.keep_last,
            lease_ttl=self.lease_ttl,
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

"""StateHook: the bridge from Airflow (config, connections, task context) to the storage core."""

from __future__ import annotations

import logging
import re
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
from airflow_stateful.core.stores.s3_options import (
    check_assume_role,
    check_config_kwargs,
    check_request_args,
    check_verify,
)
from airflow_stateful.metrics import install as install_stats_listener

log = logging.getLogger(__name__)

# The amazon provider's `aws` connection, read key by key; anything else in the extra is ignored (never passed
# through), so a connection shared with the amazon provider's own hooks keeps working. Values are checked
# (airflow_stateful.core.stores.s3_options) before the store is built, with errors naming the extra key.
_TEXT_EXTRAS = ("region_name", "profile_name", "role_arn", "endpoint_url", "addressing_style")
#: service_config.s3.extra_args -> S3ObjectStore argument. These are boto3's names, the ones S3Hook's
#: `extra_args` takes: the amazon provider has no connection-level setting for encryption or the owner.
EXTRA_ARGS = {
    "ServerSideEncryption": "server_side_encryption",
    "SSEKMSKeyId": "sse_kms_key_id",
    "BucketKeyEnabled": "bucket_key_enabled",
    "ExpectedBucketOwner": "expected_bucket_owner",
}
_WHERE = {
    "server_side_encryption": "service_config.s3.extra_args.ServerSideEncryption",
    "sse_kms_key_id": "service_config.s3.extra_args.SSEKMSKeyId",
    "bucket_key_enabled": "service_config.s3.extra_args.BucketKeyEnabled",
    "expected_bucket_owner": "service_config.s3.extra_args.ExpectedBucketOwner",
}
_SESSION_NAME_INVALID = re.compile(r"[^\w+=,.@-]")


def _mapping(parent: dict[str, Any], key: str, *, what: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigurationError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _text(parent: dict[str, Any], key: str, *, what: str, secret: bool = False) -> str | None:
    value = parent.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        shown = type(value).__name__ if secret else repr(value)
        raise ConfigurationError(f"{what} must be a string, not {shown}")
    return value


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

    def s3_options(self) -> dict[str, Any]:
        """S3 store options from the ``aws`` connection, or ``{}`` to use boto3's standard credential chain.

        Read the amazon provider's way, so a connection made for its hooks works here unchanged: keys from
        login/password (else the extra's ``aws_access_key_id``/``aws_secret_access_key``), ``aws_session_token``,
        ``region_name``, ``profile_name``, ``role_arn`` with ``assume_role_method`` (``assume_role`` only) and
        ``assume_role_kwargs``, ``verify``, ``config_kwargs``, and the endpoints: ``service_config.s3.endpoint_url``,
        else ``endpoint_url`` (else an http(s) host), with STS at ``service_config.sts.endpoint_url``.
        Encryption and the expected owner are ``service_config.s3.extra_args`` in boto3's names
        (:data:`EXTRA_ARGS`). Every value is checked here, before anything is written; an error names the
        connection and the extra key, never a secret.

        The result holds the connection's secrets: it goes to the store's constructor and nowhere else.
        """
        if not self.conn_id:
            return {}
        from airflow_stateful.compat import AirflowNotFoundException

        try:
            conn = self.get_connection(self.conn_id)
        except AirflowNotFoundException:
            log.debug("connection %r not found; using boto3's standard credential chain", self.conn_id)
            return {}
        name = f"connection {self.conn_id!r}"

        def where(key: str) -> str:
            return f"{name} extra {key}"

        extra = conn.extra_dejson or {}
        if not isinstance(extra, dict):
            raise ConfigurationError(f"{name}: the extra must be a JSON object")
        service = _mapping(extra, "service_config", what=where("service_config"))
        s3_service = _mapping(service, "s3", what=where("service_config.s3"))
        sts_service = _mapping(service, "sts", what=where("service_config.sts"))
        extra_args = _mapping(s3_service, "extra_args", what=where("service_config.s3.extra_args"))

        options: dict[str, Any] = {}
        # Credentials, in the amazon provider's order: both of login/password, else both from the extra.
        if conn.login and conn.password:
            options["aws_access_key_id"], options["aws_secret_access_key"] = conn.login, conn.password
        else:
            key_id = _text(extra, "aws_access_key_id", what=where("aws_access_key_id"))
            secret = _text(extra, "aws_secret_access_key", what=where("aws_secret_access_key"), secret=True)
            if key_id and secret:
                options["aws_access_key_id"], options["aws_secret_access_key"] = key_id, secret
        token = _text(extra, "aws_session_token", what=where("aws_session_token"), secret=True)
        if token:
            options["aws_session_token"] = token
        for key in _TEXT_EXTRAS:
            value = _text(extra, key, what=where(key))
            if value:
                options[key] = value
        # The service's own endpoint wins over the global one, as in the amazon provider.
        endpoint = _text(s3_service, "endpoint_url", what=where("service_config.s3.endpoint_url"))
        if endpoint:
            options["endpoint_url"] = endpoint
        if "endpoint_url" not in options and conn.host and urlparse(conn.host).scheme in ("http", "https"):
            options["endpoint_url"] = conn.host
        sts_endpoint = _text(sts_service, "endpoint_url", what=where("service_config.sts.endpoint_url"))
        if sts_endpoint:
            options["sts_endpoint_url"] = sts_endpoint
        if extra.get("verify") is not None:
            options["verify"] = check_verify(extra["verify"], source=where)
        if extra.get("config_kwargs") is not None:
            options["config_kwargs"] = check_config_kwargs(extra["config_kwargs"], source=where)
        self._assume_role_options(extra, options, where)

        unknown = sorted(str(k) for k in extra_args if k not in EXTRA_ARGS)
        if unknown:
            raise ConfigurationError(
                f"{where('service_config.s3.extra_args')} has the unsupported key(s) "
                f"{', '.join(map(repr, unknown))}; accepted: {', '.join(EXTRA_ARGS)}"
            )
        for key, option in EXTRA_ARGS.items():
            if extra_args.get(key) is not None:
                options[option] = extra_args[key]

        def source(option: str) -> str:
            return where(_WHERE[option])

        check_request_args(options, source=source)
        return options

    def _assume_role_options(self, extra: dict[str, Any], options: dict[str, Any], where: Any) -> None:
        """``role_arn``, ``assume_role_method`` and ``assume_role_kwargs``, as the amazon provider reads them."""
        role_arn = options.get("role_arn")
        if not role_arn:
            return
        method = extra.get("assume_role_method") or "assume_role"
        if method != "assume_role":
            raise ConfigurationError(
                f"{where('assume_role_method')} {method!r} is not supported here, only 'assume_role'. For web "
                "identity (IRSA, EKS pod identity), leave role_arn out: boto3's standard chain reads "
                "AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE by itself."
            )
        kwargs = dict(_mapping(extra, "assume_role_kwargs", what=where("assume_role_kwargs")))
        # The amazon provider's default session name, so CloudTrail shows the same one for both.
        default_name = _SESSION_NAME_INVALID.sub("", f"Airflow_{self.conn_id}")[:64]
        kwargs.setdefault("RoleSessionName", default_name)
        check_assume_role(role_arn, kwargs, source=where)
        options["assume_role_kwargs"] = kwargs

    def get_store(self) -> ObjectStore:
        """The configured store (opened once per hook, with its head signing policy: :meth:`get_signer`)."""
        if self._store is None:
            options: dict[str, Any] = {}
            if urlparse(self.backend_url).scheme == "s3":
                options = self.s3_options()
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

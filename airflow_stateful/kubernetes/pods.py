"""What a pod is told: :class:`PodState` (the identity, its lease, the store) and the variables that carry it.

The in-pod client reads everything from ``STATEFUL_*`` variables (read back by
:class:`~airflow_stateful.client.settings.PodSettings`). None of them holds a credential: the lease token and
the head signing key are never literals in the pod spec (which ``get pods``, audit logs, events and the
provider's debug log of the creation request all show); the variables refer to a Secret of their own, one
per pod lease (:func:`lease_secret_name`; the Secret itself is built in
:mod:`airflow_stateful.kubernetes.lease_secrets`). The S3 settings are picked by name
(:func:`pod_s3_fields`), so no key, token or role can slip through.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client import models as k8s

from airflow_stateful.core.protocol.lease import Lease
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.stores.s3_options import pod_config_kwargs
from airflow_stateful.kubernetes.labels import (
    EPOCH_LABEL,
    IDENTITY_LABEL,
    RUN_LABEL,
    identity_label,
    run_label,
)

#: The variable the in-pod client reads its lease token from, and the key of the token in the lease Secret.
LEASE_TOKEN_ENV = "STATEFUL_LEASE_TOKEN"
LEASE_SECRET_KEY = "lease-token"
SIGNING_SECRET_KEY = "signing-key"
SIGNING_KEY_ENV = "STATEFUL_SIGNING_KEY"
#: Variables from the downward API: the client records them as the checkpoint's writer (``node``, ``pod``).
DOWNWARD_ENV = {"NODE_NAME": "spec.nodeName", "POD_NAME": "metadata.name"}


def pod_s3_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`PodState` S3 fields from ``StateHook.s3_options()``: what a pod may be told, nothing else.

    Picked by name, so no credential (keys, session token) and no role can slip through: the pod gets its
    credentials from boto3's chain (workload identity or ``credentials_secret``), never from the operator.
    The pod must write as the workers do, so it gets the encryption, the KMS key id, the bucket-key flag, the
    expected owner, the endpoint and region, the botocore settings that describe the bucket (retries,
    timeouts, addressing style), and ``verify=False`` if the connection turned TLS verification off. Not
    given: a CA bundle path (a file on the worker, not in the pod's image: set ``AWS_CA_BUNDLE`` in the pod),
    proxies (a proxy URL may hold a password; pods use ``HTTPS_PROXY``), ``profile_name`` and ``role_arn``.
    """
    config = pod_config_kwargs(
        options.get("config_kwargs") or {}, addressing_style=options.get("addressing_style")
    )
    return {
        "endpoint_url": options.get("endpoint_url"),
        "region_name": options.get("region_name"),
        "server_side_encryption": options.get("server_side_encryption"),
        "sse_kms_key_id": options.get("sse_kms_key_id"),
        "bucket_key_enabled": options.get("bucket_key_enabled"),
        "expected_bucket_owner": options.get("expected_bucket_owner"),
        "verify": False if options.get("verify") is False else None,
        "config_kwargs": config or None,
    }


@dataclass(frozen=True)
class PodState:
    """What the pod is told: the identity, the lease it writes with, where the state lives, how to renew."""

    identity: Identity
    lease: Lease
    run_id: str
    backend_url: str
    keep_last: int
    lease_ttl: float
    schema_version: int
    endpoint_url: str | None = None
    region_name: str | None = None
    server_side_encryption: str | None = None
    sse_kms_key_id: str | None = None
    bucket_key_enabled: bool | None = None
    expected_bucket_owner: str | None = None
    verify: bool | None = None
    """Only ``False`` reaches the pod (``STATEFUL_S3_VERIFY``); see :func:`pod_s3_fields`."""
    config_kwargs: Mapping[str, Any] | None = None
    head_signer: HeadSigner | None = None
    """The signer of this identity's heads, if the deployment signs: the key derived for this identity only
    (:meth:`~airflow_stateful.core.records.integrity.HeadSigner.for_identity`), never the deployment's. Its id and
    policy reach the pod as variables, the key only through the pod's lease Secret (``STATEFUL_SIGNING_KEY``)."""

    def labels(self) -> dict[str, str]:
        return {
            IDENTITY_LABEL: identity_label(self.identity),
            EPOCH_LABEL: str(self.lease.epoch),
            RUN_LABEL: run_label(self.run_id),
        }

    def env(self, *, image: str | None, context: Any | None = None) -> list[k8s.V1EnvVar]:
        """The ``STATEFUL_*`` variables the in-pod client reads (no credentials among them), and
        ``NODE_NAME``/``POD_NAME`` from the downward API.

        The S3 settings are ``STATEFUL_S3_<OPTION>`` (read back by
        :class:`~airflow_stateful.client.settings.PodSettings`), so the pod writes with the same encryption and
        expected owner as the workers.
        """
        values: dict[str, str | None] = {
            "STATEFUL_IDENTITY": self.identity.key,
            "STATEFUL_BACKEND_URL": self.backend_url,
            "STATEFUL_EPOCH": str(self.lease.epoch),
            "STATEFUL_LEASE_TTL": f"{self.lease_ttl:g}",
            "STATEFUL_SCHEMA_VERSION": str(self.schema_version),
            "STATEFUL_KEEP_LAST": str(self.keep_last),
            "STATEFUL_S3_ENDPOINT_URL": self.endpoint_url,
            "STATEFUL_S3_SERVER_SIDE_ENCRYPTION": self.server_side_encryption,
            "STATEFUL_S3_SSE_KMS_KEY_ID": self.sse_kms_key_id,
            "STATEFUL_S3_BUCKET_KEY_ENABLED": (
                None if self.bucket_key_enabled is None else str(self.bucket_key_enabled).lower()
            ),
            "STATEFUL_S3_EXPECTED_BUCKET_OWNER": self.expected_bucket_owner,
            "STATEFUL_S3_VERIFY": "false" if self.verify is False else None,
            # Filtered again here: a proxy URL (which may hold a password) never reaches the pod spec.
            "STATEFUL_S3_CONFIG_KWARGS": (
                json.dumps(pod_config_kwargs(self.config_kwargs), sort_keys=True)
                if self.config_kwargs
                else None
            ),
            "STATEFUL_IMAGE": image,
            "STATEFUL_SIGNING_KEY_ID": self.head_signer.key_id if self.head_signer else None,
            "STATEFUL_REQUIRE_SIGNED_HEADS": "true"
            if self.head_signer and self.head_signer.required
            else None,
        }
        if context is not None:
            ti = context["ti"]
            values.update(
                STATEFUL_DAG_ID=ti.dag_id,
                STATEFUL_TASK_ID=ti.task_id,
                STATEFUL_RUN_ID=context["dag_run"].run_id,
                STATEFUL_TRY_NUMBER=str(ti.try_number),
                STATEFUL_MAP_INDEX=str(ti.map_index),
            )
        env = [k8s.V1EnvVar(name=k, value=v) for k, v in values.items() if v]
        env.extend(downward_env())  # the node and pod the checkpoints record as their writer's
        env.append(lease_token_env(self))  # from the pod's lease Secret, never a literal value
        if self.head_signer is not None:
            env.append(secret_env(self, SIGNING_KEY_ENV, SIGNING_SECRET_KEY))
        if self.region_name:
            env.append(k8s.V1EnvVar(name="AWS_DEFAULT_REGION", value=self.region_name))
        return env

    def reference(self, latest: Manifest | None) -> dict[str, Any]:
        """The XCom ``checkpoint``: where the final checkpoint is and which one it is."""
        return {
            "identity": self.identity.key,
            "url": self.backend_url,
            "seq": latest.seq if latest else None,
            "epoch": self.lease.epoch,
            "schema_version": latest.schema_version if latest else self.schema_version,
            "image": latest.extra.get("image") if latest else None,
        }


PodStatePlan = PodState
"""The earlier name of :class:`PodState` (in development builds), kept for old imports (from here and from
:mod:`airflow_stateful.operators.kubernetes`)."""


def pod_state(
    session: WriterSession,
    *,
    run_id: str,
    schema_version: int,
    backend_url: str,
    keep_last: int,
    s3_options: Mapping[str, Any],
    endpoint_url: str | None,
    head_signer: HeadSigner | None,
) -> PodState:
    """What the pod of ``session`` is told: its lease, the store as the workers use it, the S3 settings.

    ``s3_options`` are the connection's (``StateHook.s3_options()``), picked by name (:func:`pod_s3_fields`):
    encryption, expected owner, endpoint, region, botocore settings; never its login, password, session
    token, profile or role. ``endpoint_url`` (the operator's ``s3_endpoint_url``) wins over the connection's.
    """
    return PodState(
        identity=session.identity,
        lease=session.lease,
        run_id=run_id,
        backend_url=backend_url,
        keep_last=keep_last,
        lease_ttl=session.checkpoints.lease_ttl,
        schema_version=schema_version,
        **{**pod_s3_fields(s3_options), "endpoint_url": endpoint_url or s3_options.get("endpoint_url")},
        # A pod, and whoever can exec into it or read its Secret, gets this identity's key only.
        head_signer=head_signer.for_identity(session.identity.key) if head_signer is not None else None,
    )


def downward_env() -> list[k8s.V1EnvVar]:
    """``NODE_NAME`` (``spec.nodeName``) and ``POD_NAME`` (``metadata.name``), resolved by the kubelet: every
    checkpoint a pod writes records them (``manifest.writer.node``/``pod``), so the next pod can prefer the
    node whose restore cache holds its chunks."""
    return [
        k8s.V1EnvVar(
            name=name,
            value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path)),
        )
        for name, path in DOWNWARD_ENV.items()
    ]


def lease_secret_name(state: PodState) -> str:
    """The name of the Secret that holds ``state``'s lease token: one per pod lease, stable for that lease.

    Derived from the lease alone (identity, epoch, token), so the name is known before the pod is rendered,
    a retried create recognises its own Secret, and no two leases — not even after an identity's state was
    wiped and its epochs start again — share one (a pod would otherwise read an old token and be fenced).
    The token is a random UUID, so 16 hex digits of a hash of it give nothing away.
    """
    material = "\0".join((state.identity.key, str(state.lease.epoch), state.lease.token))
    return f"stateful-lease-e{state.lease.epoch}-{hashlib.sha256(material.encode('utf-8')).hexdigest()[:16]}"


def secret_env(state: PodState, name: str, key: str) -> k8s.V1EnvVar:
    """Variable ``name`` from ``key`` of the pod's lease Secret: the kubelet resolves it when a container starts."""
    return k8s.V1EnvVar(
        name=name,
        value_from=k8s.V1EnvVarSource(
            secret_key_ref=k8s.V1SecretKeySelector(name=lease_secret_name(state), key=key)
        ),
    )


def lease_token_env(state: PodState) -> k8s.V1EnvVar:
    """``STATEFUL_LEASE_TOKEN`` from the pod's lease Secret."""
    return secret_env(state, LEASE_TOKEN_ENV, LEASE_SECRET_KEY)

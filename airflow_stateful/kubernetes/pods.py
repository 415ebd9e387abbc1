"""Labels that find an identity's pods, the choice of the pod to reattach to, and the state parts of a pod.

A pod carries three labels: ``stateful-identity`` (which state it writes), ``stateful-epoch`` (the lease
epoch it was started with) and ``stateful-run`` (the DAG run it belongs to; a named identity lives across
runs). The operator finds every pod of an identity by the first, reattaches only to the one that still holds
the lease for this run, and deletes the others: they are fenced, so stopping them only saves compute.

The pod's lease token is never a literal in the pod spec (which ``get pods``, audit logs, events and the
provider's debug log of the creation request all show): it is in a Secret of its own, one per pod lease,
owned by the pod so that Kubernetes deletes it with the pod (:func:`lease_secret`).

Warm placement: every container that runs the client learns its node and pod name from the downward API
(``NODE_NAME``, ``POD_NAME``), so each checkpoint records where it was written. With a restore cache on the
node (:class:`RestoreCache`, a ``hostPath`` volume) the next pod *prefers* that node (:func:`prefer_node`):
a soft node affinity, never a required one.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from kubernetes.client import models as k8s

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.protocol.lease import Lease
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.stores.s3_options import pod_config_kwargs

IDENTITY_LABEL = "stateful-identity"
EPOCH_LABEL = "stateful-epoch"
RUN_LABEL = "stateful-run"
STATE_VOLUME = "stateful-state"
RESTORE_CONTAINER = "stateful-restore"
SIDECAR_CONTAINER = "stateful-sidecar"
STATE_MODES = ("wrap", "sidecar", "init", "env")
CLIENT_COMMAND = ("python", "-m", "airflow_stateful.client")
#: The variable the in-pod client reads its lease token from, and the key of the token in the lease Secret.
LEASE_TOKEN_ENV = "STATEFUL_LEASE_TOKEN"
LEASE_SECRET_KEY = "lease-token"
SIGNING_SECRET_KEY = "signing-key"
SIGNING_KEY_ENV = "STATEFUL_SIGNING_KEY"
#: Where the node's restore cache (a ``hostPath`` volume) is mounted in the containers that run the client.
RESTORE_CACHE_VOLUME = "stateful-restore-cache"
RESTORE_CACHE_MOUNT = "/var/cache/airflow-stateful"
RESTORE_CACHE_DIR_ENV = "STATEFUL_RESTORE_CACHE_DIR"
RESTORE_CACHE_MAX_BYTES_ENV = "STATEFUL_RESTORE_CACHE_MAX_BYTES"
#: Variables from the downward API: the client records them as the checkpoint's writer (``node``, ``pod``).
DOWNWARD_ENV = {"NODE_NAME": "spec.nodeName", "POD_NAME": "metadata.name"}
#: The weight of the preference for the node of the last writer (the highest Kubernetes allows).
PREFERRED_NODE_WEIGHT = 100
#: Environment names that would put a credential into the pod spec as a literal value.
SECRET_ENV_NAMES = frozenset({"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"})
_TERMINAL_PHASES = ("Succeeded", "Failed")
_LABEL_MAX = 63
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ESCAPES = {"_": "__", "/": "_s", "=": "_e", "%": "_p", "+": "_a"}


def identity_label(identity: Identity) -> str:
    """A Kubernetes label value (<= 63 chars of ``[A-Za-z0-9._-]``) that stands for ``identity`` alone.

    Short keys are escaped readably and reversibly (``/`` -> ``_s``, ``=`` -> ``_e``, ``%`` -> ``_p``,
    ``+`` -> ``_a``, ``_`` -> ``__``), so two identities never share a label. Longer keys become a readable
    prefix plus 16 hex digits of the key's SHA-256; an escaped key never ends in ``-`` and 16 hex digits
    (it ends in its map index), so the two forms cannot collide either.
    """
    escaped = "".join(_ESCAPES.get(ch, ch) for ch in identity.key)
    if len(escaped) <= _LABEL_MAX and _LABEL_VALUE_RE.match(escaped):
        return escaped
    digest = hashlib.sha256(identity.key.encode("utf-8")).hexdigest()[:16]
    prefix = re.sub(r"^[^A-Za-z0-9]+", "", escaped)[: _LABEL_MAX - len(digest) - 1].rstrip("._-")
    return f"{prefix}-{digest}" if prefix else f"h{digest}"


def run_label(run_id: str) -> str:
    """A label value for a DAG run id (which may hold ``:`` and ``+``): 16 hex digits of its SHA-256."""
    return "r" + hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:16]


def pod_epoch(pod: k8s.V1Pod) -> int | None:
    """The epoch a pod was started with (its ``stateful-epoch`` label), or ``None``."""
    raw = ((pod.metadata and pod.metadata.labels) or {}).get(EPOCH_LABEL)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def _pod_env(pod: k8s.V1Pod, name: str) -> str | None:
    containers = [*(pod.spec.containers or []), *(pod.spec.init_containers or [])] if pod.spec else []
    for container in containers:
        for env in container.env or []:
            if env.name == name:
                return str(env.value) if env.value is not None else None
    return None


def terminated(pod: k8s.V1Pod | None) -> bool:
    return bool(pod is not None and pod.status and pod.status.phase in _TERMINAL_PHASES)


def _deleting(pod: k8s.V1Pod) -> bool:
    return bool(pod.metadata and pod.metadata.deletion_timestamp)


def choose_pods(
    pods: Iterable[k8s.V1Pod],
    *,
    head: HeadRecord | None,
    run_id: str,
    schema_version: int,
    checked_label: str,
) -> tuple[k8s.V1Pod | None, list[k8s.V1Pod]]:
    """Split the identity's pods into the one to reattach to (or ``None``) and the stale ones to delete.

    A pod is reattached to only if it still holds the lease (its epoch is the head's and the lease is held),
    belongs to this DAG run, runs this code's schema version, is neither terminated nor being deleted, and
    was not already handled by an earlier try (``checked_label``, KubernetesPodOperator's). Every other live
    pod is stale: it is fenced, so it can no longer commit. Terminated pods are left to
    KubernetesPodOperator's ``on_finish_action``.
    """
    live = [p for p in pods if not terminated(p) and not _deleting(p)]
    chosen: k8s.V1Pod | None = None
    if head is not None and head.lease is not None:
        for pod in live:
            labels = (pod.metadata and pod.metadata.labels) or {}
            if (
                pod_epoch(pod) == head.epoch
                and labels.get(RUN_LABEL) == run_label(run_id)
                and labels.get(checked_label) != "True"
                and _pod_env(pod, "STATEFUL_SCHEMA_VERSION") == str(schema_version)
            ):
                chosen = pod
                break
    return chosen, [p for p in live if p is not chosen]


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
    """The deployment's head signing key, if any: its id and policy reach the pod as variables, the key itself
    only through the pod's lease Secret (``STATEFUL_SIGNING_KEY``)."""

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


@dataclass(frozen=True)
class RestoreCache:
    """The node's restore cache: a ``hostPath`` directory the client keeps verified chunks in.

    The client restores through it (chunks found there are not downloaded) and fills it after each save, so
    a pod that lands on the node of the last writer restores mostly from local disk. See docs/kubernetes.md,
    "Warm placement", for who else on the node can read it.
    """

    host_path: str
    max_bytes: int

    def volume(self) -> k8s.V1Volume:
        return k8s.V1Volume(
            name=RESTORE_CACHE_VOLUME,
            host_path=k8s.V1HostPathVolumeSource(path=self.host_path, type="DirectoryOrCreate"),
        )

    def mount(self) -> k8s.V1VolumeMount:
        return k8s.V1VolumeMount(name=RESTORE_CACHE_VOLUME, mount_path=RESTORE_CACHE_MOUNT)

    def env(self) -> list[k8s.V1EnvVar]:
        return [
            k8s.V1EnvVar(name=RESTORE_CACHE_DIR_ENV, value=RESTORE_CACHE_MOUNT),
            k8s.V1EnvVar(name=RESTORE_CACHE_MAX_BYTES_ENV, value=str(self.max_bytes)),
        ]


def check_restore_cache_host_path(value: Any, *, state_dir: str) -> str:
    """``restore_cache_host_path`` as given, if it is an absolute, normalised directory on the node; else
    InvalidValueError naming the value. ``state_dir`` must not overlap the cache's mount (the cache would be
    saved with the state, or hide it)."""
    text = value if isinstance(value, str) else None
    parts = PurePosixPath(text).parts if text else ()
    if (
        text is None
        or not text.startswith("/")
        or len(parts) < 2
        or any(p in (".", "..") for p in text.split("/"))
        or "\0" in text
    ):
        raise InvalidValueError(
            "restore_cache_host_path must be an absolute directory on the node below / (without '.' or '..' "
            f"parts), not {value!r}"
        )
    state, mount = PurePosixPath(state_dir), PurePosixPath(RESTORE_CACHE_MOUNT)
    if state == mount or mount in state.parents or state in mount.parents:
        raise InvalidValueError(
            f"state_dir {state_dir!r} overlaps {RESTORE_CACHE_MOUNT}, where the restore cache is mounted; "
            "choose another state_dir"
        )
    return text.rstrip("/")


def _preferred_node_term(node: str) -> k8s.V1PreferredSchedulingTerm:
    requirement = k8s.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])
    return k8s.V1PreferredSchedulingTerm(
        weight=PREFERRED_NODE_WEIGHT, preference=k8s.V1NodeSelectorTerm(match_fields=[requirement])
    )


def prefer_node(affinity: k8s.V1Affinity | None, node: str) -> k8s.V1Affinity:
    """A copy of ``affinity`` that also *prefers* node ``node`` (a weight-100 ``preferred...`` term matching
    ``metadata.name``); every term of ``affinity`` is kept and its required terms are never touched, so the
    pod still runs anywhere it could run before when ``node`` is gone or full. Adding it twice adds it once."""
    merged = copy.deepcopy(affinity) if affinity is not None else k8s.V1Affinity()
    if merged.node_affinity is None:
        merged.node_affinity = k8s.V1NodeAffinity()
    term = _preferred_node_term(node)
    preferred = list(merged.node_affinity.preferred_during_scheduling_ignored_during_execution or [])
    if term not in preferred:
        preferred.append(term)
    merged.node_affinity.preferred_during_scheduling_ignored_during_execution = preferred
    return merged


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


def lease_secret_ref(pod: k8s.V1Pod) -> str | None:
    """The Secret a (rendered or running) pod reads its lease token from, or ``None`` (no stateful env)."""
    containers = [*(pod.spec.containers or []), *(pod.spec.init_containers or [])] if pod.spec else []
    for container in containers:
        for env in container.env or []:
            ref = env.value_from.secret_key_ref if env.name == LEASE_TOKEN_ENV and env.value_from else None
            if ref is not None:
                return str(ref.name)
    return None


def lease_secret(state: PodState, *, owner: k8s.V1Pod, name: str | None = None) -> k8s.V1Secret:
    """The Secret holding ``state``'s lease token, owned by the running pod ``owner`` (which has a uid).

    The owner reference makes Kubernetes' garbage collector delete the Secret once the pod is gone, however
    it goes: deleted after success or failure, by ``on_kill`` (after its grace period: the pod still runs and
    saves until then), as a stale pod by a later try, or by hand. So it is created right after the pod (the
    kubelet waits for a missing Secret, retrying, before it starts the containers) and never needs deleting.
    ``blockOwnerDeletion`` stays unset: setting it would need update rights on ``pods/finalizers``. The
    Secret is immutable: its token cannot be edited in place under a running pod, and kubelets need not
    watch it.
    """
    meta = owner.metadata
    if meta is None or not meta.uid or not meta.name:
        raise InvalidValueError("the lease Secret's owner must be a created pod (with a name and a uid)")
    return k8s.V1Secret(
        api_version="v1",
        kind="Secret",
        type="Opaque",
        immutable=True,
        metadata=k8s.V1ObjectMeta(
            name=name or lease_secret_name(state),
            namespace=meta.namespace,
            labels=state.labels(),
            owner_references=[
                k8s.V1OwnerReference(api_version="v1", kind="Pod", name=meta.name, uid=meta.uid)
            ],
        ),
        data={
            LEASE_SECRET_KEY: base64.b64encode(state.lease.token.encode("utf-8")).decode("ascii"),
            **(
                {SIGNING_SECRET_KEY: base64.b64encode(state.head_signer.key).decode("ascii")}
                if state.head_signer is not None
                else {}
            ),
        },
    )


@dataclass(frozen=True)
class PodParts:
    """How the operator's pod arguments change to carry the state (built by :func:`state_parts`)."""

    env_vars: list[k8s.V1EnvVar]
    env_from: list[k8s.V1EnvFromSource]
    volumes: list[k8s.V1Volume]
    volume_mounts: list[k8s.V1VolumeMount]
    init_containers: list[k8s.V1Container]
    cmds: list[str]
    arguments: list[str]


def state_parts(
    state: PodState,
    *,
    mode: str,
    user_env: Sequence[k8s.V1EnvVar],
    env_from: Sequence[k8s.V1EnvFromSource],
    volumes: Sequence[k8s.V1Volume],
    volume_mounts: Sequence[k8s.V1VolumeMount],
    init_containers: Sequence[k8s.V1Container],
    cmds: Sequence[str],
    arguments: Sequence[str],
    image: str | None,
    context: Any | None,
    state_dir: str,
    save_every_seconds: int,
    client_image: str | None,
    client_command: Sequence[str],
    credentials_secret: str | None,
    restore_cache: RestoreCache | None = None,
    runtime_env: Sequence[k8s.V1EnvVar] = (),
) -> PodParts:
    """The operator's pod arguments plus the state: env, volume, init/sidecar containers or the wrapper.

    :param restore_cache: the node's restore cache, mounted (with its ``STATEFUL_RESTORE_CACHE_*`` variables)
        into every container that runs the client: the restoring init container and the sidecar, and the
        main container in ``wrap``, ``init`` and ``env`` modes (where it runs the client itself); never into
        the unchanged job container of ``sidecar`` mode.
    :param runtime_env: KubernetesPodOperator's ``pod_runtime_info_envs``, added to the main container after
        this: a ``NODE_NAME`` or ``POD_NAME`` there (or in ``user_env``) is the user's and is kept.
    """
    for env in user_env:
        if env.name in SECRET_ENV_NAMES and env.value:
            raise InvalidValueError(
                f"env_vars sets {env.name} as a literal value, which puts a credential into the pod spec; "
                "pass credentials_secret=<Kubernetes Secret name> or use workload identity instead"
            )
    stateful_env = state.env(image=image, context=context)
    cache_env = restore_cache.env() if restore_cache is not None else []
    client_env = [*stateful_env, *cache_env]
    users = {e.name for e in [*user_env, *runtime_env]}
    # The main container: the user's own NODE_NAME/POD_NAME win (the client reads whatever they hold).
    main_env = [e for e in stateful_env if not (e.name in DOWNWARD_ENV and e.name in users)]
    if mode != "sidecar":
        main_env += cache_env  # the main container runs the client itself
    ours = {e.name for e in main_env}
    secret_ref = (
        [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=credentials_secret))]
        if credentials_secret
        else []
    )
    parts = PodParts(
        env_vars=[e for e in user_env if e.name not in ours] + main_env,
        # In sidecar mode the job's own container is left as it is: no credentials for it.
        env_from=[*env_from, *secret_ref] if mode != "sidecar" else list(env_from),
        volumes=list(volumes),
        volume_mounts=list(volume_mounts),
        init_containers=list(init_containers),
        cmds=list(cmds),
        arguments=list(arguments),
    )
    cache_mounts = [restore_cache.mount()] if restore_cache is not None else []
    if restore_cache is not None:
        parts.volumes.append(restore_cache.volume())
        if mode != "sidecar":
            parts.volume_mounts.extend(cache_mounts)
    if mode == "env":
        return parts
    mount = k8s.V1VolumeMount(name=STATE_VOLUME, mount_path=state_dir)
    parts.volumes.append(k8s.V1Volume(name=STATE_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource()))
    parts.volume_mounts.append(mount)
    every = f"{save_every_seconds}s"
    if mode == "wrap":
        if not cmds:
            raise InvalidValueError(
                "state_mode='wrap' needs cmds (the image's entrypoint cannot be wrapped); "
                "give cmds=[...] or use state_mode='sidecar'"
            )
        wrapped = [*client_command, "run", "--dir", state_dir, "--every", every, "--", *cmds, *arguments]
        return PodParts(**{**parts.__dict__, "cmds": wrapped, "arguments": []})

    def client(name: str, command: list[str], restart_policy: str | None = None) -> k8s.V1Container:
        return k8s.V1Container(
            name=name,
            image=client_image,
            command=command,
            env=list(client_env),
            env_from=list(secret_ref),
            volume_mounts=[mount, *cache_mounts],
            restart_policy=restart_policy,
        )

    added = [client(RESTORE_CONTAINER, [*client_command, "restore", state_dir])]
    if mode == "sidecar":
        # A native sidecar (an init container that keeps running): renews the lease, saves every
        # `save_every`, and once more on SIGTERM, which the kubelet sends when the job ends or the pod is deleted.
        command = [*client_command, "sidecar", "--dir", state_dir, "--every", every]
        added.append(client(SIDECAR_CONTAINER, command, restart_policy="Always"))
    parts.init_containers[:0] = added
    return parts


def has_failed_sidecar(remote_pod: k8s.V1Pod | None) -> int | None:
    """The exit code of the state sidecar if it ended with an error, else ``None``."""
    statuses = (remote_pod.status.init_container_statuses if remote_pod and remote_pod.status else None) or []
    for status in statuses:
        done = status.state.terminated if status.state else None
        if status.name == SIDECAR_CONTAINER and done is not None and done.exit_code != 0:
            return int(done.exit_code)
    return None

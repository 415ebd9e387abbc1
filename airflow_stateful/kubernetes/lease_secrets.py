"""The pod's lease Secret: which one a pod reads, and the Secret itself, owned by the pod.

The lease token (and the head signing key, if any) reach the pod only through this Secret, one per pod
lease, so they never appear in the pod spec. The Secret is owned by the pod, so Kubernetes deletes it with
the pod, however the pod goes: nothing has to clean it up.
"""

from __future__ import annotations

import base64

from kubernetes.client import models as k8s

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.kubernetes.pods import (
    LEASE_SECRET_KEY,
    LEASE_TOKEN_ENV,
    SIGNING_SECRET_KEY,
    PodState,
    lease_secret_name,
)


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

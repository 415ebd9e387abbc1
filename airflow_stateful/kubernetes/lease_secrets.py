"""The pod's lease Secret: which one a pod reads, and the Secret itself, owned by the pod.

The lease token (and the head signing key, if any) reach the pod only through this Secret, one per pod
lease, so they never appear in the pod spec. The Secret is owned by the pod, so Kubernetes deletes it with
the pod, however the pod goes: nothing has to clean it up.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable

from airflow.sdk.exceptions import AirflowException
from kubernetes.client import CoreV1Api
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.kubernetes.pods import (
    LEASE_SECRET_KEY,
    LEASE_TOKEN_ENV,
    SIGNING_SECRET_KEY,
    PodState,
    lease_secret_name,
)

log = logging.getLogger("airflow_stateful")


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


def api_message(exc: ApiException) -> str:
    """The ``message`` of the API server's Status answer (it never echoes a Secret's data), else the reason.

    Used instead of the exception's text, which is the whole HTTP exchange.
    """
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


def create_lease_secret(client: CoreV1Api, state: PodState, pod: k8s.V1Pod) -> None:
    """Create the Secret ``pod`` reads its lease token from, owned by ``pod``; keep it if it exists.

    The Secret's name is a function of the lease (and is read from the pod itself), so the one that exists
    (409) after a reattaching try or a retried create is this pod's own, with this very token. It is kept only
    if it is exactly that (:func:`check_existing_secret`): a Secret created by someone else under that name
    would hand the pod a token and key its creator knows, so the pod is not started. A pod rendered without a
    lease Secret (with the token as a literal) needs none. Any other refusal is an AirflowException that names
    what the worker's service account lacks.
    """
    name = lease_secret_ref(pod)
    if name is None:
        return
    body = lease_secret(state, owner=pod, name=name)
    try:
        client.create_namespaced_secret(namespace=pod.metadata.namespace, body=body)
    except ApiException as exc:
        if exc.status != 409:
            # Not chained: the exception's text is the whole HTTP exchange; the API's message is enough.
            raise AirflowException(
                f"could not create the lease Secret {name} for pod {pod.metadata.name} in namespace "
                f"{pod.metadata.namespace}: HTTP {exc.status} {api_message(exc)}; the worker's service "
                "account needs create on secrets there (docs/kubernetes.md)"
            ) from None
        check_existing_secret(client, body, pod)
        log.info("keeping the existing lease Secret %s of pod %s", name, pod.metadata.name)
    else:
        log.info("created the lease Secret %s, owned by pod %s", name, pod.metadata.name)


class ForeignLeaseSecret(AirflowException):
    """A Secret under the lease Secret's name that this pod's operator did not create."""


def check_existing_secret(client: CoreV1Api, expected: k8s.V1Secret, pod: k8s.V1Pod) -> None:
    """Raise unless the Secret named like ``expected`` is owned by ``pod`` (its uid) and holds exactly the data
    ``expected`` holds (the lease token, and the identity's signing key if any). The message names the Secret
    and what differs, never its data."""
    meta = expected.metadata
    try:
        found = client.read_namespaced_secret(name=meta.name, namespace=meta.namespace)
    except ApiException as exc:
        raise AirflowException(
            f"the lease Secret {meta.name} exists in namespace {meta.namespace} but could not be read to check "
            f"it: HTTP {exc.status} {api_message(exc)}; the worker's service account needs get on secrets there"
        ) from None
    owners = (found.metadata.owner_references or []) if found.metadata else []
    problems = []
    if not any(o.kind == "Pod" and o.uid == pod.metadata.uid for o in owners):
        problems.append(f"it is not owned by pod {pod.metadata.name} (uid {pod.metadata.uid})")
    if (found.data or {}) != (expected.data or {}):
        problems.append("it does not hold this lease's token and key")
    if problems:
        raise ForeignLeaseSecret(
            f"a Secret named {meta.name} already exists in namespace {meta.namespace}, but {' and '.join(problems)}: "
            "it was not created for this pod, whose token and key its creator would know. The pod is not "
            "started; delete that Secret if it is stale, and find out who created it."
        )


def reattach_lease_secret(
    client: CoreV1Api, state: PodState, pod: k8s.V1Pod, *, delete: Callable[[k8s.V1Pod], object]
) -> None:
    """The lease Secret of a pod a later try reattaches to. Normally it exists and is kept (409); if the worker
    died between creating the pod and its Secret, the pod is still waiting for it: it is created now, from the
    lease in the head. Someone else's Secret under that name means the pod must not run (on) with a token and
    key they know: the pod is deleted and :class:`ForeignLeaseSecret` raised."""
    try:
        create_lease_secret(client, state, pod)
    except ForeignLeaseSecret:
        delete_pod_without_secret(pod, delete=delete)
        raise


def delete_pod_without_secret(pod: k8s.V1Pod, *, delete: Callable[[k8s.V1Pod], object]) -> None:
    """Delete ``pod``, whose lease Secret could not be created, with ``delete`` (the provider's pod manager).

    The pod could never start (the kubelet waits for the Secret), and KubernetesPodOperator's cleanup skips
    a pod it never saw. A failure to delete it is logged, not raised: the caller is already raising the
    reason the Secret failed, which matters more.
    """
    try:
        delete(pod)
    except Exception:
        log.exception("could not delete pod %s, which has no lease Secret", pod.metadata.name)

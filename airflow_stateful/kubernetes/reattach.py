"""Which of an identity's pods to reattach to, and which are stale.

The operator finds every pod of an identity by its label (:func:`find_pods`), reattaches only to the one that
still holds the lease for this run (adopting that lease: :func:`adopt_lease`), and deletes the others: they
are fenced, so stopping them only saves compute (:func:`delete_stale_pods`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kubernetes.client import CoreV1Api
from kubernetes.client import models as k8s

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.lease import lease_of
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.kubernetes.labels import RUN_LABEL, identity_selector, pod_epoch, run_label
from airflow_stateful.kubernetes.results import terminated

log = logging.getLogger("airflow_stateful")


def find_pods(client: CoreV1Api, namespace: str, identity: Identity) -> list[k8s.V1Pod]:
    """Every pod of ``identity`` in ``namespace`` (any run, try or epoch), found by label."""
    selector = identity_selector(identity)
    return list(client.list_namespaced_pod(namespace=namespace, label_selector=selector).items)


def _pod_env(pod: k8s.V1Pod, name: str) -> str | None:
    containers = [*(pod.spec.containers or []), *(pod.spec.init_containers or [])] if pod.spec else []
    for container in containers:
        for env in container.env or []:
            if env.name == name:
                return str(env.value) if env.value is not None else None
    return None


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


def adopt_lease(
    checkpoints: CheckpointStore, pod: k8s.V1Pod, *, writer: WriterInfo, schema_version: int
) -> WriterSession:
    """An open writer session on the lease the running ``pod`` holds (no new epoch), renewed for that pod.

    The pod was chosen by :func:`choose_pods`, so the head holds its lease. The lease is this task
    instance's: the session releases it when it closes, once the pod is over.
    """
    head = checkpoints.head()
    assert head is not None and head.lease is not None
    log.info(
        "reattaching to pod %s, which holds the lease of %s at epoch %d",
        pod.metadata.name,
        checkpoints.identity,
        head.epoch,
    )
    return WriterSession(
        checkpoints=checkpoints,
        writer=writer,
        schema_version=schema_version,
        lease=lease_of(checkpoints.identity, head.lease),
        release_on_close=True,  # the lease is this task instance's: release it when the pod is over
    ).open()


def delete_stale_pods(
    pods: Iterable[k8s.V1Pod], *, identity: Identity, delete: Callable[[k8s.V1Pod], object]
) -> None:
    """Delete each of ``identity``'s stale ``pods`` with ``delete`` (the provider's pod manager), saying why.

    This try holds the lease, so they are fenced and can no longer commit: deleting them stops wasted
    compute and loses no saved work.
    """
    for pod in pods:
        log.warning(
            "deleting pod %s of %s: it has epoch %s, an older writer that is fenced",
            pod.metadata.name,
            identity,
            pod_epoch(pod),
        )
        delete(pod)

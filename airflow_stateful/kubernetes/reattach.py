"""Which of an identity's pods to reattach to, and which are stale.

The operator finds every pod of an identity by its label, reattaches only to the one that still holds the
lease for this run, and deletes the others: they are fenced, so stopping them only saves compute.
"""

from __future__ import annotations

from collections.abc import Iterable

from kubernetes.client import models as k8s

from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.kubernetes.labels import RUN_LABEL, pod_epoch, run_label
from airflow_stateful.kubernetes.results import terminated


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

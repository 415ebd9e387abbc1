"""Warm placement: which node a pod should prefer, and the soft node affinity that says so.

Every container that runs the client learns its node from the downward API (``NODE_NAME``), so each
checkpoint records where it was written. With a restore cache on the nodes
(:class:`~airflow_stateful.kubernetes.restore_cache.RestoreCache`) the next pod *prefers* that node: a
soft node affinity, never a required one, so a lost or full node never blocks the retry.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from airflow.providers.cncf.kubernetes.backcompat.backwards_compat_converters import convert_affinity
from kubernetes.client import models as k8s

from airflow_stateful.core.records.manifests import Manifest

log = logging.getLogger("airflow_stateful")

#: The weight of the preference for the node of the last writer (the highest Kubernetes allows).
PREFERRED_NODE_WEIGHT = 100


def node_to_prefer(latest: Manifest | None, start: Manifest | None, *, cache: bool) -> str | None:
    """The node whose restore cache holds the files the pod restores, or ``None``; logs which, or why not.

    ``latest`` is the newest checkpoint and ``start`` the one the writer session started from: a migration
    commits on the worker, but keeps ``start``'s files, so ``start`` names the node. Without the restore
    cache (``cache`` false) no node holds anything worth preferring.
    """
    if not cache:
        log.debug("no node preference: restore_cache_host_path is not set (no restore cache on the nodes)")
        return None
    if latest is None or start is None or not latest.has_files:
        log.info(
            "no node preference: %s",
            "there is no checkpoint yet"
            if latest is None
            else f"checkpoint {latest.seq} has no files to restore",
        )
        return None
    node = start.writer.node
    if not node:
        log.info(
            "no node preference: checkpoint %d records no node (written by %s, outside Kubernetes or by a "
            "pod without NODE_NAME)",
            start.seq,
            start.writer.describe(),
        )
        return None
    log.info(
        "preferring node %s, where checkpoint %d was written (its restore cache holds its chunks); not "
        "required: the pod runs anywhere if %s is gone",
        node,
        start.seq,
        node,
    )
    return node


def prefer_node_in(pod: k8s.V1Pod, node: str | None) -> None:
    """Add the preference for ``node`` (none if ``None``) to the finished ``pod``'s affinity, in place.

    Added to the finished pod, after pod templates, ``full_pod_spec`` and ``pod_mutation_hook`` set theirs,
    so every term they set is kept (the provider's merge would replace a template's affinity).
    """
    if node is not None and pod.spec is not None:
        pod.spec.affinity = prefer_node(as_affinity(pod.spec.affinity), node)


def as_affinity(value: Any) -> k8s.V1Affinity | None:
    """A pod's affinity as a ``V1Affinity``, or ``None``: KubernetesPodOperator leaves ``{}`` when there is
    none, and a mutation hook may set a dict; :func:`prefer_node` needs the model to merge into."""
    if not value:
        return None
    if isinstance(value, k8s.V1Affinity):
        return value
    return convert_affinity(value)


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

"""Warm placement: the soft node affinity that makes a pod prefer the node of the last writer.

Every container that runs the client learns its node from the downward API (``NODE_NAME``), so each
checkpoint records where it was written. With a restore cache on the nodes
(:class:`~airflow_stateful.kubernetes.restore_cache.RestoreCache`) the next pod *prefers* that node: a
soft node affinity, never a required one, so a lost or full node never blocks the retry.
"""

from __future__ import annotations

import copy

from kubernetes.client import models as k8s

#: The weight of the preference for the node of the last writer (the highest Kubernetes allows).
PREFERRED_NODE_WEIGHT = 100


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

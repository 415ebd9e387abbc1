"""How a pod ended, read from its status: whether it is over, and whether the state sidecar's save failed.

Kept apart from the pod spec because the operator reads these from the pod the API server returns, after the
pod ran: to decide whether a pod is stale, whether its lease can be released, and whether its last work was
saved.
"""

from __future__ import annotations

from kubernetes.client import models as k8s

from airflow_stateful.kubernetes.spec import SIDECAR_CONTAINER

_TERMINAL_PHASES = ("Succeeded", "Failed")


def terminated(pod: k8s.V1Pod | None) -> bool:
    """Whether ``pod`` is over (``Succeeded`` or ``Failed``); ``None`` (no pod yet) is not."""
    return bool(pod is not None and pod.status and pod.status.phase in _TERMINAL_PHASES)


def has_failed_sidecar(remote_pod: k8s.V1Pod | None) -> int | None:
    """The exit code of the state sidecar if it ended with an error, else ``None``."""
    statuses = (remote_pod.status.init_container_statuses if remote_pod and remote_pod.status else None) or []
    for status in statuses:
        done = status.state.terminated if status.state else None
        if status.name == SIDECAR_CONTAINER and done is not None and done.exit_code != 0:
            return int(done.exit_code)
    return None

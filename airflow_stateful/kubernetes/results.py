"""How a pod ended: whether it is over, whether the state sidecar's save failed, whether its saves counted.

Kept apart from the pod spec because the operator reads these from the pod the API server returns and from the
head, after the pod ran: to decide whether a pod is stale, whether its lease can be released, and whether its
last work is in the checkpoint (:func:`check_pod_result`).
"""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowException
from kubernetes.client import models as k8s

from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.kubernetes.pods import PodState
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


def check_pod_result(
    state: PodState, *, head: HeadRecord | None, remote_pod: k8s.V1Pod | None, sidecar: bool
) -> None:
    """Raise AirflowException unless the finished pod's work can be in the checkpoint.

    The pod's saves count only while its lease is the head's: a newer try or pod that took over refused the
    rest. In sidecar mode (``sidecar``) the sidecar's final save must also have succeeded, or the latest
    checkpoint may miss the pod's last work.
    """
    if head is None or head.epoch != state.lease.epoch:
        raise AirflowException(
            f"the pod finished, but {state.identity} is now at epoch {head.epoch if head else None}, not "
            f"{state.lease.epoch}: a newer try or pod took over, so this pod's saves after that were refused"
        )
    code = has_failed_sidecar(remote_pod) if sidecar else None
    if code is not None:
        raise AirflowException(
            f"the state sidecar's final save failed with exit code {code} (3: fenced by a newer writer); "
            "the latest checkpoint may miss the pod's last work"
        )

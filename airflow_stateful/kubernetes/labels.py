"""The labels that find an identity's pods, and what a pod's labels say.

A pod carries three labels: ``stateful-identity`` (which state it writes), ``stateful-epoch`` (the lease
epoch it was started with) and ``stateful-run`` (the DAG run it belongs to; a named identity lives across
runs). Label values are short and restricted, so identities and run ids are escaped or hashed into them;
kept apart from the pod spec because the operator also reads them back from running pods.
"""

from __future__ import annotations

import hashlib
import re

from kubernetes.client import models as k8s

from airflow_stateful.core.records.identity import Identity

IDENTITY_LABEL = "stateful-identity"
EPOCH_LABEL = "stateful-epoch"
RUN_LABEL = "stateful-run"
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
    if len(escaped) <= _LABEL_MAX and _LABEL_VALUE_RE.fullmatch(escaped):
        return escaped
    digest = hashlib.sha256(identity.key.encode("utf-8")).hexdigest()[:16]
    prefix = re.sub(r"^[^A-Za-z0-9]+", "", escaped)[: _LABEL_MAX - len(digest) - 1].rstrip("._-")
    return f"{prefix}-{digest}" if prefix else f"h{digest}"


def identity_selector(identity: Identity) -> str:
    """The label selector of every pod of ``identity`` (any run, try or epoch). Like KubernetesPodOperator's
    own, it leaves out pods labelled ``airflow-worker`` (KubernetesExecutor's worker pods): only the job's
    pods are the identity's."""
    return f"{IDENTITY_LABEL}={identity_label(identity)},!airflow-worker"


def run_label(run_id: str) -> str:
    """A label value for a DAG run id (which may hold ``:`` and ``+``): 16 hex digits of its SHA-256."""
    return "r" + hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:16]


def pod_epoch(pod: k8s.V1Pod) -> int | None:
    """The epoch a pod was started with (its ``stateful-epoch`` label), or ``None``."""
    raw = ((pod.metadata and pod.metadata.labels) or {}).get(EPOCH_LABEL)
    return int(raw) if raw is not None and str(raw).isdigit() else None

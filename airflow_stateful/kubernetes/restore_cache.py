"""The node's restore cache: a ``hostPath`` directory the client keeps verified chunks in, and its checks.

Kept apart from the rest of the pod spec because it is the one volume that outlives the pod (a directory on
the node, shared by the pods that land there); see docs/kubernetes.md, "Warm placement".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from kubernetes.client import models as k8s

from airflow_stateful.core.errors import InvalidValueError

#: Where the node's restore cache (a ``hostPath`` volume) is mounted in the containers that run the client.
RESTORE_CACHE_VOLUME = "stateful-restore-cache"
RESTORE_CACHE_MOUNT = "/var/cache/airflow-stateful"
RESTORE_CACHE_DIR_ENV = "STATEFUL_RESTORE_CACHE_DIR"
RESTORE_CACHE_MAX_BYTES_ENV = "STATEFUL_RESTORE_CACHE_MAX_BYTES"


@dataclass(frozen=True)
class RestoreCache:
    """The node's restore cache: a ``hostPath`` directory the client keeps verified chunks in.

    The client restores through it (chunks found there are not downloaded) and fills it after each save, so
    a pod that lands on the node of the last writer restores mostly from local disk. See docs/kubernetes.md,
    "Warm placement", for who else on the node can read it.
    """

    host_path: str
    max_bytes: int

    @classmethod
    def on_nodes(cls, host_path: str | None, *, max_bytes: int) -> RestoreCache | None:
        """The cache at ``host_path`` on every node, or ``None``: no ``restore_cache_host_path``, no cache."""
        return None if host_path is None else cls(host_path=host_path, max_bytes=max_bytes)

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


def check_restore_cache_arguments(host_path: Any, max_bytes: Any, *, state_dir: str) -> str | None:
    """The operator's ``restore_cache_host_path`` checked (:func:`check_restore_cache_host_path`; ``None``:
    no cache), then its ``restore_cache_max_bytes``: a whole number of bytes from 1 to 2**50 (``True`` is not
    one), else InvalidValueError naming the value. The size is checked even without a cache, so a typo fails
    when the DAG is parsed rather than when the cache is turned on."""
    if host_path is not None:
        host_path = check_restore_cache_host_path(host_path, state_dir=state_dir)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or not 1 <= max_bytes <= 1 << 50:
        raise InvalidValueError(
            f"restore_cache_max_bytes must be a number of bytes from 1 to 2**50, not {max_bytes!r}"
        )
    return host_path

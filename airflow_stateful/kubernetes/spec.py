"""The state parts of a pod spec: the operator's pod arguments plus the env, volumes and client containers.

How the state reaches the pod depends on ``state_mode`` (see :func:`state_parts`): the main container's
command wrapped by the client, an init container that restores and a native sidecar that saves, only the
restoring init container, or only the variables. The result is handed back to KubernetesPodOperator as its
own pod arguments, so pod templates, ``full_pod_spec`` and the cluster's
``pod_mutation_hook`` see the additions like any other part of the pod.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client import models as k8s

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.kubernetes.pods import DOWNWARD_ENV, PodState
from airflow_stateful.kubernetes.restore_cache import RestoreCache

STATE_VOLUME = "stateful-state"
RESTORE_CONTAINER = "stateful-restore"
SIDECAR_CONTAINER = "stateful-sidecar"
STATE_MODES = ("wrap", "sidecar", "init", "env")
CLIENT_COMMAND = ("python", "-m", "airflow_stateful.client")
#: Environment names that would put a credential into the pod spec as a literal value.
SECRET_ENV_NAMES = frozenset({"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"})


@dataclass(frozen=True)
class PodParts:
    """How the operator's pod arguments change to carry the state (built by :func:`state_parts`)."""

    env_vars: list[k8s.V1EnvVar]
    env_from: list[k8s.V1EnvFromSource]
    volumes: list[k8s.V1Volume]
    volume_mounts: list[k8s.V1VolumeMount]
    init_containers: list[k8s.V1Container]
    cmds: list[str]
    arguments: list[str]


def state_parts(
    state: PodState,
    *,
    mode: str,
    user_env: Sequence[k8s.V1EnvVar],
    env_from: Sequence[k8s.V1EnvFromSource],
    volumes: Sequence[k8s.V1Volume],
    volume_mounts: Sequence[k8s.V1VolumeMount],
    init_containers: Sequence[k8s.V1Container],
    cmds: Sequence[str],
    arguments: Sequence[str],
    image: str | None,
    context: Any | None,
    state_dir: str,
    save_every_seconds: int,
    client_image: str | None,
    client_command: Sequence[str],
    credentials_secret: str | None,
    restore_cache: RestoreCache | None = None,
    runtime_env: Sequence[k8s.V1EnvVar] = (),
) -> PodParts:
    """The operator's pod arguments plus the state: env, volume, init/sidecar containers or the wrapper.

    :param restore_cache: the node's restore cache, mounted (with its ``STATEFUL_RESTORE_CACHE_*`` variables)
        into every container that runs the client: the restoring init container and the sidecar, and the
        main container in ``wrap``, ``init`` and ``env`` modes (where it runs the client itself); never into
        the unchanged job container of ``sidecar`` mode.
    :param runtime_env: KubernetesPodOperator's ``pod_runtime_info_envs``, added to the main container after
        this: a ``NODE_NAME`` or ``POD_NAME`` there (or in ``user_env``) is the user's and is kept.
    """
    for env in user_env:
        if env.name in SECRET_ENV_NAMES and env.value:
            raise InvalidValueError(
                f"env_vars sets {env.name} as a literal value, which puts a credential into the pod spec; "
                "pass credentials_secret=<Kubernetes Secret name> or use workload identity instead"
            )
    stateful_env = state.env(image=image, context=context)
    cache_env = restore_cache.env() if restore_cache is not None else []
    client_env = [*stateful_env, *cache_env]
    users = {e.name for e in [*user_env, *runtime_env]}
    # The main container: the user's own NODE_NAME/POD_NAME win (the client reads whatever they hold).
    main_env = [e for e in stateful_env if not (e.name in DOWNWARD_ENV and e.name in users)]
    if mode != "sidecar":
        main_env += cache_env  # the main container runs the client itself
    ours = {e.name for e in main_env}
    secret_ref = (
        [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=credentials_secret))]
        if credentials_secret
        else []
    )
    parts = PodParts(
        env_vars=[e for e in user_env if e.name not in ours] + main_env,
        # In sidecar mode the job's own container is left as it is: no credentials for it.
        env_from=[*env_from, *secret_ref] if mode != "sidecar" else list(env_from),
        volumes=list(volumes),
        volume_mounts=list(volume_mounts),
        init_containers=list(init_containers),
        cmds=list(cmds),
        arguments=list(arguments),
    )
    cache_mounts = [restore_cache.mount()] if restore_cache is not None else []
    if restore_cache is not None:
        parts.volumes.append(restore_cache.volume())
        if mode != "sidecar":
            parts.volume_mounts.extend(cache_mounts)
    if mode == "env":
        return parts
    mount = k8s.V1VolumeMount(name=STATE_VOLUME, mount_path=state_dir)
    parts.volumes.append(k8s.V1Volume(name=STATE_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource()))
    parts.volume_mounts.append(mount)
    every = f"{save_every_seconds}s"
    if mode == "wrap":
        if not cmds:
            raise InvalidValueError(
                "state_mode='wrap' needs cmds (the image's entrypoint cannot be wrapped); "
                "give cmds=[...] or use state_mode='sidecar'"
            )
        wrapped = [*client_command, "run", "--dir", state_dir, "--every", every, "--", *cmds, *arguments]
        return PodParts(**{**parts.__dict__, "cmds": wrapped, "arguments": []})

    def client(name: str, command: list[str], restart_policy: str | None = None) -> k8s.V1Container:
        return k8s.V1Container(
            name=name,
            image=client_image,
            command=command,
            env=list(client_env),
            env_from=list(secret_ref),
            volume_mounts=[mount, *cache_mounts],
            restart_policy=restart_policy,
        )

    added = [client(RESTORE_CONTAINER, [*client_command, "restore", state_dir])]
    if mode == "sidecar":
        # A native sidecar (an init container that keeps running): renews the lease, saves every
        # `save_every`, and once more on SIGTERM, which the kubelet sends when the job ends or the pod is deleted.
        command = [*client_command, "sidecar", "--dir", state_dir, "--every", every]
        added.append(client(SIDECAR_CONTAINER, command, restart_policy="Always"))
    parts.init_containers[:0] = added
    return parts

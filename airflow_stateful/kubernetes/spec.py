"""The state parts of a pod spec: the operator's pod arguments plus the env, volumes and client containers.

How the state reaches the pod depends on ``state_mode`` (see :func:`state_parts`): the main container's
command wrapped by the client, an init container that restores and a native sidecar that saves, only the
restoring init container, or only the variables. The result is handed back to KubernetesPodOperator as its
own pod arguments (:data:`POD_ARGUMENTS`), so pod templates, ``full_pod_spec`` and the cluster's
``pod_mutation_hook`` see the additions like any other part of the pod.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from airflow.providers.cncf.kubernetes.backcompat.backwards_compat_converters import (
    convert_env_vars_or_raise_error,
)
from kubernetes.client import models as k8s

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.kubernetes.pods import DOWNWARD_ENV, LEASE_TOKEN_ENV, SIGNING_KEY_ENV, PodState
from airflow_stateful.kubernetes.restore_cache import RestoreCache

STATE_VOLUME = "stateful-state"
RESTORE_CONTAINER = "stateful-restore"
SIDECAR_CONTAINER = "stateful-sidecar"
STATE_MODES = ("wrap", "sidecar", "init", "env")
CLIENT_COMMAND = ("python", "-m", "airflow_stateful.client")
#: Environment names that would put a credential into the pod spec as a literal value.
SECRET_ENV_NAMES = frozenset({"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"})
CLIENT_SECRET_ENV = frozenset({LEASE_TOKEN_ENV, SIGNING_KEY_ENV})
"""What only a container running the client may hold (from the lease Secret)."""
#: KubernetesPodOperator's arguments that :func:`state_parts` changes: the fields of :class:`PodParts`.
POD_ARGUMENTS = ("env_vars", "env_from", "volumes", "volume_mounts", "init_containers", "cmds", "arguments")


def check_state_arguments(
    *, state_mode: str, state_dir: str, save_every: Any, client_image: str | None
) -> str:
    """``state_dir`` without trailing ``/``, if the operator's state arguments can make a pod spec; else
    InvalidValueError naming the argument. Checked when the DAG is parsed, so a wrong value never reaches a
    pod (``state_mode`` itself is checked by the operator, before these)."""
    if not state_dir.startswith("/") or state_dir.rstrip("/") == "":
        raise InvalidValueError(f"state_dir must be an absolute path below /, not {state_dir!r}")
    if not isinstance(save_every, timedelta) or save_every < timedelta(seconds=1):
        raise InvalidValueError(f"save_every must be a timedelta of at least 1 s, not {save_every!r}")
    if state_mode in ("sidecar", "init") and not client_image:
        raise InvalidValueError(f"state_mode={state_mode!r} needs client_image (an image with the client)")
    return state_dir.rstrip("/")


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
    else:
        # The unchanged job container runs no client: it gets neither the lease token (which would let it
        # commit past the sidecar) nor the signing key. Only the restoring and saving containers hold them.
        main_env = [e for e in main_env if e.name not in CLIENT_SECRET_ENV]
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


class PodArguments(Protocol):
    """The (rendered) arguments of a StatefulKubernetesPodOperator that its pod is made from: the provider's
    pod arguments and the stateful ones. A protocol, so this module needs no operator to build a spec."""

    env_vars: Any
    env_from: Any
    volumes: Any
    volume_mounts: Any
    init_containers: Any
    cmds: Any
    arguments: Any
    image: Any
    pod_runtime_info_envs: Any
    state_mode: str
    state_dir: str
    save_every: timedelta
    client_image: str | None
    client_command: Any
    credentials_secret: str | None

    @property
    def restore_cache(self) -> RestoreCache | None: ...


@contextmanager
def stateful_pod_arguments(op: PodArguments, state: PodState, context: Any | None) -> Iterator[None]:
    """Within the block, ``op``'s pod arguments (:data:`POD_ARGUMENTS`) carry the state; afterwards, even on
    an error, they are ``op``'s own again.

    The provider builds the pod from its operator's arguments, so the state goes in through them (and pod
    templates, ``full_pod_spec`` and ``pod_mutation_hook`` see it like any other part of the pod); a second
    build or a retried try must start from the user's arguments, not from the ones with the state added.
    The arguments are read as rendered for this try (``client_image`` and ``credentials_secret`` are
    templated); ``env_vars`` may be a dict or a ``V1EnvVar`` list, as KubernetesPodOperator takes them.
    """
    saved = {name: getattr(op, name) for name in POD_ARGUMENTS}
    parts = state_parts(
        state,
        mode=op.state_mode,
        user_env=convert_env_vars_or_raise_error(op.env_vars) if op.env_vars else [],
        env_from=op.env_from,
        volumes=op.volumes,
        volume_mounts=op.volume_mounts,
        init_containers=op.init_containers,
        cmds=op.cmds,
        arguments=op.arguments,
        image=op.image,
        context=context,
        state_dir=op.state_dir,
        save_every_seconds=int(op.save_every.total_seconds()),
        client_image=op.client_image,
        client_command=op.client_command,
        credentials_secret=op.credentials_secret,
        restore_cache=op.restore_cache,
        runtime_env=op.pod_runtime_info_envs or [],
    )
    try:
        for name in POD_ARGUMENTS:
            setattr(op, name, getattr(parts, name))
        yield
    finally:
        for name, value in saved.items():
            setattr(op, name, value)

"""StatefulKubernetesPodOperator: a KubernetesPodOperator whose pod resumes from a fenced checkpoint.

Before the pod starts, the operator takes the identity's lease (raising its epoch, which fences every earlier
pod or try), brings the latest checkpoint to this code's ``schema_version`` (the same rules and the same code
as :class:`~airflow_stateful.operators.stateful.StatefulOperator`), and tells the pod what it needs in
``STATEFUL_*`` environment variables. Inside the pod, ``python -m airflow_stateful.client`` restores and saves
(see :mod:`airflow_stateful.client`); every save presents the epoch, so a pod left behind by an earlier try
can never overwrite newer state. Credentials reach the pod only through a Kubernetes Secret
(``credentials_secret``) or workload identity (``service_account_name``), never as literal values.

This module is the only one that imports the cncf.kubernetes provider (the ``kubernetes`` extra).
See docs/kubernetes.md.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.providers.cncf.kubernetes.backcompat.backwards_compat_converters import (
    convert_env_vars_or_raise_error,
)
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowRescheduleException
from kubernetes.client import models as k8s

from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.codecs import JSON
from airflow_stateful.core.errors import IncompatibleStateError, InvalidValueError, MigrationError
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.lease import Lease
from airflow_stateful.core.migrations import validate_schema
from airflow_stateful.core.records import HeadRecord, Manifest
from airflow_stateful.hooks.state import StateHook
from airflow_stateful.operators.stateful import (
    ON_INCOMPATIBLE,
    StatefulOperator,
    check_choice,
    open_task_state,
)

log = logging.getLogger("airflow_stateful")

IDENTITY_LABEL = "stateful-identity"
EPOCH_LABEL = "stateful-epoch"
STATE_VOLUME = "stateful-state"
RESTORE_CONTAINER = "stateful-restore"
SIDECAR_CONTAINER = "stateful-sidecar"
STATE_MODES = ("wrap", "sidecar", "init", "env")
CLIENT_COMMAND = ("python", "-m", "airflow_stateful.client")
#: Names the operator sets; a user's ``env_vars`` entry of the same name is replaced, not duplicated.
STATEFUL_ENV_PREFIX = "STATEFUL_"
#: Environment names that would put a credential into the pod spec as a literal value.
_SECRET_ENV_NAMES = frozenset({"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"})
_TERMINAL_PHASES = ("Succeeded", "Failed")

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
    if len(escaped) <= _LABEL_MAX and _LABEL_VALUE_RE.match(escaped):
        return escaped
    digest = hashlib.sha256(identity.key.encode("utf-8")).hexdigest()[:16]
    prefix = re.sub(r"^[^A-Za-z0-9]+", "", escaped)[: _LABEL_MAX - len(digest) - 1].rstrip("._-")
    return f"{prefix}-{digest}" if prefix else f"h{digest}"


def pod_epoch(pod: k8s.V1Pod) -> int | None:
    """The epoch a pod was started with (its ``stateful-epoch`` label), or ``None``."""
    raw = ((pod.metadata and pod.metadata.labels) or {}).get(EPOCH_LABEL)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def _pod_env(pod: k8s.V1Pod, name: str) -> str | None:
    containers = [*(pod.spec.containers or []), *(pod.spec.init_containers or [])] if pod.spec else []
    for container in containers:
        for env in container.env or []:
            if env.name == name:
                return str(env.value) if env.value is not None else None
    return None


def _terminated(pod: k8s.V1Pod) -> bool:
    return bool(pod.status and pod.status.phase in _TERMINAL_PHASES)


def _deleting(pod: k8s.V1Pod) -> bool:
    return bool(pod.metadata and pod.metadata.deletion_timestamp)


def choose_pods(
    pods: Iterable[k8s.V1Pod],
    *,
    head: HeadRecord | None,
    task_labels: Mapping[str, str],
    schema_version: int,
    checked_label: str = KubernetesPodOperator.POD_CHECKED_KEY,
) -> tuple[k8s.V1Pod | None, list[k8s.V1Pod]]:
    """Split the identity's pods into the one to reattach to (or ``None``) and the stale ones to delete.

    A pod is reattached to only if it still holds the lease (its epoch is the head's and the lease is held),
    belongs to this task instance (``task_labels``, as KubernetesPodOperator labels it, without the try
    number), runs this code's schema version, is neither terminated nor being deleted, and was not already
    handled by an earlier try. Every other live pod is stale: it is fenced, so it can no longer commit.
    Terminated pods are left to KubernetesPodOperator's ``on_finish_action``.
    """
    live = [p for p in pods if not _terminated(p) and not _deleting(p)]
    chosen: k8s.V1Pod | None = None
    if head is not None and head.lease is not None:
        for pod in live:
            labels = (pod.metadata and pod.metadata.labels) or {}
            if (
                pod_epoch(pod) == head.epoch
                and all(labels.get(k) == v for k, v in task_labels.items())
                and labels.get(checked_label) != "True"
                and _pod_env(pod, "STATEFUL_SCHEMA_VERSION") == str(schema_version)
            ):
                chosen = pod
                break
    return chosen, [p for p in live if p is not chosen]


@dataclass(frozen=True)
class PodStatePlan:
    """What the pre-start step decided: the identity, the lease the pod writes with, where the state lives."""

    identity: Identity
    lease: Lease
    backend_url: str
    keep_last: int
    schema_version: int
    endpoint_url: str | None = None
    region_name: str | None = None

    def env(self, *, image: str | None, context: Any | None = None) -> list[k8s.V1EnvVar]:
        """The ``STATEFUL_*`` variables the in-pod client reads (no credentials among them)."""
        values: dict[str, str | None] = {
            "STATEFUL_IDENTITY": self.identity.key,
            "STATEFUL_BACKEND_URL": self.backend_url,
            "STATEFUL_EPOCH": str(self.lease.epoch),
            "STATEFUL_LEASE_TOKEN": self.lease.token,
            "STATEFUL_SCHEMA_VERSION": str(self.schema_version),
            "STATEFUL_KEEP_LAST": str(self.keep_last),
            "STATEFUL_S3_ENDPOINT_URL": self.endpoint_url,
            "STATEFUL_IMAGE": image,
        }
        if context is not None:
            ti = context["ti"]
            values.update(
                STATEFUL_DAG_ID=ti.dag_id,
                STATEFUL_TASK_ID=ti.task_id,
                STATEFUL_RUN_ID=context["dag_run"].run_id,
                STATEFUL_TRY_NUMBER=str(ti.try_number),
                STATEFUL_MAP_INDEX=str(ti.map_index),
            )
        env = [k8s.V1EnvVar(name=k, value=v) for k, v in values.items() if v]
        if self.region_name:
            env.append(k8s.V1EnvVar(name="AWS_DEFAULT_REGION", value=self.region_name))
        return env

    def reference(self, latest: Manifest | None) -> dict[str, Any]:
        """The XCom ``checkpoint``: where the final checkpoint is and which one it is."""
        return {
            "identity": self.identity.key,
            "url": self.backend_url,
            "seq": latest.seq if latest else None,
            "epoch": self.lease.epoch,
            "schema_version": latest.schema_version if latest else self.schema_version,
            "image": latest.extra.get("image") if latest else None,
        }


class StatefulKubernetesPodOperator(KubernetesPodOperator):
    """A KubernetesPodOperator whose pod restores and saves a fenced checkpoint of a directory.

    Takes every KubernetesPodOperator argument, plus:

    :param state_mode: how the pod talks to the store. ``"wrap"`` (default): the main container's command
        runs under ``python -m airflow_stateful.client run`` (the image must contain the client; ``cmds``
        is required); ``"sidecar"``: for images that cannot be changed, an init container from
        ``client_image`` restores into ``state_dir`` and a native sidecar (Kubernetes >= 1.29) saves it
        every ``save_every`` and once more when the pod ends; ``"init"``: only the restoring init
        container, the main container saves by itself; ``"env"``: only the environment variables.
    :param state_dir: where the state directory (an ``emptyDir`` volume) is mounted.
    :param save_every: how often ``wrap`` and ``sidecar`` modes save while the command runs.
    :param client_image: image with ``airflow_stateful.client`` for the init and sidecar containers;
        required in ``"sidecar"`` and ``"init"`` modes. (templated)
    :param client_command: how to start the client in the pod.
    :param credentials_secret: name of a Kubernetes Secret whose keys (``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ...) become the client's environment through ``envFrom``; leave unset
        with workload identity (``service_account_name``). (templated)
    :param s3_endpoint_url: S3-compatible endpoint for the pod; default: the connection's
        ``endpoint_url``. (templated)
    :param identity: a name for state that lives across DAG runs; default ``None``: state belongs to this
        DAG run. (templated)
    :param backend_url: ``s3://bucket/prefix`` (or ``file:///path`` on a volume the pod mounts at the same
        path); default ``[stateful] backend_url``. (templated)
    :param conn_id: Airflow connection for S3, used by the operator only; default ``[stateful] conn_id``.
        (templated)
    :param schema_version: version of the state this pod's code writes.
    :param migrations: ``{v: fn}`` turning a version ``v`` value into a version ``v + 1`` one; applied by
        the operator before the pod starts.
    :param on_incompatible: ``"fail"`` (default) or ``"restart"`` (the pod starts from an empty checkpoint).
    :param keep_last: checkpoints kept for this identity; default ``[stateful] keep_last``.
    :param reschedule_delay: how long after ``on_kill`` (a SIGTERM to the worker) the task is rescheduled.
    :param termination_grace_period: seconds the pod has to save after ``on_kill`` or a deletion.
    """

    template_fields: Sequence[str] = (
        *KubernetesPodOperator.template_fields,
        "identity",
        "backend_url",
        "conn_id",
        "credentials_secret",
        "client_image",
        "s3_endpoint_url",
    )

    def __init__(
        self,
        *,
        state_mode: str = "wrap",
        state_dir: str = "/state",
        save_every: timedelta = timedelta(minutes=5),
        client_image: str | None = None,
        client_command: Sequence[str] = CLIENT_COMMAND,
        credentials_secret: str | None = None,
        s3_endpoint_url: str | None = None,
        identity: str | None = None,
        backend_url: str | None = None,
        conn_id: str | None = None,
        schema_version: int = 1,
        migrations: Mapping[int, Callable[[Any], Any]] | None = None,
        on_incompatible: str = "fail",
        keep_last: int | None = None,
        reschedule_delay: timedelta = timedelta(seconds=5),
        termination_grace_period: int | None = 60,
        deferrable: bool = False,
        **kwargs: Any,
    ) -> None:
        if deferrable:
            raise InvalidValueError(
                "StatefulKubernetesPodOperator does not support deferrable=True yet: the lease is released "
                "and the checkpoint reported by the worker that started the pod"
            )
        super().__init__(termination_grace_period=termination_grace_period, deferrable=False, **kwargs)
        self.migrations = validate_schema(schema_version, migrations)
        self.schema_version = schema_version
        check_choice("on_incompatible", on_incompatible, ON_INCOMPATIBLE)
        check_choice("state_mode", state_mode, STATE_MODES)
        if not state_dir.startswith("/") or state_dir.rstrip("/") == "":
            raise InvalidValueError(f"state_dir must be an absolute path below /, not {state_dir!r}")
        if not isinstance(save_every, timedelta) or save_every <= timedelta(0):
            raise InvalidValueError(f"save_every must be a positive timedelta, not {save_every!r}")
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise InvalidValueError(f"keep_last must be an integer >= 1, not {keep_last!r}")
        if state_mode in ("sidecar", "init") and not client_image:
            raise InvalidValueError(
                f"state_mode={state_mode!r} needs client_image (an image with the client)"
            )
        if identity is not None and "{{" not in str(identity):
            StatefulOperator._identity_for(
                dag_id="dag", task_id="task", map_index=-1, run_id="run", name=identity
            )
        self.state_mode = state_mode
        self.state_dir = state_dir.rstrip("/")
        self.save_every = save_every
        self.client_image = client_image
        self.client_command = list(client_command)
        self.credentials_secret = credentials_secret
        self.s3_endpoint_url = s3_endpoint_url
        self.identity = identity
        self.backend_url = backend_url
        self.conn_id = conn_id
        self.on_incompatible = on_incompatible
        self.keep_last = keep_last
        self.reschedule_delay = reschedule_delay
        self._plan: PodStatePlan | None = None
        self._pod_finished = False

    # -- identity and pre-start ----------------------------------------------------------------------------
    def stateful_identity(self, context: Any) -> Identity:
        """This task instance's identity: the same rules as stateful tasks (run, ``identity`` name, map index)."""
        ti = context["ti"]
        return StatefulOperator._identity_for(
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            map_index=ti.map_index,
            run_id=context["dag_run"].run_id,
            name=self.identity or None,
        )

    def _state_hook(self) -> StateHook:
        return StateHook(backend_url=self.backend_url, conn_id=self.conn_id, keep_last=self.keep_last)

    def _plan_for(self, hook: StateHook, checkpoints: CheckpointStore, lease: Lease) -> PodStatePlan:
        options = hook.s3_options() if hook.backend_url.startswith("s3://") else {}
        return PodStatePlan(
            identity=checkpoints.identity,
            lease=lease,
            backend_url=hook.backend_url,
            keep_last=hook.keep_last,
            schema_version=self.schema_version,
            # Only these two, never the connection's login, password or session token.
            endpoint_url=self.s3_endpoint_url or options.get("endpoint_url"),
            region_name=options.get("region_name"),
        )

    def prepare_state(self, context: Any, checkpoints: CheckpointStore | None = None) -> PodStatePlan:
        """The pre-start step: take the lease (fencing every earlier pod) and migrate the checkpoint.

        Afterwards the latest checkpoint, if any, has this operator's ``schema_version``, and
        :meth:`build_pod_request_obj` renders the pod with the new epoch.
        """
        hook = self._state_hook()
        checkpoints = checkpoints or hook.checkpoint_store(self.stateful_identity(context))
        writer = StateHook.writer_for(context)
        lease = checkpoints.acquire(holder=writer, steal=True)
        try:
            self._migrate(checkpoints, lease, writer)
        except (IncompatibleStateError, MigrationError, InvalidValueError) as exc:
            checkpoints.release(lease)
            # Deterministic: another try would fail the same way. Fix the DAG or migration, then clear.
            raise AirflowFailException(str(exc)) from exc
        except BaseException:
            checkpoints.release(lease)
            raise
        self._plan = self._plan_for(hook, checkpoints, lease)
        self.labels = {**self.labels, **self.stateful_labels(self._plan)}
        return self._plan

    def _migrate(self, checkpoints: CheckpointStore, lease: Lease, writer: Any) -> None:
        # The upgrade rules of every stateful operator: verify, migrate step by step, commit the migrated
        # value keeping the files, or refuse / restart per on_incompatible.
        state = open_task_state(
            checkpoints,
            lease,
            writer,
            schema_version=self.schema_version,
            migrations=self.migrations,
            on_incompatible=self.on_incompatible,
            value_codec=JSON,
        )
        latest = checkpoints.latest()
        if latest is not None and latest.schema_version != self.schema_version and state.checkpoint is None:
            # on_incompatible="restart": the pod's client restores only its own schema version, so commit an
            # empty checkpoint at this version; the old one stays in the history.
            info = state.save(None)
            log.warning("committed empty checkpoint %d at schema %d", info.seq, self.schema_version)

    @staticmethod
    def stateful_labels(plan: PodStatePlan) -> dict[str, str]:
        return {IDENTITY_LABEL: identity_label(plan.identity), EPOCH_LABEL: str(plan.lease.epoch)}

    # -- the pod ---------------------------------------------------------------------------------------------
    def build_pod_request_obj(self, context: Any | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        """KubernetesPodOperator's pod plus the state: env, volume, init/sidecar containers or wrapper.

        The additions go through the operator's own attributes (restored afterwards), so pod templates,
        ``full_pod_spec`` and the cluster's ``pod_mutation_hook`` see them like any other part of the pod.
        Before the pre-start step (a dry run) the pod has no stateful parts.
        """
        plan = self._plan
        if plan is None:
            return super().build_pod_request_obj(context, dry_run=dry_run)
        names = ("env_vars", "env_from", "volumes", "volume_mounts", "init_containers", "cmds", "arguments")
        saved = {name: getattr(self, name) for name in names}
        try:
            self._add_state(plan, context)
            return super().build_pod_request_obj(context, dry_run=dry_run)
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def _add_state(self, plan: PodStatePlan, context: Any | None) -> None:
        user_env = convert_env_vars_or_raise_error(self.env_vars) if self.env_vars else []
        for env in user_env:
            if env.name in _SECRET_ENV_NAMES and env.value:
                raise InvalidValueError(
                    f"env_vars sets {env.name} as a literal value, which puts a credential into the pod spec; "
                    "pass credentials_secret=<Kubernetes Secret name> or use workload identity instead"
                )
        stateful_env = plan.env(image=self.image, context=context)
        ours = {e.name for e in stateful_env}
        self.env_vars = [e for e in user_env if e.name not in ours] + stateful_env
        secret_ref = (
            [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=self.credentials_secret))]
            if self.credentials_secret
            else []
        )
        if self.state_mode != "sidecar":  # the main container runs the client itself
            self.env_from = [*self.env_from, *secret_ref]
        if self.state_mode == "env":
            return
        mount = k8s.V1VolumeMount(name=STATE_VOLUME, mount_path=self.state_dir)
        self.volumes = [
            *self.volumes,
            k8s.V1Volume(name=STATE_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource()),
        ]
        self.volume_mounts = [*self.volume_mounts, mount]
        every = f"{int(self.save_every.total_seconds())}s"
        if self.state_mode == "wrap":
            if not self.cmds:
                raise InvalidValueError(
                    "state_mode='wrap' needs cmds (the image's entrypoint cannot be wrapped); "
                    "give cmds=[...] or use state_mode='sidecar'"
                )
            self.cmds = [
                *self.client_command,
                *("run", "--dir", self.state_dir, "--every", every, "--"),
                *self.cmds,
                *self.arguments,
            ]
            self.arguments = []
            return

        def client_container(
            name: str, command: list[str], restart_policy: str | None = None
        ) -> k8s.V1Container:
            return k8s.V1Container(
                name=name,
                image=self.client_image,
                command=command,
                env=list(stateful_env),
                env_from=list(secret_ref),
                volume_mounts=[mount],
                restart_policy=restart_policy,
            )

        added = [client_container(RESTORE_CONTAINER, [*self.client_command, "restore", self.state_dir])]
        if self.state_mode == "sidecar":
            # A native sidecar (an init container that keeps running): saves every `save_every`, and once more
            # on SIGTERM, which the kubelet sends after the main container ends or when the pod is deleted.
            save = shlex.join([*self.client_command, "save", self.state_dir])
            script = (
                f"trap '{save}; exit $?' TERM INT; "
                f"while true; do sleep {every[:-1]} & wait $!; {save} || echo 'periodic save failed'; done"
            )
            added.append(client_container(SIDECAR_CONTAINER, ["sh", "-c", script], restart_policy="Always"))
        self.init_containers = [*added, *self.init_containers]

    # -- running -----------------------------------------------------------------------------------------------
    def _namespace(self) -> str:
        return str(self.namespace or self.hook.get_namespace() or self._incluster_namespace or "default")

    def find_stateful_pods(self, namespace: str, identity: Identity) -> list[k8s.V1Pod]:
        """Every pod of this identity (any run, try or epoch), found by label."""
        selector = f"{IDENTITY_LABEL}={identity_label(identity)},!airflow-worker"
        return list(self.client.list_namespaced_pod(namespace=namespace, label_selector=selector).items)

    def delete_stale_pods(self, pods: Iterable[k8s.V1Pod]) -> None:
        for pod in pods:
            log.warning(
                "deleting pod %s of %s: it has epoch %s, an older writer that is fenced",
                pod.metadata.name,
                (pod.metadata.labels or {}).get(IDENTITY_LABEL),
                pod_epoch(pod),
            )
            self.pod_manager.delete_pod(pod)

    def get_or_create_pod(self, pod_request_obj: k8s.V1Pod, context: Any) -> k8s.V1Pod:
        """Always create: whether to reattach was decided before the lease was taken (in ``execute``)."""
        self.pod_manager.create_pod(pod=pod_request_obj)
        return pod_request_obj

    def cleanup(
        self,
        pod: k8s.V1Pod,
        remote_pod: k8s.V1Pod,
        xcom_result: dict[str, Any] | None = None,
        context: Any | None = None,
    ) -> None:
        self._pod_finished = bool(remote_pod is not None and _terminated(remote_pod))
        super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result, context=context)

    def execute(self, context: Any) -> Any:
        self._plan, self._pod_finished, self._killed = None, False, False
        hook = self._state_hook()
        identity = self.stateful_identity(context)
        checkpoints = hook.checkpoint_store(identity)
        try:
            namespace = self._namespace()
            pods = self.find_stateful_pods(namespace, identity)
            reattach, stale = (
                choose_pods(
                    pods,
                    head=checkpoints.head(),
                    task_labels=self._get_ti_pod_labels(context, include_try_number=False),
                    schema_version=self.schema_version,
                )
                if self.reattach_on_restart
                else (None, [p for p in pods if not _terminated(p) and not _deleting(p)])
            )
            if reattach is not None:
                plan = self._reattach(hook, checkpoints, reattach)
            else:
                plan = self.prepare_state(context, checkpoints)
            self.delete_stale_pods(stale)
            result = self._run_pod(context)
            return self._finish(context, checkpoints, plan, result)
        finally:
            # Released only once the pod is over: a running (or saving, after on_kill) pod still needs it.
            if self._plan is not None and self._pod_finished and not self._killed:
                checkpoints.release(self._plan.lease)
            checkpoints.store.close()

    def _reattach(self, hook: StateHook, checkpoints: CheckpointStore, pod: k8s.V1Pod) -> PodStatePlan:
        head = checkpoints.head()
        assert head is not None and head.lease is not None
        lease = Lease(
            identity=checkpoints.identity,
            epoch=head.epoch,
            token=head.lease.token,
            holder=head.lease.holder,
            expires_at=head.lease.expires_at,
        )
        log.info(
            "reattaching to pod %s, which holds the lease of %s at epoch %d",
            pod.metadata.name,
            lease.identity,
            lease.epoch,
        )
        self._plan = self._plan_for(hook, checkpoints, lease)
        self.labels = {**self.labels, **self.stateful_labels(self._plan)}
        self.pod = self.pod_request_obj = pod
        return self._plan

    def _run_pod(self, context: Any) -> Any:
        try:
            result = super().execute(context)
        except Exception as exc:
            if self._killed:
                raise self._reschedule() from exc
            raise
        if self._killed:
            raise self._reschedule()
        self._pod_finished = True
        return result

    def _reschedule(self) -> AirflowRescheduleException:
        when = datetime.now(tz=timezone.utc) + self.reschedule_delay
        log.warning(
            "the pod was stopped to save its state; rescheduling at %s (no retry used)", when.isoformat()
        )
        return AirflowRescheduleException(when)

    def _finish(self, context: Any, checkpoints: CheckpointStore, plan: PodStatePlan, result: Any) -> Any:
        head = checkpoints.head()
        if head is None or head.epoch != plan.lease.epoch:
            raise AirflowException(
                f"the pod finished, but {plan.identity} is now at epoch {head.epoch if head else None}, not "
                f"{plan.lease.epoch}: a newer try or pod took over, so this pod's saves after that were refused"
            )
        if self.state_mode == "sidecar":
            self._check_sidecar(self.remote_pod)
        latest = checkpoints.latest()
        if latest is None:
            log.warning("the pod finished without saving a checkpoint of %s", plan.identity)
        ref = plan.reference(latest)
        context["ti"].xcom_push(key="checkpoint", value=ref)
        return result if self.do_xcom_push else ref

    @staticmethod
    def _check_sidecar(remote_pod: k8s.V1Pod | None) -> None:
        statuses = (
            remote_pod.status.init_container_statuses if remote_pod and remote_pod.status else None
        ) or []
        for status in statuses:
            terminated = status.state.terminated if status.state else None
            if status.name == SIDECAR_CONTAINER and terminated is not None and terminated.exit_code != 0:
                raise AirflowException(
                    f"the state sidecar's final save failed with exit code {terminated.exit_code} "
                    "(3: fenced by a newer writer); the latest checkpoint may miss the pod's last work"
                )

    def on_kill(self) -> None:
        """Delete the pod with ``termination_grace_period``: the client saves on SIGTERM within it.

        The lease is kept, so that final save still commits; ``execute`` then reschedules the task.
        """
        log.warning(
            "stop requested: deleting the pod with a %ss grace period so it can save its state",
            self.termination_grace_period,
        )
        super().on_kill()


__all__ = [
    "EPOCH_LABEL",
    "IDENTITY_LABEL",
    "PodStatePlan",
    "StatefulKubernetesPodOperator",
    "choose_pods",
    "identity_label",
]

"""StatefulKubernetesPodOperator: a KubernetesPodOperator whose pod resumes from a fenced checkpoint.

Built on KubernetesPodOperator's public extension points only: ``execute`` (the pre-start step around the
provider's own), ``build_pod_request_obj`` (the state parts go through the operator's own pod arguments, so
pod templates, ``full_pod_spec`` and the cluster's ``pod_mutation_hook`` see them), ``get_or_create_pod``
and ``on_kill``. The stateful arguments, their checks and the writer session come from
:class:`~airflow_stateful.operators.mixin.StatefulMixin`, shared with every stateful operator.

Before the pod starts, the operator opens a :class:`~airflow_stateful.core.protocol.session.WriterSession`: it takes
the identity's lease (raising the epoch, which fences every earlier pod or try) and brings the latest
checkpoint to this code's ``schema_version`` with the same upgrade rules as stateful tasks. The session
renews the lease while the pod runs; the pod's client renews the same lease too (``STATEFUL_LEASE_TTL``),
so a worker lost mid-run does not let the lease of a healthy pod lapse. Renewals never change the epoch, so
the two never fence each other. Credentials reach the pod only through a Kubernetes Secret
(``credentials_secret``) or workload identity (``service_account_name``), never as literal values.

This module is the operator's control flow; the pod plumbing (labels, the pod spec, the lease Secret, the
restore cache and placement, the pod's result) is in :mod:`airflow_stateful.kubernetes`. Both need the
``kubernetes`` extra. See docs/kubernetes.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from kubernetes.client import models as k8s

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.code_identity import fingerprint_json
from airflow_stateful.core.settings import RESTORE_CACHE_MAX_BYTES
from airflow_stateful.hooks.state import StateHook
from airflow_stateful.kubernetes.labels import EPOCH_LABEL, IDENTITY_LABEL, RUN_LABEL, identity_label
from airflow_stateful.kubernetes.lease_secrets import (
    create_lease_secret,
    delete_pod_without_secret,
    reattach_lease_secret,
)
from airflow_stateful.kubernetes.placement import node_to_prefer, prefer_node_in
from airflow_stateful.kubernetes.pods import PodState, PodStatePlan, pod_state
from airflow_stateful.kubernetes.reattach import adopt_lease, choose_pods, delete_stale_pods, find_pods
from airflow_stateful.kubernetes.restore_cache import (
    RESTORE_CACHE_MOUNT,
    RestoreCache,
    check_restore_cache_arguments,
)
from airflow_stateful.kubernetes.results import check_pod_result, terminated
from airflow_stateful.kubernetes.spec import (
    CLIENT_COMMAND,
    RESTORE_CONTAINER,
    SIDECAR_CONTAINER,
    STATE_MODES,
    STATE_VOLUME,
    check_state_arguments,
    stateful_pod_arguments,
)
from airflow_stateful.operators.mixin import STATEFUL_TEMPLATE_FIELDS, StatefulMixin, check_choice

log = logging.getLogger("airflow_stateful")


class StatefulKubernetesPodOperator(StatefulMixin, KubernetesPodOperator):
    """A KubernetesPodOperator whose pod restores and saves a fenced checkpoint of a directory.

    Takes every KubernetesPodOperator argument and the stateful ones of
    :class:`~airflow_stateful.operators.mixin.StatefulMixin` (``schema_version``, ``migrations``,
    ``on_incompatible``, ``identity``, ``backend_url``, ``conn_id``, ``keep_last``, ``reschedule_delay``;
    the value is always JSON), plus:

    :param state_mode: how the pod talks to the store. ``"wrap"`` (default): the main container's command
        runs under ``python -m airflow_stateful.client run`` (the image must contain the client; ``cmds``
        is required); ``"sidecar"``: for images that cannot be changed, an init container from
        ``client_image`` restores into ``state_dir`` and a native sidecar (Kubernetes >= 1.29) renews the
        lease and saves every ``save_every`` and once more when the pod ends; ``"init"``: only the restoring
        init container, the main container saves by itself; ``"env"``: only the environment variables.
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
    :param termination_grace_period: seconds the pod has to save after ``on_kill`` or a deletion.
    :param restore_cache_host_path: an absolute directory on the nodes for the restore cache (a ``hostPath``
        volume, created if missing, mounted at ``/var/cache/airflow-stateful`` in the containers that run the
        client): the client restores through it and fills it after each save, and the operator *prefers*
        (never requires) the node that wrote the checkpoint the pod resumes from. Default ``None``: no cache,
        no preference. Needs a namespace that admits ``hostPath`` volumes; see docs/kubernetes.md.
    :param restore_cache_max_bytes: the size the cache is kept under on each node (least recently used chunks
        are evicted); default 2 GiB, as ``[stateful] restore_cache_max_bytes``.
    """

    template_fields: Sequence[str] = (
        *KubernetesPodOperator.template_fields,
        *STATEFUL_TEMPLATE_FIELDS,
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
        termination_grace_period: int | None = 60,
        restore_cache_host_path: str | None = None,
        restore_cache_max_bytes: int = RESTORE_CACHE_MAX_BYTES,
        deferrable: bool = False,
        **kwargs: Any,
    ) -> None:
        if deferrable:
            raise InvalidValueError(
                "StatefulKubernetesPodOperator does not support deferrable=True yet: the lease is renewed, "
                "released and the checkpoint reported by the worker that started the pod"
            )
        if kwargs.get("value_codec", "json") != "json":
            raise InvalidValueError("the in-pod client reads and writes JSON values only; drop value_codec")
        check_choice("state_mode", state_mode, STATE_MODES)
        state_dir = check_state_arguments(
            state_mode=state_mode, state_dir=state_dir, save_every=save_every, client_image=client_image
        )
        restore_cache_host_path = check_restore_cache_arguments(
            restore_cache_host_path, restore_cache_max_bytes, state_dir=state_dir
        )
        super().__init__(termination_grace_period=termination_grace_period, deferrable=False, **kwargs)
        self.state_mode = state_mode
        self.state_dir = state_dir
        self.save_every = save_every
        self.client_image = client_image
        self.client_command = list(client_command)
        self.credentials_secret = credentials_secret
        self.s3_endpoint_url = s3_endpoint_url
        self.restore_cache_host_path = restore_cache_host_path
        self.restore_cache_max_bytes = restore_cache_max_bytes
        self._session: WriterSession | None = None
        self._pod_state: PodState | None = None
        self._preferred_node: str | None = None
        self._stop_requested = False

    # -- the pre-start step ----------------------------------------------------------------------------------
    def prepare_state(self, context: Any, hook: StateHook | None = None) -> PodState:
        """Take the lease (fencing every earlier pod), migrate the checkpoint, start renewing the lease.

        Afterwards the latest checkpoint, if any, has this operator's ``schema_version``, and
        :meth:`build_pod_request_obj` renders the pod with the new epoch.
        """
        hook = hook or self.state_hook()
        session = self.open_session(context, hook)
        if session.restarted_from is not None:
            # on_incompatible="restart": the pod restores only its own schema version: an empty one, old kept.
            info = session.commit(None, keep_files=False)
            log.warning("committed empty checkpoint %d at schema %d", info.seq, self.schema_version)
        state = self._attach(context, hook, session)
        self._preferred_node = self.preferred_node(session)
        return state

    @property
    def restore_cache(self) -> RestoreCache | None:
        """The node's restore cache the pod mounts, or ``None`` (``restore_cache_host_path`` unset)."""
        return RestoreCache.on_nodes(self.restore_cache_host_path, max_bytes=self.restore_cache_max_bytes)

    def preferred_node(self, session: WriterSession) -> str | None:
        """The node whose restore cache holds the files the pod restores, or ``None``; says which, or why not
        (only with the cache on; see :func:`~airflow_stateful.kubernetes.placement.node_to_prefer`)."""
        return node_to_prefer(session.latest, session.start, cache=self.restore_cache_host_path is not None)

    def _attach(self, context: Any, hook: StateHook, session: WriterSession) -> PodState:
        options = hook.s3_options() if hook.backend_url.startswith("s3://") else {}
        self._session = session
        self._pod_state = pod_state(
            session,
            run_id=context["dag_run"].run_id,
            schema_version=self.schema_version,
            backend_url=hook.backend_url,
            keep_last=hook.keep_last,
            s3_options=options,
            endpoint_url=self.s3_endpoint_url,
            head_signer=hook.get_signer(),
        )
        self.labels = {**self.labels, **self._pod_state.labels()}
        return self._pod_state

    def _reattach(self, context: Any, hook: StateHook, pod: k8s.V1Pod) -> PodState:
        """Adopt the lease of the running pod (no new epoch) and keep renewing it for that pod."""
        checkpoints = hook.checkpoint_store(self.stateful_identity(context))
        writer = StateHook.writer_for(context)
        session = adopt_lease(checkpoints, pod, writer=writer, schema_version=self.schema_version)
        self.pod = self.pod_request_obj = pod  # KubernetesPodOperator then follows this pod
        state = self._attach(context, hook, session)
        reattach_lease_secret(self.client, state, pod, delete=self.pod_manager.delete_pod)
        return state

    # -- the pod ---------------------------------------------------------------------------------------------
    def build_pod_request_obj(self, context: Any | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        """KubernetesPodOperator's pod plus the state: env, volume, init/sidecar containers or wrapper.

        The additions go through the operator's own pod arguments (restored afterwards), so pod templates,
        ``full_pod_spec`` and the cluster's ``pod_mutation_hook`` see them like any other part of the pod.
        Before the pre-start step (a dry run) the pod has no stateful parts.
        """
        if self._pod_state is None:
            return super().build_pod_request_obj(context, dry_run=dry_run)
        with stateful_pod_arguments(self, self._pod_state, context):
            pod = super().build_pod_request_obj(context, dry_run=dry_run)
        prefer_node_in(pod, self._preferred_node)  # to the finished pod: the terms it has are all kept
        return pod

    def find_stateful_pods(self, namespace: str, pod_state_identity: Any) -> list[k8s.V1Pod]:
        """Every pod of an identity (any run, try or epoch), found by label."""
        return find_pods(self.client, namespace, pod_state_identity)

    def get_or_create_pod(self, pod_request_obj: k8s.V1Pod, context: Any) -> k8s.V1Pod:
        """Create the pod, then its lease Secret, owned by it; whether to reattach was decided in ``execute``.

        The Secret comes second because an owner reference needs the pod's uid; the kubelet does not start a
        container whose ``secretKeyRef`` is missing, it retries. If the Secret cannot be created the pod is
        deleted at once: it could never start, and KubernetesPodOperator's cleanup skips a pod it never saw.
        """
        created = self.pod_manager.create_pod(pod=pod_request_obj)
        try:
            owner = created if created is not None and created.metadata and created.metadata.uid else None
            self.create_lease_secret(owner or self.pod_manager.read_pod(pod_request_obj))
        except BaseException:
            delete_pod_without_secret(pod_request_obj, delete=self.pod_manager.delete_pod)
            raise
        return pod_request_obj

    def create_lease_secret(self, pod: k8s.V1Pod) -> None:
        """Create the lease Secret ``pod`` reads, owned by it, or keep it (after the pre-start step only; see
        :func:`~airflow_stateful.kubernetes.lease_secrets.create_lease_secret`)."""
        if self._pod_state is not None:
            create_lease_secret(self.client, self._pod_state, pod)

    # -- running -----------------------------------------------------------------------------------------------
    def execute(self, context: Any) -> Any:
        self._session, self._pod_state, self._preferred_node, self._stop_requested = None, None, None, False
        self.pod = self.pod_request_obj = self.remote_pod = None
        hook = self.state_hook()
        identity = self.stateful_identity(context)
        try:
            # The namespace KubernetesPodOperator would use (operator, connection, in-cluster, "default").
            namespace = super().build_pod_request_obj(context, dry_run=True).metadata.namespace
            pods = self.find_stateful_pods(namespace, identity)
            reattach, stale = (
                choose_pods(
                    pods,
                    head=hook.checkpoint_store(identity).head(),
                    run_id=context["dag_run"].run_id,
                    schema_version=self.schema_version,
                    checked_label=self.POD_CHECKED_KEY,
                )
                if self.reattach_on_restart
                else (None, [p for p in pods if not terminated(p)])
            )
            if reattach is not None:
                state = self._reattach(context, hook, reattach)
            else:
                state = self.prepare_state(context, hook)
            delete_stale_pods(stale, identity=identity, delete=self.pod_manager.delete_pod)
            try:
                result = super().execute(context)
            except Exception as exc:
                if self._stop_requested:
                    rescheduled = self.reschedule("the pod was stopped to save its state")
                    self._record_end(context, rescheduled)
                    raise rescheduled from exc
                self._record_end(context, exc)
                raise
            if self._stop_requested:
                rescheduled = self.reschedule("the pod was stopped to save its state")
                self._record_end(context, rescheduled)
                raise rescheduled
            try:
                finished = self._finish(context, state, result)
            except BaseException as exc:
                self._record_end(context, exc)
                raise
            self._record_end(context, None)
            return finished
        finally:
            if self._session is not None:
                # A running (or saving, after on_kill) pod still needs the lease: keep it, unrenewed, for the
                # pod's final save; a finished pod's lease is released.
                over = terminated(self.remote_pod) and not self._stop_requested
                self._session.close(release=over)
            hook.close()

    def _record_end(self, context: Any, exc: BaseException | None) -> None:
        """How this try ends, written with the lease's release (a pod still saving keeps the lease: not then)."""
        if self._session is not None:
            self.record_end(self._session, context, exc)

    def code_fingerprint(self) -> str | None:
        """The pod's code: its image, command and arguments (what a "code change" means for a pod)."""
        return fingerprint_json({"image": self.image, "cmds": self.cmds, "arguments": self.arguments})

    def _finish(self, context: Any, state: PodState, result: Any) -> Any:
        assert self._session is not None
        head = self._session.head()
        check_pod_result(state, head=head, remote_pod=self.remote_pod, sidecar=self.state_mode == "sidecar")
        latest = self._session.read_latest()
        if latest is None:
            log.warning("the pod finished without saving a checkpoint of %s", state.identity)
        ref = state.reference(latest)
        context["ti"].xcom_push(key="checkpoint", value=ref)
        return result if self.do_xcom_push else ref

    def on_kill(self) -> None:
        """Delete the pod with ``termination_grace_period``: the client saves on SIGTERM within it.

        The lease is kept, so that final save still commits; ``execute`` then reschedules the task.
        """
        self._stop_requested = True
        log.warning(
            "stop requested: deleting the pod with a %ss grace period so it can save its state",
            self.termination_grace_period,
        )
        super().on_kill()


__all__ = [
    "EPOCH_LABEL",
    "IDENTITY_LABEL",
    "RESTORE_CACHE_MOUNT",
    "RESTORE_CONTAINER",
    "RUN_LABEL",
    "SIDECAR_CONTAINER",
    "STATE_VOLUME",
    "PodState",
    "PodStatePlan",
    "StatefulKubernetesPodOperator",
    "choose_pods",
    "identity_label",
]

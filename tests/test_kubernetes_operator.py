"""StatefulKubernetesPodOperator without a cluster: the pod it renders, its pre-start step, its API calls.

No Kubernetes API server can run on these machines. So:

* the pod spec is the operator's own ``build_pod_request_obj(context)`` (with a kubeconfig that points
  nowhere: the client is configured, never contacted), inspected as the kubernetes client's ``V1Pod``;
* the pre-start step (lease, migration) runs against a real checkpoint store in a local directory, and the
  pods' environment is handed to the real in-pod client (``python -m airflow_stateful.client``) in a
  subprocess, which plays the pod;
* the operator's calls to the API go to ``create_autospec`` of the kubernetes client's ``CoreV1Api`` and the
  provider's ``PodManager`` (the real signatures, no hand-written fake server), answering with real
  ``V1Pod`` objects;
* the end-to-end test needs ``KUBECONFIG`` pointing at a real cluster (kind, k3s) and skips otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from maintenance import GcLoop

pytest.importorskip("airflow.providers.cncf.kubernetes", reason="needs the kubernetes extra")

from kubernetes.client import CoreV1Api
from kubernetes.client import models as k8s

from airflow_stateful.client.settings import PodSettings
from airflow_stateful.core import CheckpointStore, Identity, store_from_url
from airflow_stateful.core.records import WriterInfo
from airflow_stateful.kubernetes.pods import run_label
from airflow_stateful.operators.kubernetes import (
    EPOCH_LABEL,
    IDENTITY_LABEL,
    RESTORE_CONTAINER,
    RUN_LABEL,
    SIDECAR_CONTAINER,
    STATE_VOLUME,
    StatefulKubernetesPodOperator,
    choose_pods,
    identity_label,
)

REPO = Path(__file__).resolve().parent.parent
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: nowhere, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: nobody, user: {token: not-a-token}}]
contexts: [{name: nowhere, context: {cluster: nowhere, user: nobody}}]
current-context: nowhere
"""


# -- helpers -------------------------------------------------------------------------------------------------
def offline_kubeconfig() -> str:
    """A kubeconfig whose server nobody listens on: the operator can build a client, never reach a cluster."""
    path = Path(tempfile.mkdtemp(prefix="stateful-kube-")) / "kubeconfig"
    path.write_text(KUBECONFIG)
    return str(path)


OFFLINE_KUBECONFIG = offline_kubeconfig()


@pytest.fixture
def state_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = (tmp_path / "state").as_uri()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", url)
    monkeypatch.delenv("AIRFLOW__STATEFUL__CONN_ID", raising=False)
    return url


def make_context(*, run_id: str = "manual__1", try_number: int = 1, map_index: int = -1) -> dict[str, Any]:
    """The parts of an Airflow task context the operator reads (ti, dag_run, run_id, dag), with XCom pushes."""
    pushed: dict[str, Any] = {}
    ti = SimpleNamespace(
        dag_id="train",
        task_id="fit",
        map_index=map_index,
        try_number=try_number,
        dag_version_id=None,
        pushed=pushed,
        xcom_push=lambda key, value: pushed.__setitem__(key, value),
    )
    return {"ti": ti, "dag_run": SimpleNamespace(run_id=run_id), "run_id": run_id, "dag": SimpleNamespace()}


_OPERATORS: list[StatefulKubernetesPodOperator] = []


@pytest.fixture(autouse=True)
def _close_sessions() -> Any:
    """Operators whose pre-start step a test ran directly keep renewing their lease: stop that afterwards."""
    yield
    while _OPERATORS:
        session = _OPERATORS.pop()._session
        if session is not None:
            session.close()


def make_op(**kwargs: Any) -> StatefulKubernetesPodOperator:
    args: dict[str, Any] = {
        "task_id": "fit",
        "image": "example/trainer:2",
        "cmds": ["python", "train.py"],
        "arguments": ["--epochs", "10"],
        "namespace": "ml",
        "config_file": OFFLINE_KUBECONFIG,
        **kwargs,
    }
    op = StatefulKubernetesPodOperator(**args)
    _OPERATORS.append(op)
    return op


def checkpoints_at(url: str, identity: Identity) -> CheckpointStore:
    return CheckpointStore(store=store_from_url(url), identity=identity)


def env_of(container: k8s.V1Container) -> dict[str, str]:
    return {e.name: e.value for e in container.env or []}


def base(pod: k8s.V1Pod) -> k8s.V1Container:
    return next(c for c in pod.spec.containers if c.name == "base")


def inits(pod: k8s.V1Pod) -> dict[str, k8s.V1Container]:
    return {c.name: c for c in pod.spec.init_containers or []}


def run_client(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The in-pod client, in a subprocess, with exactly the pod's STATEFUL_* environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STATEFUL_")}
    return subprocess.run(
        [sys.executable, "-m", "airflow_stateful.client", *args],
        env={**clean, **env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def seed_schema_1(url: str, identity: Identity, files: Path) -> int:
    """Version 1 of the job wrote a checkpoint (value + files) at schema 1; returns the epoch it used."""
    store = checkpoints_at(url, identity)
    lease = store.acquire(holder=WriterInfo(task_id="fit", try_number=1))
    (files / "model.bin").parent.mkdir(parents=True, exist_ok=True)
    (files / "model.bin").write_bytes(b"weights-v1")
    store.commit(lease, {"done": [0, 1, 2]}, files=files, schema_version=1)
    store.release(lease)
    return lease.epoch


def upgrade_v1_to_v2(value: dict[str, Any]) -> dict[str, Any]:
    return {"cursor": len(value["done"])}


# -- labels ----------------------------------------------------------------------------------------------------
def test_identity_label_is_a_valid_label_readable_when_short_and_hashed_when_long() -> None:
    import re

    short = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    assert identity_label(short) == "train_sfit_srun_emanual____1_smap_e-1"
    # Escaping is reversible, so identities that differ only in characters a label cannot hold stay apart.
    a = Identity.for_task(dag_id="a_sb", task_id="t", name="n")
    b = Identity.for_task(dag_id="a/b".replace("/", "%2F"), task_id="t", name="n")
    c = Identity.parse("a/b/t/name=n/map=-1".replace("a/b/", "a_sb/"))
    assert len({identity_label(a), identity_label(b), identity_label(c)}) == len({a.key, b.key, c.key})
    run_id = "scheduled__2026-11-30T08:00:00+00:00"
    long_ids = [Identity.for_task(dag_id="train", task_id="fit", run_id=run_id, map_index=i) for i in (3, 4)]
    labels = [identity_label(i) for i in long_ids]
    for label in labels:
        assert len(label) <= 63 and re.match(LABEL_VALUE, label), label
        assert label.startswith("train_sfit_srun_e"), "the hashed form keeps a readable prefix"
    assert labels[0] != labels[1], "map indexes 3 and 4 must not share a label"
    assert labels == [identity_label(i) for i in long_ids], "deterministic: a restarted worker finds its pod"
    weird = Identity.parse("_x" * 40 + "/t/name=n/map=0")
    assert re.match(LABEL_VALUE, identity_label(weird)) and len(identity_label(weird)) <= 63


# -- pre-start: lease and migration against a real local store ---------------------------------------------
def test_pre_start_migrates_schema_1_to_2_and_the_pod_gets_the_next_epoch(
    state_url: str, tmp_path: Path
) -> None:
    context = make_context()
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    old_epoch = seed_schema_1(state_url, identity, tmp_path / "v1files")
    op = make_op(schema_version=2, migrations={1: upgrade_v1_to_v2})

    plan = op.prepare_state(context)
    pod = op.build_pod_request_obj(context)

    latest = checkpoints_at(state_url, identity).latest()
    assert latest is not None
    assert (latest.schema_version, latest.value) == (2, {"cursor": 3}), "migrated before the pod starts"
    assert [f.path for f in latest.files] == ["model.bin"], "the migrated checkpoint keeps the files"
    assert plan.lease.epoch == old_epoch + 1
    env = env_of(base(pod))
    assert env["STATEFUL_IDENTITY"] == identity.key
    assert env["STATEFUL_BACKEND_URL"] == state_url
    assert env["STATEFUL_EPOCH"] == str(old_epoch + 1)
    assert env["STATEFUL_SCHEMA_VERSION"] == "2"
    assert env["STATEFUL_LEASE_TOKEN"] == plan.lease.token
    assert env["STATEFUL_IMAGE"] == "example/trainer:2"
    assert (env["STATEFUL_RUN_ID"], env["STATEFUL_TRY_NUMBER"], env["STATEFUL_MAP_INDEX"]) == (
        "manual__1",
        "1",
        "-1",
    )
    assert pod.metadata.labels[EPOCH_LABEL] == str(old_epoch + 1)
    assert pod.metadata.labels[IDENTITY_LABEL] == identity_label(identity)
    # The pod's client restores the migrated checkpoint with exactly that environment.
    restored = run_client(env, "restore", str(tmp_path / "pod"))
    assert restored.returncode == 0, restored.stderr
    assert (tmp_path / "pod" / "model.bin").read_bytes() == b"weights-v1"
    assert json.loads((tmp_path / "pod" / ".stateful-value.json").read_text()) == {"cursor": 3}


def test_a_second_pre_start_fences_the_first_pod(state_url: str, tmp_path: Path) -> None:
    first_ctx, second_ctx = make_context(try_number=1), make_context(try_number=2)
    first_op, second_op = make_op(), make_op()
    first = env_of(base((first_op.prepare_state(first_ctx), first_op.build_pod_request_obj(first_ctx))[1]))
    second = env_of(
        base((second_op.prepare_state(second_ctx), second_op.build_pod_request_obj(second_ctx))[1])
    )
    assert int(second["STATEFUL_EPOCH"]) == int(first["STATEFUL_EPOCH"]) + 1

    work = tmp_path / "work"
    work.mkdir()
    (work / "progress.txt").write_text("epoch 7")
    zombie = run_client(first, "save", str(work))
    assert zombie.returncode == 3, "the first pod is fenced: exit 3, nothing written\n" + zombie.stderr
    current = run_client(second, "save", str(work))
    assert current.returncode == 0, current.stderr
    latest = checkpoints_at(state_url, Identity.parse(second["STATEFUL_IDENTITY"])).latest()
    assert latest is not None and latest.epoch == int(second["STATEFUL_EPOCH"])
    assert latest.extra["image"] == "example/trainer:2", "the checkpoint records the pod's image"
    assert latest.writer.try_number == 2


def test_named_identity_and_map_index_follow_the_stateful_task_rules(state_url: str) -> None:
    op = make_op(identity="nightly-model")
    plan = op.prepare_state(make_context(run_id="scheduled__2", map_index=4))
    assert plan.identity == Identity.for_task(
        dag_id="train", task_id="fit", map_index=4, name="nightly-model"
    )
    again = make_op(identity="nightly-model").prepare_state(make_context(run_id="scheduled__3", map_index=4))
    assert again.identity == plan.identity and again.lease.epoch == plan.lease.epoch + 1, (
        "same state across runs"
    )


def test_incompatible_checkpoint_fails_before_the_pod_and_stays_untouched(
    state_url: str, tmp_path: Path
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    seed_schema_1(state_url, identity, tmp_path / "v1files")
    op = make_op(schema_version=2)  # no migration from 1
    with pytest.raises(AirflowFailException, match="schema"):
        op.prepare_state(make_context())
    store = checkpoints_at(state_url, identity)
    latest = store.latest()
    assert latest is not None and latest.schema_version == 1 and latest.value == {"done": [0, 1, 2]}
    head = store.head()
    assert head is not None and head.lease is None, "the lease is given back"
    assert op._pod_state is None and op._session is None


def test_on_incompatible_restart_gives_the_pod_an_empty_checkpoint_at_the_new_schema(
    state_url: str, tmp_path: Path
) -> None:
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    seed_schema_1(state_url, identity, tmp_path / "v1files")
    op = make_op(schema_version=2, on_incompatible="restart")
    env = env_of(base((op.prepare_state(make_context()), op.build_pod_request_obj(make_context()))[1]))
    history = checkpoints_at(state_url, identity).history()
    assert len(history) == 2, "the old checkpoint stays in the history"
    restored = run_client(env, "restore", str(tmp_path / "pod"))
    assert restored.returncode == 0, restored.stderr
    assert not (tmp_path / "pod" / "model.bin").exists(), "the pod starts fresh"


# -- the rendered pod ---------------------------------------------------------------------------------------------
def test_wrap_mode_runs_the_command_under_the_client_with_a_secret_reference(state_url: str) -> None:
    op = make_op(credentials_secret="s3-creds", save_every=timedelta(minutes=2))
    op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    container = base(pod)
    assert container.command == [
        *("python", "-m", "airflow_stateful.client", "run", "--dir", "/state", "--every", "120s", "--"),
        *("python", "train.py", "--epochs", "10"),
    ]
    assert container.args == []
    assert [e.secret_ref.name for e in container.env_from] == ["s3-creds"]
    assert [(m.name, m.mount_path) for m in container.volume_mounts] == [(STATE_VOLUME, "/state")]
    assert [v.name for v in pod.spec.volumes if v.empty_dir is not None] == [STATE_VOLUME]
    assert pod.spec.termination_grace_period_seconds == 60
    assert not pod.spec.init_containers
    # The operator's own attributes are unchanged: a second build does not wrap twice.
    assert op.cmds == ["python", "train.py"] and op.volumes == []
    assert base(op.build_pod_request_obj(make_context())).command == container.command


def test_sidecar_mode_restores_in_an_init_container_and_saves_from_a_native_sidecar(state_url: str) -> None:
    op = make_op(
        state_mode="sidecar",
        client_image="example/stateful-client:1",
        credentials_secret="s3-creds",
        termination_grace_period=300,
        service_account_name="trainer",
        init_containers=[k8s.V1Container(name="user-init", image="busybox")],
    )
    op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    assert [c.name for c in pod.spec.init_containers] == [RESTORE_CONTAINER, SIDECAR_CONTAINER, "user-init"]
    restore, sidecar = inits(pod)[RESTORE_CONTAINER], inits(pod)[SIDECAR_CONTAINER]
    assert restore.command == ["python", "-m", "airflow_stateful.client", "restore", "/state"]
    assert restore.restart_policy is None and sidecar.restart_policy == "Always"
    assert sidecar.command == [
        *("python", "-m", "airflow_stateful.client", "sidecar", "--dir", "/state", "--every", "300s")
    ], "the sidecar renews the lease, saves every save_every and once more on SIGTERM"
    for client in (restore, sidecar):
        assert client.image == "example/stateful-client:1"
        assert [e.secret_ref.name for e in client.env_from] == ["s3-creds"]
        assert env_of(client)["STATEFUL_IMAGE"] == "example/trainer:2", (
            "the checkpoint records the job's image"
        )
        assert env_of(client)["STATEFUL_EPOCH"] == env_of(base(pod))["STATEFUL_EPOCH"]
        assert [m.mount_path for m in client.volume_mounts] == ["/state"]
    job = base(pod)
    assert job.command == ["python", "train.py"] and job.args == ["--epochs", "10"], (
        "the image's job is unchanged"
    )
    assert not job.env_from, "the unchanged job container gets no credentials"
    assert pod.spec.termination_grace_period_seconds == 300
    assert pod.spec.service_account_name == "trainer"


def test_init_and_env_modes(state_url: str) -> None:
    op = make_op(state_mode="init", client_image="example/stateful-client:1")
    op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    assert list(inits(pod)) == [RESTORE_CONTAINER]
    assert base(pod).command == ["python", "train.py"]
    op = make_op(state_mode="env", credentials_secret="s3-creds")
    op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    assert not pod.spec.init_containers and not pod.spec.volumes
    assert env_of(base(pod))["STATEFUL_IDENTITY"] and base(pod).env_from[0].secret_ref.name == "s3-creds"


def test_parse_time_and_render_time_errors(state_url: str) -> None:
    from airflow_stateful.core.errors import InvalidValueError

    for bad in (
        {"state_mode": "magic"},
        {"state_mode": "sidecar"},  # no client_image
        {"on_incompatible": "ignore"},
        {"identity": "not a name"},
        {"deferrable": True},
        {"state_dir": "relative"},
    ):
        with pytest.raises((InvalidValueError, ValueError)):
            make_op(**bad)
    op = make_op(cmds=[], arguments=[])
    op.prepare_state(make_context())
    with pytest.raises(InvalidValueError, match="cmds"):
        op.build_pod_request_obj(make_context())
    op = make_op(env_vars={"AWS_SECRET_ACCESS_KEY": "literal"})
    op.prepare_state(make_context())
    with pytest.raises(InvalidValueError, match="credentials_secret"):
        op.build_pod_request_obj(make_context())


@pytest.mark.s3
def test_no_credential_of_the_airflow_connection_reaches_the_pod_spec(s3_backend: str) -> None:
    """The connection (login, password) is the operator's; the pod gets a Secret reference and the endpoint."""
    conn = json.loads(os.environ["AIRFLOW_CONN_STATEFUL_TEST_S3"])
    assert s3_backend == conn["password"], "the fixture's connection carries the recognisable secret"
    op = make_op(
        state_mode="sidecar", client_image="example/stateful-client:1", credentials_secret="s3-creds"
    )
    op.prepare_state(make_context())  # against the S3 endpoint, with the connection's credentials
    pod = op.build_pod_request_obj(make_context())
    rendered = json.dumps(pod.to_dict(), default=str)
    assert s3_backend not in rendered
    assert conn["login"] not in rendered
    assert conn["extra"]["endpoint_url"] in rendered, "the endpoint (not a secret) is passed on"
    assert env_of(inits(pod)[RESTORE_CONTAINER])["STATEFUL_S3_ENDPOINT_URL"] == conn["extra"]["endpoint_url"]
    assert env_of(inits(pod)[RESTORE_CONTAINER])["AWS_DEFAULT_REGION"] == conn["extra"]["region_name"]


# -- reattach and stale pods ------------------------------------------------------------------------------------
def remote(pod: k8s.V1Pod, phase: str, **labels: str) -> k8s.V1Pod:
    """What the API server would return for ``pod``: the same spec with a status (and extra labels)."""
    copy = k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=pod.metadata.name, namespace=pod.metadata.namespace, labels={**pod.metadata.labels, **labels}
        ),
        spec=pod.spec,
        status=k8s.V1PodStatus(phase=phase),
    )
    return copy


def test_choose_pods_reattaches_only_to_the_lease_holder_of_this_task_instance(state_url: str) -> None:
    context = make_context()
    op = make_op()
    op.prepare_state(context)
    holder = op.build_pod_request_obj(context)
    store = checkpoints_at(state_url, Identity.parse(env_of(base(holder))["STATEFUL_IDENTITY"]))
    head = store.head()
    ours = {"run_id": "manual__1", "checked_label": op.POD_CHECKED_KEY}

    running = remote(holder, "Running")
    assert running.metadata.labels[RUN_LABEL] == run_label("manual__1")
    chosen, stale = choose_pods([running], head=head, schema_version=1, **ours)
    assert chosen is running and stale == []

    older = remote(holder, "Running", **{EPOCH_LABEL: str(head.epoch - 1 if head else 0)})
    done = remote(holder, "Succeeded")
    other_run = remote(holder, "Running", **{RUN_LABEL: run_label("manual__2")})
    checked = remote(holder, "Running", already_checked="True")
    chosen, stale = choose_pods([older, done, other_run, checked], head=head, schema_version=1, **ours)
    assert chosen is None, (
        "a stale epoch, a finished pod, another run's pod or a checked pod is never reattached"
    )
    assert stale == [older, other_run, checked], (
        "live pods that do not hold the lease are stale; done ones are left"
    )
    chosen, _ = choose_pods([running], head=head, schema_version=2, **ours)
    assert chosen is None, "code with another schema version does not reattach to an old pod"
    released = head.evolve(lease=None) if head else None
    assert choose_pods([running], head=released, schema_version=1, **ours) == (None, [running])


def test_kpo_find_pod_selects_by_identity_epoch_and_run(state_url: str) -> None:
    """KubernetesPodOperator's own (public) find_pod looks for the pod with the stateful labels."""
    context = make_context()
    op = make_op(labels={"team": "ml"})
    state = op.prepare_state(context)
    api = PodApi(op, lambda pod: "Running")
    api.pods = [remote(op.build_pod_request_obj(context), "Running")]
    assert op.find_pod("ml", context) is api.pods[0]
    selector = api.client.list_namespaced_pod.call_args.kwargs["label_selector"].split(",")
    assert f"{IDENTITY_LABEL}={identity_label(state.identity)}" in selector
    assert f"{EPOCH_LABEL}={state.lease.epoch}" in selector
    assert f"{RUN_LABEL}={run_label('manual__1')}" in selector
    assert "team=ml" in selector


# -- execute and on_kill against the kubernetes client's API classes -------------------------------------------
class PodApi:
    """``create_autospec`` mocks of CoreV1Api and PodManager whose created pods are run by ``play``."""

    def __init__(self, op: StatefulKubernetesPodOperator, play: Callable[[k8s.V1Pod], str]) -> None:
        from airflow.providers.cncf.kubernetes.utils.pod_manager import PodManager

        self.pods: list[k8s.V1Pod] = []
        self.client = mock.create_autospec(CoreV1Api, instance=True)
        self.client.list_namespaced_pod.side_effect = self.list_pods
        self.manager = mock.create_autospec(PodManager, instance=True)
        self.manager.create_pod.side_effect = lambda pod: self.pods.append(remote(pod, play(pod)))
        self.manager.read_pod.side_effect = self.read
        self.manager.await_pod_completion.side_effect = lambda pod, *a, **k: self.read(pod)
        self.manager.delete_pod.side_effect = lambda pod: self.pods.remove(self.read(pod))
        op.client = self.client
        op.pod_manager = self.manager
        op.log_events_on_startup = False

    def read(self, pod: k8s.V1Pod) -> k8s.V1Pod:
        return next(p for p in self.pods if p.metadata.name == pod.metadata.name)

    def list_pods(self, *, namespace: str, label_selector: str) -> k8s.V1PodList:
        wanted = [s for s in label_selector.split(",") if "=" in s and "!=" not in s]

        def matches(pod: k8s.V1Pod) -> bool:
            labels = pod.metadata.labels
            return all(labels.get(k) == v for k, v in (s.split("=", 1) for s in wanted)) and (
                "already_checked!=True" not in label_selector or labels.get("already_checked") != "True"
            )

        return k8s.V1PodList(items=[p for p in self.pods if p.metadata.namespace == namespace and matches(p)])


def run_wrapped(pod: k8s.V1Pod) -> str:
    """Play the pod: run its main container's command (the client wrapping the job) with its environment."""
    container = base(pod)
    result = run_client(env_of(container), *container.command[3:])
    assert result.returncode == 0, result.stderr
    return "Succeeded"


def test_execute_leases_runs_the_pod_and_pushes_the_final_checkpoint(state_url: str, tmp_path: Path) -> None:
    job = "import pathlib, sys; pathlib.Path(sys.argv[1], 'model.bin').write_text('trained')"
    op = make_op(
        cmds=[sys.executable, "-c", job, str(tmp_path / "state-dir")],
        arguments=[],
        state_dir=str(tmp_path / "state-dir"),
    )
    api = PodApi(op, run_wrapped)
    context = make_context()
    result = op.execute(context)

    ref = context["ti"].pushed["checkpoint"]
    assert result == ref
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    store = checkpoints_at(state_url, identity)
    latest = store.latest()
    assert latest is not None and [f.path for f in latest.files] == ["model.bin"]
    assert ref == {
        "identity": identity.key,
        "url": state_url,
        "seq": latest.seq,
        "epoch": 1,
        "schema_version": 1,
        "image": "example/trainer:2",
    }
    head = store.head()
    assert head is not None and head.lease is None, "the lease is released once the pod is over"
    assert api.manager.create_pod.call_count == 1
    assert api.pods == [], "the finished pod was deleted (on_finish_action='delete_pod')"


def test_execute_reattaches_to_the_running_pod_and_deletes_a_stale_one(state_url: str) -> None:
    context = make_context(try_number=1)
    first = make_op()
    plan = first.prepare_state(context)
    holder = remote(first.build_pod_request_obj(context), "Running", try_number="1")
    stale = remote(holder, "Running", **{EPOCH_LABEL: str(plan.lease.epoch - 1)})
    stale.metadata.name = "old-pod"

    # The worker died; try 2 of the same task instance runs execute on a fresh operator.
    op = make_op()
    api = PodApi(op, lambda pod: pytest.fail("no new pod may be created while one holds the lease"))
    api.pods = [holder, stale]

    def finish(pod: k8s.V1Pod, *args: Any, **kwargs: Any) -> k8s.V1Pod:
        # The reattached pod saves with the epoch it was started with, then completes.
        env = env_of(base(holder))
        store = checkpoints_at(state_url, plan.identity)
        store.commit(PodSettings.from_env(env).lease(), {"step": 9})
        holder.status.phase = "Succeeded"
        return holder

    api.manager.await_pod_completion.side_effect = finish
    ctx2 = make_context(try_number=2)
    ref = op.execute(ctx2)
    assert ref["epoch"] == plan.lease.epoch, "no new lease: the running pod kept its epoch"
    assert ref["seq"] is not None
    deleted = [c.args[0].metadata.name for c in api.manager.delete_pod.call_args_list]
    assert deleted == ["old-pod", holder.metadata.name], "the stale pod first, the finished one at the end"
    assert api.manager.create_pod.call_count == 0


def test_on_kill_deletes_the_pod_with_its_grace_period_and_keeps_the_lease(state_url: str) -> None:
    from airflow.sdk.exceptions import AirflowRescheduleException

    op = make_op(termination_grace_period=90)
    context = make_context()

    def killed_while_running(pod: k8s.V1Pod) -> str:
        return "Running"

    api = PodApi(op, killed_while_running)

    def stop(pod: k8s.V1Pod, *args: Any, **kwargs: Any) -> k8s.V1Pod:
        op.on_kill()  # SIGTERM to the worker arrives while the pod runs
        running = api.read(pod)
        running.status.phase = "Succeeded"  # the client saved on SIGTERM and exited
        return running

    api.manager.await_pod_completion.side_effect = stop
    with pytest.raises(AirflowRescheduleException):
        op.execute(context)
    api.client.delete_namespaced_pod.assert_called_once()
    assert api.client.delete_namespaced_pod.call_args.kwargs["grace_period_seconds"] == 90
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    head = checkpoints_at(state_url, identity).head()
    assert head is not None and head.lease is not None, (
        "the lease stays: the pod's final save must still commit"
    )


def test_the_operator_keeps_the_lease_alive_while_its_pod_computes_for_4x_the_ttl(
    state_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod here never renews (init mode: it restores, computes, saves once at the end, all one-shot):
    the operator's own session keeps the lease alive while GC runs, so the pod's late save lands."""
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_TTL", "1.5")
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_GRACE", "0.5")
    op = make_op(state_mode="init", client_image="example/stateful-client:1")
    api = PodApi(op, lambda pod: "Running")
    work = tmp_path / "pod-state"

    def compute_then_save(pod: k8s.V1Pod, *args: Any, **kwargs: Any) -> k8s.V1Pod:
        running = api.read(pod)
        env = env_of(base(running))
        assert run_client(env, "restore", str(work)).returncode == 0
        time.sleep(6)  # 4 x the ttl without any save
        (work / "model.bin").write_text("trained")
        saved = run_client(env, "save", str(work))
        assert saved.returncode == 0, saved.stderr
        running.status.phase = "Succeeded"
        return running

    api.manager.await_pod_completion.side_effect = compute_then_save
    store = store_from_url(state_url)
    with GcLoop(store, keep_last=1, grace=0.5) as gc:
        ref = op.execute(make_context())
    assert len(gc.renewals) >= 3 and gc.deletion_errors() == []
    assert ref["epoch"] == 1 and ref["seq"] == 1, "the pod's save after 6 s was not fenced"
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    head = checkpoints_at(state_url, identity).head()
    assert head is not None and head.lease is None, "released once the pod was over"


# -- end to end on a real cluster ---------------------------------------------------------------------------------
def test_end_to_end_on_a_real_cluster(tmp_path: Path) -> None:
    """With KUBECONFIG at a real cluster (kind, k3s) and a store the pods can reach, a tiny pod saves and XCom says so.

    Needs: ``STATEFUL_E2E_KUBECONFIG`` or ``KUBECONFIG`` (the real cluster's kubeconfig; the other tests of this module use an
    offline one), ``STATEFUL_E2E_BACKEND_URL`` (an S3 URL reachable from the worker and the pods),
    ``STATEFUL_E2E_CLIENT_IMAGE`` (an image with the client) and ``STATEFUL_E2E_SECRET`` (a Secret with its
    credentials in the namespace ``STATEFUL_E2E_NAMESPACE``, default ``default``).
    """
    needed = (
        "STATEFUL_E2E_KUBECONFIG",
        "STATEFUL_E2E_BACKEND_URL",
        "STATEFUL_E2E_CLIENT_IMAGE",
        "STATEFUL_E2E_SECRET",
    )
    kubeconfig = os.environ.get("STATEFUL_E2E_KUBECONFIG") or os.environ.get("KUBECONFIG")
    missing = [name for name in needed[1:] if not os.environ.get(name)] + ([] if kubeconfig else [needed[0]])
    if missing:
        reason = f"no real Kubernetes cluster configured ({', '.join(missing)} unset)"
        print(f"SKIPPED end-to-end Kubernetes test: {reason}")
        pytest.skip(reason)
    op = make_op(
        config_file=kubeconfig,
        image=os.environ["STATEFUL_E2E_CLIENT_IMAGE"],
        cmds=["sh", "-c", "echo trained > /state/model.txt"],
        arguments=[],
        namespace=os.environ.get("STATEFUL_E2E_NAMESPACE", "default"),
        backend_url=os.environ["STATEFUL_E2E_BACKEND_URL"],
        credentials_secret=os.environ["STATEFUL_E2E_SECRET"],
        name=f"stateful-e2e-{uuid.uuid4().hex[:6]}",
    )
    context = make_context(run_id=f"e2e__{uuid.uuid4().hex[:8]}")
    ref = op.execute(context)
    assert ref["seq"] is not None and ref["image"] == os.environ["STATEFUL_E2E_CLIENT_IMAGE"]


def test_example_dag_imports_without_a_cluster() -> None:
    """dags/kubernetes_training.py is only imported (no cluster here); tests/test_dags.py parses it too."""
    from dag_helpers import find_dag, load_dag_module

    dag = find_dag(load_dag_module(REPO / "dags" / "kubernetes_training.py"))
    modes = {t.task_id: t.state_mode for t in dag.tasks if isinstance(t, StatefulKubernetesPodOperator)}
    assert modes == {"train_wrapped": "wrap", "train_unchanged_image": "sidecar"}

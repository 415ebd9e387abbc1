"""StatefulKubernetesPodOperator without a cluster: the pod it renders, its pre-start step, its API calls.

No Kubernetes API server can run on these machines. So:

* the pod spec is the operator's own ``build_pod_request_obj(context)`` (with a kubeconfig that points
  nowhere: the client is configured, never contacted), inspected as the kubernetes client's ``V1Pod``;
* the pre-start step (lease, migration) runs against a real checkpoint store in a local directory, and the
  pods' environment is handed to the real in-pod client (``python -m airflow_stateful.client``) in a
  subprocess, which plays the pod;
* the operator's calls to the API go to ``create_autospec`` of the kubernetes client's ``CoreV1Api`` and the
  provider's ``PodManager`` (the real signatures, no hand-written fake server), answering with real
  ``V1Pod`` and ``V1Secret`` objects (:class:`PodApi`). Only the Kubernetes API is mocked. Of a cluster's
  behaviour :class:`PodApi` models just the parts the operator relies on, each documented Kubernetes
  behaviour: the kubelet (a container starts only once every ``secretKeyRef`` of its env resolves, and
  ``fieldRef`` variables get the pod's node and name from the downward API; the tests then run the real
  client with that resolved environment) and the garbage collector (a Secret whose owner pods are all gone
  is deleted). The tests check the owner reference itself too. No scheduler is modelled: warm placement is
  checked on the affinity the operator renders, and a test says which node "ran" a pod (``PodApi.node``);
* the end-to-end test needs ``KUBECONFIG`` pointing at a real cluster (kind, k3s) and skips otherwise.
"""

from __future__ import annotations

import base64
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
from s3_endpoint import S3Endpoint, needs_moto

pytest.importorskip("airflow.providers.cncf.kubernetes", reason="needs the kubernetes extra")

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_stateful.client.settings import PodSettings, signer_from_env
from airflow_stateful.core import CheckpointStore, Identity, store_from_url
from airflow_stateful.core.errors import CheckpointCorruptError, ConfigurationError
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.kubernetes.labels import run_label
from airflow_stateful.kubernetes.pods import LEASE_SECRET_KEY, LEASE_TOKEN_ENV, lease_secret_name
from airflow_stateful.operators.kubernetes import (
    EPOCH_LABEL,
    IDENTITY_LABEL,
    RESTORE_CONTAINER,
    RUN_LABEL,
    SIDECAR_CONTAINER,
    STATE_VOLUME,
    PodState,
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
    """The literal env values of a container as rendered (a ``secretKeyRef`` variable maps to ``None``)."""
    return {e.name: e.value for e in container.env or []}


def serialized(obj: Any) -> str:
    """``obj`` as the kubernetes client sends it to the API server (JSON)."""
    return json.dumps(ApiClient().sanitize_for_serialization(obj))


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


def save_in_pod(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The in-pod client saving a small work directory with the pod's environment; must succeed."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.bin").write_text("trained")
    saved = run_client(env, "save", str(work))
    assert saved.returncode == 0, saved.stderr
    return saved


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
    files = checkpoints_at(state_url, identity).files(latest)
    assert [f.path for f in files] == ["model.bin"], "the migrated checkpoint keeps the files"
    assert plan.lease.epoch == old_epoch + 1
    env = env_of(base(pod))
    assert env["STATEFUL_IDENTITY"] == identity.key
    assert env["STATEFUL_BACKEND_URL"] == state_url
    assert env["STATEFUL_EPOCH"] == str(old_epoch + 1)
    assert env["STATEFUL_SCHEMA_VERSION"] == "2"
    assert env[LEASE_TOKEN_ENV] is None, "the token is not a literal: it comes from the lease Secret"
    assert env["STATEFUL_IMAGE"] == "example/trainer:2"
    assert (env["STATEFUL_RUN_ID"], env["STATEFUL_TRY_NUMBER"], env["STATEFUL_MAP_INDEX"]) == (
        "manual__1",
        "1",
        "-1",
    )
    assert pod.metadata.labels[EPOCH_LABEL] == str(old_epoch + 1)
    assert pod.metadata.labels[IDENTITY_LABEL] == identity_label(identity)
    # The pod is created with its lease Secret; its client restores the migrated checkpoint with exactly the
    # environment the kubelet gives it.
    api = PodApi(op, keep_running)
    op.get_or_create_pod(pod, context)
    env = api.kubelet_env(api.read(pod))["base"]
    assert env[LEASE_TOKEN_ENV] == plan.lease.token
    restored = run_client(env, "restore", str(tmp_path / "pod"))
    assert restored.returncode == 0, restored.stderr
    assert (tmp_path / "pod" / "model.bin").read_bytes() == b"weights-v1"
    assert json.loads((tmp_path / "pod" / ".stateful-value.json").read_text()) == {"cursor": 3}


def test_a_signing_deployment_gives_its_pods_the_key_through_the_lease_secret_only(
    state_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_home: Path
) -> None:
    """With [stateful] signing_conn_id, a pod signs the heads it writes with the key of its own identity,
    derived from the deployment's (which no pod gets); that key is in the per-lease Secret, never in the pod spec,
    and it signs nothing a reader accepts for another identity."""
    key = "deployment-signing-key-0123456789"
    monkeypatch.setenv(
        "AIRFLOW_CONN_STATEFUL_SIGNING",
        json.dumps({"conn_type": "generic", "password": key, "extra": {"key_id": "prod-1"}}),
    )
    monkeypatch.setenv("AIRFLOW__STATEFUL__SIGNING_CONN_ID", "stateful_signing")
    monkeypatch.setenv("AIRFLOW__STATEFUL__REQUIRE_SIGNED_HEADS", "true")
    op = make_op()
    api = PodApi(op, keep_running)
    state, pod = start_pod(op, make_context(), api)
    assert key not in json.dumps(pod.to_dict(), default=str), "the key is not in the pod spec"
    literal = env_of(base(pod))
    assert (
        literal["STATEFUL_SIGNING_KEY_ID"] == "prod-1" and literal["STATEFUL_REQUIRE_SIGNED_HEADS"] == "true"
    )
    assert literal["STATEFUL_SIGNING_KEY"] is None, "from the lease Secret, not a literal"
    env = api.kubelet_env(pod)["base"]
    deployment = HeadSigner(key=key.encode(), key_id="prod-1", required=True)
    assert env["STATEFUL_SIGNING_KEY"] != key, "the pod never gets the deployment's key"
    assert env["STATEFUL_SIGNING_KEY"].encode() == deployment.for_identity(state.identity.key).key
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.bin").write_text("trained")
    saved = run_client(env, "save", str(work))
    assert saved.returncode == 0, saved.stderr
    head = json.loads(store_from_url(state_url).get(f"{state.identity.key}/~head.json").data)
    assert head["signature"]["key_id"] == "prod-1", "the pod signed the head it wrote"
    store = store_from_url(state_url)
    latest = CheckpointStore(store=store, identity=state.identity, signer=deployment).latest()
    assert latest is not None, "the deployment's readers verify the pod's head"
    # Whoever takes the key from the pod (exec, the Secret) signs with it a head of another identity: refused.
    other = Identity.for_task(dag_id="other-team", task_id="job", name="ledger")
    stolen = HeadSigner(key=env["STATEFUL_SIGNING_KEY"].encode(), key_id="prod-1", identity=other.key)
    forged = CheckpointStore(store=store, identity=other, signer=stolen)
    forged.commit(forged.acquire(), {"balance": 10**9})
    with pytest.raises(CheckpointCorruptError, match="does not verify with key 'prod-1'"):
        CheckpointStore(store=store, identity=other, signer=deployment).latest()
    with pytest.raises(ConfigurationError, match="belongs to identity"):
        CheckpointStore(store=store, identity=other, signer=signer_from_env(env))
    unsigned = {k: v for k, v in env.items() if k != "STATEFUL_SIGNING_KEY"}
    refused = run_client(unsigned, "save", str(work))
    assert refused.returncode == 2 and "STATEFUL_SIGNING_KEY is not set" in refused.stderr


def test_a_second_pre_start_fences_the_first_pod(state_url: str, tmp_path: Path) -> None:
    first_ctx, second_ctx = make_context(try_number=1), make_context(try_number=2)
    first_op, second_op = make_op(), make_op()
    api = PodApi(first_op, keep_running)
    api.attach(second_op)
    first = api.kubelet_env(start_pod(first_op, first_ctx, api)[1])["base"]
    second = api.kubelet_env(start_pod(second_op, second_ctx, api)[1])["base"]
    assert int(second["STATEFUL_EPOCH"]) == int(first["STATEFUL_EPOCH"]) + 1
    assert first[LEASE_TOKEN_ENV] != second[LEASE_TOKEN_ENV] and len(api.secrets) == 2, "a Secret per lease"

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
    from airflow_stateful.compat import AirflowFailException

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
    api = PodApi(op, keep_running)
    env = api.kubelet_env(start_pod(op, make_context(), api)[1])["base"]
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


@pytest.mark.s3
def test_the_pod_writes_with_the_connections_encryption_and_expected_owner(
    s3_backend: str, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator passes the bucket's non-secret settings (SSE-KMS, owner) to the pod, never the credentials."""
    needs_moto(s3_endpoint, "a made-up KMS key and bucket owner (SeaweedFS has no KMS: its PUT answers 500)")
    conn = json.loads(os.environ["AIRFLOW_CONN_STATEFUL_TEST_S3"])
    extra_args = {
        "ServerSideEncryption": "aws:kms",
        "SSEKMSKeyId": "arn:aws:kms:us-east-1:123456789012:key/stateful",
        "ExpectedBucketOwner": "123456789012",
    }
    conn["extra"]["service_config"] = {"s3": {"extra_args": extra_args}}
    monkeypatch.setenv("AIRFLOW_CONN_STATEFUL_TEST_S3", json.dumps(conn))
    op = make_op(credentials_secret="s3-creds")
    try:
        op.prepare_state(make_context())
    except Exception as exc:  # moto does not enforce the owner: a refusal here would be a real bug
        pytest.fail(f"the pre-start step failed with the connection's extra_args: {exc}")
    env = env_of(base(op.build_pod_request_obj(make_context())))
    assert env["STATEFUL_S3_SERVER_SIDE_ENCRYPTION"] == "aws:kms"
    assert env["STATEFUL_S3_SSE_KMS_KEY_ID"] == extra_args["SSEKMSKeyId"]
    assert env["STATEFUL_S3_EXPECTED_BUCKET_OWNER"] == "123456789012"
    assert s3_backend not in json.dumps(env) and conn["login"] not in json.dumps(env)


# -- reattach and stale pods ------------------------------------------------------------------------------------
def remote(pod: k8s.V1Pod, phase: str, *, uid: str | None = None, **labels: str) -> k8s.V1Pod:
    """What the API server would return for ``pod``: the same spec with a status (and extra labels)."""
    copy = k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=pod.metadata.name,
            namespace=pod.metadata.namespace,
            labels={**pod.metadata.labels, **labels},
            uid=uid or pod.metadata.uid,
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
    api = PodApi(op, keep_running)
    api.pods = [remote(op.build_pod_request_obj(context), "Running")]
    assert op.find_pod("ml", context) is api.pods[0]
    selector = api.client.list_namespaced_pod.call_args.kwargs["label_selector"].split(",")
    assert f"{IDENTITY_LABEL}={identity_label(state.identity)}" in selector
    assert f"{EPOCH_LABEL}={state.lease.epoch}" in selector
    assert f"{RUN_LABEL}={run_label('manual__1')}" in selector
    assert "team=ml" in selector


# -- execute and on_kill against the kubernetes client's API classes -------------------------------------------
Play = Callable[[k8s.V1Pod, dict[str, dict[str, str]]], str]


class PodApi:
    """``create_autospec`` mocks of CoreV1Api and PodManager that record real ``V1Pod`` and ``V1Secret`` objects.

    Two behaviours of a cluster are modelled, because the operator relies on them (and nothing else is):

    * the kubelet: a created pod stays ``Pending`` until every ``secretKeyRef`` in its containers' env
      resolves from a recorded Secret (a real pod shows ``CreateContainerConfigError`` and is retried); then
      ``play(pod, env)`` runs it, with ``env`` each container's environment as the kubelet resolves it (a
      ``fieldRef`` to ``spec.nodeName`` is :attr:`node`, the node the test says the pod landed on), and
      returns its phase;
    * the garbage collector: a Secret whose ``ownerReferences`` all name pods (by uid) that no longer exist
      is deleted; a Secret without owner references never is. A pod deleted with a grace period while it
      runs stays, terminating, until :meth:`end_terminating` plays its end.
    """

    def __init__(self, op: StatefulKubernetesPodOperator, play: Play) -> None:
        from airflow.providers.cncf.kubernetes.utils.pod_manager import PodManager

        self.play = play
        self.node = "node-a"  # where the (unmodelled) scheduler put the pods
        self.pods: list[k8s.V1Pod] = []
        self.secrets: list[k8s.V1Secret] = []
        self.secrets_ever: list[k8s.V1Secret] = []
        self._started: set[str] = set()
        self.client = mock.create_autospec(CoreV1Api, instance=True)
        self.client.list_namespaced_pod.side_effect = self.list_pods
        self.client.create_namespaced_secret.side_effect = self.create_secret
        self.client.read_namespaced_secret.side_effect = self.read_secret
        self.client.delete_namespaced_pod.side_effect = self.delete_gracefully
        self.manager = mock.create_autospec(PodManager, instance=True)
        self.manager.create_pod.side_effect = self.create_pod
        self.manager.read_pod.side_effect = self.read
        self.manager.await_pod_completion.side_effect = lambda pod, *a, **k: self.read(pod)
        self.manager.delete_pod.side_effect = self.delete
        self.attach(op)

    def attach(self, op: StatefulKubernetesPodOperator) -> None:
        """Point ``op`` at this API (a second operator, e.g. a later try on a restarted worker, may share it)."""
        op.client = self.client
        op.pod_manager = self.manager
        op.log_events_on_startup = False

    # pods
    def create_pod(self, pod: k8s.V1Pod) -> k8s.V1Pod:
        created = remote(pod, "Pending", uid=str(uuid.uuid4()))
        self.pods.append(created)
        return created

    def read(self, pod: k8s.V1Pod) -> k8s.V1Pod:
        self.kubelet()
        return next(p for p in self.pods if p.metadata.name == pod.metadata.name)

    def list_pods(self, *, namespace: str, label_selector: str) -> k8s.V1PodList:
        self.kubelet()
        wanted = [s for s in label_selector.split(",") if "=" in s and "!=" not in s]

        def matches(pod: k8s.V1Pod) -> bool:
            labels = pod.metadata.labels
            return all(labels.get(k) == v for k, v in (s.split("=", 1) for s in wanted)) and (
                "already_checked!=True" not in label_selector or labels.get("already_checked") != "True"
            )

        return k8s.V1PodList(items=[p for p in self.pods if p.metadata.namespace == namespace and matches(p)])

    def delete(self, pod: k8s.V1Pod) -> None:
        self.pods.remove(next(p for p in self.pods if p.metadata.name == pod.metadata.name))
        self.collect_garbage()

    def delete_gracefully(self, name: str, namespace: str, **kwargs: Any) -> None:
        pod = next(p for p in self.pods if p.metadata.name == name and p.metadata.namespace == namespace)
        if kwargs.get("grace_period_seconds") == 0 or terminated_phase(pod):
            self.delete(pod)
        else:
            pod.metadata.deletion_timestamp = "now"  # terminating: its containers get SIGTERM and may save

    def end_terminating(self) -> None:
        """The terminating pods' containers have exited: the pods go, and with them what they own."""
        for pod in [p for p in self.pods if p.metadata.deletion_timestamp]:
            self.delete(pod)

    # the kubelet and the garbage collector
    def kubelet_env(self, pod: k8s.V1Pod) -> dict[str, dict[str, str]]:
        """Each container's environment as the kubelet gives it: ``secretKeyRef`` read from the Secret.

        Raises ``LookupError`` if a referenced Secret or key does not exist (the container cannot start).
        """
        envs: dict[str, dict[str, str]] = {}
        for container in [*(pod.spec.init_containers or []), *pod.spec.containers]:
            env: dict[str, str] = {}
            for var in container.env or []:
                field = var.value_from.field_ref if var.value_from else None
                if field is not None:  # the downward API
                    env[var.name] = {"spec.nodeName": self.node, "metadata.name": pod.metadata.name}[
                        field.field_path
                    ]
                    continue
                ref = var.value_from.secret_key_ref if var.value_from else None
                if ref is None:
                    env[var.name] = var.value
                    continue
                secret = self.secret(ref.name, pod.metadata.namespace)
                if secret is None or ref.key not in (secret.data or {}):
                    raise LookupError(f"secret {ref.name} (key {ref.key}) not found for {container.name}")
                env[var.name] = base64.b64decode(secret.data[ref.key]).decode()
            envs[container.name] = env
        return envs

    def kubelet(self) -> None:
        for pod in self.pods:
            if pod.metadata.uid in self._started or pod.metadata.deletion_timestamp:
                continue
            try:
                env = self.kubelet_env(pod)
            except LookupError:
                continue  # CreateContainerConfigError: retried at the next sync
            self._started.add(pod.metadata.uid)
            pod.status.phase = self.play(pod, env)

    def collect_garbage(self) -> None:
        alive = {p.metadata.uid for p in self.pods}
        self.secrets = [
            s
            for s in self.secrets
            if not s.metadata.owner_references or any(o.uid in alive for o in s.metadata.owner_references)
        ]

    # secrets
    def secret(self, name: str, namespace: str) -> k8s.V1Secret | None:
        return next(
            (s for s in self.secrets if (s.metadata.name, s.metadata.namespace) == (name, namespace)), None
        )

    def read_secret(self, name: str, namespace: str, **kwargs: Any) -> k8s.V1Secret:
        found = self.secret(name, namespace)
        if found is None:
            raise ApiException(status=404, reason="Not Found")
        return found

    def create_secret(self, namespace: str, body: k8s.V1Secret, **kwargs: Any) -> k8s.V1Secret:
        assert isinstance(body, k8s.V1Secret) and body.metadata.namespace in (None, namespace)
        if self.secret(body.metadata.name, namespace) is not None:
            raise ApiException(status=409, reason="Conflict")
        body.metadata.namespace = namespace
        self.secrets.append(body)
        self.secrets_ever.append(body)
        self.collect_garbage()
        return body


def terminated_phase(pod: k8s.V1Pod) -> bool:
    return pod.status.phase in ("Succeeded", "Failed")


def start_pod(
    op: StatefulKubernetesPodOperator, context: dict[str, Any], api: PodApi
) -> tuple[PodState, k8s.V1Pod]:
    """The pre-start step, the rendered pod, and its creation (with its lease Secret) through the mocked API."""
    state = op.prepare_state(context)
    pod = op.build_pod_request_obj(context)
    op.get_or_create_pod(pod, context)
    return state, api.read(pod)


def keep_running(pod: k8s.V1Pod, env: dict[str, dict[str, str]]) -> str:
    return "Running"


def run_wrapped(pod: k8s.V1Pod, env: dict[str, dict[str, str]]) -> str:
    """Play the pod: run its main container's command (the client wrapping the job) with its environment."""
    result = run_client(env["base"], *base(pod).command[3:])
    assert result.returncode == 0, result.stderr
    return "Succeeded"


def test_execute_leases_runs_the_pod_and_pushes_the_final_checkpoint(
    state_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = "import pathlib, sys; pathlib.Path(sys.argv[1], 'model.bin').write_text('trained')"
    op = make_op(
        cmds=[sys.executable, "-c", job, str(tmp_path / "state-dir")],
        arguments=[],
        state_dir=str(tmp_path / "state-dir"),
    )
    api = PodApi(op, run_wrapped)
    context = make_context()
    with caplog.at_level("DEBUG"):
        result = op.execute(context)

    ref = context["ti"].pushed["checkpoint"]
    assert result == ref
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    store = checkpoints_at(state_url, identity)
    latest = store.latest()
    assert latest is not None and [f.path for f in store.files(latest)] == ["model.bin"]
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
    (secret,) = api.secrets_ever
    assert api.secrets == [], "its lease Secret went with it"
    token = base64.b64decode(secret.data[LEASE_SECRET_KEY]).decode()
    assert token and token not in caplog.text, "the token is in no log line, not even at DEBUG"


# -- the lease token: in a Secret the pod owns, never in the pod spec ---------------------------------------------
@pytest.mark.parametrize("mode", ["wrap", "sidecar", "init", "env"])
def test_the_lease_token_is_never_in_the_pod_spec_only_in_a_secret_the_pod_owns(
    state_url: str, tmp_path: Path, mode: str
) -> None:
    """Anyone who may ``get pods`` (and every log of the pod spec) sees no token; the pod's client still
    gets it, from the Secret, and can save with it."""
    op = make_op(state_mode=mode, client_image="example/stateful-client:1", credentials_secret="s3-creds")
    api = PodApi(op, keep_running)
    state, pod = start_pod(op, make_context(), api)
    token = state.lease.token

    sent = api.manager.create_pod.call_args.kwargs["pod"]
    assert token not in serialized(sent), "the pod as sent to the API server holds no token"
    assert token not in serialized(pod) and token not in json.dumps(pod.to_dict(), default=str)
    (secret,) = api.secrets
    name = lease_secret_name(state)
    assert (secret.metadata.name, secret.metadata.namespace) == (name, "ml")
    assert base64.b64decode(secret.data[LEASE_SECRET_KEY]).decode() == token
    assert [(o.api_version, o.kind, o.name, o.uid) for o in secret.metadata.owner_references] == [
        ("v1", "Pod", pod.metadata.name, pod.metadata.uid)
    ], "owned by the created pod (its uid), so Kubernetes deletes it with the pod"
    assert not secret.metadata.owner_references[0].block_owner_deletion, "would need pods/finalizers rights"
    assert secret.immutable is True and secret.type == "Opaque"
    assert secret.metadata.labels[EPOCH_LABEL] == str(state.lease.epoch)
    assert token not in serialized(secret.metadata), "the name and labels do not give the token away"

    # Every container that gets the stateful env reads the token from that Secret, and only from there.
    with_state = [
        c
        for c in [*(pod.spec.init_containers or []), *pod.spec.containers]
        if env_of(c).get("STATEFUL_EPOCH")
    ]
    assert with_state, "some container runs the client"
    for container in with_state:
        tokens = [v for v in container.env if v.name == LEASE_TOKEN_ENV]
        if mode == "sidecar" and container in pod.spec.containers:
            # The unchanged job container runs no client: holding the token would let it commit past the sidecar.
            assert tokens == [], "the job container of sidecar mode gets no lease token"
            continue
        (var,) = tokens
        assert var.value is None
        assert (var.value_from.secret_key_ref.name, var.value_from.secret_key_ref.key) == (
            name,
            LEASE_SECRET_KEY,
        )

    # Playing the kubelet: the client container's env resolved from the Secret is enough to save.
    client = RESTORE_CONTAINER if mode in ("sidecar", "init") else "base"
    env = api.kubelet_env(pod)[client]
    assert env[LEASE_TOKEN_ENV] == token
    saved = save_in_pod(env, tmp_path)
    latest = checkpoints_at(state_url, state.identity).latest()
    assert latest is not None and latest.epoch == state.lease.epoch and token not in saved.stderr

    api.secrets.clear()  # without its Secret the kubelet cannot start the container
    with pytest.raises(LookupError, match=name):
        api.kubelet_env(pod)


def test_the_pod_waits_for_its_lease_secret_and_a_refused_secret_removes_the_pod(state_url: str) -> None:
    """The Secret is created after the pod (it needs the pod's uid): until then the kubelet does not start
    it. If the API refuses the Secret (RBAC), the pod is deleted at once and the error names the fix."""
    from airflow.sdk.exceptions import AirflowException

    op = make_op()
    api = PodApi(op, keep_running)
    op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    api.manager.create_pod(pod)
    assert api.read(pod).status.phase == "Pending", "no Secret yet: CreateContainerConfigError, retried"
    op.create_lease_secret(api.read(pod))
    assert api.read(pod).status.phase == "Running"
    op.create_lease_secret(api.read(pod))  # again (a retried create, a reattach): kept, not replaced
    assert len(api.secrets_ever) == 1

    op2 = make_op()
    api2 = PodApi(op2, keep_running)
    forbidden = json.dumps({"kind": "Status", "message": 'secrets is forbidden: User "worker" cannot create'})
    api2.client.create_namespaced_secret.side_effect = ApiException(status=403, reason="Forbidden")
    api2.client.create_namespaced_secret.side_effect.body = forbidden
    with pytest.raises(AirflowException, match=r"HTTP 403 secrets is forbidden.*needs create on secrets"):
        op2.execute(make_context(try_number=2))
    assert api2.pods == [] and api2.secrets == [], "the pod that could never start is gone"


def test_a_lease_secret_someone_else_created_under_the_pods_name_keeps_the_pod_from_starting(
    state_url: str,
) -> None:
    """The Secret's name is known to whoever reads the head (it hashes the lease token the head holds). One
    planted under it before the operator creates it would give the pod a token and key its creator chose: a
    409 is kept only for the pod's own Secret (owner uid and contents), else the pod is deleted unstarted."""
    from airflow_stateful.kubernetes.lease_secrets import ForeignLeaseSecret, lease_secret_ref

    op = make_op()
    api = PodApi(op, keep_running)
    op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    planted = k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(
            name=lease_secret_ref(pod),
            namespace="ml",  # owned by nobody: Kubernetes keeps it
        ),
        data={LEASE_SECRET_KEY: base64.b64encode(b"a-token-the-planter-knows").decode()},
    )
    api.secrets.append(planted)
    with pytest.raises(
        ForeignLeaseSecret, match=r"already exists in namespace ml, but it is not owned by pod"
    ) as refused:
        op.get_or_create_pod(pod, make_context())
    assert "a-token-the-planter-knows" not in str(refused.value) and "YS10b2tlbi" not in str(refused.value)
    assert api.pods == [], "the pod that would have read the planted Secret is gone"
    assert api.secrets == [planted], "the planted Secret is left for whoever investigates"


@pytest.mark.parametrize("path", ["pod fails", "keep_pod"])
def test_a_failed_or_kept_pod_takes_its_lease_secret_with_it(state_url: str, path: str) -> None:
    """A failed pod is deleted by KubernetesPodOperator's cleanup and its Secret with it; a kept pod keeps its
    Secret exactly as long as it exists. The failure message (which holds the remote pod) has no token."""
    from airflow.sdk.exceptions import AirflowException

    kept = path == "keep_pod"
    op = make_op(on_finish_action="keep_pod" if kept else "delete_pod")
    api = PodApi(op, lambda pod, env: "Succeeded" if kept else "Failed")
    if kept:
        op.execute(make_context())
        (pod,) = api.pods
        assert len(api.secrets) == 1, "the kept pod keeps its Secret"
        api.manager.delete_pod(pod)  # deleted later, by hand or by a later try
    else:
        with pytest.raises(AirflowException, match="returned a failure") as failure:
            op.execute(make_context())
        (secret,) = api.secrets_ever
        assert base64.b64decode(secret.data[LEASE_SECRET_KEY]).decode() not in str(failure.value)
        assert "remote_pod" in str(failure.value), "KubernetesPodOperator printed the pod spec"
    assert api.pods == [] and api.secrets == []
    assert len(api.secrets_ever) == 1


def test_execute_reattaches_to_the_running_pod_keeps_its_secret_and_deletes_a_stale_pod_with_its_own(
    state_url: str,
) -> None:
    context = make_context(try_number=1)
    earlier, first = make_op(), make_op()
    api = PodApi(earlier, keep_running)
    api.attach(first)
    stale_state, stale = start_pod(earlier, context, api)  # fenced by the next pre-start, still running
    plan, holder = start_pod(first, context, api)
    assert plan.lease.epoch == stale_state.lease.epoch + 1 and len(api.secrets) == 2
    holder_secret = api.secret(lease_secret_name(plan), "ml")
    assert holder_secret is not None

    # The worker died; try 2 of the same task instance runs execute on a fresh operator.
    op = make_op()
    api.attach(op)
    api.play = lambda pod, env: pytest.fail("no new pod may be created while one holds the lease")
    created_before = api.manager.create_pod.call_count

    def finish(pod: k8s.V1Pod, *args: Any, **kwargs: Any) -> k8s.V1Pod:
        assert api.pods == [holder] and api.secrets == [holder_secret], (
            "the stale pod was deleted and its Secret with it; the reattached pod keeps its Secret"
        )
        # The reattached pod saves with the epoch and token it was started with, then completes.
        env = api.kubelet_env(holder)["base"]
        store = checkpoints_at(state_url, plan.identity)
        store.commit(PodSettings.from_env(env).lease(), {"step": 9})
        holder.status.phase = "Succeeded"
        return holder

    api.manager.await_pod_completion.side_effect = finish
    ref = op.execute(make_context(try_number=2))
    assert ref["epoch"] == plan.lease.epoch, "no new lease: the running pod kept its epoch"
    assert ref["seq"] is not None
    deleted = [c.args[0].metadata.name for c in api.manager.delete_pod.call_args_list]
    assert deleted == [stale.metadata.name, holder.metadata.name], (
        "the stale pod first, the finished one last"
    )
    assert api.manager.create_pod.call_count == created_before
    assert len(api.secrets_ever) == 2, "the reattaching try created no Secret of its own"
    assert api.pods == [] and api.secrets == []


def test_reattach_gives_a_pod_whose_worker_died_before_its_secret_the_secret_it_waits_for(
    state_url: str, tmp_path: Path
) -> None:
    first = make_op()
    api = PodApi(first, keep_running)
    plan = first.prepare_state(make_context())
    pod = first.build_pod_request_obj(make_context())
    api.manager.create_pod(pod)  # ... and the worker died before it created the Secret
    assert api.read(pod).status.phase == "Pending"

    def save_once(pod: k8s.V1Pod, env: dict[str, dict[str, str]]) -> str:
        work = tmp_path / "work"
        work.mkdir()
        (work / "model.bin").write_text("trained")
        saved = run_client(env["base"], "save", str(work))
        assert saved.returncode == 0, saved.stderr
        return "Succeeded"

    op = make_op()
    api.attach(op)
    api.play = save_once
    ref = op.execute(make_context(try_number=2))
    assert (ref["epoch"], ref["seq"]) == (plan.lease.epoch, 1), "the waiting pod started and saved"
    (secret,) = api.secrets_ever
    assert secret.metadata.name == lease_secret_name(plan)
    assert api.pods == [] and api.secrets == []


def test_on_kill_deletes_the_pod_with_its_grace_period_and_keeps_the_lease(state_url: str) -> None:
    from airflow_stateful.compat import AirflowRescheduleException

    op = make_op(termination_grace_period=90)
    context = make_context()
    api = PodApi(op, keep_running)

    def stop(pod: k8s.V1Pod, *args: Any, **kwargs: Any) -> k8s.V1Pod:
        op.on_kill()  # SIGTERM to the worker arrives while the pod runs
        terminating = api.read(pod)
        assert terminating.metadata.deletion_timestamp and len(api.secrets) == 1, (
            "the pod saves during its grace period: its Secret stays while it exists"
        )
        terminating.status.phase = "Succeeded"  # the client saved on SIGTERM and exited
        api.end_terminating()
        return terminating

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
    assert api.pods == [] and api.secrets == [] and len(api.secrets_ever) == 1


def test_the_operator_keeps_the_lease_alive_while_its_pod_computes_for_4x_the_ttl(
    state_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod here never renews (init mode: it restores, computes, saves once at the end, all one-shot):
    the operator's own session keeps the lease alive while GC runs, so the pod's late save lands."""
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_TTL", "1.5")
    monkeypatch.setenv("AIRFLOW__STATEFUL__LEASE_GRACE", "0.5")
    op = make_op(state_mode="init", client_image="example/stateful-client:1")
    api = PodApi(op, keep_running)
    work = tmp_path / "pod-state"

    def compute_then_save(pod: k8s.V1Pod, *args: Any, **kwargs: Any) -> k8s.V1Pod:
        running = api.read(pod)
        env = api.kubelet_env(running)
        assert run_client(env[RESTORE_CONTAINER], "restore", str(work)).returncode == 0
        time.sleep(6)  # 4 x the ttl without any save
        (work / "model.bin").write_text("trained")
        saved = run_client(env["base"], "save", str(work))
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


# -- warm placement: where the last writer ran, preferred, never required ---------------------------------------
CACHE_HOST_PATH = "/var/lib/airflow-stateful/cache"
DEFAULT_MAX_BYTES = 2 * 1024 * 1024 * 1024
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def downward_refs(container: k8s.V1Container) -> dict[str, str]:
    return {
        v.name: v.value_from.field_ref.field_path
        for v in container.env or []
        if v.value_from is not None and v.value_from.field_ref is not None
    }


def user_affinity() -> k8s.V1Affinity:
    """A user's own affinity: a required node term, a preferred one and a pod anti-affinity."""
    return k8s.V1Affinity(
        node_affinity=k8s.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(
                node_selector_terms=[
                    k8s.V1NodeSelectorTerm(
                        match_expressions=[
                            k8s.V1NodeSelectorRequirement(key="pool", operator="In", values=["gpu"])
                        ]
                    )
                ]
            ),
            preferred_during_scheduling_ignored_during_execution=[
                k8s.V1PreferredSchedulingTerm(
                    weight=10,
                    preference=k8s.V1NodeSelectorTerm(
                        match_expressions=[
                            k8s.V1NodeSelectorRequirement(
                                key="topology.kubernetes.io/zone", operator="In", values=["z1"]
                            )
                        ]
                    ),
                )
            ],
        ),
        pod_anti_affinity=k8s.V1PodAntiAffinity(
            preferred_during_scheduling_ignored_during_execution=[
                k8s.V1WeightedPodAffinityTerm(
                    weight=5,
                    pod_affinity_term=k8s.V1PodAffinityTerm(
                        topology_key="kubernetes.io/hostname",
                        label_selector=k8s.V1LabelSelector(match_labels={"team": "ml"}),
                    ),
                )
            ]
        ),
    )


def preference_for(node: str) -> dict[str, Any]:
    """The term the operator adds, as the API server receives it."""
    return {
        "weight": 100,
        "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]},
    }


def seed_checkpoint(url: str, identity: Identity, *, files: Path | None, node: str | None) -> int:
    """An earlier pod's checkpoint (with or without files), written on ``node``; returns its seq."""
    store = checkpoints_at(url, identity)
    lease = store.acquire(holder=WriterInfo(task_id="fit", try_number=1), steal=True)
    if files is not None:
        files.mkdir(parents=True, exist_ok=True)
        (files / "model.bin").write_bytes(b"weights" * 1000)
    writer = WriterInfo(task_id="fit", try_number=1, pod="fit-abc", node=node)
    seq = store.commit(lease, {"step": 1}, files=files, writer=writer).seq
    store.release(lease)
    return seq


@pytest.mark.parametrize("mode", ["wrap", "sidecar", "init", "env"])
def test_every_stateful_container_learns_its_node_and_pod_name_from_the_downward_api(
    state_url: str, mode: str
) -> None:
    op = make_op(state_mode=mode, client_image="example/stateful-client:1")
    op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    stateful = [
        c
        for c in [*(pod.spec.init_containers or []), *pod.spec.containers]
        if env_of(c).get("STATEFUL_EPOCH")
    ]
    assert {c.name for c in stateful} >= {"base"}
    for container in stateful:
        assert downward_refs(container) == {"NODE_NAME": "spec.nodeName", "POD_NAME": "metadata.name"}, (
            container.name
        )


def test_the_users_own_node_name_and_pod_name_are_kept_and_every_save_records_the_node(
    state_url: str, tmp_path: Path
) -> None:
    """NODE_NAME/POD_NAME the user set (``env_vars``, ``pod_runtime_info_envs``) win, once each; with the
    operator's own, a save records the node and pod the kubelet resolved (mocked API: :class:`PodApi`)."""
    own_pod_name = k8s.V1EnvVar(
        name="POD_NAME",
        value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="metadata.name")),
    )
    op = make_op(env_vars={"NODE_NAME": "pinned-node"}, pod_runtime_info_envs=[own_pod_name])
    op.prepare_state(make_context())
    container = base(op.build_pod_request_obj(make_context()))
    names = [e.name for e in container.env]
    assert names.count("NODE_NAME") == 1 and names.count("POD_NAME") == 1
    assert env_of(container)["NODE_NAME"] == "pinned-node"

    op = make_op()
    api = PodApi(op, keep_running)
    api.node = "node-a"
    state, pod = start_pod(op, make_context(try_number=2), api)
    env = api.kubelet_env(pod)["base"]
    assert (env["NODE_NAME"], env["POD_NAME"]) == ("node-a", pod.metadata.name)
    save_in_pod(env, tmp_path)
    latest = checkpoints_at(state_url, state.identity).latest()
    assert latest is not None
    assert (latest.writer.node, latest.writer.pod) == ("node-a", pod.metadata.name)


def test_with_the_restore_cache_the_next_pod_prefers_the_last_writers_node_and_restores_from_its_cache(
    state_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Try 1 runs on node-a and saves through node-a's cache; try 2 *prefers* node-a (merged with the user's
    affinity, whose required term is untouched) and, landing there, downloads no chunk. The Kubernetes API
    is mocked (:class:`PodApi`); node-a's hostPath directory is a temporary directory given to the client as
    the mount would."""
    node_a_cache = tmp_path / "node-a-cache"  # node-a's hostPath directory, mounted into the client
    first = make_op(restore_cache_host_path=CACHE_HOST_PATH + "/")
    api = PodApi(first, keep_running)
    api.node = "node-a"
    with caplog.at_level("INFO", logger="airflow_stateful"):
        state, pod = start_pod(first, make_context(try_number=1), api)
    assert "no node preference: there is no checkpoint yet" in caplog.text
    assert not pod.spec.affinity, "no checkpoint yet: nothing to prefer"
    (volume,) = [v for v in pod.spec.volumes if v.host_path is not None]
    assert (volume.host_path.path, volume.host_path.type) == (CACHE_HOST_PATH, "DirectoryOrCreate")
    assert [(m.name, m.mount_path) for m in base(pod).volume_mounts if m.name == volume.name] == [
        (volume.name, "/var/cache/airflow-stateful")
    ]
    literal = env_of(base(pod))
    assert literal["STATEFUL_RESTORE_CACHE_DIR"] == "/var/cache/airflow-stateful"
    assert literal["STATEFUL_RESTORE_CACHE_MAX_BYTES"] == str(DEFAULT_MAX_BYTES)
    env = {**api.kubelet_env(pod)["base"], "STATEFUL_RESTORE_CACHE_DIR": str(node_a_cache)}
    work = tmp_path / "work1"
    (work / "data").mkdir(parents=True)
    (work / "data" / "weights.bin").write_bytes(os.urandom(300_000))
    saved = run_client(env, "save", str(work))
    assert saved.returncode == 0, saved.stderr
    store = checkpoints_at(state_url, state.identity)
    latest = store.latest()
    assert latest is not None and latest.writer.node == "node-a"
    assert any((node_a_cache / f"uid-{os.geteuid()}").rglob("*")), "the save filled node-a's cache"

    # Try 2 (the worker's restart, say): the user's affinity plus the preference for node-a.
    affinity = user_affinity()
    before = ApiClient().sanitize_for_serialization(affinity)
    second = make_op(restore_cache_host_path=CACHE_HOST_PATH, affinity=affinity)
    api.attach(second)
    caplog.clear()
    with caplog.at_level("INFO", logger="airflow_stateful"):
        second.prepare_state(make_context(try_number=2))
    assert (
        f"preferring node node-a, where checkpoint {latest.seq} was written (its restore cache holds its "
        "chunks); not required: the pod runs anywhere if node-a is gone"
    ) in caplog.text
    pod2 = second.build_pod_request_obj(make_context(try_number=2))
    sent = ApiClient().sanitize_for_serialization(pod2.spec.affinity)
    assert sent["nodeAffinity"][REQUIRED] == before["nodeAffinity"][REQUIRED], (
        "the user's required term is exactly as it was: none added, none changed"
    )
    assert sent["nodeAffinity"][PREFERRED] == [*before["nodeAffinity"][PREFERRED], preference_for("node-a")]
    assert sent["podAntiAffinity"] == before["podAntiAffinity"]
    assert ApiClient().sanitize_for_serialization(second.affinity) == before, (
        "the operator's own is unchanged"
    )
    again = second.build_pod_request_obj(make_context(try_number=2))
    assert ApiClient().sanitize_for_serialization(again.spec.affinity) == sent, "built twice, added once"

    # The pod landed on node-a: its chunks come from node-a's cache. Proof: they are gone from the store.
    tree = store.tree(latest)
    assert tree is not None
    store.store.delete_many({c.key for f in tree.files for c in f.chunks})
    second.get_or_create_pod(pod2, make_context(try_number=2))
    env2 = {**api.kubelet_env(api.read(pod2))["base"], "STATEFUL_RESTORE_CACHE_DIR": str(node_a_cache)}
    restored = run_client(env2, "restore", str(tmp_path / "work2"))
    assert restored.returncode == 0, restored.stderr
    assert (tmp_path / "work2" / "data" / "weights.bin").read_bytes() == (
        work / "data" / "weights.bin"
    ).read_bytes()
    assert "0 chunk(s) downloaded (warm; written on node node-a, this pod runs on node node-a)" in (
        restored.stderr
    )


def test_the_preference_keeps_the_affinity_of_a_full_pod_spec_and_is_never_required(
    state_url: str, tmp_path: Path
) -> None:
    """The provider's merge would replace a template's affinity by the operator's: the preference is added to
    the finished pod instead, so a template's required term survives."""
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    seq = seed_checkpoint(state_url, identity, files=tmp_path / "files", node="node-b")
    spec = k8s.V1Pod(spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base")], affinity=user_affinity()))
    op = make_op(restore_cache_host_path=CACHE_HOST_PATH, full_pod_spec=spec)
    op.prepare_state(make_context())
    assert op._preferred_node == "node-b" and seq == 1
    sent = ApiClient().sanitize_for_serialization(op.build_pod_request_obj(make_context()).spec.affinity)
    template = ApiClient().sanitize_for_serialization(user_affinity())
    assert sent["nodeAffinity"][REQUIRED] == template["nodeAffinity"][REQUIRED]
    assert sent["nodeAffinity"][PREFERRED] == [*template["nodeAffinity"][PREFERRED], preference_for("node-b")]
    assert sent["podAntiAffinity"] == template["podAntiAffinity"]
    # Without any affinity of the user's: the preference alone, and never a required term.
    plain = make_op(restore_cache_host_path=CACHE_HOST_PATH)
    plain.prepare_state(make_context(try_number=2))
    alone = ApiClient().sanitize_for_serialization(plain.build_pod_request_obj(make_context()).spec.affinity)
    assert alone == {"nodeAffinity": {PREFERRED: [preference_for("node-b")]}}


@pytest.mark.parametrize("case", ["no cache", "no files", "no node"])
def test_no_preference_without_the_cache_without_files_or_without_a_recorded_node(
    state_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    seq = seed_checkpoint(
        state_url,
        identity,
        files=None if case == "no files" else tmp_path / "files",
        node=None if case == "no node" else "node-b",
    )
    affinity = user_affinity()
    op = make_op(affinity=affinity, restore_cache_host_path=None if case == "no cache" else CACHE_HOST_PATH)
    with caplog.at_level("DEBUG", logger="airflow_stateful"):
        op.prepare_state(make_context())
    pod = op.build_pod_request_obj(make_context())
    assert ApiClient().sanitize_for_serialization(pod.spec.affinity) == (
        ApiClient().sanitize_for_serialization(affinity)
    ), "the user's affinity, untouched"
    expected = {
        "no cache": "no node preference: restore_cache_host_path is not set",
        "no files": f"no node preference: checkpoint {seq} has no files to restore",
        "no node": f"no node preference: checkpoint {seq} records no node",
    }[case]
    assert expected in caplog.text
    assert "preferring node" not in caplog.text
    if case == "no cache":
        assert not [v for v in pod.spec.volumes or [] if v.host_path is not None]
        assert "STATEFUL_RESTORE_CACHE_DIR" not in env_of(base(pod))


def test_the_restore_cache_is_mounted_only_where_the_client_runs(state_url: str) -> None:
    """Sidecar mode leaves the job's container as it is; init and env modes run the client in it."""
    for mode, with_cache in (
        ("sidecar", {RESTORE_CONTAINER, SIDECAR_CONTAINER}),
        ("init", {RESTORE_CONTAINER, "base"}),
        ("env", {"base"}),
    ):
        op = make_op(state_mode=mode, client_image="example/stateful-client:1", restore_cache_host_path="/c")
        op.prepare_state(make_context())
        pod = op.build_pod_request_obj(make_context())
        containers = [*(pod.spec.init_containers or []), *pod.spec.containers]
        mounted = {
            c.name
            for c in containers
            if any(m.mount_path == "/var/cache/airflow-stateful" for m in c.volume_mounts or [])
        }
        told = {c.name for c in containers if env_of(c).get("STATEFUL_RESTORE_CACHE_DIR")}
        assert mounted == told == with_cache, mode
        assert [v.host_path.path for v in pod.spec.volumes if v.host_path is not None] == ["/c"]


def test_a_bad_restore_cache_host_path_is_refused_when_the_dag_is_parsed(state_url: str) -> None:
    from airflow_stateful.core.errors import InvalidValueError

    for bad in ("", "relative/cache", "/", "/var/../etc", "./cache"):
        with pytest.raises(InvalidValueError, match="restore_cache_host_path") as refused:
            make_op(restore_cache_host_path=bad)
        assert repr(bad) in str(refused.value)
    with pytest.raises(
        InvalidValueError, match="state_dir '/var/cache' overlaps /var/cache/airflow-stateful"
    ):
        make_op(restore_cache_host_path="/srv/cache", state_dir="/var/cache")
    for max_bytes in (0, -1, True, "1G"):
        with pytest.raises(InvalidValueError, match="restore_cache_max_bytes"):
            make_op(restore_cache_host_path="/srv/cache", restore_cache_max_bytes=max_bytes)


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

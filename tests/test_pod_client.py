"""The in-pod client in a subprocess against the real S3 endpoint: restore, run, save on SIGTERM, fencing.

The client runs as ``python -m airflow_stateful.client`` exactly as in a pod: configuration from ``STATEFUL_*``
variables, credentials from boto3's standard chain (here AWS_* variables for the test endpoint). The lease is
taken by the test, playing the part of StatefulKubernetesPodOperator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from maintenance import GcLoop
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession, store_from_url
from airflow_stateful.core.protocol.lease import Lease

pytestmark = [pytest.mark.s3, pytest.mark.slow]

# A long job: counts up, writing its progress atomically (value file + a data file), until SIGTERM.
JOB = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    work, ledger = Path(sys.argv[1]), Path(sys.argv[2])
    value_file = work / ".stateful-value.json"
    count = json.loads(value_file.read_text())["count"] if value_file.exists() else 0
    data = work / "data" / "progress.txt"
    with open(ledger, "a") as fh:
        fh.write(f"start {count}\\n")
    stop = False

    def on_term(signum, frame):
        global stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while not stop and count < 10_000:
        count += 1
        data.parent.mkdir(exist_ok=True)
        tmp = data.with_suffix(".tmp")
        tmp.write_text(str(count))
        os.replace(tmp, data)
        tmp = value_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"count": count}))
        os.replace(tmp, value_file)
        time.sleep(0.01)
    with open(ledger, "a") as fh:
        fh.write(f"stop {count}\\n")
    """
)


@pytest.fixture
def pod(s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path) -> dict[str, object]:
    backend = f"s3://{s3_endpoint.bucket}/{s3_prefix}"
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    checkpoints = CheckpointStore(store=store_from_url(backend, **s3_endpoint.options()), identity=identity)
    (tmp_path / "job.py").write_text(JOB)
    env = dict(os.environ)
    env.update(
        {
            "STATEFUL_IDENTITY": identity.key,
            "STATEFUL_BACKEND_URL": backend,
            "STATEFUL_SCHEMA_VERSION": "1",
            "STATEFUL_IMAGE": "example/train:1.2",
            "STATEFUL_TRY_NUMBER": "1",
            "AWS_DEFAULT_REGION": s3_endpoint.region,
        }
    )
    if s3_endpoint.endpoint_url:
        env["STATEFUL_S3_ENDPOINT_URL"] = s3_endpoint.endpoint_url
    creds = s3_endpoint.credentials
    if creds:
        env["AWS_ACCESS_KEY_ID"] = creds["aws_access_key_id"]
        env["AWS_SECRET_ACCESS_KEY"] = creds["aws_secret_access_key"]
    return {"checkpoints": checkpoints, "env": env, "tmp": tmp_path}


def leased_env(pod: dict[str, object], lease: Lease) -> dict[str, str]:
    env = dict(pod["env"])  # type: ignore[call-overload]
    env.update({"STATEFUL_EPOCH": str(lease.epoch), "STATEFUL_LEASE_TOKEN": lease.token})
    return env


def start_run(env: dict[str, str], work: Path, ledger: Path, job: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "airflow_stateful.client",
        "run",
        "--dir",
        str(work),
        "--every",
        "0.3s",
        "--",
    ]
    return subprocess.Popen(
        [*cmd, sys.executable, str(job), str(work), str(ledger)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_run_saves_on_sigterm_and_the_next_pod_resumes(pod: dict[str, object]) -> None:
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    ledger = tmp / "ledger"
    lease = checkpoints.acquire(steal=True)
    first = start_run(leased_env(pod, lease), tmp / "work1", ledger, tmp / "job.py")
    try:
        wait_for(lambda: checkpoints.latest() is not None)  # at least one periodic save happened
        first.send_signal(signal.SIGTERM)  # the pod is being evicted
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out
    stopped_at = int(ledger.read_text().split("stop ")[1].split()[0])
    latest = checkpoints.latest()
    assert latest is not None
    assert latest.value == {"count": stopped_at}, "the final save after SIGTERM holds the last progress"
    assert [f.path for f in checkpoints.files(latest)] == ["data/progress.txt"], "the value file is not data"
    assert latest.extra.get("image") == "example/train:1.2"
    assert latest.writer.try_number == 1

    # The next pod (a new lease: the operator of the next try took it) starts where the first one stopped.
    lease2 = checkpoints.acquire(steal=True)
    work2 = tmp / "work2"
    second = start_run(leased_env(pod, lease2), work2, ledger, tmp / "job.py")
    try:
        wait_for(lambda: ledger.read_text().count("start") == 2)
        second.send_signal(signal.SIGTERM)
        out2, _ = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 0, out2
    assert f"start {stopped_at}" in ledger.read_text(), "the second pod resumed from the saved count"
    assert (work2 / "data" / "progress.txt").exists()


def test_a_pod_with_a_stale_epoch_is_refused(pod: dict[str, object]) -> None:
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    old = checkpoints.acquire(steal=True)
    newer = checkpoints.acquire(steal=True)  # a restarted worker started a new pod
    checkpoints.commit(newer, {"count": 500})
    work = tmp / "left-behind"
    work.mkdir()
    (work / ".stateful-value.json").write_text(json.dumps({"count": 3}))
    (work / "weights.bin").write_bytes(b"stale")
    result = subprocess.run(
        [sys.executable, "-m", "airflow_stateful.client", "save", str(work)],
        env=leased_env(pod, old),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "FENCED" in result.stderr and f"epoch {old.epoch}" in result.stderr
    latest = checkpoints.latest()
    assert latest is not None and latest.value == {"count": 500}, "the newer state is intact"


def test_misconfigured_pod_fails_before_writing(pod: dict[str, object]) -> None:
    env = dict(pod["env"])  # type: ignore[call-overload]
    env.update({"STATEFUL_EPOCH": "zero", "STATEFUL_LEASE_TOKEN": "t"})
    result = subprocess.run(
        [sys.executable, "-m", "airflow_stateful.client", "save", str(pod["tmp"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "STATEFUL_EPOCH must be an integer, not 'zero'" in result.stderr
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    assert checkpoints.latest() is None


def test_the_client_needs_no_airflow(tmp_path: Path) -> None:
    """Pods have only boto3: importing the client must not import Airflow (a fake one refuses to load)."""
    fake = tmp_path / "fake" / "airflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('airflow must not be imported in a pod')\n")
    code = (
        f"import sys; sys.path.insert(0, {str(fake.parent)!r}); "
        "import airflow_stateful.client.__main__, airflow_stateful.client.pod; "
        "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- a pod computing for longer than the lease ttl ------------------------------------------------------------
SLOW_JOB = textwrap.dedent(
    """
    import pathlib, sys, time

    time.sleep(float(sys.argv[2]))  # one long step, no save in between
    (pathlib.Path(sys.argv[1]) / "result.txt").write_text("trained")
    """
)
POD_TTL = 1.5


def run_slow_pod(
    pod: dict[str, object], lease: Lease, work: Path, *, every: str
) -> subprocess.CompletedProcess[str]:
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    (tmp / "slow.py").write_text(SLOW_JOB)
    env = {**leased_env(pod, lease), "STATEFUL_LEASE_TTL": str(POD_TTL)}
    command = [sys.executable, "-m", "airflow_stateful.client", "run", "--dir", str(work), "--every", every]
    return subprocess.run(
        [*command, "--", sys.executable, str(tmp / "slow.py"), str(work), str(4 * POD_TTL)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_pod_computing_4x_the_ttl_keeps_the_lease_alive_by_itself_while_gc_runs(
    pod: dict[str, object],
) -> None:
    """Nobody else renews here (the operator's worker is gone): the pod's client alone keeps the lease."""
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    lease = CheckpointStore(
        store=checkpoints.store, identity=checkpoints.identity, lease_ttl=POD_TTL
    ).acquire(steal=True)
    with GcLoop(checkpoints.store, keep_last=1, grace=0.5) as gc:
        result = run_slow_pod(pod, lease, tmp / "work", every="100s")  # saves only when the job ends
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(gc.renewals) >= 3 and gc.deletion_errors() == []
    latest = checkpoints.latest()
    assert latest is not None and latest.epoch == lease.epoch, "the pod's final save was not fenced"
    out = tmp / "restored"
    checkpoints.restore_files(latest, out)
    assert (out / "result.txt").read_text() == "trained"


def test_the_operator_and_the_pod_renew_the_same_lease_without_fencing_each_other(
    pod: dict[str, object],
) -> None:
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    operator_side = CheckpointStore(store=checkpoints.store, identity=checkpoints.identity, lease_ttl=POD_TTL)
    with WriterSession(
        checkpoints=operator_side, writer=WriterInfo(task_id="fit"), renew_every=0.3
    ) as operator_session:
        epoch = operator_session.lease.epoch
        result = run_slow_pod(pod, operator_session.lease, tmp / "work", every="0.5s")
        assert not operator_session.lost, "the pod's renewals and saves never fenced the operator"
    assert result.returncode == 0, result.stdout + result.stderr
    head = checkpoints.head()
    assert head is not None and head.epoch == epoch, "nobody raised the epoch"
    assert head.lease is None, "the operator released the lease once the pod was over"
    history = checkpoints.history()
    assert len(history) >= 3 and all(e.epoch == head.epoch for e in history), "periodic saves all landed"


def test_the_sidecar_renews_saves_periodically_and_once_more_on_sigterm(pod: dict[str, object]) -> None:
    """``client sidecar``: what the native sidecar of an unchangeable image runs beside the job."""
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    lease = CheckpointStore(
        store=checkpoints.store, identity=checkpoints.identity, lease_ttl=POD_TTL
    ).acquire(steal=True)
    work = tmp / "shared"
    work.mkdir()
    (work / "progress.txt").write_text("0")
    env = {**leased_env(pod, lease), "STATEFUL_LEASE_TTL": str(POD_TTL)}
    command = [
        sys.executable,
        "-m",
        "airflow_stateful.client",
        "sidecar",
        "--dir",
        str(work),
        "--every",
        "1s",
    ]
    sidecar = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(checkpoints.history()) >= 2)  # periodic saves
        time.sleep(3 * POD_TTL)  # longer than the ttl: the sidecar's heartbeat keeps the lease
        (work / "progress.txt").write_text("final")  # the job's last words, then the kubelet stops the pod
        sidecar.send_signal(signal.SIGTERM)
        out, _ = sidecar.communicate(timeout=60)
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
    assert sidecar.returncode == 0, out
    latest = checkpoints.latest()
    assert latest is not None and latest.epoch == lease.epoch
    restored = tmp / "restored"
    checkpoints.restore_files(latest, restored)
    assert (restored / "progress.txt").read_text() == "final", (
        "the final save on SIGTERM holds the last state"
    )
    head = checkpoints.head()
    assert head is not None and head.lease is not None and head.lease.token == lease.token, (
        "the sidecar renews but never releases the operator's lease"
    )


# -- S3 options: the pod writes with the connection's encryption and expected owner ---------------------------
KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/1b1b1b1b-2c2c-3d3d-4e4e-5f5f5f5f5f5f"
OWNER = "123456789012"  # moto's default account


def _heads(endpoint: S3Endpoint, prefix: str) -> dict[str, dict[str, object]]:
    client = endpoint.client()
    listing = client.list_objects_v2(Bucket=endpoint.bucket, Prefix=f"{prefix}/").get("Contents", [])
    return {o["Key"]: client.head_object(Bucket=endpoint.bucket, Key=o["Key"]) for o in listing}


def test_the_pod_is_told_the_connections_s3_options_and_writes_with_them(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connection -> StateHook.s3_options() -> PodState.env() -> PodSettings -> the pod's store, for real.

    Only the non-secret options travel (no key, token or proxy password in the pod spec), and the pod's
    session writes every object with SSE-KMS and sends the expected owner with every request.
    """
    if s3_endpoint.kind != "moto":
        pytest.skip("a made-up KMS key and account: moto only")
    from airflow_stateful.client.pod import pod_session
    from airflow_stateful.client.pod import save as pod_save
    from airflow_stateful.client.settings import PodSettings
    from airflow_stateful.hooks.state import StateHook
    from airflow_stateful.kubernetes.pods import PodState, pod_s3_fields

    secrets = {"password": "pw-secret-1f2e", "token": "token-secret-9a8b", "proxy": "proxy-secret-7c6d"}
    conn = {
        "conn_type": "aws",
        "login": s3_endpoint.credentials["aws_access_key_id"],
        "password": secrets["password"],  # moto accepts any secret key
        "extra": {
            "region_name": s3_endpoint.region,
            "aws_session_token": secrets["token"],
            "verify": False,
            "config_kwargs": {
                "retries": {"mode": "standard", "max_attempts": 7},
                "connect_timeout": 5,
                "proxies": {"https": f"http://user:{secrets['proxy']}@proxy.internal:3128"},
            },
            "addressing_style": "path",
            "service_config": {
                "s3": {
                    "endpoint_url": s3_endpoint.endpoint_url,
                    "extra_args": {
                        "ServerSideEncryption": "aws:kms",
                        "SSEKMSKeyId": KMS_KEY,
                        "BucketKeyEnabled": True,
                        "ExpectedBucketOwner": OWNER,
                    },
                }
            },
        },
    }
    monkeypatch.setenv("AIRFLOW_CONN_STATEFUL_POD_S3", json.dumps(conn))
    backend = f"s3://{s3_endpoint.bucket}/{s3_prefix}"
    options = StateHook(backend_url=backend, conn_id="stateful_pod_s3").s3_options()
    identity = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")
    checkpoints = CheckpointStore(store=store_from_url(backend, **s3_endpoint.options()), identity=identity)
    lease = checkpoints.acquire()
    state = PodState(
        identity=identity,
        lease=lease,
        run_id="manual__1",
        backend_url=backend,
        keep_last=3,
        lease_ttl=600,
        schema_version=1,
        **pod_s3_fields(options),
    )
    env_vars = state.env(image="example/train:1.2")
    rendered = json.dumps([e.to_dict() for e in env_vars])
    assert not any(secret in rendered for secret in secrets.values()), "no secret in the pod spec"
    literal = {e.name: e.value for e in env_vars if e.value is not None}
    assert {k: v for k, v in literal.items() if k.startswith("STATEFUL_S3_")} == {
        "STATEFUL_S3_ENDPOINT_URL": s3_endpoint.endpoint_url,
        "STATEFUL_S3_SERVER_SIDE_ENCRYPTION": "aws:kms",
        "STATEFUL_S3_SSE_KMS_KEY_ID": KMS_KEY,
        "STATEFUL_S3_BUCKET_KEY_ENABLED": "true",
        "STATEFUL_S3_EXPECTED_BUCKET_OWNER": OWNER,
        "STATEFUL_S3_VERIFY": "false",
        "STATEFUL_S3_CONFIG_KWARGS": json.dumps(
            {
                "connect_timeout": 5,
                "retries": {"max_attempts": 7, "mode": "standard"},
                "s3": {"addressing_style": "path"},
            },
            sort_keys=True,
        ),
    }
    settings = PodSettings.from_env({**literal, "STATEFUL_LEASE_TOKEN": lease.token})
    assert settings.store_options() == {
        "endpoint_url": s3_endpoint.endpoint_url,
        "server_side_encryption": "aws:kms",
        "sse_kms_key_id": KMS_KEY,
        "bucket_key_enabled": True,
        "expected_bucket_owner": OWNER,
        "verify": False,
        "config_kwargs": {
            "connect_timeout": 5,
            "retries": {"max_attempts": 7, "mode": "standard"},
            "s3": {"addressing_style": "path"},
        },
    }

    # The pod's own credentials: boto3's chain (here AWS_* variables, as a credentials_secret would give).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.credentials["aws_secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_endpoint.region)
    work = tmp_path / "work"
    (work / "model").mkdir(parents=True)
    (work / "model" / "weights.bin").write_bytes(os.urandom(1024))
    (work / ".stateful-value.json").write_text(json.dumps({"epoch": 3}))
    sent: list[dict[str, str]] = []
    with pod_session(settings, heartbeat=False) as session:
        client = session.checkpoints.store.client  # type: ignore[attr-defined]
        client.meta.events.register(
            "before-send",
            lambda request, event_name, **_: sent.append(
                {
                    "op": event_name,
                    **{
                        k.lower(): v.decode() if isinstance(v, bytes) else v
                        for k, v in request.headers.items()
                    },
                }
            ),
        )
        pod_save(session, work)
    assert sent and all(s.get("x-amz-expected-bucket-owner") == OWNER for s in sent), sent
    heads = _heads(s3_endpoint, s3_prefix)
    assert len(heads) == 3, heads.keys()  # head, manifest, data file
    for key, head in heads.items():
        assert (head["ServerSideEncryption"], head["SSEKMSKeyId"]) == ("aws:kms", KMS_KEY), key
    assert checkpoints.latest().value == {"epoch": 3}  # type: ignore[union-attr]


def test_a_pod_saves_with_the_encryption_it_is_told(pod: dict[str, object], s3_endpoint: S3Endpoint) -> None:
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    work = tmp / "sse"
    work.mkdir()
    (work / "weights.bin").write_bytes(b"w")
    env = {**leased_env(pod, checkpoints.acquire()), "STATEFUL_S3_SERVER_SIDE_ENCRYPTION": "AES256"}
    result = subprocess.run(
        [sys.executable, "-m", "airflow_stateful.client", "save", str(work)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    prefix = checkpoints.store.url.split("/", 3)[3]
    heads = _heads(s3_endpoint, prefix)
    assert len(heads) == 3
    assert {h.get("ServerSideEncryption") for h in heads.values()} == {"AES256"}


def test_a_pod_with_bad_s3_options_fails_before_writing(pod: dict[str, object]) -> None:
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    (tmp / "weights.bin").write_bytes(b"w")
    lease = checkpoints.acquire()
    for variables, message in (
        (
            {"STATEFUL_S3_SERVER_SIDE_ENCRYPTION": "aws:kmz"},
            "STATEFUL_S3_SERVER_SIDE_ENCRYPTION must be one of AES256, aws:kms, aws:kms:dsse, not 'aws:kmz'",
        ),
        (
            {"STATEFUL_S3_SSE_KMS_KEY_ID": "alias/k"},
            "STATEFUL_S3_SSE_KMS_KEY_ID 'alias/k' needs STATEFUL_S3_SERVER_SIDE_ENCRYPTION aws:kms",
        ),
        ({"STATEFUL_S3_VERIFY": "maybe"}, "STATEFUL_S3_VERIFY: the CA bundle 'maybe' does not exist"),
        (
            {"STATEFUL_S3_CONFIG_KWARGS": '{"retry": 1}'},
            "STATEFUL_S3_CONFIG_KWARGS has the unknown key(s) 'retry'",
        ),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "airflow_stateful.client", "save", str(tmp)],
            env={**leased_env(pod, lease), **variables},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr
    assert checkpoints.latest() is None


# -- the node's restore cache (StatefulKubernetesPodOperator's restore_cache_host_path) --------------------------
def run_verb(env: dict[str, str], verb: str, directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "airflow_stateful.client", verb, str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_client_restores_through_the_nodes_cache_and_says_how_warm_it_was(pod: dict[str, object]) -> None:
    """A save fills the node's cache; a restore on that node takes every chunk from it (proof: the chunk
    objects are deleted from the bucket first). A cold cache is filled by the restore that misses it."""
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    node_a, node_b = tmp / "node-a-cache", tmp / "node-b-cache"
    work = tmp / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "weights.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    (work / "notes.txt").write_text("epoch 3")
    (work / ".stateful-value.json").write_text(json.dumps({"epoch": 3}))
    lease = checkpoints.acquire(steal=True)
    on_a = {**leased_env(pod, lease), "NODE_NAME": "node-a", "STATEFUL_RESTORE_CACHE_DIR": str(node_a)}
    saved = run_verb(on_a, "save", work)
    assert saved.returncode == 0, saved.stderr
    latest = checkpoints.latest()
    assert latest is not None and latest.writer.node == "node-a"

    # The next pod lands on node-b (cold), then one more on node-b (warm now: the first restore filled it).
    lease2 = checkpoints.acquire(steal=True)
    on_b = {**leased_env(pod, lease2), "NODE_NAME": "node-b", "STATEFUL_RESTORE_CACHE_DIR": str(node_b)}
    cold = run_verb(on_b, "restore", tmp / "cold")
    assert cold.returncode == 0, cold.stderr
    assert "0 B of 3.0 MiB from the restore cache" in cold.stderr, cold.stderr
    assert "(cold; written on node node-a, this pod runs on node node-b)" in cold.stderr

    tree = checkpoints.tree(latest)
    assert tree is not None
    chunks = {c.key for f in tree.files for c in f.chunks}
    checkpoints.store.delete_many(chunks)  # from here on, a restore that downloads a chunk fails
    for env, cache, name in ((on_b, node_b, "warm-b"), ({**on_a, **_lease_env(lease2)}, node_a, "warm-a")):
        warm = run_verb(env, "restore", tmp / name)
        assert warm.returncode == 0, warm.stderr
        assert (
            f"from the restore cache {cache / f'uid-{os.geteuid()}'} ({len(chunks)} chunk(s)), "
            in warm.stderr
        )
        assert "0 chunk(s) downloaded (warm;" in warm.stderr, warm.stderr
        for rel in ("data/weights.bin", "notes.txt"):
            assert (tmp / name / rel).read_bytes() == (work / rel).read_bytes()
        assert json.loads((tmp / name / ".stateful-value.json").read_text()) == {"epoch": 3}


def _lease_env(lease: Lease) -> dict[str, str]:
    return {"STATEFUL_EPOCH": str(lease.epoch), "STATEFUL_LEASE_TOKEN": lease.token}


def test_a_cache_directory_that_cannot_be_created_does_not_fail_the_pod(pod: dict[str, object]) -> None:
    """The cache can only save downloads: a directory that cannot be made (here: below a regular file) is
    reported once and skipped, and restore and save go on. A malformed variable is a configuration error."""
    checkpoints: CheckpointStore = pod["checkpoints"]  # type: ignore[assignment]
    tmp: Path = pod["tmp"]  # type: ignore[assignment]
    (tmp / "a-file").write_text("not a directory")
    work = tmp / "work"
    work.mkdir()
    (work / "model.bin").write_bytes(b"trained")
    env = {
        **leased_env(pod, checkpoints.acquire(steal=True)),
        "STATEFUL_RESTORE_CACHE_DIR": str(tmp / "a-file" / "cache"),
    }
    saved = run_verb(env, "save", work)
    assert saved.returncode == 0, saved.stderr
    restored = run_verb(env, "restore", tmp / "restored")
    assert restored.returncode == 0, restored.stderr
    assert (tmp / "restored" / "model.bin").read_bytes() == b"trained"
    assert "not used" in restored.stderr and "restoring without it" in restored.stderr
    assert "without the restore cache" in restored.stderr
    bad = run_verb({**env, "STATEFUL_RESTORE_CACHE_DIR": "relative/cache"}, "restore", tmp / "never")
    assert bad.returncode == 2
    assert (
        "STATEFUL_RESTORE_CACHE_DIR must be an absolute path" in bad.stderr
        and "'relative/cache'" in bad.stderr
    )

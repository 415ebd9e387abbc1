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
from airflow_stateful.core.lease import Lease

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
    assert [f.path for f in latest.files] == ["data/progress.txt"], "the value file is not a data file"
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

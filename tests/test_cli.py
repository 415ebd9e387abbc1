"""The ``airflow-stateful`` command on a local directory and on S3 (moto's server): tables, --json, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.cli.main import main
from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession, store_from_url
from airflow_stateful.core.errors import FencedError
from airflow_stateful.task_state import TaskState

WATERMARK = Identity.for_task(dag_id="etl", task_id="load", name="nightly-watermark")
BATCH = Identity.for_task(dag_id="etl", task_id="crunch", run_id="manual__1")


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "local":
        yield (tmp_path / "state").as_uri()
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    prefix: str = request.getfixturevalue("s3_prefix")
    monkeypatch.setenv("STATEFUL_S3_ENDPOINT_URL", str(endpoint.endpoint_url))
    for name, value in {
        "AWS_ACCESS_KEY_ID": endpoint.credentials.get("aws_access_key_id"),
        "AWS_SECRET_ACCESS_KEY": endpoint.credentials.get("aws_secret_access_key"),
        "AWS_DEFAULT_REGION": endpoint.region,
    }.items():
        if value:
            monkeypatch.setenv(name, value)
    yield f"s3://{endpoint.bucket}/{prefix}"


def open_cs(backend: str, identity: Identity) -> CheckpointStore:
    endpoint = os.environ.get("STATEFUL_S3_ENDPOINT_URL") if backend.startswith("s3://") else None
    store = store_from_url(backend, **({"endpoint_url": endpoint} if endpoint else {}))
    return CheckpointStore(store=store, identity=identity, keep_last=5)


LS_HEADER = ["IDENTITY", "SEQ", "KEPT", "SIZE", "EPOCH", "LEASE", "STATUS", "OUTCOME", "UPDATED"]
"""The columns of `airflow-stateful ls`, as its table header prints them."""


def cli(capsys: pytest.CaptureFixture[str], backend: str, *args: str) -> tuple[int, str, str]:
    code = main([*args, "--backend", backend])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def seeded(backend: str, tmp_path: Path) -> dict[str, object]:
    """Two identities: a watermark with three checkpoints (one with files) and a batch under a live lease."""
    wm = open_cs(backend, WATERMARK)
    lease = wm.acquire()
    files = tmp_path / "files"
    (files / "sub").mkdir(parents=True)
    (files / "model.bin").write_bytes(os.urandom(300_000))
    (files / "sub" / "cfg.json").write_text('{"lr": 0.1}')
    wm.commit(lease, {"watermark": "2026-11-01"}, files=files)
    wm.commit(lease, {"watermark": "2026-11-02"})
    wm.commit(lease, {"watermark": "2026-11-03"})
    wm.release(lease)
    batch = open_cs(backend, BATCH)
    held = batch.acquire()
    batch.commit(held, {"next": 30})
    return {"wm": wm, "batch": batch, "held": held, "files": files}


pytestmark = pytest.mark.s3


def test_ls_lists_identities_as_a_table_and_as_json(
    capsys: pytest.CaptureFixture[str], backend: str, seeded: dict[str, object]
) -> None:
    code, out, _ = cli(capsys, backend, "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == LS_HEADER
    assert any(line.startswith(WATERMARK.key) and " 3 " in line for line in lines)
    code, out, _ = cli(capsys, backend, "ls", "--json")
    rows = {r["identity"]: r for r in json.loads(out)}
    assert set(rows) == {WATERMARK.key, BATCH.key}
    assert rows[WATERMARK.key]["seq"] == 3 and rows[WATERMARK.key]["lease"] is None
    assert rows[BATCH.key]["lease"] is not None
    assert (rows[WATERMARK.key]["status"], rows[BATCH.key]["status"]) == ("idle", "active")
    code, out, _ = cli(capsys, backend, "ls", "etl/load/", "--json")
    assert [r["identity"] for r in json.loads(out)] == [WATERMARK.key]


def test_show_history_and_cat(
    capsys: pytest.CaptureFixture[str], backend: str, seeded: dict[str, object], tmp_path: Path
) -> None:
    code, out, _ = cli(capsys, backend, "show", WATERMARK.key, "--json")
    info = json.loads(out)
    assert code == 0 and info["latest"]["value"] == {"watermark": "2026-11-03"} and info["kept"] == [3, 2, 1]
    code, out, _ = cli(capsys, backend, "show", BATCH.key, "--json")
    lease = json.loads(out)["lease"]
    held: CheckpointStore = seeded["batch"]  # type: ignore[assignment]
    head = held.head()
    assert head is not None and head.lease is not None
    assert lease["renewed_at"] == head.lease.last_renewed, "when the holder last renewed (its heartbeat)"
    code, out, _ = cli(capsys, backend, "history", BATCH.key, "--json")
    assert [r["seq"] for r in json.loads(out)] == [1]
    code, out, _ = cli(capsys, backend, "cat", WATERMARK.key, "--seq", "1", "--files", str(tmp_path / "out"))
    assert code == 0 and json.loads(out) == {"watermark": "2026-11-01"}
    files: Path = seeded["files"]  # type: ignore[assignment]
    assert (tmp_path / "out" / "model.bin").read_bytes() == (files / "model.bin").read_bytes()
    assert (tmp_path / "out" / "sub" / "cfg.json").read_text() == '{"lr": 0.1}'


def test_show_and_history_list_the_cursors_as_text_and_as_json(
    capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    """What resume() loops stored (position, last key, fingerprint) is what show and history print."""
    rows_ti = Identity.for_task(dag_id="etl", task_id="rows", run_id="manual__c")
    writer = WriterInfo(run_id="manual__c", try_number=1)
    with WriterSession(checkpoints=open_cs(backend, rows_ti), writer=writer, heartbeat=False) as session:
        state = TaskState(session=session, checkpoint_every=10)
        for _ in state.resume([{"id": f"row-{i}"} for i in range(30)], key=lambda row: row["id"]):
            pass
        for _ in state.resume(range(5), cursor="pages"):
            pass
    code, out, _ = cli(capsys, backend, "show", rows_ti.key)
    assert code == 0 and "cursors:   items=30 (last 'row-29'), pages=5\n" in out
    code, out, _ = cli(capsys, backend, "show", rows_ti.key, "--json")
    cursors = json.loads(out)["latest"]["cursors"]
    assert cursors["items"]["position"] == 30 and cursors["items"]["last_key"] == "row-29"
    assert (
        cursors["items"]["fingerprint"]["items"] == 8 and len(cursors["items"]["fingerprint"]["sha256"]) == 64
    )
    assert cursors["pages"]["position"] == 5 and cursors["pages"]["last_key"] is None
    assert cursors["pages"]["fingerprint"]["items"] == 5
    code, out, _ = cli(capsys, backend, "history", rows_ti.key)
    table = out.splitlines()
    assert code == 0 and table[0].split()[-1] == "CURSORS"
    assert table[1].endswith("items=30 (last 'row-29'), pages=5")
    assert [line.endswith("items=20 (last 'row-19')") for line in table[1:]] == [False, False, True, False]
    code, out, _ = cli(capsys, backend, "history", rows_ti.key, "--json")
    history = json.loads(out)
    assert [r["cursors"]["items"]["position"] for r in history] == [30, 30, 20, 10]
    assert history[0]["cursors"] == cursors

    forged = Identity.for_task(dag_id="etl", task_id="forged", run_id="manual__c")
    cs = open_cs(backend, forged)
    cs.commit(cs.acquire(), 1, extra={"cursors": {"items": {"position": -1}}})
    code, out, _ = cli(capsys, backend, "show", forged.key)
    assert code == 0 and "cursors:   checkpoint 1: cursor 'items': field 'position' must be" in out
    code, out, _ = cli(capsys, backend, "history", forged.key, "--json")
    [row] = json.loads(out)
    assert row["cursors"] is None and "field 'position'" in row["cursors_error"]


def test_rollback_commits_a_copy_and_respects_a_live_lease(
    capsys: pytest.CaptureFixture[str], backend: str, seeded: dict[str, object], tmp_path: Path
) -> None:
    code, out, _ = cli(capsys, backend, "rollback", WATERMARK.key, "--to", "1", "--json")
    assert code == 0 and json.loads(out) == [{"identity": WATERMARK.key, "seq": 4, "copy_of": 1}]
    wm = open_cs(backend, WATERMARK)
    latest = wm.latest()
    assert latest is not None and latest.value == {"watermark": "2026-11-01"} and latest.file_count == 2
    wm.restore_files(latest, tmp_path / "rolled")
    files: Path = seeded["files"]  # type: ignore[assignment]
    assert (tmp_path / "rolled" / "model.bin").read_bytes() == (files / "model.bin").read_bytes()

    code, _, err = cli(capsys, backend, "rollback", BATCH.key, "--to", "1")
    assert code == 3 and "is leased by" in err and "airflow-stateful unlock" in err
    code, _, _ = cli(capsys, backend, "rollback", BATCH.key, "--to", "1", "--force")
    assert code == 0
    batch: CheckpointStore = seeded["batch"]  # type: ignore[assignment]
    with pytest.raises(FencedError):
        batch.commit(seeded["held"], {"next": 40})  # type: ignore[arg-type]


def test_rollback_of_a_pickled_checkpoint_restores_the_value_not_its_text(
    capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    """The copy is the same pickle, byte for byte; the CLI never unpickles anything to make it."""
    from airflow_stateful.core.records.codecs import decode_value

    identity = Identity.for_task(dag_id="ml", task_id="fit", run_id="manual__1")
    cs = open_cs(backend, identity)
    lease = cs.acquire()
    for step in (1, 2):
        cs.commit(lease, {"step": step, "seen": {step}}, value_codec="pickle")  # a set: not JSON
    cs.release(lease)
    code, _, _ = cli(capsys, backend, "rollback", identity.key, "--to", "1")
    assert code == 0
    latest, first = cs.latest(), cs.get(1)
    assert latest is not None and latest.value_codec == "pickle" and latest.value == first.value
    assert decode_value(latest.value, "pickle", allowed="pickle", where="test") == {"step": 1, "seen": {1}}


def test_unlock_refuses_a_live_lease_unless_forced(
    capsys: pytest.CaptureFixture[str], backend: str, seeded: dict[str, object]
) -> None:
    code, _, err = cli(capsys, backend, "unlock", BATCH.key)
    assert code == 3 and "--force" in err
    code, out, _ = cli(capsys, backend, "unlock", BATCH.key, "--force", "--json")
    assert code == 0 and json.loads(out)[0]["lease"] is None
    batch: CheckpointStore = seeded["batch"]  # type: ignore[assignment]
    with pytest.raises(FencedError, match="broken"):
        batch.commit(seeded["held"], {"next": 40})  # type: ignore[arg-type]
    head = batch.head()
    assert head is not None and head.lease is None


def test_verify_reports_corruption_and_repairs_nothing(
    capsys: pytest.CaptureFixture[str], backend: str, seeded: dict[str, object]
) -> None:
    code, out, _ = cli(capsys, backend, "verify", "--all", "--json")
    assert code == 0 and {r["status"] for r in json.loads(out)} == {"ok"}
    wm: CheckpointStore = seeded["wm"]  # type: ignore[assignment]
    victim_key = wm.files(wm.get(1))[0].keys[0]
    wm.store.put(victim_key, b"bit rot")
    code, out, _ = cli(capsys, backend, "verify", WATERMARK.key, "--json")
    rows = {r["seq"]: r["status"] for r in json.loads(out)}
    assert code == 1
    assert rows[1].startswith("CORRUPT") and victim_key in rows[1]
    assert rows[2] == rows[3] == "ok"
    assert wm.store.get(victim_key).data == b"bit rot", "verify never repairs silently"


def test_gc_dry_run_lists_exactly_what_the_real_run_deletes(
    capsys: pytest.CaptureFixture[str], backend: str, seeded: dict[str, object]
) -> None:
    wm: CheckpointStore = seeded["wm"]  # type: ignore[assignment]
    garbage = f"{WATERMARK.key}/~chunks/{'de' * 32}"
    wm.store.put(garbage, b"left by a crashed commit")
    in_flight = f"{BATCH.key}/~chunks/{'ca' * 32}"
    wm.store.put(in_flight, b"uploaded by the live lease holder, not committed yet")
    before = {i.key for i in wm.store.list_objects("")}
    code, out, _ = cli(capsys, backend, "gc", "--min-age", "0s", "--dry-run", "--json")
    assert code == 0
    rows = {r["identity"]: r for r in json.loads(out)}
    assert rows[WATERMARK.key]["objects"] == 1 and rows[WATERMARK.key]["action"] == "would delete"
    assert rows[BATCH.key]["action"].startswith("skipped: live lease") and rows[BATCH.key]["objects"] == 0
    assert {i.key for i in wm.store.list_objects("")} == before
    code, out, _ = cli(capsys, backend, "gc", "--min-age", "0s", "--json")
    assert {i.key for i in wm.store.list_objects("")} == before - {garbage}


def test_exit_codes_for_missing_and_invalid_identities(
    capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    if backend.startswith("file://"):
        Path(backend.removeprefix("file://")).mkdir()  # a store in use, without that identity
    code, _, err = cli(capsys, backend, "show", "etl/none/run=x/map=-1")
    assert code == 4 and "etl/none/run=x/map=-1" in err
    code, _, err = cli(capsys, backend, "show", "../escape")
    assert code == 2 and "../escape" in err


def test_console_script_and_module_entry_points(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for cmd in (
        [sys.executable, "-m", "airflow_stateful"],
        [str(Path(sys.executable).parent / "airflow-stateful")],
    ):
        result = subprocess.run(
            [*cmd, "ls", "--backend", (tmp_path / "empty").as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "(none)"


def test_s3_credentials_come_from_the_airflow_connection(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    """Inside an Airflow installation the CLI uses the connection tasks use: no AWS_* variables needed."""
    if not s3_endpoint.credentials:
        pytest.skip("the configured endpoint uses the ambient credential chain")
    backend = f"s3://{s3_endpoint.bucket}/{s3_prefix}"
    cs = CheckpointStore(store=store_from_url(backend, **s3_endpoint.options()), identity=WATERMARK)
    cs.commit(cs.acquire(), {"watermark": "x"})
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "STATEFUL_S3_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_endpoint.region)
    conn = {
        "conn_type": "aws",
        "login": s3_endpoint.credentials["aws_access_key_id"],
        "password": s3_endpoint.credentials["aws_secret_access_key"],
        "extra": {"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region},
    }
    monkeypatch.setenv("AIRFLOW_CONN_CLI_S3", json.dumps(conn))
    code = main(["ls", "--backend", backend, "--conn-id", "cli_s3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [r["identity"] for r in json.loads(out)] == [WATERMARK.key]
    assert s3_endpoint.credentials["aws_secret_access_key"] not in out + err or s3_endpoint.kind == "moto"


def test_json_output_on_stdout_stays_pure_json(backend: str, seeded: dict[str, object]) -> None:
    """Scripts parse stdout: log lines (Airflow's, boto3's, ours) must go to stderr, never into the JSON."""
    result = subprocess.run(
        [sys.executable, "-m", "airflow_stateful", "verify", "--all", "--json", "--backend", backend],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {r["identity"] for r in rows} == {WATERMARK.key, BATCH.key}

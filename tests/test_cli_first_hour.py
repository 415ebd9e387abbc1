"""The ``airflow-stateful`` command as a new user meets it (issue 25): identities named by their Airflow ids, a
version, help without markup, sizes people read, stdout that only carries the result, exit 2 for a store that
does not exist or cannot be reached, read-only verbs that create nothing and start without importing Airflow.

Everything runs for real: the console script as a subprocess where stdout/stderr separation or Airflow's import
is the point, a DAG run under ``dag.test()`` for the identity, moto's or SeaweedFS's server for S3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dag_helpers import load_dag_module
from s3_endpoint import S3Endpoint, needs_moto

from airflow_stateful.cli.definition import build_parser
from airflow_stateful.cli.environment import airflow_cfg, light_settings
from airflow_stateful.cli.main import main
from airflow_stateful.cli.output import human_size
from airflow_stateful.core import CheckpointStore, Identity, store_from_url
from airflow_stateful.s3_connection import connection_from_env
from airflow_stateful.testing.s3_server import free_port
from airflow_stateful.version import __version__

SCRIPT = str(Path(sys.executable).parent / "airflow-stateful")
VALUE_ONLY = Identity.for_task(dag_id="etl", task_id="load", name="nightly-watermark")


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_script(*args: str, env: dict[str, str] | None = None, python_flags: tuple[str, ...] = ()) -> Any:
    """The real command in a process of its own (``-X importtime`` etc. through ``python_flags``)."""
    command = [sys.executable, *python_flags, "-m", "airflow_stateful"] if python_flags else [SCRIPT]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=180, env=env or os.environ.copy()
    )


def airflow_imported(stderr: str) -> list[str]:
    """The Airflow modules ``python -X importtime`` reports having imported."""
    names = [
        line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")
    ]
    return [n for n in names if n == "airflow" or n.startswith("airflow.")]


def seed_value_only(url: str, **options: Any) -> None:
    cs = CheckpointStore(store=store_from_url(url, **options), identity=VALUE_ONLY)
    lease = cs.acquire()
    cs.commit(lease, {"watermark": "2026-12-01", "note": "x" * 2000})
    cs.release(lease)


# -- identities by their Airflow ids -------------------------------------------------------------------------
def test_selectors_find_the_identity_a_real_dag_run_wrote(
    capsys: pytest.CaptureFixture[str], dags_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = (tmp_path / "state").as_uri()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", backend)
    monkeypatch.setenv("STATEFUL_DEMO_LEDGER", str(tmp_path / "ledger"))
    monkeypatch.setenv("STATEFUL_DEMO_PIDFILE", str(tmp_path / "pids"))
    run = load_dag_module(dags_folder / "killable_batch.py").dag_object.test(run_conf={"item_seconds": 0.0})
    capsys.readouterr()  # the run's own log lines
    run_id = run.run_id
    assert ":" in run_id and "+" in run_id, f"a real run id needs encoding: {run_id!r}"
    selectors = ["--dag-id", "killable_batch", "--task-id", "crunch", "--run-id", run_id]

    code, out, err = cli(capsys, "show", *selectors, "--json")
    assert code == 0, err
    info = json.loads(out)
    key = Identity.for_task(dag_id="killable_batch", task_id="crunch", run_id=run_id).key
    assert info["identity"] == key and info["latest"]["value"]["total"] == sum(i * i for i in range(100))
    # The same identity by its raw (encoded) key, and with the map index spelled out.
    assert cli(capsys, "show", key, "--json")[0] == 0
    assert json.loads(cli(capsys, "history", *selectors, "--map-index", "-1", "--json")[1])[-1]["seq"] >= 1

    # The key as people write it, unencoded: refused (exit 2) with the selector form to use instead.
    plain = f"killable_batch/crunch/run={run_id}/map=-1"
    code, out, err = cli(capsys, "show", plain)
    assert code == 2 and out == ""
    assert "--dag-id killable_batch --task-id crunch --run-id" in err and run_id in err and key in err


def test_selector_mistakes_are_named_before_anything_is_opened(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "never-created"
    for args, says in (
        (["show", "--dag-id", "etl", "--run-id", "r1"], "--task-id"),
        (["show", "--dag-id", "etl", "--task-id", "t"], "exactly one of --run-id and --name"),
        (["show", "--dag-id", "etl", "--task-id", "t", "--run-id", "r", "--name", "n"], "exactly one"),
        (["show", "etl/t/run=r/map=-1", "--dag-id", "etl"], "not both"),
        (["show"], "name the identity"),
        (["verify"], "--all"),
        (["verify", "--all", "--dag-id", "etl", "--task-id", "t", "--name", "n"], "not both"),
        (["show", "--dag-id", "etl", "--task-id", "t", "--name", "bad name!"], "'bad name!'"),
    ):
        code, out, err = cli(capsys, *args, "--backend", missing.as_uri())
        assert (code, out) == (2, ""), args
        assert says in err, (args, err)
        assert "no state directory" not in err, "the identity is checked before the store is opened"
    assert not missing.exists()


# -- help, version -------------------------------------------------------------------------------------------
def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [("airflow-stateful", parser), *sub.choices.items()]


def test_every_option_of_every_verb_has_help_and_no_markup() -> None:
    undocumented = []
    for name, parser in _parsers():
        text = parser.format_help()
        assert "``" not in text and ":class:" not in text and ":func:" not in text, f"{name} --help: {text}"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            if not action.help:
                undocumented.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not undocumented, f"options without help: {undocumented}"


def test_version_and_help_go_to_stdout() -> None:
    result = run_script("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"airflow-stateful {__version__}")
    result = run_script("show", "--help")
    assert result.returncode == 0 and "--dag-id" in result.stdout and "--run-id" in result.stdout


# -- sizes ---------------------------------------------------------------------------------------------------
def test_human_size() -> None:
    assert [human_size(n) for n in (0, 812, 2286, 10 * 1024**2 + 1, 3 * 1024**4)] == [
        "0 B",
        "812 B",
        "2.2 KiB",
        "10.0 MiB",
        "3.0 TiB",
    ]


def test_ls_and_du_show_the_same_size_for_a_value_only_checkpoint_readable_or_exact(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    backend = (tmp_path / "state").as_uri()
    seed_value_only(backend)
    ls_rows = json.loads(cli(capsys, "ls", "--backend", backend, "--json")[1])
    du_rows = {r["identity"]: r for r in json.loads(cli(capsys, "du", "--backend", backend, "--json")[1])}
    size = ls_rows[0]["size"]
    assert size > 2000, "a value-only checkpoint is not 0 bytes: its value is stored"
    assert du_rows[VALUE_ONLY.key]["size"] == size
    assert du_rows[VALUE_ONLY.key]["bytes"] >= size, "du also counts the head and older checkpoints"

    table = cli(capsys, "ls", "--backend", backend)[1].splitlines()
    header = table[0].split()
    [row] = [line for line in table[1:] if line.startswith(VALUE_ONLY.key)]
    assert header[3] == "SIZE" and human_size(size) in row and f" {size} " not in row
    exact = cli(capsys, "ls", "--backend", backend, "--bytes")[1]
    assert f" {size} " in exact
    du_table = cli(capsys, "du", "--backend", backend)[1]
    assert human_size(size) in du_table and human_size(du_rows[VALUE_ONLY.key]["bytes"]) in du_table


# -- exit codes, nothing created -----------------------------------------------------------------------------
def test_a_mistyped_file_backend_creates_nothing_and_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    mistyped = tmp_path / "typo" / "stateful"
    for verb in (
        ["ls"],
        ["du"],
        ["stuck"],
        ["verify", "--all"],
        ["show", VALUE_ONLY.key],
        ["gc", "--dry-run"],
    ):
        code, out, err = cli(capsys, *verb, "--backend", mistyped.as_uri())
        assert code == 2 and "no state directory" in err and str(mistyped) in err, (verb, code, err)
        assert out == ""
    assert not (tmp_path / "typo").exists(), "a read-only command must create nothing"
    (tmp_path / "empty").mkdir()
    code, out, _ = cli(capsys, "ls", "--backend", (tmp_path / "empty").as_uri())
    assert (code, out.strip()) == (0, "(none)"), "an existing, empty store is just empty"
    assert os.listdir(tmp_path / "empty") == []


def _s3_env(endpoint: S3Endpoint, **extra: str) -> dict[str, str]:
    env = os.environ.copy()
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "STATEFUL_S3_ENDPOINT_URL",
    ):
        env.pop(name, None)
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent")
    env.update(AWS_DEFAULT_REGION=endpoint.region, **extra)
    return env


@pytest.mark.s3
def test_a_missing_bucket_or_an_unreachable_endpoint_exits_2(s3_endpoint: S3Endpoint) -> None:
    creds = s3_endpoint.credentials
    env = _s3_env(
        s3_endpoint,
        AWS_ACCESS_KEY_ID=creds.get("aws_access_key_id", "x"),
        AWS_SECRET_ACCESS_KEY=creds.get("aws_secret_access_key", "x"),
        AIRFLOW__STATEFUL__CONN_ID="",
    )
    result = run_script(
        "ls",
        "--backend",
        "s3://no-such-bucket-25/p",
        "--endpoint-url",
        str(s3_endpoint.endpoint_url),
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert "bucket 'no-such-bucket-25' does not exist" in result.stderr and result.stdout == ""
    closed = f"http://127.0.0.1:{free_port()}"
    env["AWS_MAX_ATTEMPTS"] = "1"
    result = run_script("du", "--backend", f"s3://{s3_endpoint.bucket}/p", "--endpoint-url", closed, env=env)
    assert result.returncode == 2, result.stderr
    assert "cannot reach" in result.stderr and result.stdout == ""


# -- stdout carries only the result --------------------------------------------------------------------------
SHORT_PASSWORD_CONN = "short_pw"


@pytest.mark.s3
def test_json_parses_when_airflow_warns_about_a_short_connection_password(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """A connection whose password is too short to mask makes Airflow log a warning while it is read; Airflow's
    logging prints to stdout, and that used to come before the JSON. Read through Airflow (a secrets backend
    holds the connection) and through the environment (no Airflow import)."""
    needs_moto(s3_endpoint, "the connection's password is a made-up short one, which only moto accepts")
    backend = f"s3://{s3_endpoint.bucket}/{s3_prefix}"
    seed_value_only(backend, **s3_endpoint.options())
    conn = {
        "conn_type": "aws",
        "login": "AKIAFIRSTHOUR",
        "password": "abc",
        "extra": {"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region},
    }
    connections = tmp_path / "connections.json"
    connections.write_text(json.dumps({SHORT_PASSWORD_CONN: conn}))
    through_airflow = _s3_env(
        s3_endpoint,
        AIRFLOW__SECRETS__BACKEND="airflow.secrets.local_filesystem.LocalFilesystemBackend",
        AIRFLOW__SECRETS__BACKEND_KWARGS=json.dumps({"connections_file_path": str(connections)}),
    )
    through_env = _s3_env(s3_endpoint, **{f"AIRFLOW_CONN_{SHORT_PASSWORD_CONN.upper()}": json.dumps(conn)})
    for env, imports_airflow in ((through_airflow, True), (through_env, False)):
        result = run_script(
            "ls", "--backend", backend, "--conn-id", SHORT_PASSWORD_CONN, "--json", env=env,
            python_flags=("-X", "importtime"),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        rows = json.loads(result.stdout)  # nothing but the JSON on stdout
        assert [r["identity"] for r in rows] == [VALUE_ONLY.key]
        assert bool(airflow_imported(result.stderr)) == imports_airflow
        if imports_airflow:
            assert "Skipping masking" in result.stderr, "the warning this test is about went to stderr"
        assert "abc" not in result.stdout


# -- read-only verbs start without Airflow -------------------------------------------------------------------
@pytest.mark.s3
def test_read_only_verbs_do_not_import_airflow_when_the_environment_says_all(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    local = (tmp_path / "state").as_uri()
    seed_value_only(local)
    env = os.environ.copy()
    env["AIRFLOW__STATEFUL__BACKEND_URL"] = local
    for verb in (
        ["ls"],
        ["du"],
        ["stuck"],
        ["show", VALUE_ONLY.key],
        ["history", VALUE_ONLY.key],
        ["cat", VALUE_ONLY.key],
    ):
        result = run_script(*verb, env=env, python_flags=("-X", "importtime"))
        assert result.returncode == 0, (verb, result.stderr[-2000:])
        assert airflow_imported(result.stderr) == [], verb
    # A verb that changes the store goes through Airflow, as tasks do.
    result = run_script("unlock", VALUE_ONLY.key, env=env, python_flags=("-X", "importtime"))
    assert result.returncode == 0 and airflow_imported(result.stderr), result.stderr[-2000:]

    # S3 with the connection in the environment: the same rows as through Airflow.
    if not s3_endpoint.credentials:
        return
    backend = f"s3://{s3_endpoint.bucket}/{s3_prefix}"
    seed_value_only(backend, **s3_endpoint.options())
    conn = {
        "conn_type": "aws",
        "login": s3_endpoint.credentials["aws_access_key_id"],
        "password": s3_endpoint.credentials["aws_secret_access_key"],
        "extra": {"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region},
    }
    env = _s3_env(
        s3_endpoint, AIRFLOW_CONN_FIRST_HOUR=json.dumps(conn), AIRFLOW__STATEFUL__CONN_ID="first_hour"
    )
    light = run_script("ls", "--backend", backend, "--json", env=env, python_flags=("-X", "importtime"))
    assert light.returncode == 0 and airflow_imported(light.stderr) == [], light.stderr[-2000:]
    env["AIRFLOW__STATEFUL__RESTORE_CACHE_DIR_CMD"] = "echo /tmp"  # only Airflow runs commands for options
    heavy = run_script("ls", "--backend", backend, "--json", env=env, python_flags=("-X", "importtime"))
    assert heavy.returncode == 0 and airflow_imported(heavy.stderr), heavy.stderr[-2000:]
    strip = ("status", "since_progress_seconds", "checkpoint_age_seconds", "idle_seconds", "reason")
    assert [{k: v for k, v in r.items() if k not in strip} for r in json.loads(light.stdout)] == [
        {k: v for k, v in r.items() if k not in strip} for r in json.loads(heavy.stdout)
    ]


def test_the_light_settings_reader_agrees_with_airflow(tmp_path: Path) -> None:
    """``[stateful]`` from the environment and airflow.cfg, read without Airflow and through Airflow's own
    configuration (in a fresh process, as Airflow reads its configuration once)."""
    cfg = tmp_path / "airflow.cfg"
    cfg.write_text("[stateful]\nkeep_last = 7\nlease_ttl = 90\nbackend_url = file:///from/cfg\n")
    env = os.environ.copy()
    env.update(
        AIRFLOW_CONFIG=str(cfg),
        AIRFLOW__STATEFUL__LEASE_TTL="120",  # the environment wins over the file, as in Airflow
        AIRFLOW__STATEFUL__EXPECTED_CHECKPOINT_INTERVAL="15m",
    )
    env.pop("AIRFLOW__STATEFUL__BACKEND_URL", None)
    code = (
        "from airflow_stateful.cli.environment import airflow_cfg, light_settings\n"
        "light = light_settings(airflow_cfg())\n"
        "from airflow_stateful.config import load_settings\n"
        "print(repr(light)); print(repr(load_settings()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    light, airflow = result.stdout.strip().splitlines()[-2:]
    assert light == airflow
    assert "keep_last=7" in light and "lease_ttl=120.0" in light and "file:///from/cfg" in light
    assert "expected_checkpoint_interval=900.0" in light
    assert light_settings(airflow_cfg()) is not None


@pytest.mark.parametrize(
    "text",
    [
        "aws://AKIA%2FX:s%40cret%3A1@/?region_name=eu-west-1&endpoint_url=http%3A%2F%2F127.0.0.1%3A9000",
        "aws://AKIA:pw@s3.example.com:9000/bucket?__extra__=%7B%22region_name%22%3A+%22us-east-1%22%7D",
        "aws://?verify=false&config_kwargs=%7B%22retries%22%3A+%7B%22max_attempts%22%3A+3%7D%7D",
        "aws://",
        json.dumps({"conn_type": "aws", "login": "a", "password": "b", "host": "h", "extra": {"x": 1}}),
        json.dumps({"conn_type": "aws", "extra": json.dumps({"region_name": "us-east-2"})}),
    ],
)
def test_connections_from_the_environment_read_as_airflow_reads_them(text: str) -> None:
    from airflow.models.connection import Connection

    mine = connection_from_env("c", text)
    assert mine is not None
    theirs = (
        Connection.from_json(text, conn_id="c") if text.startswith("{") else Connection(conn_id="c", uri=text)
    )
    assert (mine.login, mine.password, mine.host, mine.extra) == (
        theirs.login,
        theirs.password,
        theirs.host,
        theirs.extra_dejson,
    )


def test_verify_says_it_verifies_and_show_names_an_unversioned_dag_folder(tmp_path: Path) -> None:
    """A read-only ``verify`` of a checkpoint large enough for progress lines says "verifying", never "restoring";
    ``show`` of a checkpoint a try wrote from a DAG folder without bundle versions says so, without a ``?``."""
    from airflow_stateful.core import WriterInfo
    from airflow_stateful.core.records.code_identity import CodeIdentity

    backend = (tmp_path / "state").as_uri()
    files = tmp_path / "files"
    files.mkdir()
    with open(files / "model.bin", "wb") as f:
        f.truncate(65 * 1024 * 1024)  # above the 64 MiB from which transfers report progress
    cs = CheckpointStore(store=store_from_url(backend), identity=VALUE_ONLY)
    lease = cs.acquire()
    code = CodeIdentity(fingerprint="1a2b3c4d5e6f7a8b", bundle_name="dags-folder", dag_version_id="7")
    cs.commit(lease, {"n": 1}, files=files, writer=WriterInfo(host="h", pid=1), code=code)
    cs.release(lease)

    verified = run_script("verify", VALUE_ONLY.key, "--backend", backend)
    assert verified.returncode == 0, verified.stderr[-2000:]
    assert "verifying 1 file(s) of" in verified.stderr and "restoring" not in verified.stderr, verified.stderr

    shown = run_script("show", VALUE_ONLY.key, "--backend", backend)
    assert shown.returncode == 0, shown.stderr[-2000:]
    [line] = [line for line in shown.stdout.splitlines() if line.startswith("code:")]
    assert line == (
        "code:      code 1a2b3c4d5e6f7a8b from bundle dags-folder, no bundle version (unversioned DAG folder), "
        "dag version 7"
    ), shown.stdout

    # A try that recorded no bundle at all (``dag.test()`` of a file) printed "from bundle ?" before.
    unnamed = Identity.for_task(dag_id="etl", task_id="load", name="from-a-file")
    cs = CheckpointStore(store=store_from_url(backend), identity=unnamed)
    lease = cs.acquire()
    cs.commit(lease, {"n": 1}, code=CodeIdentity(fingerprint="1a2b3c4d5e6f7a8b"))
    cs.release(lease)
    shown = run_script("show", unnamed.key, "--backend", backend)
    assert shown.returncode == 0, shown.stderr[-2000:]
    [line] = [line for line in shown.stdout.splitlines() if line.startswith("code:")]
    assert (
        line == "code:      code 1a2b3c4d5e6f7a8b no bundle version (unversioned DAG folder), dag version ?"
    )

"""docs/deploy.md's "From install to operating, step by step", run as printed (issue 33, "Done when").

Every block the page marks ``<!-- walk: ... -->`` runs here in order, in one bash session (``set -euo
pipefail``: a failing command fails the walk), as an operator would type them on an Airflow machine:

* the deployment before step 1: a fresh virtualenv that sees this environment's packages (Airflow and the
  package's dependencies, through a ``.pth`` line, so nothing is fetched; ``PIP_NO_INDEX=1``) with an
  ``airflow`` script of its own, as the Airflow install would have left; ``AIRFLOW_VERSION`` set, as the official
  image sets it; an Airflow database on SQLite (``airflow db migrate``: an existing deployment has one);
* first the README's install block (``<!-- walk: readme install -->``), in the checkout: ``make dist`` builds
  the wheel and the sdist (``twine check``), pip installs the wheel, ``airflow providers list`` lists it; the
  wheel is then copied to the ``dist/`` of the deploy walk's working directory;
* step 2 (create the bucket) is done here with boto3, since the page leaves it to the operator's own tools;
* step 3's placeholders (``my-bucket``, ``YOUR_ACCESS_KEY_ID``, ``YOUR_SECRET_ACCESS_KEY``,
  ``http://seaweedfs:8333``) are replaced by SeaweedFS's (a real S3 server on 127.0.0.1); nothing else of any
  block is changed.

Then what the operator would look at is asserted: the provider listed, ``check`` passing every check, the first
DAG's checkpoints in the bucket, the maintenance DAG succeeding, ``du``/``gc --dry-run``/``verify --all`` naming
the identity, and the installed wheel (not this checkout) having done it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import uuid
from importlib.metadata import version
from pathlib import Path

import pytest
from s3_endpoint import S3Endpoint

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.airflow]

REPO = Path(__file__).resolve().parent.parent
DEPLOY_DOC = REPO / "docs" / "deploy.md"
README = REPO / "README.md"
BLOCK = re.compile(
    r"^<!-- walk: (?P<name>[^>]+?) -->\n```(?P<lang>bash|python)\n(?P<body>.*?)^```$", re.M | re.S
)
PLACEHOLDERS = ("my-bucket", "YOUR_ACCESS_KEY_ID", "YOUR_SECRET_ACCESS_KEY", "http://seaweedfs:8333")
STEPS = ["install", "configure", "check", "first run", "maintenance", "operate"]


def walk_blocks(page: Path = DEPLOY_DOC) -> list[tuple[str, str, str]]:
    """(name, language, text) of every walk block of ``page``, in page order."""
    return [(m["name"], m["lang"], m["body"]) for m in BLOCK.finditer(page.read_text())]


def test_the_walk_has_every_step_in_order() -> None:
    """install -> configure -> check -> first DAG -> maintenance DAG -> operate, as the issue asks; each
    placeholder the test replaces is in the configure step, where the page says the reader puts their own."""
    blocks = walk_blocks()
    names = [name for name, _, _ in blocks]
    assert [n for n in names if n in STEPS] == STEPS, names
    assert names.index("dags/first_stateful.py") < names.index("first run")
    assert names.index("dags/stateful_maintenance.py") < names.index("maintenance")
    configure = dict((n, body) for n, _, body in blocks)["configure"]
    assert all(p in configure for p in PLACEHOLDERS)
    assert not any(p in body for n, _, body in blocks if n != "configure" for p in PLACEHOLDERS)
    readme = README.read_text()
    assert "```bash\nairflow-stateful check\n```" in readme, "the README lost the check step"
    assert "docs/deploy.md#from-install-to-operating-step-by-step" in readme


def sections(text: str) -> dict[str, str]:
    """A stream of the walk cut at its ``=== walk: NAME`` lines: what each step printed."""
    found = re.finditer(r"^=== walk: (?P<name>[^\n]+)\n(?P<out>.*?)(?=^=== walk: |\Z)", text, re.M | re.S)
    return {m["name"]: m["out"] for m in found}


def _environment(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A virtualenv standing for the Airflow deployment before step 1, and the shell environment of its
    machine: no AWS credentials or Airflow settings from this process, only what the walk exports."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Airflow and every dependency from this environment, without the checkout's editable install (its
    # metadata would register the provider before step 1 installs it): a folder of links to everything else.
    deps = tmp_path / "deployment-site-packages"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("airflow_provider_stateful", "__editable__", "airflow_stateful")):
            (deps / entry.name).symlink_to(entry)
    (Path(purelib) / "deployment.pth").write_text(f"{deps}\n")
    airflow = venv / "bin" / "airflow"
    airflow.write_text(f"#!{python}\nimport sys\nfrom airflow.__main__ import main\nsys.exit(main())\n")
    airflow.chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "AWS_", "STATEFUL_", "PYTHON", "PIP_", "VIRTUAL_ENV"))
    }
    env.update(
        PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        VIRTUAL_ENV=str(venv),
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW_VERSION=version("apache-airflow"),
        AIRFLOW__CORE__DAGS_FOLDER=str(tmp_path / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_CONFIG_FILE="/nonexistent",
        AWS_EC2_METADATA_DISABLED="true",
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return venv, env


def test_the_deploy_guides_walk_runs_as_printed(tmp_path: Path, seaweedfs_endpoint: S3Endpoint) -> None:
    work = tmp_path / "machine"
    (work / "dist").mkdir(parents=True)
    (tmp_path / "dags").mkdir()
    venv, env = _environment(tmp_path)
    migrate = subprocess.run(
        ["airflow", "db", "migrate"], env=env, cwd=work, capture_output=True, text=True, timeout=300
    )
    assert migrate.returncode == 0, migrate.stderr[-3000:]

    # The README's install block, in the checkout: `make dist` builds the wheel the deploy walk installs.
    readme_blocks = [body for name, lang, body in walk_blocks(README) if name == "readme install"]
    assert len(readme_blocks) == 1, "README.md lost its <!-- walk: readme install --> block"
    readme = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + readme_blocks[0]],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert readme.returncode == 0, f"{readme.stdout[-3000:]}\n{readme.stderr[-3000:]}"
    assert "airflow-provider-stateful" in readme.stdout and "PASSED" in readme.stdout, readme.stdout[-3000:]
    for wheel in (REPO / "dist").glob("*.whl"):
        shutil.copy(wheel, work / "dist")

    bucket = f"walk-{uuid.uuid4().hex[:12]}"  # step 2, with boto3
    seaweedfs_endpoint.client().create_bucket(Bucket=bucket)
    creds = seaweedfs_endpoint.credentials
    values = (
        bucket,
        creds["aws_access_key_id"],
        creds["aws_secret_access_key"],
        str(seaweedfs_endpoint.endpoint_url),
    )
    replace = dict(zip(PLACEHOLDERS, values, strict=True))

    script = ["set -euo pipefail"]
    for name, lang, body in walk_blocks():
        if lang == "python":
            (tmp_path / "dags" / Path(name).name).write_text(body)
            continue
        if name == "configure":
            for placeholder, value in replace.items():
                body = body.replace(placeholder, value)
        script += [f"echo '=== walk: {name}'; echo '=== walk: {name}' >&2", body]
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)], env=env, cwd=work, capture_output=True, text=True, timeout=900
    )
    out, err = sections(proc.stdout), sections(proc.stderr)
    assert proc.returncode == 0, (
        f"the walk stopped in step {list(err)[-1:]}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    assert creds["aws_secret_access_key"] not in proc.stdout + proc.stderr

    assert "airflow-provider-stateful" in out["install"]
    assert out["configure"].strip() == f"s3://{bucket}/airflow-state"
    lines = out["check"].strip().splitlines()
    assert lines and all(line.split()[0] in ("ok", "skip") for line in lines), out["check"]
    assert any(line.split()[1] == "if-none-match" for line in lines), out["check"]
    assert "first_stateful/crunch/run=manual__" in out["first run"], out["first run"]
    for step in ("first run", "maintenance"):
        assert re.search(r"DagRun Finished: .*state=success", out[step] + err[step]), (
            step,
            err[step][-3000:],
        )
    assert "first_stateful/crunch/run=manual__" in out["operate"], out["operate"]

    client = seaweedfs_endpoint.client()
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    assert any(k.startswith("airflow-state/first_stateful/crunch/") for k in keys), keys
    assert not any("~check/" in k for k in keys), "the check's probe was left behind"
    located = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import airflow_stateful, json; print(json.dumps(airflow_stateful.__file__))",
        ],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(json.loads(located.stdout)).is_relative_to(venv), "the walk used the checkout, not the wheel"

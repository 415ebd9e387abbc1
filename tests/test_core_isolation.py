"""The storage core never imports Airflow.

``airflow_stateful.core`` (every submodule, the S3 store included) runs inside Kubernetes pods that only
have boto3. The top package and ``get_provider_info`` must stay lazy too: Airflow imports
``get_provider_info`` while its own configuration is loading, and an eager Airflow import there is a
circular import that breaks every Airflow command.

Each check runs in a fresh interpreter, because this pytest process may already have imported Airflow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE_DIR = REPO / "airflow_stateful" / "core"
BLOCKED_MESSAGE = "airflow must not be imported by the core"

# Runs in the child. argv: repo root, fake-airflow dir ("" for none), then a JSON list of "steps".
CHILD = r"""
import importlib, json, pkgutil, sys, traceback

repo, fake, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, repo)
if fake:
    sys.path.insert(0, fake)

report = {"imported": [], "failed": {}, "ran": {}}

def airflow_modules():
    return sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow."))

def try_import(name):
    try:
        importlib.import_module(name)
        report["imported"].append(name)
    except BaseException as exc:
        report["failed"][name] = f"{type(exc).__name__}: {exc}"

if "core" in steps:
    import airflow_stateful.core as core
    report["imported"].append(core.__name__)
    for info in pkgutil.walk_packages(
        core.__path__, core.__name__ + ".",
        onerror=lambda name: report["failed"].setdefault(name, "walk_packages could not import it"),
    ):
        try_import(info.name)

if "top" in steps:
    import airflow_stateful
    from airflow_stateful.get_provider_info import get_provider_info
    info = get_provider_info()
    report["ran"]["provider_name"] = info["package-name"]
    # The lazy attributes that point into the core must not drag Airflow in either.
    report["ran"]["lazy"] = [airflow_stateful.Identity.__module__, airflow_stateful.CheckpointStore.__module__]

if "use" in steps:
    # Not just imports: a whole commit/restore cycle on the local store and an S3 store with its boto3
    # client, in case something imports Airflow lazily at run time.
    import tempfile, pathlib
    from airflow_stateful.core import CheckpointStore, Identity, collect_garbage, store_from_url
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "src").mkdir()
        (root / "src" / "f.bin").write_bytes(b"payload" * 1000)
        store = store_from_url((root / "state").as_uri())
        cs = CheckpointStore(store=store, identity=Identity.for_task(dag_id="d", task_id="t", name="n"))
        lease = cs.acquire()
        for n in range(4):
            cs.commit(lease, {"n": n}, files=root / "src")
        restored = cs.restore_files(cs.latest(), root / "out")
        cs.release(lease)
        collect_garbage(cs, dry_run=True)
        report["ran"]["restored"] = [p.read_bytes() == b"payload" * 1000 for p in restored]
    s3 = store_from_url(
        "s3://bucket/prefix", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
        aws_access_key_id="x", aws_secret_access_key="y",
    )
    report["ran"]["s3_client"] = type(s3.client).__name__
    import boto3, botocore
    report["ran"]["boto3"] = boto3.__version__

if "hook" in steps:
    try_import("airflow_stateful.hooks.state")

import airflow_stateful
report["package_file"] = airflow_stateful.__file__
report["airflow_modules"] = airflow_modules()
print(json.dumps(report))
"""


def run_child(*steps: str, fake_airflow: Path | None = None, isolated: bool = False) -> dict[str, Any]:
    cmd = [sys.executable]
    if isolated:
        cmd.append("-I")  # no PYTHON* variables, no user site, no cwd on sys.path
    cmd += ["-c", CHILD, str(REPO), str(fake_airflow or ""), json.dumps(list(steps))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/", timeout=300)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fake_airflow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose ``airflow`` package raises on import; put first on sys.path it shadows the real one."""
    root = tmp_path_factory.mktemp("fake-airflow")
    (root / "airflow").mkdir()
    (root / "airflow" / "__init__.py").write_text(f"raise ImportError({BLOCKED_MESSAGE!r})\n")
    return root


def core_modules_on_disk() -> set[str]:
    names = set()
    for path in CORE_DIR.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.add(".".join(parts))
    return names


def test_every_core_module_imports_without_airflow() -> None:
    report = run_child("core")
    assert report["failed"] == {}
    # Discovery really covers the core: every .py file under airflow_stateful/core was imported.
    assert set(report["imported"]) == core_modules_on_disk()
    assert "airflow_stateful.core.stores.s3" in report["imported"]
    assert report["airflow_modules"] == []


def test_core_works_when_airflow_cannot_be_imported(fake_airflow: Path) -> None:
    report = run_child("core", "use", fake_airflow=fake_airflow, isolated=True)
    assert Path(report["package_file"]).is_relative_to(REPO)
    assert report["failed"] == {}
    assert set(report["imported"]) == core_modules_on_disk()
    assert report["ran"]["restored"] == [True]
    assert report["ran"]["s3_client"] == "S3"
    assert report["ran"]["boto3"]
    assert report["airflow_modules"] == []


def test_top_package_and_provider_info_stay_lazy(fake_airflow: Path) -> None:
    for kwargs in ({}, {"fake_airflow": fake_airflow, "isolated": True}):
        report = run_child("top", **kwargs)
        assert report["ran"]["provider_name"] == "airflow-provider-stateful"
        assert report["ran"]["lazy"] == [
            "airflow_stateful.core.records.identity",
            "airflow_stateful.core.protocol.checkpoint_store",
        ]
        assert report["airflow_modules"] == [], kwargs


def test_the_blocker_catches_a_module_that_does_import_airflow(fake_airflow: Path) -> None:
    """Control: the hook layer imports Airflow, so with the fake package first it must fail, and without
    it Airflow shows up in sys.modules. Otherwise the checks above could never fail."""
    blocked = run_child("hook", fake_airflow=fake_airflow, isolated=True)
    assert BLOCKED_MESSAGE in blocked["failed"]["airflow_stateful.hooks.state"]

    real = run_child("hook")
    assert real["failed"] == {}
    assert "airflow" in real["airflow_modules"]

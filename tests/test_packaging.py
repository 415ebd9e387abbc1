"""What ``make dist`` builds is what a user installs: the sdist and the wheel, opened and read.

Until the package is on the package index, the built wheel is how users install it (README, "Install"), so its
contents are checked here rather than trusted to ``pyproject.toml``: the license and its notice travel with both
artifacts (Apache-2.0 asks for them); the wheel, installed into a virtualenv of its own, creates the maintenance
DAG from the file the README tells users to put in their DAG folder; no test ships (the suite is for a
checkout, and ``tests/`` on a user's path would shadow their own); the wheel carries the three entry points Airflow and the shell find the package by
(``airflow-stateful``, ``apache_airflow_provider``, ``airflow.plugins``) and every file of the package (the UI's
templates, ``py.typed``); and ``twine check --strict`` accepts both, as the index would.

Both are built once per module the way ``make dist`` builds them: ``python -m build --no-isolation``, so the
build backend (hatchling) comes from this interpreter's environment and nothing is fetched. ``build`` builds
the wheel from the sdist it just made, so a file missing from the sdist fails the wheel too. The three tools are
in the ``dev`` extra, which ``make test`` installs: without them this module fails, naming the extra, rather
than skipping (a skip would let a broken ``make dist`` pass CI unseen). Nothing outside the project is needed,
so there is no reason to skip. About five seconds.
"""

from __future__ import annotations

import ast
import configparser
import email.parser
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path, PurePosixPath

import pytest

from airflow_stateful.version import __version__

pytestmark = pytest.mark.slow  # starts subprocesses

REPO = Path(__file__).resolve().parent.parent
DIST_NAME = "airflow_provider_stateful"
LICENSE_FILES = ("LICENSE", "NOTICE")

ENTRY_POINTS = {
    "console_scripts": {"airflow-stateful": "airflow_stateful.cli.main:run"},
    "apache_airflow_provider": {"provider_info": "airflow_stateful.get_provider_info:get_provider_info"},
    "airflow.plugins": {"stateful": "airflow_stateful.plugins.stateful_view:StatefulPlugin"},
}
"""What pyproject.toml declares ([project.scripts] and [project.entry-points]); the wheel must carry each."""

SDIST_TOP_LEVEL = {
    # What [tool.hatch.build.targets.sdist] picks: the code, its docs, the example DAGs the docs quote, deploy/
    # (IAM policy, alert rules, dashboard) that docs/deploy.md links to, the CHANGELOG ...
    "airflow_stateful",
    "docs",
    "dags",
    "deploy",
    "CHANGELOG.md",
    # ... and what hatchling always adds: the project file, the readme, the license files, the metadata and the
    # .gitignore (it keeps ignored files out of a wheel built from the sdist).
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "NOTICE",
    "PKG-INFO",
    ".gitignore",
}
"""Everything at the top of the sdist. tests/, benchmarks/, .ci/, the Makefile, constraints/ and the container
files serve a checkout, not a reader of the package: a new top-level entry is a choice to make here."""


@dataclass(frozen=True)
class Artifacts:
    wheel: Path
    sdist: Path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    missing = [name for name in ("build", "twine", "hatchling") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not installed beside {sys.executable}: they are in the dev extra "
            "(pip install -e '.[dev]' -c constraints/ci.txt; `make test` installs it)"
        )
    out = tmp_path_factory.mktemp("dist")
    proc = _run("-m", "build", "--no-isolation", "--outdir", str(out), str(REPO))
    assert proc.returncode == 0, f"python -m build failed:\n{proc.stdout}\n{proc.stderr}"
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert [p.name for p in wheels] == [f"{DIST_NAME}-{__version__}-py3-none-any.whl"]
    assert [p.name for p in sdists] == [f"{DIST_NAME}-{__version__}.tar.gz"]
    return Artifacts(wheel=wheels[0], sdist=sdists[0])


def _wheel_files(built: Artifacts) -> dict[str, bytes]:
    with zipfile.ZipFile(built.wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist() if not name.endswith("/")}


def _sdist_files(built: Artifacts) -> dict[str, bytes]:
    """The sdist's files by path below its top folder (``airflow_provider_stateful-<version>/``)."""
    root = f"{DIST_NAME}-{__version__}"
    files = {}
    with tarfile.open(built.sdist) as tf:
        for member in tf.getmembers():
            path = PurePosixPath(member.name)
            assert path.parts[0] == root, f"{member.name} is outside the sdist's top folder {root}/"
            if member.isfile():
                extracted = tf.extractfile(member)
                assert extracted is not None
                files[PurePosixPath(*path.parts[1:]).as_posix()] = extracted.read()
    return files


def _metadata(raw: bytes) -> Message:
    """Core metadata: headers, then the long description (the README) as the body; UTF-8 (PEP 566)."""
    return email.parser.Parser().parsestr(raw.decode("utf-8"))


DIST_INFO = f"{DIST_NAME}-{__version__}.dist-info"


def test_the_wheel_carries_license_and_notice(built: Artifacts) -> None:
    files = _wheel_files(built)
    for name in LICENSE_FILES:
        path = f"{DIST_INFO}/licenses/{name}"
        assert path in files, (
            f"{path} missing from the wheel: {sorted(n for n in files if '.dist-info/' in n)}"
        )
        assert files[path] == (REPO / name).read_bytes(), f"{path} differs from the repository's {name}"
    metadata = _metadata(files[f"{DIST_INFO}/METADATA"])
    assert metadata["License-Expression"] == "Apache-2.0"
    assert sorted(metadata.get_all("License-File") or []) == sorted(LICENSE_FILES)


def test_the_sdist_carries_license_and_notice(built: Artifacts) -> None:
    files = _sdist_files(built)
    for name in LICENSE_FILES:
        assert files.get(name) == (REPO / name).read_bytes(), f"{name} missing from the sdist, or different"
    assert sorted(_metadata(files["PKG-INFO"]).get_all("License-File") or []) == sorted(LICENSE_FILES)


def test_the_license_is_the_apache_2_0_text() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text


def _test_files(paths: list[str]) -> list[str]:
    return [
        p
        for p in paths
        if "tests" in PurePosixPath(p).parts
        or PurePosixPath(p).name == "conftest.py"
        or (PurePosixPath(p).name.startswith("test_") and p.endswith(".py"))
    ]


def test_no_test_ships_in_either(built: Artifacts) -> None:
    assert _test_files(list(_wheel_files(built))) == []
    assert _test_files(list(_sdist_files(built))) == []
    # The check itself sees a test file where one would be.
    assert _test_files(["tests/conftest.py", "a/tests/x.json", "airflow_stateful/testing/seaweedfs.py"]) == [
        "tests/conftest.py",
        "a/tests/x.json",
    ]


def test_the_sdist_holds_the_chosen_top_level_entries(built: Artifacts) -> None:
    top = {PurePosixPath(p).parts[0] for p in _sdist_files(built)}
    assert top == SDIST_TOP_LEVEL


def test_the_wheel_holds_every_file_of_the_package_and_nothing_else(built: Artifacts) -> None:
    package = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "airflow_stateful").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    files = _wheel_files(built)
    shipped = {name for name in files if not name.startswith(f"{DIST_INFO}/")}
    assert shipped == package
    assert "airflow_stateful/py.typed" in shipped
    assert any(name.startswith("airflow_stateful/plugins/view/templates/") for name in shipped)


def test_the_wheel_declares_the_console_script_provider_and_plugin(built: Artifacts) -> None:
    files = _wheel_files(built)
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # keep the names' case
    parser.read_string(files[f"{DIST_INFO}/entry_points.txt"].decode())
    declared = {section: dict(parser[section]) for section in parser.sections()}
    assert declared == ENTRY_POINTS
    for group in ENTRY_POINTS.values():
        for target in group.values():
            module, _, attr = target.partition(":")
            source = files[module.replace(".", "/") + ".py"]
            names = {
                node.name
                for node in ast.parse(source).body
                if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            }
            assert attr in names, f"{target}: the wheel's {module} defines no {attr}"


def test_the_wheel_metadata_names_the_package_and_its_readme(built: Artifacts) -> None:
    metadata = _metadata(_wheel_files(built)[f"{DIST_INFO}/METADATA"])
    assert metadata["Name"] == "airflow-provider-stateful"
    assert metadata["Version"] == __version__
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert any(req.startswith("apache-airflow>=3.1") for req in metadata.get_all("Requires-Dist") or [])
    assert metadata.get_payload() == (REPO / "README.md").read_text(), (
        "the long description is not the README"
    )


def test_twine_check_accepts_both(built: Artifacts) -> None:
    proc = _run("-m", "twine", "check", "--strict", str(built.wheel), str(built.sdist))
    assert proc.returncode == 0, f"twine check failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("PASSED") == 2, proc.stdout


MAINTENANCE_DAG_FILE = REPO / "dags" / "stateful_maintenance.py"
"""The maintenance DAG's file: the one call a user puts in their DAG folder, quoted by the README and deploy.md."""

_LOAD_DAG_FOLDER = """
import json, sys
try:
    from airflow.dag_processing.dagbag import DagBag
except ImportError:  # Airflow 3.1
    from airflow.models.dagbag import DagBag
import airflow_stateful
bag = DagBag(dag_folder=sys.argv[1])
dag = bag.dags.get("stateful_maintenance")
print(json.dumps({
    "package": airflow_stateful.__file__,
    "errors": {path: str(error) for path, error in bag.import_errors.items()},
    "dag_ids": sorted(bag.dag_ids),
    "tasks": None if dag is None else sorted(dag.task_ids),
    "schedule": None if dag is None else str(dag.schedule),
    "fileloc": None if dag is None else dag.fileloc,
}))
"""


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", markdown, re.M | re.S)


def test_the_installed_wheel_creates_the_maintenance_dag_from_the_documented_file(
    built: Artifacts, tmp_path: Path
) -> None:
    """The README's and deploy.md's maintenance DAG file, in a DAG folder, parsed by Airflow with the package
    installed from the wheel: the DAG and its two tasks come from the installed package, not from this checkout.

    The wheel goes into a virtualenv of its own, which sees this environment's site-packages (Airflow and the
    other dependencies, so nothing is fetched) through a ``.pth`` line; a ``.pth`` line adds a directory without
    running the ``.pth`` files in it, so the editable install of this checkout is not on that environment's path.
    """
    file_text = MAINTENANCE_DAG_FILE.read_text()
    for doc in (REPO / "README.md", REPO / "docs" / "deploy.md"):
        assert file_text in _python_blocks(doc.read_text()), (
            f"{doc.name} does not show {MAINTENANCE_DAG_FILE.name}"
        )

    venv = tmp_path / "venv"
    proc = _run("-m", "venv", "--without-pip", str(venv))
    assert proc.returncode == 0, proc.stderr
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = _run(
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--quiet",
        "--no-deps",
        "--no-index",
        str(built.wheel),
    )
    assert proc.returncode == 0, f"pip install of the wheel failed:\n{proc.stdout}\n{proc.stderr}"

    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "stateful_maintenance.py").write_text(file_text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(tmp_path / "home"), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    proc = subprocess.run(
        [str(python), "-c", _LOAD_DAG_FOLDER, str(dags)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(loaded["package"]).is_relative_to(venv), f"imported from {loaded['package']}, not the wheel"
    assert loaded["errors"] == {}
    assert loaded["dag_ids"] == ["stateful_maintenance"]
    assert loaded["tasks"] == ["gc", "stuck_check"]
    assert loaded["schedule"] == "@daily"
    assert loaded["fileloc"] == str(dags / "stateful_maintenance.py")

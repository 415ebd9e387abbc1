"""The package's import rules hold, and a wrong import breaks them.

``pyproject.toml`` ``[tool.importlinter]`` declares the rules: the core's layers (records <- stores <- data <-
protocol <- fleet), no Airflow (or anything of this package's Airflow layer) in the core, records without I/O,
and no import circle anywhere. ``make lint`` and ``make test`` run ``lint-imports`` on the tree; these tests
prove the contracts are not vacuous: each copies the package, adds one import a newcomer might write, and
expects ``lint-imports`` to fail naming the rule it broke.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists(),
    reason=f"import-linter is not installed beside {sys.executable} (the dev extra)",
)


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package (and pyproject.toml) with ``line`` appended to ``module`` (a path under the root)."""
    root = tmp_path / "tree"
    shutil.copytree(
        REPO / "airflow_stateful", root / "airflow_stateful", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    target = root / module
    target.write_text(target.read_text() + f"\n{line}\n")
    return root


def test_the_tree_keeps_every_import_contract() -> None:
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        pytest.param(
            "airflow_stateful/core/records/fields.py",
            "from airflow_stateful.core.protocol import lease  # noqa",
            "The core's layers",
            id="records-imports-protocol",
        ),
        pytest.param(
            "airflow_stateful/core/data/transfer.py",
            "from airflow_stateful.core.fleet import catalog  # noqa",
            "The core's layers",
            id="data-imports-fleet",
        ),
        pytest.param(
            "airflow_stateful/core/stores/local.py",
            "import airflow  # noqa",
            "The core never imports Airflow",
            id="core-imports-airflow",
        ),
        pytest.param(
            "airflow_stateful/core/fleet/gc.py",
            "from airflow_stateful import metrics  # noqa",
            "The core never imports Airflow",
            id="core-imports-the-airflow-layer",
        ),
        pytest.param(
            "airflow_stateful/core/errors.py",
            "from airflow_stateful.core.data import files  # noqa",
            "The modules beside the layers",
            id="errors-imports-a-layer",
        ),
        pytest.param(
            "airflow_stateful/cli/output.py",
            "from airflow_stateful.cli import main  # noqa",
            "No import circles",
            id="a-circle",
        ),
    ],
)
def test_a_wrong_import_breaks_the_contract_it_violates(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    done = _lint(_copy_with(tmp_path, module, line))
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Broken contracts" in done.stdout, done.stdout[-4000:]
    broken = " ".join(done.stdout.split("Broken contracts", 1)[1].split())
    assert contract in broken, done.stdout[-4000:]
    assert line.split("  #")[0].split()[-1] in broken, "the report names the offending import"

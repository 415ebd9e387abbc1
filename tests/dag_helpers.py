"""Loading and running DAG files under real Airflow (``dag.test()``), and reading what their tasks did."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

AIRFLOW_VERSION = tuple(int(part) for part in version("apache-airflow").split(".")[:2])
"""The running Airflow's (major, minor): ``make test-matrix`` runs the suite on 3.1 and 3.2 too."""


def needs_airflow(minor: tuple[int, int], why: str) -> pytest.MarkDecorator:
    """Skip a test on an older Airflow, saying why (a 3.3-only feature, or a test reaching into 3.3 internals)."""
    shown = ".".join(map(str, minor))
    return pytest.mark.skipif(minor > AIRFLOW_VERSION, reason=f"needs Airflow {shown}+: {why}")


def dagbag(folder: Path) -> Any:
    """Airflow's DagBag of ``folder`` (``airflow.dag_processing.dagbag`` from 3.2, ``airflow.models`` in 3.1)."""
    try:
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:
        from airflow.models.dagbag import DagBag
    return DagBag(dag_folder=str(folder))


NEEDS_33 = {"task_state_store.py"}
"""Example DAG files that use a 3.3-only feature (the task state store); older Airflow reports them as import
errors naming the missing 3.3 name, and every other file must import cleanly."""


def import_errors_outside_33_examples(bag: Any) -> dict[str, str]:
    """The DagBag's import errors, except (on Airflow < 3.3) those of the 3.3-only examples."""
    if AIRFLOW_VERSION >= (3, 3):
        return dict(bag.import_errors)
    return {path: error for path, error in bag.import_errors.items() if Path(path).name not in NEEDS_33}


def load_dag_module(path: Path) -> ModuleType:
    """Import a DAG file fresh (a new module each time, as a worker parsing a changed file would)."""
    name = f"dagfile_{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def find_dag(module: ModuleType, dag_id: str | None = None) -> Any:
    """The module's only DAG, or the one with ``dag_id`` (a file may define a producer and its consumer)."""
    from airflow.sdk import DAG

    dags = [v for v in vars(module).values() if isinstance(v, DAG) and dag_id in (None, v.dag_id)]
    assert len(dags) == 1, f"{module.__file__} defines {len(dags)} DAG objects" + (
        f" {dag_id!r}" if dag_id else ""
    )
    return dags[0]


def ledger_by_try(path: Path) -> dict[int, list[int]]:
    """Rows ``try_number,item`` appended by tasks as real side effects, grouped by try."""
    tries: dict[int, list[int]] = {}
    for row in path.read_text().split():
        try_number, item = (int(x) for x in row.split(",")[:2])
        tries.setdefault(try_number, []).append(item)
    return tries

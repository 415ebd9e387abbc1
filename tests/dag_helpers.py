"""Loading and running DAG files under real Airflow (``dag.test()``), and reading what their tasks did."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any


def load_dag_module(path: Path) -> ModuleType:
    """Import a DAG file fresh (a new module each time, as a worker parsing a changed file would)."""
    name = f"dagfile_{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def find_dag(module: ModuleType) -> Any:
    from airflow.sdk import DAG

    dags = [v for v in vars(module).values() if isinstance(v, DAG)]
    assert len(dags) == 1, f"{module.__file__} defines {len(dags)} DAG objects"
    return dags[0]


def ledger_by_try(path: Path) -> dict[int, list[int]]:
    """Rows ``try_number,item`` appended by tasks as real side effects, grouped by try."""
    tries: dict[int, list[int]] = {}
    for row in path.read_text().split():
        try_number, item = (int(x) for x in row.split(",")[:2])
        tries.setdefault(try_number, []).append(item)
    return tries

"""``python -m airflow_stateful`` is the ``airflow-stateful`` command."""

from __future__ import annotations

from airflow_stateful.cli.main import run

if __name__ == "__main__":
    run()

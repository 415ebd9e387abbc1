"""``python -m airflow_stateful`` is the ``airflow-stateful`` command."""

from __future__ import annotations

import sys

from airflow_stateful.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

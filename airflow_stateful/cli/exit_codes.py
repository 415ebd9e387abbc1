"""The exit codes scripts rely on (``airflow-stateful --help`` documents them).

A module of their own because both sides need them and neither may import the other: the commands return them,
:func:`airflow_stateful.cli.main.main` maps exceptions to them, and the parser gives ``stuck`` the code its
failures take.
"""

from __future__ import annotations

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_LEASE, EXIT_NOT_FOUND = 0, 1, 2, 3, 4

"""Backends Airflow loads by dotted path from its own configuration, implemented on the storage core.

Each module here implements one of Airflow's pluggable backend interfaces (today Airflow 3.3's task and asset
state store, :mod:`airflow_stateful.backends.task_state_store`). They are kept apart from the core because
they import Airflow, and apart from operators and hooks because Airflow, not DAG code, builds them.
"""

from __future__ import annotations

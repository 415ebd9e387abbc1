"""airflow-provider-stateful: durable identity, fenced checkpoints and upgrade-safe resume for Airflow 3.

This module stays lazy (PEP 562): Airflow imports ``airflow_stateful.get_provider_info`` while its own
configuration is loading, and an eager import of anything that touches Airflow here would make every
Airflow command fail with a circular import.
"""

from __future__ import annotations

from typing import Any

from airflow_stateful.core.lazy import load
from airflow_stateful.version import __version__

_LAZY = {
    "stateful_task": "airflow_stateful.decorators.stateful",
    "StatefulPythonOperator": "airflow_stateful.operators.python",
    "StatefulOperator": "airflow_stateful.operators.stateful",
    "TaskState": "airflow_stateful.task_state",
    "CheckpointInfo": "airflow_stateful.task_state",
    "StateHook": "airflow_stateful.hooks.state",
    "StatefulGCOperator": "airflow_stateful.operators.gc",
    "StatefulStuckCheckOperator": "airflow_stateful.operators.stuck",
    "stateful_maintenance_dag": "airflow_stateful.maintenance",
    "S3StateStoreBackend": "airflow_stateful.state_store",
    "StatefulError": "airflow_stateful.core.errors",
    "FencedError": "airflow_stateful.core.errors",
    "CheckpointCorruptError": "airflow_stateful.core.errors",
    "IdentityError": "airflow_stateful.core.errors",
    "IncompatibleStateError": "airflow_stateful.core.errors",
    "CursorMismatchError": "airflow_stateful.core.errors",
    "MigrationError": "airflow_stateful.core.errors",
    "CodeChangedError": "airflow_stateful.core.errors",
    "CodeIdentity": "airflow_stateful.core.records.code_identity",
    "TryOutcome": "airflow_stateful.core.records.outcomes",
    "InvalidValueError": "airflow_stateful.core.errors",
    "Identity": "airflow_stateful.core.records.identity",
    "CheckpointStore": "airflow_stateful.core.protocol.checkpoint_store",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` when it is first asked for (PEP 562)."""
    return load(__name__, _LAZY, name)

"""The configured path users already have in airflow.cfg: ``S3StateStoreBackend`` is imported from here.

``[state_store] backend`` and ``[workers] state_store_backend`` name the backend by the dotted path
``airflow_stateful.state_store.S3StateStoreBackend``, so that path must keep working. The implementation
lives in :mod:`airflow_stateful.backends.task_state_store`; this module re-exports the very same objects.
Airflow's ``issubclass`` check against its core ``BaseStoreBackend`` holds for either path, because that
module registers the class with the core's ABC when it is imported.
"""

from __future__ import annotations

from airflow_stateful.backends.task_state_store import ExpiryReport, S3StateStoreBackend, collect_expired

__all__ = ["ExpiryReport", "S3StateStoreBackend", "collect_expired"]

from __future__ import annotations

from airflow_stateful.maintenance import stateful_maintenance_dag

dag_object = stateful_maintenance_dag()

"""AirflowApiHook: Airflow's own REST API, reached through a connection, for maintenance that must ask Airflow.

In Airflow 3 a task cannot read the metadata database; the maintenance DAG's GC asks the API server instead
whether a run is finished before it deletes the run's state (:mod:`airflow_stateful.core.fleet.lifetimes`). The
connection (``[stateful] airflow_conn_id``, type ``http``) gives the API server's URL as host (with its scheme,
or ``schema`` for it) and port, a user that may read the DAGs as login and password, and optionally a ready
access token as ``extra.token``. Only those keys are read.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook

from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.fleet.airflow_runs import RestApiRunStates


class AirflowApiHook(BaseHook):
    """Builds a :class:`~airflow_stateful.core.fleet.airflow_runs.RestApiRunStates` from an Airflow connection.

    :param airflow_conn_id: the connection to Airflow's API server.
    """

    conn_name_attr = "airflow_conn_id"
    default_conn_name = "airflow_api"
    conn_type = "http"
    hook_name = "Airflow REST API (for stateful maintenance)"

    def __init__(self, *, airflow_conn_id: str) -> None:
        super().__init__()
        self.airflow_conn_id = airflow_conn_id

    def base_url(self, conn: Any) -> str:
        host = str(conn.host or "").strip().rstrip("/")
        if not host:
            raise ConfigurationError(
                f"connection {self.airflow_conn_id!r} has no host (the API server's URL)"
            )
        if "://" not in host:
            host = f"{conn.schema or 'http'}://{host}"
        if conn.port and host.count(":") < 2:
            host = f"{host}:{conn.port}"
        return host

    def run_states(self) -> RestApiRunStates:
        """The API client; the connection's password goes into it and nowhere else."""
        from airflow_stateful.compat import AirflowNotFoundException

        try:
            conn = self.get_connection(self.airflow_conn_id)
        except AirflowNotFoundException:
            raise ConfigurationError(
                f"the Airflow API connection {self.airflow_conn_id!r} does not exist"
            ) from None
        extra = conn.extra_dejson or {}
        token = extra.get("token") if isinstance(extra, dict) else None
        try:
            return RestApiRunStates(
                base_url=self.base_url(conn),
                username=conn.login or None,
                password=conn.password or None,
                token=str(token) if token else None,
            )
        except ValueError as exc:
            raise ConfigurationError(f"connection {self.airflow_conn_id!r}: {exc}") from None

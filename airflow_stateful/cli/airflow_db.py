"""Asking Airflow's metadata database whether a task instance is finished (the CLI's way; tasks use the API).

The ``airflow-stateful`` CLI runs where Airflow is installed and often configured (a scheduler host, an admin's
shell). There GC can read the task instance straight from the database, which needs no API credentials. Whether
the database is there is found out once (:func:`metadata_db_run_states`), so a laptop without one is told why
Airflow was not asked instead of getting an error per identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow_stateful.core.fleet.lifetimes import AirflowAnswer


class MetadataDbRunStates:
    """Task instance states from the metadata database this Airflow installation is configured with."""

    def __init__(self) -> None:
        from airflow.models.dag import DagModel
        from airflow.models.dagrun import DagRun
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import select

        self._select, self._session = select, create_session
        self._dag, self._run, self._ti = DagModel, DagRun, TaskInstance

    def __repr__(self) -> str:
        return "MetadataDbRunStates()"

    def probe(self) -> None:
        """Raise if the database cannot be read (not configured, not migrated, unreachable)."""
        with self._session() as session:
            session.execute(self._select(self._dag.dag_id).limit(1)).all()

    def ask(self, *, dag_id: str, run_id: str, task_id: str, map_index: int) -> AirflowAnswer:
        ti, run, dag = self._ti, self._run, self._dag
        try:
            with self._session() as session:
                row: Any = session.execute(
                    self._select(ti.state, ti.end_date).where(
                        ti.dag_id == dag_id,
                        ti.run_id == run_id,
                        ti.task_id == task_id,
                        ti.map_index == map_index,
                    )
                ).first()
                if row is not None:
                    state, ended = row
                    return AirflowAnswer(
                        state=str(getattr(state, "value", state)) if state else "none",
                        ended_at=ended.timestamp() if ended is not None else None,
                    )
                if session.execute(
                    self._select(run.id).where(run.dag_id == dag_id, run.run_id == run_id)
                ).first():
                    return AirflowAnswer(state=None)
                if session.execute(self._select(dag.dag_id).where(dag.dag_id == dag_id)).first():
                    return AirflowAnswer(run_known=False)
                return AirflowAnswer(dag_known=False, run_known=False)
        except Exception as exc:  # an unreachable or half-migrated database: cannot tell, so keep
            return AirflowAnswer(error=f"metadata database: {type(exc).__name__}")


def metadata_db_run_states() -> tuple[MetadataDbRunStates | None, str]:
    """The database client if this installation's metadata database can be read, and a line saying which.

    A SQLite database file that does not exist is not opened (SQLite would create an empty one)."""
    from airflow_stateful.compat import airflow_conf

    url = str(airflow_conf().get("database", "sql_alchemy_conn", fallback=""))
    backend = url.split(":", 1)[0] or "?"
    if backend.startswith("sqlite"):
        path = url.split(":///", 1)[1].split("?", 1)[0] if ":///" in url else ""
        if not path or not Path(path).is_file():
            return None, f"Airflow's metadata database is not here (no SQLite file {path or url!r})"
    try:
        states = MetadataDbRunStates()
        states.probe()
    except Exception as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return None, f"Airflow's metadata database cannot be read here ({type(exc).__name__}: {first})"
    return states, f"Airflow's metadata database ({backend})"

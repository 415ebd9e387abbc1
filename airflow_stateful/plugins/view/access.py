"""Who may see what in the Stateful view: Airflow's auth manager decides, DAG by DAG.

A plugin's FastAPI app is mounted inside Airflow's api-server but is *not* behind Airflow's auth unless its
routes ask for it. Every route of the view depends on :func:`current_viewer`, which is built from the same
dependencies Airflow 3's own REST API uses:

* ``get_user``: the user of a bearer token (``Authorization: Bearer``, what API clients send), else of the
  ``_token`` session cookie the UI's login sets (what the browser sends when the UI shows this page in its
  frame). No credential: 401. A token that does not verify: 401 or 403, as Airflow decides.
* ``permitted_dag_filter_factory("GET")``: the ids of the DAGs the auth manager lets this user read (it
  honours per-DAG permissions and multi-team ownership).

An identity belongs to a DAG through ``Identity.task_parts["dag_id"]`` (its key, never its head record, which
anyone who can write the bucket can forge). Identities that are not task identities (free-form keys), and
identities of DAGs Airflow does not know (deleted, or not parsed yet), have no DAG to check against, so only
a user who may read *every* DAG sees them (:func:`reads_every_dag`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.auth.managers.models.resource_details import ConfigurationDetails, DagDetails
from airflow.api_fastapi.core_api.security import (
    GetUserDep,
    PermittedDagFilter,
    permitted_dag_filter_factory,
)
from airflow.configuration import conf
from airflow.models.dag import DagModel
from airflow.models.team import Team
from airflow.utils.session import create_session
from fastapi import Depends, HTTPException
from sqlalchemy import select
from sqlalchemy.orm import Session

from airflow_stateful.core.errors import IdentityError
from airflow_stateful.core.records.identity import Identity, encode_segment


@dataclass(frozen=True)
class Viewer:
    """The user of one request and what the auth manager lets them read."""

    user: BaseUser
    readable_dags: frozenset[str]
    #: may read every DAG: sees free-form identities and those of DAGs Airflow does not know.
    reads_every_dag: bool
    #: may read Airflow's configuration: sees the backend URL (it is ``[stateful] backend_url``).
    reads_configuration: bool

    def may_read(self, identity: Identity) -> bool:
        parts = identity.task_parts
        if parts is None:
            return self.reads_every_dag
        return self.reads_every_dag or str(parts["dag_id"]) in self.readable_dags

    def may_read_dag(self, dag_id: str) -> bool:
        return self.reads_every_dag or dag_id in self.readable_dags

    def require_dag(self, dag_id: str) -> None:
        """403 unless this user may read DAG ``dag_id`` (checked before the store is read, whether the DAG
        exists or not: no existence oracle)."""
        if not self.may_read_dag(dag_id):
            raise HTTPException(status_code=403, detail=f"you may not read DAG {dag_id!r}")

    def require(self, identity: Identity) -> None:
        """403 unless this user may read ``identity`` (checked before the store is read: no existence oracle)."""
        if not self.may_read(identity):
            raise HTTPException(status_code=403, detail=f"you may not read identity {identity.key!r}")

    def scan_prefixes(self, prefix: str) -> list[str]:
        """The key prefixes to list for ``prefix``: all of it for a user who reads every DAG; otherwise only
        the folders of DAGs they may read, so a user of one DAG never makes the server walk every other DAG's
        state."""
        if self.reads_every_dag:
            return [prefix]
        scans = set()
        for dag_id in self.readable_dags:
            folder = f"{encode_segment(dag_id)}/"
            if prefix.startswith(folder):
                return [prefix]  # the prefix names one DAG (folders end in "/": no other DAG matches)
            if folder.startswith(prefix):
                scans.add(folder)
        return sorted(scans)


def reads_every_dag(user: BaseUser, readable: set[str], session: Session) -> bool:
    """Whether ``user`` may read every DAG, asked in terms every auth manager answers the same way.

    ``is_authorized_dag`` without details is "DAGs in general" (FAB: the global DAG permission; the simple
    auth manager: the role), which in multi-team mode says nothing about other teams' DAGs. So: that, plus
    every DAG Airflow knows is in ``readable``, plus (multi-team) every team's DAGs are readable.
    """
    auth_manager = get_auth_manager()
    if not auth_manager.is_authorized_dag(method="GET", user=user):
        return False
    if not set(session.scalars(select(DagModel.dag_id))) <= readable:
        return False
    if conf.getboolean("core", "multi_team", fallback=False):
        return all(
            auth_manager.is_authorized_dag(method="GET", user=user, details=DagDetails(team_name=team))
            for team in session.scalars(select(Team.name))
        )
    return True


def current_viewer(
    user: GetUserDep,
    readable: Annotated[PermittedDagFilter, Depends(permitted_dag_filter_factory("GET"))],
) -> Viewer:
    """FastAPI dependency: the authenticated user and their readable DAGs (401/403 come from ``get_user``).

    The DB session lives only as long as this function (not Airflow's request-long ``SessionDep``): a
    request may then wait for the store for seconds, and must not hold one of the api-server's few DB
    connections meanwhile (its health check needs one too).
    """
    dag_ids = set(readable.value or ())
    with create_session() as session:
        every = reads_every_dag(user, dag_ids, session)
    return Viewer(
        user=user,
        readable_dags=frozenset(dag_ids),
        reads_every_dag=every,
        reads_configuration=get_auth_manager().is_authorized_configuration(
            method="GET", user=user, details=ConfigurationDetails(section="stateful")
        ),
    )


ViewerDep = Annotated[Viewer, Depends(current_viewer)]


def checked_prefix(value: str) -> str:
    """``value`` if it can start an identity key, else 400 naming it.

    Each complete segment must be a valid identity segment (no ``..``, no leading ``/``, no ``~``, no
    backslash, no control character), and so must the last, partial one: nothing the store could resolve
    outside its root, or into the library's own ``~`` folders.
    """
    if value == "":
        return value
    try:
        Identity.parse(value[:-1] if value.endswith("/") else value)
    except IdentityError as exc:
        raise HTTPException(
            status_code=400, detail=f"prefix {value!r} cannot start an identity key: {exc}"
        ) from None
    return value


def checked_identity(key: str) -> Identity:
    """The identity ``key`` names, else 400 naming it."""
    try:
        return Identity.parse(key)
    except IdentityError as exc:
        raise HTTPException(status_code=400, detail=f"{key!r} is not an identity key: {exc}") from None

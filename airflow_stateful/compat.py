"""Airflow names that moved between 3.1, 3.2 and 3.3, imported from wherever the running Airflow has them.

The package supports Airflow 3.1+ (``make test-matrix`` runs the suite on each minor's latest patch), but the
Task SDK grew between those releases: 3.1 has no ``AirflowFailException`` in ``airflow.sdk.exceptions``, no
``airflow.sdk.conf`` and no ``airflow.sdk.observability``. Each name is taken from the SDK first (the
supported home from 3.2/3.3 on) and from its 3.1 home otherwise, so task code raises the class the running
task runner catches. Features that exist only in newer Airflow (the 3.3 task state store) say so where they
are used instead (see :mod:`airflow_stateful.state_store`).

Imported lazily by the modules that need Airflow: the storage core never imports this.
"""

from __future__ import annotations

from typing import Any

try:  # Airflow 3.2+
    from airflow.sdk.exceptions import (
        AirflowFailException,
        AirflowNotFoundException,
        AirflowRescheduleException,
    )
except ImportError:  # Airflow 3.1
    from airflow.exceptions import (  # type: ignore[no-redef,attr-defined,unused-ignore]
        AirflowFailException,
        AirflowNotFoundException,
        AirflowRescheduleException,
    )

__all__ = [
    "AirflowFailException",
    "AirflowNotFoundException",
    "AirflowRescheduleException",
    "airflow_conf",
    "stats",
]


def airflow_conf() -> Any:
    """Airflow's configuration (``airflow.sdk.conf`` from 3.2; ``airflow.configuration.conf`` in 3.1)."""
    try:
        from airflow.sdk import conf
    except ImportError:
        from airflow.configuration import conf  # type: ignore[assignment]
    return conf


def stats() -> Any:
    """Airflow's StatsD/OpenTelemetry facade (``airflow.sdk.observability.stats`` from 3.3; ``airflow.stats``
    before)."""
    try:
        from airflow.sdk.observability.stats import Stats
    except ImportError:
        from airflow.stats import Stats
    return Stats

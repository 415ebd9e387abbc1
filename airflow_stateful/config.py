"""The ``[stateful]`` configuration section, read from Airflow's configuration.

The defaults and the validation live in :mod:`airflow_stateful.core.settings` (shared with the in-pod client);
this module only knows where Airflow keeps the raw text.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow_stateful.core.settings import SECTION, StatefulSettings

__all__ = ["SECTION", "StatefulSettings", "default_backend_url", "load_settings"]


def default_backend_url() -> str:
    """``file://{AIRFLOW_HOME}/stateful``: the embedded default for a single machine."""
    home = os.environ.get("AIRFLOW_HOME") or str(Path("~/airflow").expanduser())
    return (Path(home).absolute() / "stateful").as_uri()


def load_settings() -> StatefulSettings:
    """Read ``[stateful]`` from Airflow's configuration (``AIRFLOW__STATEFUL__*`` variables included)."""
    from airflow_stateful.compat import airflow_conf

    conf = airflow_conf()

    def get(option: str) -> str | None:
        if not conf.has_option(SECTION, option):
            return None
        value = conf.get(SECTION, option, fallback=None)
        return None if value is None else str(value)

    return StatefulSettings.from_options(get, default_backend_url=default_backend_url())

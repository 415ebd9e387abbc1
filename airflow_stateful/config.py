"""The ``[stateful]`` configuration section, read from Airflow's configuration.

The defaults and the validation live in :mod:`airflow_stateful.core.settings` (shared with the in-pod client);
this module only knows where Airflow keeps the raw text.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow_stateful.core.settings import SECTION, StatefulSettings

__all__ = [
    "DEFAULT_BACKEND_URL",
    "SECTION",
    "StatefulSettings",
    "backend_url_option",
    "default_backend_url",
    "load_settings",
]

DEFAULT_BACKEND_URL = "file://{AIRFLOW_HOME}/stateful"
"""``[stateful] backend_url`` as the provider declares its default (``airflow config list`` shows it), and as a
new ``airflow.cfg`` holds it: a placeholder this package resolves (:func:`default_backend_url`), never Airflow."""


def default_backend_url() -> str:
    """``file://{AIRFLOW_HOME}/stateful``: the embedded default for a single machine."""
    home = os.environ.get("AIRFLOW_HOME") or str(Path("~/airflow").expanduser())
    return (Path(home).absolute() / "stateful").as_uri()


def backend_url_option(value: str | None) -> str | None:
    """``value`` of ``[stateful] backend_url``, or ``None`` where it is the declared default.

    The default is written into ``airflow.cfg`` as the placeholder itself; reading it as unset lets
    :func:`default_backend_url` resolve it for the process that runs, exactly as the empty default did.
    """
    return None if value is not None and value.strip() == DEFAULT_BACKEND_URL else value


def load_settings() -> StatefulSettings:
    """Read ``[stateful]`` from Airflow's configuration (``AIRFLOW__STATEFUL__*`` variables included)."""
    from airflow_stateful.compat import airflow_conf

    conf = airflow_conf()

    def get(option: str) -> str | None:
        if not conf.has_option(SECTION, option):
            return None
        value = conf.get(SECTION, option, fallback=None)
        text = None if value is None else str(value)
        return backend_url_option(text) if option == "backend_url" else text

    return StatefulSettings.from_options(get, default_backend_url=default_backend_url())

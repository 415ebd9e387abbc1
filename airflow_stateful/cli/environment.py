"""The installation's ``[stateful]`` options and S3 connection read without importing Airflow, or ``None`` where
only Airflow can tell.

Airflow reads an option from ``AIRFLOW__<SECTION>__<KEY>``, else from ``airflow.cfg`` (``AIRFLOW_CONFIG``, else
``$AIRFLOW_HOME/airflow.cfg``), else its default; a connection from a configured secrets backend first, then
from ``AIRFLOW_CONN_<ID>``, then its database. This module reads the same places in the same order and gives up
(returns ``None``) wherever the answer could depend on something it does not read: an option given by a command
or a secret (``_cmd``/``_secret``), a value Airflow would interpolate, a secrets backend, a connection not in
the environment (it may be in the database). Giving up only costs the caller Airflow's import time, never a
different answer; tests/test_cli_light.py checks both readers agree.
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path
from typing import Any

from airflow_stateful.config import DEFAULT_BACKEND_URL, backend_url_option, default_backend_url
from airflow_stateful.core.settings import SECTION, StatefulSettings
from airflow_stateful.s3_connection import connection_from_env, connection_source, s3_options

READ_ONLY_VERBS = frozenset({"ls", "stuck", "du", "show", "history", "cat", "outputs", "verify"})
"""The verbs that only read the store (``cat --files`` and ``outputs --get`` write only to a local directory)."""

_INDIRECT = ("_cmd", "_secret")


def airflow_cfg() -> configparser.ConfigParser | None:
    """``airflow.cfg`` as Airflow would find it, parsed without interpolation; an empty parser when there is no
    file; ``None`` when it cannot be read (then Airflow must say what it means)."""
    home = os.environ.get("AIRFLOW_HOME") or str(Path("~/airflow").expanduser())
    path = Path(os.environ.get("AIRFLOW_CONFIG") or Path(home) / "airflow.cfg")
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        if path.is_file():
            parser.read(path, encoding="utf-8")
    except (OSError, configparser.Error, UnicodeDecodeError):
        return None
    return parser


def _option(cfg: configparser.ConfigParser, section: str, option: str) -> tuple[bool, str | None]:
    """``(known, value)``: ``known`` is false when only Airflow can resolve the option."""
    env = f"AIRFLOW__{section.upper()}__{option.upper()}"
    if any(f"{env}{suffix.upper()}" in os.environ for suffix in _INDIRECT):
        return False, None
    if env in os.environ:
        return True, os.environ[env]
    if not cfg.has_section(section):
        return True, None
    if any(cfg.has_option(section, option + suffix) for suffix in _INDIRECT):
        return False, None
    value = cfg.get(section, option, fallback=None)
    if value is not None and ("%" in value or "{" in value) and value.strip() != DEFAULT_BACKEND_URL:
        # Airflow may expand it (interpolation, templated defaults); backend_url's default it keeps as written.
        return False, None
    return True, value


def light_settings(cfg: configparser.ConfigParser | None) -> StatefulSettings | None:
    """``[stateful]`` as :func:`airflow_stateful.config.load_settings` reads it from the environment and ``cfg``
    (:func:`airflow_cfg`), or ``None`` if only Airflow can."""
    if cfg is None:
        return None
    values: dict[str, str | None] = {}
    unknown = False

    def get(option: str) -> str | None:
        nonlocal unknown
        if option not in values:
            known, values[option] = _option(cfg, SECTION, option)
            unknown = unknown or not known
        return backend_url_option(values[option]) if option == "backend_url" else values[option]

    settings = StatefulSettings.from_options(get, default_backend_url=default_backend_url())
    return None if unknown else settings


def light_connection(conn_id: str, cfg: configparser.ConfigParser) -> dict[str, Any] | None:
    """The S3 store options of connection ``conn_id`` when Airflow would take it from ``AIRFLOW_CONN_<ID>``
    (``cfg``: :func:`airflow_cfg`, for a configured secrets backend); ``None`` when it might come from elsewhere
    (a secrets backend, the database) or is in a form left to Airflow. The result holds secrets: it goes to the
    store's constructor only."""
    known, backend = _option(cfg, "secrets", "backend")
    if not known or (backend or "").strip():
        return None  # a secrets backend is asked before the environment
    text = os.environ.get(f"AIRFLOW_CONN_{conn_id.upper()}")
    if text is None:
        return None
    fields = connection_from_env(conn_id, text)
    if fields is None:
        return None
    options = s3_options(fields)
    return {**options, "credential_source": connection_source(conn_id, options)}

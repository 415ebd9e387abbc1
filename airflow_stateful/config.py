"""The ``[stateful]`` configuration section, read in one place with the documented defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from airflow_stateful.core.errors import ConfigurationError

SECTION = "stateful"


def default_backend_url() -> str:
    """``file://{AIRFLOW_HOME}/stateful``: the embedded default for a single machine."""
    home = os.environ.get("AIRFLOW_HOME") or str(Path("~/airflow").expanduser())
    return (Path(home).absolute() / "stateful").as_uri()


@dataclass(frozen=True)
class StatefulSettings:
    backend_url: str
    conn_id: str
    lease_ttl: int
    keep_last: int

    @classmethod
    def load(cls) -> StatefulSettings:
        """Read ``[stateful]`` from Airflow's configuration (environment variables included)."""
        from airflow.sdk import conf

        def get_int(option: str, default: int, minimum: int) -> int:
            raw = conf.get(SECTION, option, fallback=str(default))
            try:
                value = int(str(raw).strip())
            except ValueError:
                raise ConfigurationError(f"[{SECTION}] {option} must be an integer, not {raw!r}") from None
            if value < minimum:
                raise ConfigurationError(f"[{SECTION}] {option} must be >= {minimum}, not {value}")
            return value

        return cls(
            backend_url=(conf.get(SECTION, "backend_url", fallback="") or "").strip()
            or default_backend_url(),
            conn_id=(conf.get(SECTION, "conn_id", fallback="aws_default") or "").strip(),
            lease_ttl=get_int("lease_ttl", 600, 1),
            keep_last=get_int("keep_last", 3, 1),
        )

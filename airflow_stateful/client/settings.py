"""What the pod is told through ``STATEFUL_*`` environment variables, checked before anything is written."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.identity import Identity
from airflow_stateful.core.lease import Lease
from airflow_stateful.core.records import WriterInfo

VALUE_FILE = ".stateful-value.json"


def _int(env: Mapping[str, str], name: str, default: int | None = None, minimum: int = 1) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigurationError(
                f"{name} is not set; the pod must be started by StatefulKubernetesPodOperator"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be an integer, not {raw!r}") from None
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, not {value}")
    return value


@dataclass(frozen=True)
class PodSettings:
    identity: Identity
    backend_url: str
    epoch: int
    lease_token: str
    schema_version: int
    keep_last: int
    endpoint_url: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PodSettings:
        env = os.environ if env is None else env
        for name in ("STATEFUL_IDENTITY", "STATEFUL_BACKEND_URL", "STATEFUL_LEASE_TOKEN"):
            if not env.get(name):
                raise ConfigurationError(
                    f"{name} is not set; the pod must be started by StatefulKubernetesPodOperator"
                )
        return cls(
            identity=Identity.parse(env["STATEFUL_IDENTITY"]),
            backend_url=env["STATEFUL_BACKEND_URL"],
            epoch=_int(env, "STATEFUL_EPOCH"),
            lease_token=env["STATEFUL_LEASE_TOKEN"],
            schema_version=_int(env, "STATEFUL_SCHEMA_VERSION", default=1),
            keep_last=_int(env, "STATEFUL_KEEP_LAST", default=3),
            endpoint_url=env.get("STATEFUL_S3_ENDPOINT_URL") or None,
        )

    def lease(self) -> Lease:
        """The lease the operator took for this pod: every commit presents its epoch and token."""
        return Lease(
            identity=self.identity,
            epoch=self.epoch,
            token=self.lease_token,
            holder=WriterInfo.current(),
            expires_at="",
        )

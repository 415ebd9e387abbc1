"""What the pod is told through ``STATEFUL_*`` environment variables, checked before anything is written."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_stateful.core.data.chunk_cache import LocalChunkCache
from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.protocol.lease import Lease
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.settings import RESTORE_CACHE_MAX_BYTES, StatefulSettings, parse_int
from airflow_stateful.core.stores.s3_options import (
    check_request_args,
    parse_bool,
    parse_config_kwargs,
    parse_verify,
)

VALUE_FILE = ".stateful-value.json"
_REQUIRED = ("STATEFUL_IDENTITY", "STATEFUL_BACKEND_URL", "STATEFUL_EPOCH", "STATEFUL_LEASE_TOKEN")


def _s3_env(option: str) -> str:
    return f"STATEFUL_S3_{option.upper()}"


def s3_options_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The S3 store options in ``STATEFUL_S3_*`` (what ``PodState.env()`` renders), checked, by option name.

    Credentials are not among them: the pod's boto3 finds its own (workload identity, ``credentials_secret``).
    An error names the variable and its value, before anything is written.
    """
    options: dict[str, Any] = {}
    for option in ("endpoint_url", "server_side_encryption", "sse_kms_key_id", "expected_bucket_owner"):
        if env.get(_s3_env(option)):
            options[option] = env[_s3_env(option)]
    if env.get(_s3_env("bucket_key_enabled")):
        options["bucket_key_enabled"] = parse_bool(
            env[_s3_env("bucket_key_enabled")], what=_s3_env("bucket_key_enabled")
        )
    if env.get(_s3_env("verify")):
        options["verify"] = parse_verify(env[_s3_env("verify")], what=_s3_env("verify"))
    if env.get(_s3_env("config_kwargs")):
        options["config_kwargs"] = parse_config_kwargs(
            env[_s3_env("config_kwargs")], what=_s3_env("config_kwargs")
        )
    check_request_args(options, source=_s3_env)
    return options


def _int(env: Mapping[str, str], name: str, *, default: int | None = None, minimum: int = 1) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigurationError(
                f"{name} is not set; the pod must be started by StatefulKubernetesPodOperator"
            )
        return default
    return parse_int(raw, what=name, minimum=minimum)


def signer_from_env(env: Mapping[str, str]) -> HeadSigner | None:
    """The head signer the operator configured (``STATEFUL_SIGNING_KEY_ID``), keyed by ``STATEFUL_SIGNING_KEY``.

    A key id without a key means the pod would write unsigned heads that this deployment's readers refuse (or
    cannot tell from forged ones): refused before anything is written.
    """
    key_id = env.get("STATEFUL_SIGNING_KEY_ID")
    if not key_id:
        return None
    key = env.get("STATEFUL_SIGNING_KEY")
    if not key:
        raise ConfigurationError(
            f"this deployment signs head records with key {key_id!r}, but STATEFUL_SIGNING_KEY is not set; the "
            "pod's lease Secret provides it when the pod is started by StatefulKubernetesPodOperator"
        )
    required = (env.get("STATEFUL_REQUIRE_SIGNED_HEADS") or "").lower() == "true"
    # The operator gives a pod the key of its own identity only (HeadSigner.for_identity), never the deployment's.
    identity = env.get("STATEFUL_IDENTITY") or None
    return HeadSigner(key=key.encode("utf-8"), key_id=key_id, required=required, identity=identity)


@dataclass(frozen=True)
class PodSettings:
    """The pod's identity, lease and store, from the environment StatefulKubernetesPodOperator rendered."""

    identity: Identity
    backend_url: str
    epoch: int
    lease_token: str
    schema_version: int
    keep_last: int
    lease_ttl: float
    endpoint_url: str | None
    s3: Mapping[str, Any] = field(default_factory=dict)
    """The S3 store options from ``STATEFUL_S3_*`` (see :func:`s3_options_from_env`), ``endpoint_url`` included."""
    head_signer: HeadSigner | None = field(default=None, repr=False)
    """The deployment's head signing key (``STATEFUL_SIGNING_KEY`` from the lease Secret), if it signs heads."""
    restore_cache_dir: str = ""
    """``STATEFUL_RESTORE_CACHE_DIR``: the node's restore cache (a ``hostPath`` mount); ``""``: no cache."""
    restore_cache_max_bytes: int = RESTORE_CACHE_MAX_BYTES
    """``STATEFUL_RESTORE_CACHE_MAX_BYTES``: the size the cache is kept under (0 turns it off)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PodSettings:
        env = os.environ if env is None else env
        for name in _REQUIRED:
            if not env.get(name):
                raise ConfigurationError(
                    f"{name} is not set; the pod must be started by StatefulKubernetesPodOperator"
                )
        # The shared options (ttl, keep_last) are parsed like [stateful]'s, with the same defaults.
        shared = StatefulSettings.from_options(
            lambda option: env.get(f"STATEFUL_{option.upper()}"),
            default_backend_url=env["STATEFUL_BACKEND_URL"],
            source=lambda option: f"STATEFUL_{option.upper()}",
        )
        return cls(
            identity=Identity.parse(env["STATEFUL_IDENTITY"]),
            backend_url=env["STATEFUL_BACKEND_URL"],
            epoch=_int(env, "STATEFUL_EPOCH"),
            lease_token=env["STATEFUL_LEASE_TOKEN"],
            schema_version=_int(env, "STATEFUL_SCHEMA_VERSION", default=1),
            keep_last=shared.keep_last,
            lease_ttl=shared.lease_ttl,
            endpoint_url=env.get("STATEFUL_S3_ENDPOINT_URL") or None,
            s3=s3_options_from_env(env) if env["STATEFUL_BACKEND_URL"].startswith("s3://") else {},
            head_signer=signer_from_env(env),
            # Parsed as [stateful]'s (an absolute path, a byte count), but unset means no cache in a pod: only
            # a directory on the node (the operator's hostPath) outlives the pod.
            restore_cache_dir=shared.restore_cache_dir if env.get("STATEFUL_RESTORE_CACHE_DIR") else "",
            restore_cache_max_bytes=shared.restore_cache_max_bytes,
        )

    def restore_cache(self) -> LocalChunkCache | None:
        """The node's restore cache, or ``None`` (turned off). Its chunks are in ``uid-<this user's uid>`` below
        ``STATEFUL_RESTORE_CACHE_DIR``: the mount's root belongs to whoever created it on the node (the
        kubelet: root), and the cache uses only a directory of its own user's. Nothing is touched on disk
        here; a directory that turns out unusable is reported once and the client goes on without it."""
        if not self.restore_cache_dir or self.restore_cache_max_bytes <= 0:
            return None
        return LocalChunkCache(
            directory=os.path.join(self.restore_cache_dir, f"uid-{os.geteuid()}"),
            max_bytes=self.restore_cache_max_bytes,
        )

    def store_options(self) -> dict[str, Any]:
        """Keyword arguments for ``store_from_url(self.backend_url, ...)``: the S3 options, none for a directory."""
        return dict(self.s3)

    def lease(self) -> Lease:
        """The lease the operator took for this pod: every commit presents its epoch and token."""
        return Lease(
            identity=self.identity,
            epoch=self.epoch,
            token=self.lease_token,
            holder=WriterInfo.current(),
            expires_at="",
        )

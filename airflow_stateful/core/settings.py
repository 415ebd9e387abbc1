"""Every setting a writer, a reader or maintenance shares, with its default, in one place.

The same settings arrive by different roads: ``[stateful]`` in ``airflow.cfg`` (or ``AIRFLOW__STATEFUL__*``)
for tasks, the CLI and the plugin (read by :mod:`airflow_stateful.config`), and ``STATEFUL_*`` environment
variables for the in-pod client (:mod:`airflow_stateful.client.settings`). Both hand their raw text to
:meth:`StatefulSettings.from_options`, so defaults and validation cannot drift apart, and
``get_provider_info`` documents these same defaults. No Airflow import here: pods run this with only boto3.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from airflow_stateful.core.durations import optional_duration, parse_duration
from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.records.formats import MAX_KEPT

SECTION = "stateful"

LEASE_TTL = 600
"""Seconds a lease lives after its last renewal (or commit). Writers renew at about a third of it."""
LEASE_GRACE = 60
"""Seconds past a lease's expiry before maintenance may break it: covers clock skew between hosts."""
KEEP_LAST = 3
"""Committed checkpoints kept per identity."""
CONN_ID = "aws_default"
"""Airflow connection with the S3 credentials."""
GC_MIN_AGE = timedelta(hours=1)
"""Unreferenced objects younger than this are left alone by GC (an extra margin on top of the lease rules)."""
RENEW_FRACTION = 1 / 3
"""A writer renews its lease every ``lease_ttl * RENEW_FRACTION`` seconds (with jitter)."""
EXPECTED_CHECKPOINT_INTERVAL = timedelta(hours=1)
"""A writer with a live lease that commits nothing for longer than this is *stuck* (:mod:`.status`), unless its
task declares its own ``expected_checkpoint_interval``."""
KEEP_FAILED_FOR = timedelta(days=30)
"""Per-run state of a task that failed for good is kept at least this long, so a task cleared meanwhile resumes."""
RESTORE_CACHE_MAX_BYTES = 2 * 1024 * 1024 * 1024
"""Bytes a worker's restore cache keeps at most (least recently used chunks are evicted beyond it)."""


def default_restore_cache_dir() -> str:
    """``<temp dir>/airflow-stateful-cache-<uid>``: on the worker's own disk, one per user (the cache refuses a
    directory another user owns, so a shared temp dir cannot be used to plant or read chunks)."""
    return str(Path(tempfile.gettempdir()) / f"airflow-stateful-cache-{os.geteuid()}")


def parse_int(raw: str, *, what: str, minimum: int, maximum: int | None = None) -> int:
    """An integer option's text, within bounds; ConfigurationError naming ``what`` otherwise."""
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{what} must be an integer, not {raw!r}") from None
    if value < minimum:
        raise ConfigurationError(f"{what} must be >= {minimum}, not {value}")
    if maximum is not None and value > maximum:
        raise ConfigurationError(f"{what} must be <= {maximum}, not {value}")
    return value


@dataclass(frozen=True)
class StatefulSettings:
    """The ``[stateful]`` options, validated. ``backend_url`` is ``""`` only before a default is applied."""

    backend_url: str
    conn_id: str = CONN_ID
    lease_ttl: float = LEASE_TTL
    lease_grace: float = LEASE_GRACE
    keep_last: int = KEEP_LAST
    signing_conn_id: str = ""
    require_signed_heads: bool = False
    restore_cache_dir: str = field(default_factory=default_restore_cache_dir)
    """Where a worker keeps chunks it restored or saved, for a retry on the same machine; ``""``: no cache."""
    restore_cache_max_bytes: int = RESTORE_CACHE_MAX_BYTES
    expected_checkpoint_interval: float = EXPECTED_CHECKPOINT_INTERVAL.total_seconds()
    """Seconds without a commit after which a live writer counts as stuck (a task may declare its own)."""
    release_after_success: float | None = None
    """Seconds after a task succeeded that GC releases its per-run state; ``None`` (unset): it ages out by
    ``idle_for`` as any state does."""
    keep_failed_for: float | None = KEEP_FAILED_FOR.total_seconds()
    """Seconds GC keeps the per-run state of a task that failed for good at least; ``None`` (set to ``0``): no
    minimum beyond ``idle_for``."""
    airflow_conn_id: str = ""
    """An Airflow connection to Airflow's own REST API, through which GC asks whether a run is finished before
    deleting its state (the maintenance task cannot read the metadata database); ``""``: not asked."""

    @classmethod
    def from_options(
        cls,
        get: Callable[[str], str | None],
        *,
        default_backend_url: str,
        source: Callable[[str], str] = lambda option: f"[{SECTION}] {option}",
    ) -> StatefulSettings:
        """Build settings from raw option text (``get(option)`` is ``None`` or ``""`` when unset).

        :param source: how to name an option in an error (``[stateful] lease_ttl``, ``STATEFUL_LEASE_TTL``).
        """

        def text(option: str) -> str | None:
            raw = get(option)
            return raw.strip() if isinstance(raw, str) and raw.strip() else None

        def seconds(option: str, default: float, *, minimum: float) -> float:
            raw = text(option)
            if raw is None:
                return float(default)
            try:
                value = parse_duration(raw, what=source(option)).total_seconds()
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
            if value < minimum:
                raise ConfigurationError(f"{source(option)} must be at least {minimum:g} s, not {raw!r}")
            return value

        def optional_seconds(option: str, default: float | None) -> float | None:
            """Unset: ``default``; ``0`` (or ``never``, ``off``): ``None``."""
            raw = text(option)
            if raw is None:
                return default
            try:
                span = optional_duration(raw, what=source(option))
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
            return span.total_seconds() if span is not None else None

        def integer(option: str, default: int, *, minimum: int, maximum: int) -> int:
            raw = text(option)
            if raw is None:
                return default
            return parse_int(raw, what=source(option), minimum=minimum, maximum=maximum)

        def boolean(option: str) -> bool:
            raw = text(option)
            if raw is None:
                return False
            if raw.lower() in ("true", "1", "yes", "on"):
                return True
            if raw.lower() in ("false", "0", "no", "off"):
                return False
            raise ConfigurationError(f"{source(option)} must be true or false, not {raw!r}")

        return cls(
            backend_url=text("backend_url") or default_backend_url,
            # An empty conn_id is meaningful: no connection, boto3's standard credential chain.
            conn_id=(get("conn_id") or "").strip() if get("conn_id") is not None else CONN_ID,
            lease_ttl=seconds("lease_ttl", LEASE_TTL, minimum=1),
            lease_grace=seconds("lease_grace", LEASE_GRACE, minimum=0),
            keep_last=integer("keep_last", KEEP_LAST, minimum=1, maximum=MAX_KEPT),
            signing_conn_id=text("signing_conn_id") or "",
            require_signed_heads=boolean("require_signed_heads"),
            restore_cache_dir=_cache_dir(get("restore_cache_dir"), what=source("restore_cache_dir")),
            restore_cache_max_bytes=integer(
                "restore_cache_max_bytes", RESTORE_CACHE_MAX_BYTES, minimum=0, maximum=1 << 50
            ),
            expected_checkpoint_interval=seconds(
                "expected_checkpoint_interval", EXPECTED_CHECKPOINT_INTERVAL.total_seconds(), minimum=1
            ),
            release_after_success=optional_seconds("release_after_success", None),
            keep_failed_for=optional_seconds("keep_failed_for", KEEP_FAILED_FOR.total_seconds()),
            airflow_conn_id=text("airflow_conn_id") or "",
        )


def _cache_dir(raw: str | None, *, what: str) -> str:
    """Unset (``None``): the default; set but empty: ``""`` (no cache); else an absolute path (``~`` expanded)."""
    if raw is None:
        return default_restore_cache_dir()
    if not raw.strip():
        return ""
    path = Path(raw.strip()).expanduser()
    if not path.is_absolute():
        raise ConfigurationError(
            f"{what} must be an absolute path (or empty to turn the cache off), not {raw!r}"
        )
    return str(path)

"""The one way records write and read times: ISO 8601 UTC strings with microseconds.

Its own module so that every record module (heads, outcomes, pins) can use it without importing another.
"""

from __future__ import annotations

from datetime import datetime, timezone


def utcnow_iso(ts: float) -> str:
    """An epoch timestamp as an ISO 8601 UTC string with microseconds."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="microseconds")


def parse_iso(value: str) -> float:
    """Seconds since the epoch of a time :func:`utcnow_iso` wrote (or any ISO 8601 string with an offset)."""
    return datetime.fromisoformat(value).timestamp()

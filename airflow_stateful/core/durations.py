"""Durations as people write them (``90``, ``30s``, ``5m``, ``12h``, ``30d``): one parser for every entry point.

The CLI, the in-pod client, templated operator arguments and the ``[stateful]`` options all accept the same
forms, so a value that works in one place works in all of them.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")


def parse_duration(value: timedelta | str | float | int, *, what: str = "duration") -> timedelta:
    """``timedelta``, a number of seconds, or text such as ``"30s"``, ``"5m"``, ``"12h"``, ``"30d"``.

    Raises ValueError naming ``what`` and the bad value for anything else, including negative, infinite or
    NaN values and booleans.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.fullmatch(value.strip().lower())
        if not match:
            raise ValueError(f"{what} must be a duration such as 90, 30s, 5m, 12h or 30d, not {value!r}")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ValueError(f"{what} must be a duration such as 90, 30s, 5m, 12h or 30d, not {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite, non-negative duration, not {value!r}")
    return timedelta(seconds=seconds)


def positive_duration(value: timedelta | str | float | int, *, what: str = "duration") -> timedelta:
    """Like :func:`parse_duration`, but zero is refused too."""
    parsed = parse_duration(value, what=what)
    if parsed <= timedelta(0):
        raise ValueError(f"{what} must be a positive duration, not {value!r}")
    return parsed


NEVER = ("never", "off", "none")
"""Words that switch a duration setting off (as ``0`` does)."""


def optional_duration(
    value: timedelta | str | float | int | None, *, what: str = "duration"
) -> timedelta | None:
    """A duration that may be switched off: ``None``, ``0``, ``"never"``, ``"off"`` or ``"none"`` give ``None``;
    anything else as :func:`parse_duration`. For settings where "no limit" is a choice (``release_after_success``,
    ``keep_failed_for``)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in (*NEVER, "")):
        return None
    parsed = parse_duration(value, what=what)
    return parsed or None

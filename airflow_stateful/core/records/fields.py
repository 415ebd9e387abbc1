"""Typed, bounded reading of the JSON records this library stores: every record read back is untrusted.

Anyone who can write to the bucket (or a bug, or bit rot that keeps the JSON valid) can put anything into a
head, a manifest or a state document. Each field is therefore read with its type and bounds checked, and any
violation raises :class:`CheckpointCorruptError` naming the record and the field, before a single value is
used (to find objects, to compare epochs, or to be shown in a UI). ``bool`` never passes for an integer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError

MAX_TEXT = 1024
"""Longest free-text field (host names, versions, writer ids); longer is not something this library wrote."""
MAX_INT = 2**53
"""Largest integer a JSON reader in any language keeps exact."""

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class Fields:
    """Reads the fields of one decoded JSON object; every error names ``what`` (the record) and the field."""

    def __init__(self, body: Any, *, what: str) -> None:
        if not isinstance(body, Mapping):
            raise CheckpointCorruptError(f"{what} is not a JSON object")
        self.body = body
        self.what = what

    def bad(self, name: str, expected: str) -> CheckpointCorruptError:
        """The error for field ``name`` not being ``expected`` (its value shown, cut to 80 characters)."""
        value = repr(self.body.get(name))
        shown = value if len(value) <= 80 else value[:77] + "..."
        return CheckpointCorruptError(f"{self.what}: field {name!r} must be {expected}, not {shown}")

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def integer(
        self, name: str, *, minimum: int = 0, maximum: int = MAX_INT, default: int | None = None
    ) -> int:
        value = self.body.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.bad(name, f"an integer from {minimum} to {maximum}")
        return value

    def optional_integer(self, name: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int | None:
        return None if self.body.get(name) is None else self.integer(name, minimum=minimum, maximum=maximum)

    def optional_number(
        self, name: str, *, minimum: float = 0.0, maximum: float = float(MAX_INT)
    ) -> float | None:
        """A JSON number (integer or finite float) within bounds, as a float; ``None`` when absent."""
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= maximum:
            raise self.bad(name, f"a number from {minimum:g} to {maximum:g}")
        return float(value)

    def boolean(self, name: str, *, default: bool = False) -> bool:
        value = self.body.get(name, default)
        if not isinstance(value, bool):
            raise self.bad(name, "true or false")
        return value

    def text(
        self,
        name: str,
        *,
        max_len: int = MAX_TEXT,
        default: str | None = None,
        pattern: re.Pattern[str] | None = None,
    ) -> str:
        value = self.body.get(name, default)
        if not isinstance(value, str) or len(value) > max_len or "\x00" in value:
            raise self.bad(name, f"a string of at most {max_len} characters without NUL")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.bad(name, f"a string matching {pattern.pattern}")
        return value

    def optional_text(self, name: str, *, max_len: int = MAX_TEXT) -> str | None:
        return None if self.body.get(name) is None else self.text(name, max_len=max_len)

    def hex32(self, name: str) -> str:
        return self.text(name, max_len=32, pattern=_HEX32)

    def sha256(self, name: str) -> str:
        return self.text(name, max_len=64, pattern=_HEX64)

    def token(self, name: str) -> str:
        return self.text(name, max_len=128, pattern=_TOKEN)

    def time(self, name: str, *, default: str | None = None) -> str:
        """An ISO 8601 timestamp with a time zone, returned as the stored text."""
        value = self.text(name, max_len=40, default=default)
        if value == "" and default == "":
            return value
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise self.bad(name, "an ISO 8601 timestamp") from None
        if parsed.tzinfo is None:
            raise self.bad(name, "an ISO 8601 timestamp with a time zone")
        return value

    def optional_time(self, name: str) -> str | None:
        return None if self.body.get(name) is None else self.time(name)

    def items(self, name: str, *, max_items: int, default: list[Any] | None = None) -> list[Any]:
        value = self.body.get(name, default)
        if not isinstance(value, list) or len(value) > max_items:
            raise self.bad(name, f"a list of at most {max_items} items")
        return value

    def mapping(self, name: str, *, default: dict[str, Any] | None = None) -> dict[str, Any]:
        value = self.body.get(name, default)
        if not isinstance(value, dict):
            raise self.bad(name, "a JSON object")
        return value

    def optional_mapping(self, name: str) -> dict[str, Any] | None:
        return None if self.body.get(name) is None else self.mapping(name)

    def equal(self, name: str, expected: Any) -> Any:
        value = self.body.get(name)
        if value != expected:
            raise self.bad(name, repr(expected))
        return value

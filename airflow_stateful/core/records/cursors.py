"""Cursor records: where each ``resume()`` loop of a task stands, as a checkpoint stores it.

A checkpoint's ``extra["cursors"]`` maps a cursor's name to its record::

    {"items": {"position": 30, "last_key": "row-29", "fingerprint": {"items": 8, "sha256": "..."}}}

``position`` is the index just after the last finished item (so also the items done, for display);
``last_key`` is that item's key when the loop has ``key=`` (resuming by key), else ``None``; ``fingerprint``
is a SHA-256 over the first items (or keys) the loop saw, so that a resume can tell that the iterable
changed under it (:mod:`airflow_stateful.core.protocol.resume`). Checkpoints written before cursors had records
store a bare integer: it reads as a position-only cursor.

Cursors are read back from storage, so they are untrusted like every other field (see
:mod:`airflow_stateful.core.records.fields`): typed, bounded, and an error names the checkpoint and the cursor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError, InvalidValueError
from airflow_stateful.core.records.fields import MAX_INT, Fields

CURSORS = "cursors"
"""The key of ``Manifest.extra`` that holds the cursors."""
MAX_CURSORS = 50
"""Cursors one checkpoint may record (one per resume() loop of the task)."""
MAX_NAME = 200
"""Longest cursor name."""
MAX_KEY = 1000
"""Longest string item key; a longer one is refused when stored and when read."""
MAX_INT_KEY = 2**63
"""Integer item keys lie in [-2**63, 2**63): what a 64-bit database key holds."""
MAX_FINGERPRINT_ITEMS = 1000
"""Most items a stored fingerprint may cover (this version covers 8; the bound only keeps reads sane)."""

ItemKey = str | int


@dataclass(frozen=True)
class Fingerprint:
    """A SHA-256 over the canonical encoding of the first ``items`` items (or keys) of an iterable."""

    items: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "sha256": self.sha256}


@dataclass(frozen=True)
class Cursor:
    """One resume() loop's stored progress: the next position, the last finished key, the fingerprint."""

    position: int
    last_key: ItemKey | None = None
    fingerprint: Fingerprint | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "last_key": self.last_key,
            "fingerprint": None if self.fingerprint is None else self.fingerprint.to_json(),
        }

    def describe(self) -> str:
        """``30 (last 'row-29')`` or ``30``: the position, and the last key when there is one (capped)."""
        if self.last_key is None:
            return str(self.position)
        return f"{self.position} (last {shown_key(self.last_key)})"


def check_item_key(key: Any, *, position: int, cursor: str) -> ItemKey:
    """``key`` if it can be stored as an item key; else InvalidValueError naming the item and the type.

    Only ``str`` (at most :data:`MAX_KEY` characters, no NUL) and ``int`` (not ``bool``) keys: they compare
    exactly after a JSON round trip, which a float or a tuple would not.
    """
    where = f"resume(cursor={cursor!r}): key= of item {position}"
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InvalidValueError(f"{where} returned a {type(key).__name__}; a key must be a str or an int")
    if isinstance(key, int) and not -MAX_INT_KEY <= key < MAX_INT_KEY:
        raise InvalidValueError(f"{where} is an int outside [-2**63, 2**63)")
    if isinstance(key, str) and (len(key) > MAX_KEY or "\x00" in key):
        raise InvalidValueError(f"{where} is a str of {len(key)} characters; at most {MAX_KEY}, without NUL")
    return key


def shown_key(key: ItemKey, limit: int = 60) -> str:
    """A key for logs and tables: its repr, cut to ``limit`` characters."""
    text = repr(key)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_cursors(extra: Mapping[str, Any], *, what: str) -> dict[str, Cursor]:
    """The cursors a checkpoint's ``extra`` records (``{}`` without any); CheckpointCorruptError if malformed.

    ``what`` names the checkpoint in errors (``"checkpoint 7"``).
    """
    raw = extra.get(CURSORS)
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_CURSORS:
        raise CheckpointCorruptError(
            f"{what}: cursors must be a JSON object of at most {MAX_CURSORS} cursors"
        )
    cursors = {}
    for name, body in raw.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise CheckpointCorruptError(f"{what}: a cursor name must be 1-{MAX_NAME} characters")
        cursors[name] = _parse_cursor(body, what=f"{what}: cursor {name[:60]!r}")
    return cursors


def _parse_cursor(body: Any, *, what: str) -> Cursor:
    if isinstance(body, int) and not isinstance(body, bool):  # a checkpoint of an earlier version
        return Cursor(position=Fields({"position": body}, what=what).integer("position"))
    f = Fields(body, what=what)
    position = f.integer("position")
    last_key = body.get("last_key")
    if last_key is not None:
        if isinstance(last_key, str):
            last_key = f.text("last_key", max_len=MAX_KEY)
        elif isinstance(last_key, bool) or not isinstance(last_key, int):
            raise CheckpointCorruptError(f"{what}: field 'last_key' must be a string or an integer")
        elif not -MAX_INT_KEY <= last_key < MAX_INT_KEY:
            raise CheckpointCorruptError(f"{what}: field 'last_key' is an integer outside [-2**63, 2**63)")
    fingerprint = None
    if f.has("fingerprint"):
        fp = Fields(f.mapping("fingerprint"), what=f"{what}: fingerprint")
        # It covers items the loop had finished: never more than the position (a resume reads no further).
        fingerprint = Fingerprint(
            items=fp.integer("items", minimum=1, maximum=min(MAX_FINGERPRINT_ITEMS, position)),
            sha256=fp.sha256("sha256"),
        )
    return Cursor(position=position, last_key=last_key, fingerprint=fingerprint)


def cursors_to_json(cursors: Mapping[str, Cursor]) -> dict[str, Any]:
    """What ``extra["cursors"]`` stores for ``cursors``."""
    return {name: cursor.to_json() for name, cursor in cursors.items()}


def read_cursors(extra: Mapping[str, Any], *, what: str) -> tuple[dict[str, Cursor], str | None]:
    """The cursors of ``extra`` for display: ``(cursors, None)``, or ``({}, error)`` when they are malformed."""
    try:
        return parse_cursors(extra, what=what), None
    except CheckpointCorruptError as exc:
        return {}, str(exc)


def cursor_position(manifest: Any, name: str = "items") -> int | None:
    """The position of cursor ``name`` in a manifest (or its ``extra``), either record shape; None if absent."""
    extra = manifest if isinstance(manifest, Mapping) else manifest.extra
    what = f"checkpoint {getattr(manifest, 'seq', '?')}"
    cursor = parse_cursors(extra, what=what).get(name)
    return None if cursor is None else cursor.position


def items_done(cursors: Mapping[str, Cursor]) -> int | None:
    """The sum of the cursors' positions (items finished), or None without cursors."""
    if not cursors:
        return None
    return min(sum(c.position for c in cursors.values()), MAX_INT)


def cursor_rows(cursors: Mapping[str, Cursor]) -> list[dict[str, Any]]:
    """One display row per cursor, sorted by name: name, position, last key (as stored), fingerprint."""
    return [{"name": name, **cursors[name].to_json()} for name in sorted(cursors)]


def describe_cursors(cursors: Mapping[str, Cursor]) -> str:
    """``items=30 (last 'row-29'), pages=2`` for a table cell or a log line; ``-`` without cursors."""
    if not cursors:
        return "-"
    return ", ".join(f"{name[:60]}={cursors[name].describe()}" for name in sorted(cursors))

"""How a checkpoint's value is stored in its manifest: JSON by default, pickle only when asked for by name.

JSON keeps checkpoints readable by any version of any program, which is what upgrade-safe resume needs.
Pickle can run arbitrary code when loaded and breaks when classes move, so it is never chosen silently:
the writer must say ``value_codec="pickle"`` and so must every reader.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.records.canonical import canonical_json

JSON = "json"
PICKLE = "pickle"
CODECS = (JSON, PICKLE)


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise InvalidValueError(f"value_codec must be one of {', '.join(CODECS)}, not {codec!r}")
    return codec


def encode_value(value: Any, codec: str) -> Any:
    """The JSON-storable form of ``value``; InvalidValueError (before anything is written) if impossible."""
    check_codec(codec)
    if codec == PICKLE:
        import pickle

        try:
            return base64.b64encode(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
        except Exception as exc:
            raise InvalidValueError(f"checkpoint value cannot be pickled: {exc}") from exc
    try:
        canonical_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidValueError(
            f"checkpoint value is not JSON-serializable: {exc}. Store plain dicts, lists, strings, numbers, "
            "booleans and None (no NaN/Infinity); put binary data in files=, or opt in to "
            "value_codec='pickle'."
        ) from exc
    changed = json_round_trip_problem(value)
    if changed is not None:
        raise InvalidValueError(
            f"checkpoint value would not come back as it was saved: {changed}. A resumed task must read "
            "exactly what it wrote, so the value was not saved; convert it to plain JSON types (dict with "
            "str keys, list, str, int, float, bool, None) or opt in to value_codec='pickle'."
        )
    return value


_EXACT = (str, int, float, bool, type(None))


def json_round_trip_problem(value: Any) -> str | None:
    """Where ``value`` differs from what ``json.loads(json.dumps(value))`` gives back, or ``None``.

    ``json.dumps`` accepts more than it returns: a tuple comes back as a list, an ``int`` or ``float`` key
    as a string (``{1: "a"}`` -> ``{"1": "a"}``), a ``str``/``int`` subclass (an enum) as its plain base
    type. Saving such a value would hand the retry something else than the try had: refuse it instead.
    Iterative, so a deep value costs no recursion (the encoder already refused one too deep to encode).
    """
    stack: list[tuple[Any, str]] = [(value, "value")]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind is dict:
            for key, child in item.items():
                if type(key) is not str:
                    stored = next(iter(json.loads(json.dumps({key: None}))))
                    return f"{where} has the {type(key).__name__} key {key!r}, which JSON stores as the string {stored!r}"
                stack.append((child, f"{where}[{key!r}]"))
        elif kind is list:
            stack.extend((child, f"{where}[{n}]") for n, child in enumerate(item))
        elif kind not in _EXACT:
            base = (
                "list"
                if isinstance(item, (list, tuple))
                else "object"
                if isinstance(item, dict)
                else next((t.__name__ for t in _EXACT if isinstance(item, t)), "something else")
            )
            shown = repr(item)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return f"{where} is a {kind.__name__} ({shown}), which JSON gives back as a plain {base}"
    return None


def encoded_form(stored: Any, codec: str) -> Any:
    """Check a value already in its stored form (copied from a manifest), without decoding it."""
    check_codec(codec)
    if codec == PICKLE and not isinstance(stored, str):
        raise InvalidValueError(f"a pickled value is stored as base64 text, not {type(stored).__name__}")
    return encode_value(stored, JSON)


def decode_value(stored: Any, codec: str, *, allowed: str, where: str) -> Any:
    """The value of a manifest written with ``codec``, if the reader allows that codec."""
    if codec == JSON:
        return stored
    if codec == PICKLE:
        if allowed != PICKLE:
            raise InvalidValueError(
                f"{where} holds a pickled value; reading it runs code from the store. Set "
                "value_codec='pickle' on the reading task if you trust the writer."
            )
        import pickle

        return pickle.loads(base64.b64decode(stored))
    raise InvalidValueError(
        f"{where} uses the unknown value codec {codec!r}; upgrade airflow-provider-stateful."
    )

"""How a checkpoint's value is stored in its manifest: JSON by default, pickle only when asked for by name.

JSON keeps checkpoints readable by any version of any program, which is what upgrade-safe resume needs.
Pickle can run arbitrary code when loaded and breaks when classes move, so it is never chosen silently:
the writer must say ``value_codec="pickle"`` and so must every reader.
"""

from __future__ import annotations

import base64
from typing import Any

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.records import canonical_json

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
    except (TypeError, ValueError) as exc:
        raise InvalidValueError(
            f"checkpoint value is not JSON-serializable: {exc}. Store plain dicts, lists, strings, numbers, "
            "booleans and None (no NaN/Infinity); put binary data in files=, or opt in to "
            "value_codec='pickle'."
        ) from exc
    return value


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

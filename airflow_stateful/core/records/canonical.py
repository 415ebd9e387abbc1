"""The one byte form of every record this library hashes, signs or compares: canonical JSON, and its SHA-256.

Its own module, below every record module (heads, manifests, trees, outputs), so that each can use it without
importing another.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no NaN/Infinity (they are not JSON)."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

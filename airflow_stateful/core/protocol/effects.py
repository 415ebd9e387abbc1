"""Effect keys: one stable name per external effect of a task, for the systems that deduplicate by key.

A retry resumes from the last checkpoint, so whatever the task did between that checkpoint and the crash is
done again. For a sum that is harmless; for a row upserted into a warehouse, an HTTP call with an idempotency
header, a message with a deduplication id, the external system can drop the repeat, provided the retry sends
the *same* key as the try before it. An effect key is that key: derived from the identity (the same in every
try of one task instance, different for another run, task or map index) and a name the task chooses per
effect (``f"invoice-{n}"``), so no key needs to be stored anywhere.

The key is a hash, not the identity itself: identities hold DAG, task and run ids that an external system has
no business seeing, and may be longer or use characters its keys do not allow. It is not a secret (anyone who
knows the identity and the name can compute it); it only has to be stable and unique.
"""

from __future__ import annotations

import hashlib

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.records.identity import Identity

MAX_NAME = 512
"""Longest effect name: a name is a label chosen by code, not data."""
PREFIX = "stateful-"
DIGEST_CHARS = 40
"""160 bits of SHA-256, as hex: unique among any number of effects a fleet makes, and 49 characters in all,
within the limits of common idempotency keys (Stripe 255, SQS deduplication ids 128, Kafka transactional ids)."""


def effect_key(identity: Identity, name: str) -> str:
    """The key of the effect ``name`` of ``identity``: ``stateful-`` and 40 lowercase hex digits.

    Equal for the same identity and name in every try (and every process, release and machine: it depends on
    nothing else); different for another name or identity. Raises :class:`InvalidValueError` naming a bad name
    (not a string, empty, longer than 512 characters, or holding control characters).
    """
    if not isinstance(name, str):
        raise InvalidValueError(f"an effect name must be a string, not {type(name).__name__} {name!r}")
    if not name or len(name) > MAX_NAME or any(ord(c) < 32 or ord(c) == 127 for c in name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise InvalidValueError(
            f"effect name {shown!r} must be 1 to {MAX_NAME} characters without control characters"
        )
    material = f"airflow-stateful effect key v1\n{identity.key}\n{name}".encode()
    return PREFIX + hashlib.sha256(material).hexdigest()[:DIGEST_CHARS]

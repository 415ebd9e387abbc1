"""Keyed integrity for head records: tell a head written by this deployment from one anybody could write.

A head's ``checksum`` is an unkeyed SHA-256: it catches damage, not forgery (whoever can write to the bucket
can compute it too). With a signing key configured (``[stateful] signing_conn_id``: an Airflow connection,
so any secrets backend can hold it), every head this deployment writes also carries an HMAC-SHA256 of its
body, and every reader verifies it. Heads refer to their manifests by SHA-256, and manifests to their data,
so a verified head vouches for the whole checkpoint.

Every head is signed with a key of its own identity: ``HMAC-SHA256(deployment key, identity key)``
(:meth:`HeadSigner.for_identity`). A worker holds the deployment key and derives the key of whichever identity
it reads or writes; a Kubernetes pod is given only the derived key of the one identity it works on, so a key
taken from a pod signs nothing for any other identity (and never reveals the deployment key).

``required`` decides what a reader does with a head that has no signature (written before signing was turned
on, or by a writer without the key, or forged): refuse it, or accept it as before. A signature made with
another key id is refused when required and accepted with a warning otherwise (a key rotation in progress).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError, ConfigurationError

log = logging.getLogger("airflow_stateful")

SIGNATURE_FIELD = "signature"
_KEY_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_DERIVATION = b"airflow-stateful head key v1\x00"
"""What a derived key is the HMAC of, before the identity key: names the purpose and the scheme's version."""


@dataclass(frozen=True)
class HeadSigner:
    """Signs the heads a writer stores and verifies the heads a reader loads.

    :param key: the secret (at least 16 bytes); never shown in a repr, a log or an error.
    :param key_id: a public name for the key, stored beside each signature (rotation, diagnostics).
    :param required: refuse heads without a valid signature by this key.
    :param identity: the identity key this key belongs to, when it is a derived key (a pod's); ``None`` for
        the deployment key, from which every identity's key is derived.
    """

    key: bytes = field(repr=False)
    key_id: str
    required: bool = False
    identity: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < 16:
            raise ConfigurationError(
                "the head signing key must be at least 16 bytes (the value is not shown)"
            )
        if not isinstance(self.key_id, str) or not _KEY_ID.fullmatch(self.key_id):
            raise ConfigurationError(
                f"the head signing key id must be 1-64 letters, digits or . _ : -, not {self.key_id!r}"
            )

    def for_identity(self, identity: str) -> HeadSigner:
        """The signer of ``identity``'s heads: the key derived for it from the deployment key (hex text, so it
        can travel through a Kubernetes Secret into an environment variable), or this signer if it already is
        that identity's. A derived key cannot serve another identity: :class:`ConfigurationError`."""
        if self.identity is not None:
            if self.identity != identity:
                raise ConfigurationError(
                    f"this head signing key belongs to identity {self.identity!r} only; it cannot sign or verify "
                    f"the heads of {identity!r}"
                )
            return self
        derived = hmac.new(self.key, _DERIVATION + identity.encode("utf-8"), hashlib.sha256).hexdigest()
        return HeadSigner(
            key=derived.encode("ascii"), key_id=self.key_id, required=self.required, identity=identity
        )

    def mac(self, payload: bytes) -> str:
        return hmac.new(self.key, payload, hashlib.sha256).hexdigest()

    def sign(self, payload: bytes) -> dict[str, str]:
        """The signature of a head body (its canonical JSON without checksum and signature)."""
        return {"key_id": self.key_id, "hmac_sha256": self.mac(payload)}

    def verify(self, signature: Any, payload: bytes, *, what: str) -> None:
        """Raise CheckpointCorruptError unless ``signature`` is this key's over ``payload`` (or may be absent)."""
        if signature is None:
            if self.required:
                raise CheckpointCorruptError(
                    f"{what} carries no signature, and this deployment requires heads signed with key "
                    f"{self.key_id!r}: it was written without the key (or forged). Its state was not used."
                )
            return
        if not isinstance(signature, dict) or not isinstance(signature.get("hmac_sha256"), str):
            raise CheckpointCorruptError(f"{what} has a malformed signature")
        key_id = signature.get("key_id")
        if key_id != self.key_id:
            if self.required:
                raise CheckpointCorruptError(
                    f"{what} is signed with key {str(key_id)[:64]!r}, not this deployment's {self.key_id!r}; its "
                    "state was not used."
                )
            log.warning(
                "%s is signed with another key (%r); accepted: signatures are not required", what, key_id
            )
            return
        if not hmac.compare_digest(signature["hmac_sha256"], self.mac(payload)):
            raise CheckpointCorruptError(
                f"{what}'s signature does not verify with key {self.key_id!r}: it was altered or forged by someone "
                "who could write to the store but does not hold the key. Its state was not used."
            )

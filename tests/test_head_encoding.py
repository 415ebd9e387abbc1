"""A head record's bytes are ``canonical_json`` of its body with its checksum (issue 32's small commit).

``HeadRecord.to_bytes`` encodes the checkpoints once and splices that text into the signed form, the checksummed
form and the record, instead of encoding the whole body up to three times. The bytes must stay exactly what the
whole-body encoding gives: readers verify the checksum against ``canonical_json`` of what they parsed, and a
signer's HMAC against the same. Heads come from real commits on a local store: values of every JSON kind,
unicode and escapes, inline manifests and a manifest object, a lease and none, with and without a signer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.integrity import SIGNATURE_FIELD, HeadSigner
from airflow_stateful.core.stores.local import LocalObjectStore


def whole_body_encoding(head: HeadRecord, signer: HeadSigner | None) -> bytes:
    """The record as the body encoded whole, each time: the oracle."""
    body: dict[str, Any] = {
        "format": head.format,
        "identity": head.identity,
        "epoch": head.epoch,
        "next_seq": head.next_seq,
        "lease": head.lease.to_json() if head.lease else None,
        "checkpoints": [c.to_json() for c in head.checkpoints],
        "updated_at": head.updated_at,
    }
    if head.outcome is not None:
        body["outcome"] = head.outcome.to_json()
    if signer is not None:
        body[SIGNATURE_FIELD] = signer.sign(canonical_json(body))
    body["checksum"] = sha256_hex(canonical_json(body))
    return canonical_json(body) + b"\n"


VALUES: list[Any] = [
    None, 0, -1, 2**62, 1.5, "", 'q"uo\\te', "ünï\u2028código 🙂", "\x00\x1f", [], {}, {"z": 1, "a": [1, {"b": None}]},
    {"big": "x" * 40_000},  # large enough for a manifest object of its own rather than inline
]  # fmt: skip


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_head_is_stored_as_the_canonical_json_of_its_body(signed: bool, tmp_path: Path) -> None:
    signer = HeadSigner(key=b"k" * 32, key_id="test-1") if signed else None
    store = LocalObjectStore(root=tmp_path / "b", fsync=False)
    cs = CheckpointStore(
        store=store,
        identity=Identity.for_task(dag_id="e", task_id="t", name="unicode"),
        signer=signer,
        keep_last=4,
    )
    lease = cs.acquire()
    seen = 0
    for n, value in enumerate(VALUES):
        cs.commit(lease, value, extra={"n": n, "note": VALUES[n % 7]})
        head = cs.head()
        assert head is not None
        stored = store.get(cs.heads.key).data
        used = cs.heads.signer  # the identity's key, derived from the deployment's
        assert head.to_bytes(used) == whole_body_encoding(head, used) == stored
        assert HeadRecord.from_bytes(stored, key=cs.heads.key, signer=used) == head
        seen += 1
    cs.release(lease)
    head = cs.head()
    assert head is not None and head.lease is None
    assert (
        head.to_bytes(cs.heads.signer)
        == whole_body_encoding(head, cs.heads.signer)
        == store.get(cs.heads.key).data
    )
    assert json.loads(head.to_bytes(cs.heads.signer))["checksum"]
    assert seen == len(VALUES)

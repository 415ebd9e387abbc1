"""Finding the identities in a backend: every key that ends in ``/~head.json`` is one."""

from __future__ import annotations

from collections.abc import Iterator

from airflow_stateful.core.identity import Identity
from airflow_stateful.core.records import HEAD_NAME
from airflow_stateful.core.stores.base import ObjectInfo, ObjectStore

_SUFFIX = f"/{HEAD_NAME}"


def list_identities(store: ObjectStore, prefix: str = "") -> Iterator[tuple[Identity, ObjectInfo]]:
    """Identities whose key starts with ``prefix``, with their head object's listing entry, in key order.

    Objects of the library's own top-level folders (``~task-state/``, ``~asset-state/``) and keys that are
    not valid identities (written by something else) are skipped.
    """
    for info in store.list_objects(prefix):
        if not info.key.endswith(_SUFFIX) or info.key.startswith("~"):
            continue
        key = info.key[: -len(_SUFFIX)]
        try:
            identity = Identity.parse(key)
        except ValueError:
            continue
        yield identity, info

"""Test helpers for leases under maintenance: GC running in a loop beside a writer, a reference check, and a
store that can be taken down.

``GcLoop`` runs the real store-wide GC (plan, then apply) over and over in a thread, exactly what
``airflow-stateful gc`` or the maintenance DAG does on a schedule, only without pause; after every pass it
checks that no checkpoint any head lists has lost an object.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ObjectNotFoundError,
    StoreError,
)
from airflow_stateful.core.fleet.gc import apply_gc, group_by_identity, plan_gc
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.stores.base import Blob, ObjectInfo, ObjectStore, ProgressCallback, StoredFile


def missing_references(store: ObjectStore, identity: Identity) -> list[str]:
    """Objects that a checkpoint still listed by the identity's head needs but the store no longer holds.

    The head is read twice, before and after looking for the objects: an object may legitimately vanish
    after its checkpoint was dropped from the head (retention), so only an object of a checkpoint that the
    *later* head still lists counts as missing.
    """
    cs = CheckpointStore(store=store, identity=identity)
    head = cs.head()
    if head is None:
        return []
    absent: dict[str, list[str]] = {}
    present = {info.key for info in store.list_objects(f"{identity.key}/")}
    for entry in head.checkpoints:
        needed = [entry.manifest] if entry.manifest else []
        needed += [entry.tree.key] if entry.tree else []
        needed += [entry.outputs_tree.key] if entry.outputs_tree else []
        # Pruned meanwhile (the second head read decides) or missing (then the manifest is reported).
        with contextlib.suppress(CheckpointNotFoundError, ObjectNotFoundError, CheckpointCorruptError):
            manifest = cs.get(entry.seq)
            needed += [key for f in cs.files(manifest) for key in f.keys]
            for name in manifest.outputs:  # published outputs are referenced like the checkpoint's own files
                needed += [c.key for f in cs.output_files(manifest, name) for c in f.chunks]
        absent[entry.commit_id] = [key for key in needed if key not in present]
    after = cs.head()
    still = {e.commit_id for e in after.checkpoints} if after else set()
    return sorted(key for commit_id, keys in absent.items() if commit_id in still for key in keys)


@dataclass
class GcLoop:
    """Store-wide GC, plan then apply, in a loop in a thread, with a reference check after every pass."""

    store: ObjectStore
    keep_last: int | None = 1
    idle_for: timedelta | None = None
    grace: float = 0.5
    passes: int = 0
    applied: int = 0
    errors: list[str] = field(default_factory=list)
    renewals: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> GcLoop:
        self._thread = threading.Thread(target=self._run, name="gc-loop", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                groups = group_by_identity(self.store)
                plan = plan_gc(
                    self.store,
                    keep_last=self.keep_last,
                    idle_for=self.idle_for,
                    min_age=timedelta(0),
                    grace=self.grace,
                    expired_state=False,
                    groups=groups,
                )
                self.applied += len(apply_gc(plan).deleted)
                for key in groups:
                    head = CheckpointStore(store=self.store, identity=Identity.parse(key)).head()
                    if head is not None and head.lease is not None:
                        self.renewals.add(head.lease.last_renewed)
                    for missing in missing_references(self.store, Identity.parse(key)):
                        self.errors.append(f"pass {self.passes}: {missing} is referenced but deleted")
            except StoreError as exc:  # an outage a test injected on purpose; GC retries next pass
                self.errors.append(f"store error (expected only during an outage): {exc}")
            except Exception:
                self.errors.append(traceback.format_exc())
            self.passes += 1
            time.sleep(0.05)

    def deletion_errors(self) -> list[str]:
        return [e for e in self.errors if not e.startswith("store error")]


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def keys(store: ObjectStore, prefix: str = "") -> set[str]:
    return {info.key for info in store.list_objects(prefix)}


def head_key(identity: Identity) -> str:
    return f"{identity.key}/{HEAD_NAME}"


class OutageStore(ObjectStore):
    """A real store behind a switch: while ``down`` every call fails as an unreachable endpoint would.

    For the local directory, which has no network to cut; S3 tests cut a real TCP path instead
    (:class:`netproxy.TcpProxy`).
    """

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.down = threading.Event()

    def _check(self) -> None:
        if self.down.is_set():
            raise StoreError(f"cannot reach {self.url}: ConnectionError: the store is unreachable (injected)")

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        self._check()
        return self.inner.get(key, max_bytes=max_bytes)

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        adopt_identical: bool = True,
    ) -> str:
        self._check()
        return self.inner.put(
            key, data, if_none_match=if_none_match, if_match=if_match, adopt_identical=adopt_identical
        )

    def upload_file(self, key: str, path: Path, *, progress: ProgressCallback | None = None) -> StoredFile:
        self._check()
        return self.inner.upload_file(key, path, progress=progress)

    def download_file(
        self, key: str, dest: Path, *, size: int, sha256: str, progress: ProgressCallback | None = None
    ) -> None:
        self._check()
        self.inner.download_file(key, dest, size=size, sha256=sha256, progress=progress)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        self._check()
        return self.inner.list_objects(prefix)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        self._check()
        self.inner.delete(key, if_match=if_match)

    def delete_many(self, keys: Iterable[str]) -> None:
        self._check()
        self.inner.delete_many(keys)


def rewrite_latest_tree(
    store: ObjectStore, identity: Identity, change: Callable[[dict[str, Any]], None]
) -> None:
    """Change the file tree of the newest checkpoint as someone with write access to the bucket could: the tree
    is written under its new content name and every hash on the way up (manifest, head) is recomputed, so only
    the library's own checks of the *content* can catch it.

    The newest checkpoint must have a manifest object (commit a value too big to ride inline).
    """
    head_key = f"{identity.key}/~head.json"
    head = json.loads(store.get(head_key).data)
    entry = head["checkpoints"][-1]
    manifest = json.loads(store.get(entry["manifest"]).data)
    tree = json.loads(store.get(manifest["tree"]["key"]).data)
    change(tree)
    data = canonical_json(tree) + b"\n"
    sha = sha256_hex(data)
    ref = {**manifest["tree"], "key": f"{identity.key}/~trees/{sha}.json", "sha256": sha, "size": len(data)}
    store.put(ref["key"], data)
    manifest["tree"] = entry["tree"] = ref
    body = canonical_json(manifest) + b"\n"
    store.put(entry["manifest"], body)
    entry["manifest_sha256"], entry["manifest_size"] = sha256_hex(body), len(body)
    head.pop("checksum", None)
    head["checksum"] = sha256_hex(canonical_json(head))
    store.put(head_key, canonical_json(head))


BALLAST = ["x" * 100] * 100
"""A value part too big to ride inline in the head: the checkpoint gets a manifest object."""

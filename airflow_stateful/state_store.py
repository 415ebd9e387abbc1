"""Airflow's task and asset state store (``context["task_state_store"]``, Airflow 3.3+) on our object stores.

:class:`S3StateStoreBackend` keeps every value as a small JSON document in the store of
``[stateful] backend_url`` (S3 or any S3-compatible endpoint, with the ``[stateful] conn_id`` connection; or a
local directory), below two folders of that store's root::

    <prefix>/~task-state/<dag_id>/<run_id>/<task_id>/map=<map_index>/<key>.json
    <prefix>/~asset-state/name=<asset name>/<key>.json     (worker side: asset by name)
    <prefix>/~asset-state/uri=<asset uri>/<key>.json       (worker side: asset by URI)
    <prefix>/~asset-state/id=<asset id>/<key>.json         (server side: Airflow's asset id)

Every part is percent-encoded, and a key is always one object name (``connector/offset`` is the object
``connector%2Foffset.json``; :mod:`airflow_stateful.core.protocol.state_documents` has the format). Unlike a plain
overwrite, every write is conditional (create-if-absent, else compare-and-swap on the ETag), so concurrent
writers never tear a value or lose a write silently, and each document carries the ``expires_at`` Airflow
computed, which :func:`~airflow_stateful.core.protocol.state_documents.collect_expired` (and
:meth:`S3StateStoreBackend.cleanup`) honours.

Users configure the class by its path, ``airflow_stateful.state_store.S3StateStoreBackend``, in airflow.cfg.

Airflow instantiates the class with no arguments, in two places (see docs/state-store.md):

* ``[state_store] backend``: the API server's execution API stores *every* value here instead of the
  metadata database (``get``/``set``/``delete``/``clear`` with ``TaskScope`` or ``AssetScope(asset_id=...)``).
* ``[workers] state_store_backend``: the worker writes the value here itself
  (``serialize_*_to_ref``) and the database keeps only the reference ``<store url>/<object key>``; Airflow
  then does not tell the backend when the value expires, so these documents carry ``expires_at: null``.

Both may be set at once: the server then recognises the reference to its own document and records the
expiry in it (``by_ref: true``) instead of storing the reference as a second value.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from datetime import datetime
from typing import Any, cast

from airflow_stateful.core.errors import ConfigurationError, InvalidValueError, ObjectNotFoundError
from airflow_stateful.core.protocol.state_documents import (
    ASSET_STATE_DIR,
    MAX_CAS_ATTEMPTS,
    SUFFIX,
    TASK_STATE_DIR,
    ExpiryReport,
    KeyValueStore,
    StateDocument,
    asset_prefix,
    check_json_text,
    collect_expired,
    object_key,
    task_prefix,
)
from airflow_stateful.core.stores.base import ObjectStore


def _needs_airflow_3_3() -> str:
    try:
        from importlib.metadata import version

        installed = f"apache-airflow {version('apache-airflow')}"
    except Exception:
        installed = "no apache-airflow distribution"
    return (
        "S3StateStoreBackend (airflow_stateful.state_store) needs Apache Airflow 3.3 or newer: it implements "
        f"the task and asset state store (airflow.sdk.state) added in 3.3, and this environment has "
        f"{installed}. Upgrade with pip install 'apache-airflow>=3.3'. (@stateful_task and the operators work "
        "without it.)"
    )


try:
    from airflow.sdk.state import AssetScope, BaseStoreBackend, TaskScope
except ImportError as exc:
    raise ImportError(_needs_airflow_3_3()) from exc

# airflow-core and the task SDK each vendor their own copy of the state classes: the API server loads
# ``[state_store] backend`` with ``issubclass(cls, airflow._shared.state.BaseStoreBackend)`` and passes
# ``airflow._shared.state`` scopes, while workers use ``airflow.sdk.state``. The copies are distinct classes,
# so this backend accepts the scopes of both and registers itself with the core's ABC (when airflow-core is
# installed; a worker with only the task SDK has no such module).
_TASK_SCOPES: tuple[type, ...] = (TaskScope,)
_ASSET_SCOPES: tuple[type, ...] = (AssetScope,)
_CORE_BASE: Any = None
try:
    from airflow._shared import state as _core_state
except ImportError:  # pragma: no cover - a worker without airflow-core
    pass
else:
    if _core_state.BaseStoreBackend is not BaseStoreBackend:
        _TASK_SCOPES += (_core_state.TaskScope,)
        _ASSET_SCOPES += (_core_state.AssetScope,)
        _CORE_BASE = _core_state.BaseStoreBackend

__all__ = ["ExpiryReport", "S3StateStoreBackend", "collect_expired"]

log = logging.getLogger(__name__)

#: The marker Airflow's worker wraps a reference in before it stores it (``_EXTERNAL_STATE_REF_KEY`` in
#: airflow/sdk/execution_time/context.py); the server-side backend sees it inside the JSON text it is given.
AIRFLOW_REF_KEY = "__airflow_state_ref__"

Scope = TaskScope | AssetScope


class S3StateStoreBackend(BaseStoreBackend):
    """Task and asset state in S3 (or a local directory), with conditional writes and expiry.

    Configure it as ``[state_store] backend`` (server side), ``[workers] state_store_backend`` (worker side)
    or both; Airflow builds it without arguments, and it then opens the store of ``[stateful] backend_url``
    with the credentials of ``[stateful] conn_id``.

    :param store: an open object store to use instead (any :class:`ObjectStore`; tests, scripts).
    :param backend_url: ``s3://bucket/prefix`` or ``file:///path``; default ``[stateful] backend_url``.
    :param conn_id: Airflow connection with the S3 credentials; default ``[stateful] conn_id``.
    :param max_attempts: compare-and-swap rounds before a write on a key other writers keep changing fails.
    """

    def __init__(
        self,
        *,
        store: ObjectStore | None = None,
        backend_url: str | None = None,
        conn_id: str | None = None,
        max_attempts: int = MAX_CAS_ATTEMPTS,
    ) -> None:
        super().__init__()
        if store is None:
            from airflow_stateful.hooks.state import StateHook

            store = StateHook(backend_url=backend_url, conn_id=conn_id).get_store()
        elif backend_url is not None or conn_id is not None:
            raise ConfigurationError("give either store or backend_url/conn_id, not both")
        self.store = store
        self.kv = KeyValueStore(store=store, max_attempts=max_attempts)
        self._ref_root = store.url.rstrip("/") + "/"
        log.debug("task and asset state store at %s", store.url)

    def __repr__(self) -> str:
        return f"S3StateStoreBackend(store={self.store!r})"

    # -- layout --------------------------------------------------------------------------------------------
    @staticmethod
    def scope_prefix(scope: Scope, *, all_map_indices: bool = False) -> str:
        """The folder of a scope (``all_map_indices``: every map index of a ``TaskScope``'s task)."""
        if isinstance(scope, _TASK_SCOPES):
            task = cast(TaskScope, scope)
            return task_prefix(
                dag_id=task.dag_id,
                run_id=task.run_id,
                task_id=task.task_id,
                map_index=None if all_map_indices else task.map_index,
            )
        if isinstance(scope, _ASSET_SCOPES):
            asset = cast(AssetScope, scope)
            return asset_prefix(name=asset.name, uri=asset.uri, asset_id=asset.asset_id)
        raise TypeError(f"scope must be a TaskScope or an AssetScope, not {type(scope).__name__}")

    def object_key(self, scope: Scope, key: str) -> str:
        """The object (below the store's root) that holds ``key`` of ``scope``."""
        return object_key(self.scope_prefix(scope), key)

    def _key_from_ref(self, ref: str, *, top: str) -> str:
        if not isinstance(ref, str) or not ref.startswith(self._ref_root):
            raise ConfigurationError(
                f"state reference {ref!r} does not point into this backend's store {self.store.url}; was it "
                "written with another [stateful] backend_url? Configure the same one on every worker."
            )
        key = ref[len(self._ref_root) :]
        if not key.startswith(f"{top}/") or not key.endswith(SUFFIX):
            raise ConfigurationError(f"state reference {ref!r} is not a {top} document of this backend.")
        return key

    # -- server side: the execution API stores every value here ------------------------------------------
    def get(self, scope: Scope, key: str, *, session: Any = None) -> str | None:
        """The value of ``key`` as JSON text, or ``None``. Expired values stay readable until GC runs."""
        okey = self.object_key(scope, key)
        doc = self.kv.read(okey)
        if doc is None:
            return None
        if doc.by_ref:
            # Written by a worker-side instance of this backend: hand back the reference, as the metadata
            # database would, so the worker resolves it through deserialize_*_from_ref.
            return json.dumps({AIRFLOW_REF_KEY: self._ref_root + okey})
        return doc.value

    def set(
        self,
        scope: Scope,
        key: str,
        value: str,
        *,
        expires_at: datetime | None = None,
        session: Any = None,
    ) -> None:
        """Store ``value`` (JSON text) with a conditional write; ``expires_at`` ``None`` never expires."""
        okey = self.object_key(scope, key)
        check_json_text(value, key=key)
        if self._is_own_ref(value, okey):
            # Both sides run this backend: the worker already wrote the value to okey and Airflow now asks
            # the server to store the reference. Record the expiry in that document instead.
            def adopt(current: StateDocument | None) -> StateDocument:
                if current is None:
                    raise ObjectNotFoundError(
                        f"the worker's state document {okey!r} in {self.store.url} disappeared before the "
                        "server recorded its reference; set the key again."
                    )
                return replace(current, expires_at=expires_at, by_ref=True)

            self.kv.update(okey, adopt)
            return
        self.kv.write(okey, value, expires_at=expires_at)

    def _is_own_ref(self, value: str, okey: str) -> bool:
        if AIRFLOW_REF_KEY not in value:
            return False
        parsed = json.loads(value)
        return isinstance(parsed, dict) and parsed == {AIRFLOW_REF_KEY: self._ref_root + okey}

    def delete(self, scope: Scope, key: str, *, session: Any = None) -> None:
        """Remove ``key``; a missing key is not an error."""
        self.kv.delete(self.object_key(scope, key))

    def clear(self, scope: Scope, *, all_map_indices: bool = False, session: Any = None) -> None:
        """Remove every key of the scope (of every map index of the task with ``all_map_indices``)."""
        self.kv.clear(self.scope_prefix(scope, all_map_indices=all_map_indices))

    # The object stores are synchronous; the async variants run them in a worker thread.
    async def aget(self, scope: Scope, key: str, *, session: Any = None) -> str | None:
        return await asyncio.to_thread(self.get, scope, key)

    async def aset(
        self,
        scope: Scope,
        key: str,
        value: str,
        *,
        expires_at: datetime | None = None,
        session: Any = None,
    ) -> None:
        await asyncio.to_thread(self.set, scope, key, value, expires_at=expires_at)

    async def adelete(self, scope: Scope, key: str, *, session: Any = None) -> None:
        await asyncio.to_thread(self.delete, scope, key)

    async def aclear(self, scope: Scope, *, all_map_indices: bool = False, session: Any = None) -> None:
        await asyncio.to_thread(self.clear, scope, all_map_indices=all_map_indices)

    def cleanup(self) -> None:
        """Delete the documents whose ``expires_at`` has passed (see :func:`collect_expired`)."""
        report = collect_expired(self.store)
        log.info(
            "state store cleanup in %s: %d expired document(s) deleted of %d scanned",
            self.store.url,
            len(report.deleted),
            report.scanned,
        )

    # -- worker side: the worker writes the value, the database keeps the reference ---------------------
    def _write_by_ref(self, okey: str, value: Any, key: str) -> str:
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidValueError(
                f"the value of state key {key!r} is not JSON-serialisable: {exc}"
            ) from None
        check_json_text(text, key=key)  # the size limit, before anything is written

        def put(current: StateDocument | None) -> StateDocument:
            # Airflow does not pass the expiry to this side: keep it open until the server (if it runs this
            # backend too) records it. Keep by_ref so a concurrent server read still returns the reference.
            return StateDocument(value=text, expires_at=None, by_ref=current.by_ref if current else False)

        self.kv.update(okey, put)
        return self._ref_root + okey

    def _read_by_ref(self, ref: str, *, top: str) -> Any:
        okey = self._key_from_ref(ref, top=top)
        doc = self.kv.read(okey)
        if doc is None:
            log.warning("state document %r is gone from %s; returning None", okey, self.store.url)
            return None
        return json.loads(doc.value)

    def serialize_task_state_store_to_ref(self, *, value: Any, key: str, scope: TaskScope) -> str:
        return self._write_by_ref(self.object_key(scope, key), value, key)

    def deserialize_task_state_store_from_ref(self, stored: str) -> Any:
        return self._read_by_ref(stored, top=TASK_STATE_DIR)

    def serialize_asset_state_store_to_ref(self, *, value: Any, key: str, scope: AssetScope) -> str:
        return self._write_by_ref(self.object_key(scope, key), value, key)

    def deserialize_asset_state_store_from_ref(self, stored: str) -> Any:
        return self._read_by_ref(stored, top=ASSET_STATE_DIR)


if _CORE_BASE is not None:
    _CORE_BASE.register(S3StateStoreBackend)

"""A store's contract, tried on the store itself: write, read back, list and delete one probe object, and see
that both conditional writes the commit protocol stands on are enforced.

The protocol is only as safe as the store's conditions: ``put(..., if_none_match=True)`` must refuse a key that
exists and ``put(..., if_match=etag)`` a stale ETag. Some S3-compatible servers accept both headers and ignore
them (npm's s3rver does); every write then succeeds, so nothing fails until two writers overwrite each other's
heads and a fenced zombie's commit lands. :func:`probe_store` asks the store directly, so a deployment learns it
before its first task runs (``airflow-stateful check``).

The probe object lives under :data:`PROBE_PREFIX`, a ``~`` name at the store's root: no identity segment may
hold ``~`` (:mod:`airflow_stateful.core.records.identity`), so it can never be an identity's object, and
listings of identities and GC skip it. It is deleted before the probe returns, whatever happened.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from airflow_stateful.core.errors import ObjectNotFoundError, PreconditionFailedError, StatefulError
from airflow_stateful.core.stores.base import ObjectStore

PROBE_PREFIX = "~check/"
"""Where probe objects live, relative to the store's root."""

OK, FAIL, WARN, SKIP = "ok", "FAIL", "warn", "skip"

FENCING_UNSAFE = (
    "fencing is NOT safe on this endpoint: two writers can both take an identity and a fenced (zombie) try's "
    "commit can overwrite newer state"
)
CONDITIONAL_FIX = (
    "use an endpoint that enforces conditional writes (AWS S3, SeaweedFS, current MinIO releases): "
    "endpoint_url in the connection's extra, or backend_url"
)


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``status`` is :data:`OK`, :data:`FAIL`, :data:`WARN` or :data:`SKIP`; ``fix`` says
    what to change when it failed (``None`` when the detail says it already)."""

    check: str
    status: str
    detail: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def describe_error(exc: Exception) -> str:
    """The library's errors say what happened and what to do; anything else is named by its type too."""
    return str(exc) if isinstance(exc, StatefulError) else f"{type(exc).__name__}: {exc}"


def probe_store(store: ObjectStore, *, fix: str | None = None) -> list[Finding]:
    """Probe ``store`` with one object under :data:`PROBE_PREFIX`; one finding per check, in order: ``reach``
    (a listing, before anything is written), ``write``, ``read``, ``list``, ``if-none-match``, ``if-match``,
    ``delete``. A failed listing or write ends the probe (nothing was stored to go on with).

    :param fix: what to fix when a request raised (the caller knows the settings' names: the store does not);
        ``None``: the error's message says it.
    """
    key = f"{PROBE_PREFIX}probe-{uuid.uuid4().hex}"
    findings: list[Finding] = []

    def failed(check: str, exc: Exception) -> None:
        findings.append(Finding(check, FAIL, describe_error(exc), fix))

    def body(n: int) -> bytes:
        return f"airflow-stateful check probe {n} of {key}\n".encode()

    try:
        # Before anything is written: some servers (SeaweedFS) create a missing bucket on the first PutObject,
        # which would hide a mistyped bucket name; a listing answers NoSuchBucket.
        for _ in store.list_objects(PROBE_PREFIX):
            break
    except Exception as exc:
        failed("reach", exc)
        return findings
    findings.append(Finding("reach", OK, f"listed {store.url}: it exists and may be listed"))
    try:
        first = store.put(key, body(1), if_none_match=True, adopt_identical=False)
    except PreconditionFailedError:
        detail = (
            f"creating the new, random key {key} with If-None-Match: * was refused as if it existed: the "
            "endpoint does not implement conditional writes as S3 does"
        )
        findings.append(Finding("write", FAIL, detail, CONDITIONAL_FIX))
        return findings
    except Exception as exc:
        failed("write", exc)
        return findings
    findings.append(
        Finding(
            "write", OK, f"created {key} in {store.url} (a create-if-absent write: If-None-Match: * on S3)"
        )
    )
    try:
        _probe_written(store, key, first, body, findings, failed)
    finally:
        deleted = _delete(store, key, findings, failed)
        if not deleted:
            try:  # best effort: never leave the probe behind
                store.delete(key)
            except Exception:
                findings.append(Finding("cleanup", WARN, f"could not delete {key}; delete it by hand"))
    return findings


def _probe_written(
    store: ObjectStore,
    key: str,
    first: str,
    body: Callable[[int], bytes],
    findings: list[Finding],
    failed: Callable[[str, Exception], None],
) -> None:
    try:
        blob = store.get(key)
    except Exception as exc:
        failed("read", exc)
        return
    if blob.data != body(1):
        findings.append(Finding("read", FAIL, f"read {key} back with other bytes than were written"))
    else:
        findings.append(Finding("read", OK, f"read {key} back, {len(blob.data)} bytes as written"))
    try:
        listed = any(info.key == key for info in store.list_objects(PROBE_PREFIX))
    except Exception as exc:
        failed("list", exc)
    else:
        if listed:
            findings.append(
                Finding("list", OK, f"listed {PROBE_PREFIX} and found the probe (ls, du, gc list)")
            )
        else:
            findings.append(Finding("list", FAIL, f"a listing of {PROBE_PREFIX} does not show {key}"))
    # If-None-Match: * on a key that exists must be refused.
    try:
        store.put(key, body(2), if_none_match=True, adopt_identical=False)
    except PreconditionFailedError:
        findings.append(
            Finding(
                "if-none-match",
                OK,
                "a create-if-absent write (If-None-Match: *) on the existing key was refused",
            )
        )
    except Exception as exc:
        failed("if-none-match", exc)
    else:
        findings.append(
            Finding(
                "if-none-match",
                FAIL,
                "the endpoint IGNORES If-None-Match: PutObject with If-None-Match: * replaced an existing key; "
                + FENCING_UNSAFE,
                CONDITIONAL_FIX,
            )
        )
    # If-Match with the current ETag must succeed, with a stale one be refused.
    try:
        current = store.get(key).etag
        replaced = store.put(key, body(3), if_match=current)
    except Exception as exc:
        failed("if-match", exc)
        return
    stale = first if first != replaced else current
    try:
        store.put(key, body(4), if_match=stale)
    except PreconditionFailedError:
        findings.append(
            Finding(
                "if-match",
                OK,
                "a compare-and-swap (If-Match) with the current ETag replaced the object, one with a stale "
                "ETag was refused",
            )
        )
    except Exception as exc:
        failed("if-match", exc)
    else:
        findings.append(
            Finding(
                "if-match",
                FAIL,
                "the endpoint IGNORES If-Match: PutObject with a stale ETag replaced the object; "
                + FENCING_UNSAFE,
                CONDITIONAL_FIX,
            )
        )


def _delete(
    store: ObjectStore, key: str, findings: list[Finding], failed: Callable[[str, Exception], None]
) -> bool:
    try:
        store.delete(key)
    except Exception as exc:
        failed("delete", exc)
        return False
    try:
        store.get(key)
    except ObjectNotFoundError:
        findings.append(Finding("delete", OK, f"deleted {key}; it is gone"))
        return True
    except Exception as exc:
        failed("delete", exc)
        return True
    findings.append(Finding("delete", FAIL, f"{key} can still be read after it was deleted"))
    return True

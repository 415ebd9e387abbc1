"""The rows of the Stateful view: one summary per identity, read from the store within fixed bounds, with its
status (:func:`~airflow_stateful.core.fleet.status.work_status`: active, stuck, dead or idle).

Only metadata is read (head records); checkpoint values never are, so the view cannot leak task data. Every
head is untrusted input (anyone who can write the bucket can write one): a head that fails to parse or to
summarise becomes an error row of its own identity and the others are still listed; the page escapes every
string (Jinja2 autoescape) and only ever shows strings built here.

Identities come from a delimited listing (one entry per identity, however many files it holds) and their
heads are read a few at a time. A request is still bounded three ways: it stops after ``limit`` identities,
after ``max_scanned`` objects (listing entries and heads) and after ``seconds`` of wall time, and says why it
stopped (``truncated``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.fleet.catalog import HeadRead, list_identities, read_heads
from airflow_stateful.core.fleet.status import work_status
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.settings import EXPECTED_CHECKPOINT_INTERVAL
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import parse_iso
from airflow_stateful.plugins.view.urls import URL_PREFIX


def human_age(seconds: float) -> str:
    """``45s``, ``12m 3s``, ``5h 2m``, ``3d 4h``: idle ages at a glance."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def dag_links(identity: Identity, head: HeadRecord | None, base: str = "") -> dict[str, str]:
    """Links into Airflow's UI: the DAG, and the run whose state this is (or the lease holder's run)."""
    parts = identity.task_parts
    if not parts:
        return {}
    dag_id = str(parts["dag_id"])
    links = {"dag": f"{base}/dags/{quote(dag_id, safe='')}"}
    run_id: str | None = str(parts["scope"]) if parts["scope_kind"] == "run" else None
    if run_id is None and head is not None and head.lease is not None:
        run_id = head.lease.holder.run_id
    if run_id:
        links["run"] = f"{links['dag']}/runs/{quote(run_id, safe='')}"
    if parts["scope_kind"] == "run":  # the view's own Checkpoints page of this task instance
        task = quote(str(parts["task_id"]), safe="")
        links["checkpoints"] = (
            f"{base}{URL_PREFIX}/ti/{quote(dag_id, safe='')}/{quote(str(parts['scope']), safe='')}/{task}"
            f"?map_index={parts['map_index']}"
        )
    return links


def _identity_fields(identity: Identity) -> dict[str, Any]:
    parts = identity.task_parts or {}
    return {
        "identity": identity.key,
        "dag_id": parts.get("dag_id"),
        "task_id": parts.get("task_id"),
        "map_index": parts.get("map_index"),
        "scope_kind": parts.get("scope_kind"),
        "scope": parts.get("scope"),
    }


def summarize(
    identity: Identity,
    head: HeadRecord,
    *,
    now: float,
    base: str = "",
    default_interval: timedelta = EXPECTED_CHECKPOINT_INTERVAL,
) -> dict[str, Any]:
    """The JSON summary of one identity (the row of the table); ``status`` is :func:`work_status` at ``now``."""
    latest = head.latest
    updated = head.updated_at or (latest.created_at if latest else "")
    lease = head.lease
    return {
        **_identity_fields(identity),
        "links": dag_links(identity, head, base),
        "status": work_status(head, now=now, default_interval=default_interval).to_json(),
        "epoch": head.epoch,
        "checkpoints": len(head.checkpoints),
        "last_checkpoint": None
        if latest is None
        else {
            "seq": latest.seq,
            "created_at": latest.created_at,
            "schema_version": latest.schema_version,
            "total_size": latest.total_size,
            "file_count": latest.file_count,
        },
        "size": latest.total_size if latest else 0,
        "updated_at": updated or None,
        "idle_seconds": round(now - parse_iso(updated), 3) if updated else None,
        "lease": None
        if lease is None
        else {
            "holder": lease.holder.to_json(),
            "described": lease.holder.describe(),
            "acquired_at": lease.acquired_at,
            "renewed_at": lease.last_renewed,  # as `airflow-stateful show` names it
            "expires_at": lease.expires_at,
            "expired": lease.expired(now),
        },
    }


def history_of(head: HeadRecord) -> list[dict[str, Any]]:
    """The kept checkpoints of ``head``, newest first."""
    return [
        {
            "seq": e.seq,
            "created_at": e.created_at,
            "schema_version": e.schema_version,
            "epoch": e.epoch,
            "total_size": e.total_size,
            "file_count": e.file_count,
        }
        for e in reversed(head.checkpoints)
    ]


def when(iso: str) -> str:
    """``2026-11-30T08:00:00Z`` (UTC, to the second) from an ISO time; raises for anything else."""
    return datetime.fromtimestamp(parse_iso(iso), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cells(row: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """What the page shows of ``row``: strings only, built with the types checked, so a head that parses
    but holds something unexpected fails here, on its own row, and not in the template."""
    status = row["status"]
    cells: dict[str, Any] = {
        "who": _who(row),
        "link": _link(row["links"]),
        "status": {"name": str(status["status"]), "reason": str(status["reason"])},
    }
    if "checkpoints" in row["links"]:
        cells["checkpoints_href"] = str(row["links"]["checkpoints"])
    last = row["last_checkpoint"]
    cells["last"] = (
        None
        if last is None
        else {
            "seq": f"#{int(last['seq'])}",
            "schema": f"schema {int(last['schema_version'])}",
            "created": when(last["created_at"]),
        }
    )
    lease = row["lease"]
    if lease is None:
        cells["lease"] = None
    else:
        cells["lease"] = {
            "state": "expired" if lease["expired"] else "held",
            "by": str(lease["described"]),
            "renewed": when(lease["renewed_at"]),
            "until": when(lease["expires_at"]),
        }
    cells["size"] = human_bytes(int(row["size"]))
    idle = row["idle_seconds"]
    cells["idle"] = "—" if idle is None else human_age(float(idle))
    cells["history"] = [
        {
            "seq": f"#{int(e['seq'])}",
            "created": when(e["created_at"]),
            "schema": f"schema {int(e['schema_version'])}",
            "size": human_bytes(int(e["total_size"])),
        }
        for e in history
    ]
    cells["history_href"] = f"api/identities/{quote(row['identity'], safe='/')}/history"
    return cells


def _who(row: dict[str, Any]) -> dict[str, str]:
    if row.get("dag_id") is None:
        return {"key": str(row["identity"])}
    mapped = f" [{row['map_index']}]" if row["map_index"] != -1 else ""
    return {
        "dag": str(row["dag_id"]),
        "task": f"{row['task_id']}{mapped}",
        "scope": f"{row['scope_kind']} {row['scope']}",
    }


def _link(links: dict[str, str]) -> dict[str, str] | None:
    if "run" in links:
        return {"label": "DAG run", "href": links["run"]}
    if "dag" in links:
        return {"label": "DAG", "href": links["dag"]}
    return None


@dataclass(frozen=True)
class Bounds:
    """How much one listing may cost."""

    #: identities shown
    limit: int = 500
    #: objects read: each entry of the delimited listing, and each head
    max_scanned: int = 100_000
    #: wall time
    seconds: float = 15.0


@dataclass
class Entry:
    """One identity: its JSON row, its history (newest first) and its cells on the page."""

    row: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    cells: dict[str, Any] = field(default_factory=dict)


@dataclass
class Listing:
    entries: list[Entry]
    #: why the listing stopped before the end of the prefix, or None when it is complete
    truncated: str | None = None


def status_of(entry: Entry) -> str | None:
    """The status of ``entry`` (``active``, ``stuck``, ``dead``, ``idle``), or None for an error row."""
    status = entry.row.get("status")
    return str(status["status"]) if isinstance(status, dict) else None


class _Stop(Exception):
    """A bound was reached; the message says which."""


def _identities(
    store: ObjectStore,
    prefixes: Iterable[str],
    *,
    may_read: Callable[[Identity], bool],
    bounds: Bounds,
    deadline: float,
    monotonic: Callable[[], float],
) -> Iterator[Identity]:
    """The identities under ``prefixes`` that ``may_read`` allows, counting what the request reads.

    Every entry of the delimited listing (:func:`~airflow_stateful.core.fleet.catalog.list_identities`) counts as
    one object against ``max_scanned``, and every identity whose head is to be read as one more. A readable
    identity past ``limit`` stops the listing, so the page can say there is more. An identity whose head
    turns out to be gone (objects left without state) counts against the limit but gets no row.
    """
    scanned = 0

    def count() -> None:
        nonlocal scanned
        scanned += 1
        if scanned > bounds.max_scanned:
            raise _Stop(f"listed {bounds.max_scanned} objects")
        if monotonic() > deadline:
            raise _Stop(f"listed for {bounds.seconds:g} s")

    shown = 0
    for prefix in prefixes:
        for identity in list_identities(store, prefix, on_entry=count):
            if not may_read(identity):
                continue
            if shown >= bounds.limit:
                raise _Stop(f"showed {bounds.limit} identities (limit)")
            count()  # its head
            shown += 1
            yield identity


def collect(
    store: ObjectStore,
    *,
    prefixes: Iterable[str],
    may_read: Callable[[Identity], bool],
    bounds: Bounds,
    now: float,
    base: str = "",
    default_interval: timedelta = EXPECTED_CHECKPOINT_INTERVAL,
    monotonic: Callable[[], float] = time.monotonic,
    signer: HeadSigner | None,
    marks: MarkStore | None = None,
) -> Listing:
    """Read the head of each identity under ``prefixes`` that ``may_read`` allows, within ``bounds``.

    Heads are read a few at a time while the listing goes on (:func:`~airflow_stateful.core.fleet.catalog.read_heads`);
    when a bound stops the listing, the identities listed before it are still shown.
    """
    deadline = monotonic() + bounds.seconds
    listed = _identities(
        store, prefixes, may_read=may_read, bounds=bounds, deadline=deadline, monotonic=monotonic
    )
    entries: list[Entry] = []
    truncated: str | None = None
    try:
        for read in read_heads(store, listed, signer=signer, marks=marks):
            if read.head is None and read.error is None:
                continue  # no head: objects without state (gc removes them), as before the delimited listing
            entries.append(_entry(read, now=now, base=base, default_interval=default_interval))
    except _Stop as stop:
        truncated = f"stopped after it {stop}; narrow it with prefix= or raise limit="
    return Listing(entries=entries, truncated=truncated)


def _entry(read: HeadRead, *, now: float, base: str, default_interval: timedelta) -> Entry:
    error = read.error
    if error is None and read.head is not None:
        try:
            row = summarize(read.identity, read.head, now=now, base=base, default_interval=default_interval)
            history = history_of(read.head)
            return Entry(row=row, history=history, cells=_cells(row, history))
        except Exception as exc:  # a head that parses but holds something unexpected fails on its own row
            error = exc
    # A corrupt, forged or newer-format head must not hide every other identity.
    row = {**_identity_fields(read.identity), "links": dag_links(read.identity, None, base)}
    row["error"] = f"{type(error).__name__}: {error}"
    return Entry(row=row, cells={"who": _who(row), "link": _link(row["links"]), "error": row["error"]})

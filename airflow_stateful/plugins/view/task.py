"""The Checkpoints tab of a task instance: what the view reads for it, within bounds (the DAG run's tab,
:mod:`.run`, is built on the same readers).

A task instance's state lives under ``Identity.for_task(dag_id, task_id, map_index, run_id)``: its key follows
from the URL. State kept across runs under a *name* (``name="nightly-watermark"``) cannot be derived from the
URL, so the tab also lists the named identities of the same task and map index whose lease holder works on this
run, or whose newest checkpoint this run wrote (``writer.run_id``). That costs one delimited listing of the
task's ``name=`` folder and one head per named identity (at most :data:`MAX_NAMED`), plus the newest manifest of
those that ride outside their head. A named identity a later run has written to since no longer shows here.

Like the listing, everything read is untrusted (anyone who can write the bucket can write a head or a manifest):
records are parsed with their typed readers, a manifest outside its head is checked against the size and
SHA-256 its head entry records, and the page only shows strings built here (escaped by the template). Every
request is bounded: the listing's object count and wall time (:class:`.rows.Bounds`), at most
:data:`~.budget.MAX_MANIFESTS` manifest objects of at most :data:`~.budget.MANIFEST_MAX_BYTES` each
(:class:`.budget.Budget`); what was not read is shown as such.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.fleet.catalog import HeadRead, list_identities, read_head, read_heads
from airflow_stateful.core.fleet.status import work_status
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.cursors import cursor_rows, cursors_to_json, read_cursors
from airflow_stateful.core.records.cursors import items_done as cursors_items_done
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
from airflow_stateful.core.records.identity import NAMED_SCOPE, Identity, encode_segment
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import parse_iso
from airflow_stateful.plugins.view.budget import Budget, Stop, bounded_manifest, bounded_manifests
from airflow_stateful.plugins.view.cells import lease_cells, lease_json, lineage_cells, status_cells
from airflow_stateful.plugins.view.chart import Chart, LeaseMarks, Point, build_chart
from airflow_stateful.plugins.view.rows import Bounds, when

MAX_NAMED = 50
"""Named identities of one task examined for a run."""
MAX_CURSOR = 1 << 53
CURSOR_SHOWN = 80
"""Characters of a cursor's name or last key the page shows (the JSON answer has them whole)."""
SHA_SHOWN = 12


def items_done(manifest: Manifest) -> int | None:
    """The sum of the positions of the ``resume()`` cursors a checkpoint records (items finished), or None
    without cursors (or with malformed ones)."""
    cursors, _ = read_cursors(manifest.extra, what=f"checkpoint {manifest.seq}")
    done = cursors_items_done(cursors)
    return None if done is None else min(done, MAX_CURSOR)


def _cursors(manifest: Manifest) -> tuple[dict[str, Any] | None, list[dict[str, str]], str | None]:
    """A checkpoint's cursors for the JSON answer, for the page (strings, capped), and why they are not shown.

    Parsed like every stored record (typed, bounded: at most 50 cursors, keys of at most 1,000 characters);
    the page shows names and keys cut to :data:`CURSOR_SHOWN` characters, as text.
    """
    cursors, error = read_cursors(manifest.extra, what=f"checkpoint {manifest.seq}")
    if error is not None:
        return None, [], error
    if not cursors:
        return None, [], None
    shown = [
        {
            "name": _cut(row["name"]),
            "position": f"{row['position']:,}",
            "last": "" if row["last_key"] is None else _cut(repr(row["last_key"])),
        }
        for row in cursor_rows(cursors)
    ]
    return cursors_to_json(cursors), shown, None


def _cut(text: str) -> str:
    return text if len(text) <= CURSOR_SHOWN else text[: CURSOR_SHOWN - 1] + "…"


def ti_path(root: str, dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    """The view's own page of one task instance (``root``: where the view is mounted, e.g. ``/stateful``)."""
    parts = "/".join(quote(p, safe="") for p in (dag_id, run_id, task_id))
    return f"{root}/ti/{parts}?map_index={map_index}"


def run_path(root: str, dag_id: str, run_id: str) -> str:
    return f"{root}/run/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


@dataclass
class Found:
    """One identity shown in a tab, and why it belongs to the task instance."""

    identity: Identity
    read: HeadRead
    matched_by: str
    #: the newest checkpoint's manifest, when it was read to decide whether the identity belongs
    newest: Manifest | None = None


@dataclass
class TabView:
    """What a tab shows: a JSON body and the page's cells."""

    body: dict[str, Any]
    cells: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    truncated: str | None = None

    @classmethod
    def of(
        cls,
        about: dict[str, Any],
        key: str,
        rows: list[tuple[dict[str, Any], dict[str, Any]]],
        *,
        notes: list[str],
        truncated: str | None,
    ) -> TabView:
        """A tab of ``rows`` (each its JSON and its page cells): the body is ``about``, then the rows' JSON under
        ``key``, the notes, and where the listing stopped (None when it is complete)."""
        body = {**about, key: [row for row, _ in rows], "notes": notes, "truncated": truncated}
        return cls(body=body, cells=[cells for _, cells in rows], notes=notes, truncated=truncated)


def named_matches(
    store: ObjectStore,
    folder: str,
    *,
    map_index: int | None,
    run_id: str,
    budget: Budget,
    notes: list[str],
    signer: HeadSigner | None,
    marks: MarkStore | None = None,
) -> Iterator[Found]:
    """The named identities in task folder ``folder`` (``<dag>/<task>/``) whose lease holder works on
    ``run_id`` or whose newest checkpoint ``run_id`` wrote; of map index ``map_index`` unless it is None."""
    candidates: list[Identity] = []
    for identity in list_identities(store, f"{folder}{NAMED_SCOPE}=", on_entry=budget.count):
        parts = identity.task_parts
        if parts is None or parts["scope_kind"] != NAMED_SCOPE:
            continue
        if map_index is not None and parts["map_index"] != map_index:
            continue
        if len(candidates) >= MAX_NAMED:
            notes.append(f"only the first {MAX_NAMED} named identities of {folder.rstrip('/')} were examined")
            break
        budget.count()
        candidates.append(identity)
    unreadable = 0
    for read in read_heads(store, candidates, signer=signer, marks=marks):
        head = read.head
        if head is None:
            unreadable += read.error is not None
            continue
        if head.lease is not None and head.lease.holder.run_id == run_id:
            yield Found(read.identity, read, "its lease holder works on this run")
            continue
        if head.latest is None:
            continue
        newest = bounded_manifest(store, read.identity, head.latest, budget)
        if newest.refused:
            continue
        if newest.manifest is None:
            unreadable += 1
            continue
        if newest.manifest.writer.run_id == run_id:
            yield Found(read.identity, read, "this run wrote its newest checkpoint", newest=newest.manifest)
    if unreadable:
        notes.append(f"{unreadable} named identit{'y' if unreadable == 1 else 'ies'} could not be read")


# -- one task instance --------------------------------------------------------------------------------------


def task_instance_tab(
    store: ObjectStore,
    *,
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int,
    now: float,
    default_interval: timedelta,
    bounds: Bounds,
    signer: HeadSigner | None,
    marks: MarkStore | None = None,
) -> TabView:
    """The identities of one task instance (its run identity, and the named ones this run works on), each with
    its status, lease, kept history, committed outputs and progress chart."""
    budget = Budget(bounds)
    run_identity = Identity.for_task(dag_id=dag_id, task_id=task_id, map_index=map_index, run_id=run_id)
    found: list[Found] = []
    notes: list[str] = []
    truncated = None
    read = read_head(store, run_identity, signer=signer, marks=marks)
    if read.head is not None or read.error is not None:
        found.append(Found(run_identity, read, "its key names this run"))
    folder = f"{encode_segment(dag_id)}/{encode_segment(task_id)}/"
    try:
        found.extend(
            named_matches(
                store,
                folder,
                map_index=map_index,
                run_id=run_id,
                budget=budget,
                notes=notes,
                signer=signer,
                marks=marks,
            )
        )
    except Stop as stop:
        truncated = f"the search for named identities stopped after it {stop}"
    reading = _Reading(store=store, run_id=run_id, now=now, default_interval=default_interval, budget=budget)
    views = [_identity_view(f, reading) for f in found]
    about = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index}
    return TabView.of(about, "identities", views, notes=notes, truncated=truncated)


def scope_label(identity: Identity) -> str:
    parts = identity.task_parts or {}
    if parts.get("scope_kind") == NAMED_SCOPE:
        return f"named state {parts['scope']}"
    return "state of this run"


@dataclass(frozen=True)
class _Reading:
    """What every section of one tab is read with."""

    store: ObjectStore
    run_id: str
    now: float
    default_interval: timedelta
    budget: Budget


def _identity_view(found: Found, r: _Reading) -> tuple[dict[str, Any], dict[str, Any]]:
    identity, head = found.identity, found.read.head
    body: dict[str, Any] = {"identity": identity.key, "matched_by": found.matched_by}
    cells: dict[str, Any] = {
        "key": identity.key,
        "scope": scope_label(identity),
        "matched": found.matched_by,
    }
    if head is None:
        error = found.read.error
        body["error"] = cells["error"] = f"{type(error).__name__}: {error}"
        return body, cells
    try:
        return _head_view(found, head, body, cells, r)
    except Exception as exc:  # a head that parses but holds something unexpected fails on its own section
        body = {
            "identity": identity.key,
            "matched_by": found.matched_by,
            "error": f"{type(exc).__name__}: {exc}",
        }
        return body, {
            "key": identity.key,
            "scope": cells["scope"],
            "matched": found.matched_by,
            "error": body["error"],
        }


def _head_view(
    found: Found, head: HeadRecord, body: dict[str, Any], cells: dict[str, Any], r: _Reading
) -> tuple[dict[str, Any], dict[str, Any]]:
    store, now, budget = r.store, r.now, r.budget
    default_interval = r.default_interval
    status = work_status(head, now=now, default_interval=default_interval)
    body.update(epoch=head.epoch, status=status.to_json(), lease=lease_json(head, now))
    cells.update(status=status_cells(status), lease=lease_cells(head, status, now, run_id=r.run_id))
    # How the newest try ended (Airflow's words) and what that means for how long the state is kept.
    body["outcome"] = head.outcome.to_json() if head.outcome else None
    cells["outcome"] = head.outcome.describe()[:300] if head.outcome else ""
    history, points = [], []
    newest_manifest: Manifest | None = None
    previous_epoch: int | None = None
    manifests = _manifests(store, found, head, budget)
    for entry in head.checkpoints:
        manifest = manifests[entry.seq]
        resumed = previous_epoch is not None and entry.epoch != previous_epoch
        previous_epoch = entry.epoch
        row: dict[str, Any] = {
            "seq": entry.seq,
            "created_at": entry.created_at,
            "epoch": entry.epoch,
            "file_count": entry.file_count,
            "total_size": entry.total_size,
            "resumed": resumed,
            "pinned": entry.pinned.to_json() if entry.pinned else None,
            "copy_of": None,
        }
        shown = {
            "seq": f"#{entry.seq}",
            "created": when(entry.created_at),
            "epoch": str(entry.epoch),
            "files": f"{entry.file_count:,}",
            "bytes": human_bytes(entry.total_size),
            "resumed": resumed,
            "pin": entry.pinned.reason[:300] if entry.pinned else "",
            **lineage_cells(None, head),
        }
        if isinstance(manifest, Manifest):
            items = items_done(manifest)
            writer = manifest.writer
            cursors, cursor_cells, cursor_error = _cursors(manifest)
            row.update(
                try_number=writer.try_number,
                run_id=writer.run_id,
                writer=writer.describe(),
                items_done=items,
                cursors=cursors,
                manifest="read",
                copy_of=manifest.copy_of.to_json() if manifest.copy_of else None,
            )
            shown.update(
                try_="—" if writer.try_number is None else str(writer.try_number),
                done="—" if items is None else f"{items:,}",
                writer=writer.pod or writer.host or "—",
                cursors=cursor_cells,
                cursor_note=cursor_error or "",
                note="",
                **lineage_cells(manifest.copy_of, head),
            )
            points.append(
                Point(
                    seq=entry.seq,
                    at=parse_iso(entry.created_at),
                    epoch=entry.epoch,
                    try_number=writer.try_number,
                    items=items,
                )
            )
            if entry is head.latest:
                newest_manifest = manifest
        else:
            row.update(try_number=None, items_done=None, manifest=manifest)
            shown.update(try_="—", done="—", writer="—", cursors=[], cursor_note="", note=manifest)
        history.append((row, shown))
    body["checkpoints"] = [row for row, _ in reversed(history)]
    cells["history"] = [shown for _, shown in reversed(history)]
    outputs = (
        [] if newest_manifest is None else sorted(newest_manifest.outputs.values(), key=lambda o: o.name)
    )
    body["outputs"] = [{"name": o.name, **o.to_json()} for o in outputs]
    cells["outputs"] = [
        {
            "name": o.name,
            "kind": o.kind,
            "size": human_bytes(o.size),
            "files": f"{o.file_count:,}",
            "sha": o.sha256[:SHA_SHOWN],
            "sha_full": o.sha256,
            "seq": f"#{o.seq}",
            "try_": "—" if o.try_number is None else str(o.try_number),
            "committed": when(o.committed_at),
        }
        for o in outputs
    ]
    cells["outputs_unknown"] = head.latest is not None and newest_manifest is None
    lease = head.lease
    marks = (
        None
        if lease is None
        else LeaseMarks(
            holder=lease.holder.describe(),
            epoch=lease.epoch,
            acquired_at=parse_iso(lease.acquired_at),
            expired_at=parse_iso(lease.expires_at) if lease.expired(now) else None,
        )
    )
    chart: Chart | None = build_chart(points, lease=marks)
    cells["chart"] = chart
    return body, cells


def _manifests(
    store: ObjectStore, found: Found, head: HeadRecord, budget: Budget
) -> dict[int, Manifest | str]:
    """The manifest of each kept checkpoint by seq, or why it was not read (a bound, or its error): the newest
    first win the budget (:func:`bounded_manifests`); the one already read to match ``found`` costs nothing."""
    manifests: dict[int, Manifest | str] = {}
    wanted: list[CheckpointEntry] = []
    for entry in reversed(head.checkpoints):
        if found.newest is not None and found.newest.seq == entry.seq:
            manifests[entry.seq] = found.newest
        else:
            wanted.append(entry)
    for entry, read in zip(wanted, bounded_manifests(store, found.identity, wanted, budget), strict=True):
        manifests[entry.seq] = read.shown
    return manifests

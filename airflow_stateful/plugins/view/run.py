"""The Checkpoints tab of a DAG run: every stateful task instance of the run, one row each.

The DAG's task folders come from one delimited listing (``<dag_id>/`` with delimiter ``/``: one entry per task,
however much state it holds), then each folder's identities of this run (``<task_id>/run=<run_id>/``) and the
named identities this run works on (:func:`.task.named_matches`). Rows link to the task instance's own
page of the view (in the same frame: Airflow's sandbox lets no link leave it). Bounded like every page of the
view (:class:`.budget.Budget`); a row whose head cannot be read says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

from airflow_stateful.core.fleet.catalog import list_identities, read_heads
from airflow_stateful.core.fleet.status import work_status
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.identity import RUN_SCOPE, Identity, encode_segment
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.stores.base import CommonPrefix, ObjectStore
from airflow_stateful.plugins.view.budget import Budget, Stop, bounded_manifest
from airflow_stateful.plugins.view.cells import status_cells
from airflow_stateful.plugins.view.rows import Bounds, human_age, when
from airflow_stateful.plugins.view.task import (
    Found,
    TabView,
    named_matches,
    scope_label,
    ti_path,
)

T = TypeVar("T")


def dag_run_tab(
    store: ObjectStore,
    *,
    dag_id: str,
    run_id: str,
    now: float,
    default_interval: timedelta,
    bounds: Bounds,
    root: str,
    signer: HeadSigner | None,
    marks: MarkStore | None = None,
) -> TabView:
    """Every stateful task instance of one DAG run: each identity under ``<dag>/<task>/run=<run_id>/`` and the
    named identities this run works on, with status, newest checkpoint and outputs count."""
    budget = Budget(bounds)
    notes: list[str] = []
    truncated = None
    found: list[Found] = []
    scope = f"{RUN_SCOPE}={encode_segment(run_id)}/"
    try:
        folders = [
            entry.prefix
            for entry in _counted(store.list_delimited(f"{encode_segment(dag_id)}/", "/"), budget)
            if isinstance(entry, CommonPrefix)
        ]
        for folder in folders:
            if len(found) >= bounds.limit:  # more task folders to look in
                raise Stop(f"showed {bounds.limit} identities (limit)")
            run_ids = [
                i
                for i in list_identities(store, f"{folder}{scope}", on_entry=budget.count)
                if _in_run(i, run_id)
            ]
            for read in read_heads(store, run_ids, signer=signer, marks=marks):
                if read.head is not None or read.error is not None:
                    found.append(Found(read.identity, read, "its key names this run"))
            found.extend(
                named_matches(
                    store,
                    folder,
                    map_index=None,
                    run_id=run_id,
                    budget=budget,
                    notes=notes,
                    signer=signer,
                    marks=marks,
                )
            )
    except Stop as stop:
        truncated = f"the listing stopped after it {stop}"
    rows = [
        _run_row(
            store, f, run_id=run_id, now=now, default_interval=default_interval, budget=budget, root=root
        )
        for f in found
    ]
    about = {"dag_id": dag_id, "run_id": run_id}
    return TabView.of(about, "task_instances", rows, notes=notes, truncated=truncated)


def _counted(entries: Iterable[T], budget: Budget) -> Iterator[T]:
    """``entries``, each counted against the budget as it is listed."""
    for entry in entries:
        budget.count()
        yield entry


def _in_run(identity: Identity, run_id: str) -> bool:
    parts = identity.task_parts
    return parts is not None and parts["scope_kind"] == RUN_SCOPE and parts["scope"] == run_id


def _run_row(
    store: ObjectStore,
    found: Found,
    *,
    run_id: str,
    now: float,
    default_interval: timedelta,
    budget: Budget,
    root: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    identity, head = found.identity, found.read.head
    parts = identity.task_parts or {}
    dag_id, task_id, map_index = str(parts["dag_id"]), str(parts["task_id"]), int(parts["map_index"])
    href = ti_path(root, dag_id, run_id, task_id, map_index)
    row: dict[str, Any] = {
        "identity": identity.key,
        "task_id": task_id,
        "map_index": map_index,
        "scope_kind": parts["scope_kind"],
        "scope": parts["scope"],
        "matched_by": found.matched_by,
        "href": href,
    }
    mapped = f" [{map_index}]" if map_index != -1 else ""
    cells: dict[str, Any] = {"task": f"{task_id}{mapped}", "scope": scope_label(identity), "href": href}
    if head is None:
        row["error"] = cells["error"] = f"{type(found.read.error).__name__}: {found.read.error}"
        return row, cells
    try:
        status = work_status(head, now=now, default_interval=default_interval)
        latest = head.latest
        newest = found.newest
        outputs: int | None = 0 if latest is None else None
        if latest is not None:
            if newest is None:
                newest = bounded_manifest(store, identity, latest, budget).manifest
            outputs = None if newest is None else len(newest.outputs)
        row.update(
            status=status.to_json(),
            newest_seq=None if latest is None else latest.seq,
            checkpoints=len(head.checkpoints),
            outputs=outputs,
            updated_at=head.updated_at or None,
        )
        holder = None if head.lease is None else head.lease.holder
        if holder is not None and holder.run_id == run_id:
            holder = replace(holder, run_id=None)  # the page's own run: said once, in its title
        age = status.checkpoint_age
        cells.update(
            status=status_cells(status),
            seq="—" if latest is None else f"#{latest.seq}",
            kept=str(len(head.checkpoints)),
            outputs="—" if outputs is None else str(outputs),
            created="—" if latest is None else when(latest.created_at),
            age="" if age is None else f"{human_age(age)} ago",
            lease="free" if holder is None else holder.describe(),
            expired=head.lease is not None and head.lease.expired(now),
        )
    except Exception as exc:  # a head that parses but holds something unexpected fails on its own row
        row["error"] = cells["error"] = f"{type(exc).__name__}: {exc}"
    return row, cells

"""``ls``, ``stuck`` and ``du``: every identity under a prefix (or selected by Airflow ids), one row each.

Together because they walk the whole store the same way (one delimited listing, heads read a few at a time, a
row printed as soon as it is read) and answer the fleet-wide questions: what is there, what is stuck, what it
costs. A head that cannot be read is a row with its ``error``, never a reason to stop.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from airflow_stateful.cli.common import checkpoint_size, lifetimes, selected_groups
from airflow_stateful.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from airflow_stateful.cli.output import TABLE_PAGE, emit, hms
from airflow_stateful.cli.selections import selected_prefixes
from airflow_stateful.core.fleet.lifetimes import Lifetimes, judge
from airflow_stateful.core.fleet.status import STATUSES, WorkStatus
from airflow_stateful.core.fleet.stuck import IdentityStatus, StuckReport, find_stuck, identity_statuses
from airflow_stateful.core.fleet.usage import GB, disk_usage
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.settings import EXPECTED_CHECKPOINT_INTERVAL
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import utcnow_iso

LS_COLUMNS = ["identity", "seq", "kept", "size", "epoch", "lease", "status", "outcome", "updated"]


def cmd_ls(args: argparse.Namespace, store: ObjectStore) -> int:
    """One delimited listing (an entry per identity), the heads read a few at a time, each row printed as
    soon as it and those before it are read. A head that cannot be read is a row with its ``error`` (shown
    whatever ``--status`` asks for: its status is unknown), the others are still listed, and the exit code
    is 1. ``status`` is :func:`~airflow_stateful.core.fleet.status.work_status` at the moment the head was read."""
    errors = 0
    wanted = set(args.status or STATUSES)

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal errors
        statuses = (
            item
            for prefix in selected_prefixes(args, store)
            for item in identity_statuses(
                store, prefix, default_interval=args.default_interval, signer=args.signer
            )
        )
        for item in statuses:
            if item.error is not None:
                errors += 1
                yield {"identity": item.identity.key, **dict.fromkeys(LS_COLUMNS[1:]), "error": item.error}
            elif item.head is not None and item.status is not None and item.status.status in wanted:
                yield _ls_row(item.identity, item.head, item.status)

    _stream(args, rows(), LS_COLUMNS, sizes=("size",))
    return EXIT_PROBLEM if errors else EXIT_OK


def _ls_row(identity: Identity, head: HeadRecord, status: WorkStatus) -> dict[str, Any]:
    latest = head.latest
    lease = head.lease
    return {
        "identity": identity.key,
        "seq": latest.seq if latest else None,
        "kept": len(head.checkpoints),
        # The newest checkpoint's files and value (du shows the same number as its "size").
        "size": checkpoint_size(latest),
        "epoch": head.epoch,
        "lease": lease.holder.describe() if lease else None,
        "updated": head.updated_at,
        **status.to_json(),  # status, since_progress_seconds, checkpoint_age_seconds, ..., reason
        # How the newest try ended (Airflow's words), what GC judges lifetimes by; the whole record in --json.
        "outcome": head.outcome.describe() if head.outcome else None,
        "outcome_record": head.outcome.to_json() if head.outcome else None,
        "pinned": [e.seq for e in head.pinned],
    }


STUCK_COLUMNS = ["identity", "holder", "since_progress", "expected", "renewed", "reason"]
SHOWN_DEAD = 20
"""Dead identities named on stderr by ``stuck`` (the JSON report has them all)."""


def cmd_stuck(args: argparse.Namespace, store: ObjectStore) -> int:
    """The stuck check (:func:`~airflow_stateful.core.fleet.stuck.find_stuck`, as ``StatefulStuckCheckOperator``
    runs it): the stuck identities on stdout (a table, or with ``--json`` the whole report: stuck, dead and
    unreadable identities, counts), a summary and the dead ones on stderr. Exit 1 when any is stuck, else 2
    when a head could not be read, else 0."""
    reports = [
        find_stuck(store, prefix, default_interval=args.default_interval, signer=args.signer)
        for prefix in selected_prefixes(args, store)
    ]
    report = _one_report(store, reports, shown=args.prefix or args.prefix_option or "", args=args)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str), file=args.out)
    else:
        emit(
            [*map(_stuck_row, report.stuck), *map(_stuck_row, report.errors)],
            STUCK_COLUMNS,
            as_json=False,
            out=args.out,
        )
    print(report.summary(), file=sys.stderr)
    if report.dead:
        names = ", ".join(d.identity.key for d in report.dead[:SHOWN_DEAD])
        more = f" and {len(report.dead) - SHOWN_DEAD} more" if len(report.dead) > SHOWN_DEAD else ""
        print(
            f"not stuck but dead (lease expired, the writer is gone; Airflow retries the task, "
            f"`airflow-stateful unlock` frees it): {names}{more}",
            file=sys.stderr,
        )
    if report.stuck:
        return EXIT_PROBLEM
    return EXIT_USAGE if report.errors else EXIT_OK


def _one_report(
    store: ObjectStore, reports: list[StuckReport], *, shown: str, args: argparse.Namespace
) -> StuckReport:
    """One report for the whole selection: a run selected across a DAG's tasks is one check per task folder
    (its identities share no single prefix), reported as one, under the selection's name."""
    if len(reports) == 1:
        return dataclasses.replace(reports[0], prefix=shown)
    counts: Counter[str] = Counter(dict.fromkeys(STATUSES, 0))
    for r in reports:
        counts.update(r.counts)
    return StuckReport(
        store=store.url,
        prefix=shown,
        default_interval=(args.default_interval or EXPECTED_CHECKPOINT_INTERVAL).total_seconds(),
        checked_at=reports[0].checked_at if reports else utcnow_iso(time.time()),
        checked=sum(r.checked for r in reports),
        counts=dict(counts),
        stuck=tuple(s for r in reports for s in r.stuck),
        dead=tuple(d for r in reports for d in r.dead),
        errors=tuple(e for r in reports for e in r.errors),
    )


def _stuck_row(item: IdentityStatus) -> dict[str, Any]:
    if item.error is not None or item.status is None:
        return {"identity": item.identity.key, "error": item.error}
    lease = item.head.lease if item.head is not None else None
    status = item.status
    return {
        "identity": item.identity.key,
        "holder": lease.holder.describe() if lease else None,
        "since_progress": hms(status.since_progress),
        "expected": hms(status.expected_interval),
        "renewed": lease.last_renewed if lease else None,
        "reason": status.reason,
    }


def cmd_du(args: argparse.Namespace, store: ObjectStore) -> int:
    """One full listing (sizes are only in listings), then the heads read a few at a time, each identity's row
    printed as soon as it is read, and a TOTAL row. A head that cannot be read leaves its row with an
    ``error`` (its bytes still count) and the exit code 1."""
    price = args.price_per_gb_month
    packs = bool(getattr(args, "packs", False))  # a Namespace built by a caller of its own may lack it
    total: dict[str, int | None] = {"checkpoints": 0, "objects": 0, "bytes": 0, "garbage_bytes": 0}
    if packs:
        total["dead_pack_bytes"] = 0
    errors = 0
    lives = lifetimes(args)

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal errors
        groups = selected_groups(args, store)
        for u in disk_usage(store, prefix=args.prefix or "", groups=groups, signer=args.signer, packs=packs):
            for field, sum_so_far in total.items():
                value = getattr(u, field)
                total[field] = None if sum_so_far is None or value is None else sum_so_far + value
            row = {
                "identity": u.identity,
                "checkpoints": u.checkpoints,
                "objects": u.objects,
                "bytes": u.bytes,
                "size": checkpoint_size(u.head.latest) if u.head is not None else None,
                "garbage_bytes": u.garbage_bytes,
                **({"dead_pack_bytes": u.dead_pack_bytes} if packs else {}),
                "idle": _age(u.idle_seconds),
                "idle_seconds": u.idle_seconds,
                "usd_per_month": round(u.monthly_cost(price), 6),
                "outcome": u.head.outcome.state if u.head is not None and u.head.outcome else None,
                **_lifetime(u.head, u.identity, lives, args.lease_grace),
            }
            if u.error is not None:
                errors += 1
                row["error"] = u.error
            yield row
        yield {
            "identity": "TOTAL",
            **total,
            "size": None,
            "idle": None,
            "idle_seconds": None,
            "usd_per_month": round((total["bytes"] or 0) / GB * price, 6),
            "outcome": None,
            "lifetime": None,
            "lifetime_until": None,
        }

    columns = [
        "identity",
        "checkpoints",
        "objects",
        "bytes",
        "garbage_bytes",
        *(["dead_pack_bytes"] if packs else []),
        "size",
        "idle",
        "usd_per_month",
        "outcome",
        "lifetime",
    ]
    _stream(args, rows(), columns, sizes=("bytes", "garbage_bytes", "dead_pack_bytes", "size"))
    return EXIT_PROBLEM if errors else EXIT_OK


def _stream(
    args: argparse.Namespace, rows: Iterator[dict[str, Any]], columns: list[str], *, sizes: tuple[str, ...]
) -> None:
    """A fleet table (or JSON) written a page at a time as the heads are read, sizes as ``--bytes`` asks."""
    emit(rows, columns, as_json=args.json, page=TABLE_PAGE, out=args.out, sizes=sizes, exact=args.exact_sizes)


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    days, rest = divmod(int(seconds), 86400)
    return f"{days}d{rest // 3600}h" if days else f"{rest // 3600}h{rest % 3600 // 60}m"


def _lifetime(head: HeadRecord | None, key: str, lives: Lifetimes, grace: float) -> dict[str, Any]:
    """What GC would do with the identity by the heads alone (``du`` asks Airflow nothing): the verdict, and when
    a keep ends by itself (``lifetime_until``, in ``--json``)."""
    verdict = None
    if head is not None:
        with contextlib.suppress(ValueError):
            verdict = judge(head, Identity.parse(key), now=time.time(), lifetimes=lives, grace=grace)
    until = verdict.until if verdict is not None else None
    return {
        "lifetime": verdict.reason if verdict is not None else None,
        "lifetime_until": utcnow_iso(until) if until is not None else None,
    }

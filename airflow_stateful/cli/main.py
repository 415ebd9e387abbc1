"""``airflow-stateful``: inspect, verify, roll back, unlock and clean checkpointed state.

Exit codes scripts can rely on: 0 success; 1 a problem was found (``verify`` saw corruption, ``ls``/``du`` a
head they could not read, ``outputs --get`` a download that does not match its recorded SHA-256); 2 bad usage or
configuration, or a restore (``cat --files``, ``outputs --get``) refused because its destination is not empty
(the default ``--mode empty``; choose ``--mode exact`` or ``--mode merge``); 3 refused because of a lease (a live writer holds the identity; ``--force`` overrides);
4 no such identity, checkpoint or output.

``stuck`` is made for cron and monitoring: 0 nothing is stuck; 1 at least one identity is stuck (alive, renewing
its lease, but committing nothing for longer than its expected checkpoint interval); 2 the check could not be
made or is incomplete (bad usage or configuration, the store could not be listed, a head could not be read) and
nothing was found stuck. Dead identities (lease expired: the writer is gone) are never stuck: they are named on
stderr but do not change the exit code.

The backend is ``--backend URL``, else ``AIRFLOW__STATEFUL__BACKEND_URL``, else ``[stateful] backend_url`` of
the Airflow installation. S3 credentials and endpoint come from the Airflow connection (``--conn-id``, else
``[stateful] conn_id``) or, without one, boto3's standard chain; ``--endpoint-url`` (or
``STATEFUL_S3_ENDPOINT_URL``) overrides the endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow_stateful.cli.common import checkpoints_of, lifetimes, logs_to_stderr, open_store, progress
from airflow_stateful.cli.exit_codes import EXIT_LEASE, EXIT_NOT_FOUND, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from airflow_stateful.cli.output import TABLE_PAGE, emit, hms
from airflow_stateful.core.data.restore_modes import EMPTY, MODES, refusal
from airflow_stateful.core.durations import parse_duration
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigurationError,
    DestinationNotEmptyError,
    FencedError,
    LeaseHeldError,
    StatefulError,
)
from airflow_stateful.core.fleet.catalog import list_identities
from airflow_stateful.core.fleet.gc import apply_gc, group_by_identity, plan_gc
from airflow_stateful.core.fleet.lifetimes import Lifetimes, RunStates, judge
from airflow_stateful.core.fleet.status import STATUSES, WorkStatus
from airflow_stateful.core.fleet.stuck import IdentityStatus, find_stuck, identity_statuses
from airflow_stateful.core.fleet.usage import DEFAULT_PRICE_PER_GB_MONTH, GB, disk_usage
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.cursors import cursors_to_json, describe_cursors, read_cursors
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import OutputInfo, check_output_name, content_sha256
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.settings import EXPECTED_CHECKPOINT_INTERVAL, KEEP_FAILED_FOR
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.timestamps import utcnow_iso

LS_COLUMNS = ["identity", "seq", "kept", "bytes", "epoch", "lease", "status", "outcome", "updated"]


def _cmd_ls(args: argparse.Namespace, store: ObjectStore) -> int:
    """One delimited listing (an entry per identity), the heads read a few at a time, each row printed as
    soon as it and those before it are read. A head that cannot be read is a row with its ``error`` (shown
    whatever ``--status`` asks for: its status is unknown), the others are still listed, and the exit code
    is 1. ``status`` is :func:`~airflow_stateful.core.fleet.status.work_status` at the moment the head was read."""
    errors = 0
    wanted = set(args.status or STATUSES)

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal errors
        for item in identity_statuses(store, args.prefix or "", default_interval=args.default_interval):
            if item.error is not None:
                errors += 1
                yield {"identity": item.identity.key, **dict.fromkeys(LS_COLUMNS[1:]), "error": item.error}
            elif item.head is not None and item.status is not None and item.status.status in wanted:
                yield _ls_row(item.identity, item.head, item.status)

    emit(rows(), LS_COLUMNS, as_json=args.json, page=TABLE_PAGE)
    return EXIT_PROBLEM if errors else EXIT_OK


def _ls_row(identity: Identity, head: HeadRecord, status: WorkStatus) -> dict[str, Any]:
    latest = head.latest
    lease = head.lease
    return {
        "identity": identity.key,
        "seq": latest.seq if latest else None,
        "kept": len(head.checkpoints),
        "bytes": latest.total_size if latest else 0,
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


def _cmd_stuck(args: argparse.Namespace, store: ObjectStore) -> int:
    """The stuck check (:func:`~airflow_stateful.core.fleet.stuck.find_stuck`, as ``StatefulStuckCheckOperator``
    runs it): the stuck identities on stdout (a table, or with ``--json`` the whole report: stuck, dead and
    unreadable identities, counts), a summary and the dead ones on stderr. Exit 1 when any is stuck, else 2
    when a head could not be read, else 0."""
    if args.prefix and args.prefix_option and args.prefix != args.prefix_option:
        raise ValueError(f"two different prefixes: {args.prefix!r} and --prefix {args.prefix_option!r}")
    report = find_stuck(
        store, args.prefix or args.prefix_option or "", default_interval=args.default_interval
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        emit([*map(_stuck_row, report.stuck), *map(_stuck_row, report.errors)], STUCK_COLUMNS, as_json=False)
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


OUTPUT_COLUMNS = ["name", "kind", "size", "sha256", "seq", "committed_at", "try", "location"]


def _cmd_outputs(args: argparse.Namespace, store: ObjectStore) -> int:
    """The outputs committed with the newest checkpoint (or ``--seq``); ``--get NAME --to DIR`` downloads one."""
    if (args.get is None) != (args.to is None):
        raise ValueError("--get NAME and --to DIR go together")
    cs = checkpoints_of(store, args.identity)
    manifest = cs.get(args.seq) if args.seq is not None else cs.latest()
    if manifest is None:
        raise CheckpointNotFoundError(f"identity {args.identity!r} has no checkpoint yet, so no outputs")
    outputs = cs.outputs(manifest)
    if args.get is not None:
        return _get_output(args, cs, manifest, outputs)
    if args.json:
        emit([info.to_json() for info in outputs.values()], OUTPUT_COLUMNS, as_json=True)
    else:
        rows = [{**info.to_json(), "try": info.try_number} for info in outputs.values()]
        emit(rows, OUTPUT_COLUMNS, as_json=False)
    return EXIT_OK


def _get_output(
    args: argparse.Namespace, cs: CheckpointStore, manifest: Manifest, outputs: dict[str, OutputInfo]
) -> int:
    """Download output ``--get`` into ``--to`` (every chunk verified by the restore), then check the result
    against the SHA-256 the checkpoint recorded for the whole output, as ``sha256sum`` would."""
    name = check_output_name(args.get)
    info = outputs.get(name)
    if info is None:
        have = ", ".join(outputs) or "none"
        raise CheckpointNotFoundError(
            f"checkpoint {manifest.seq} of {cs.identity} has no output {name!r}; its outputs: {have}"
        )
    dest = Path(args.to)
    with _mode_hint():
        written = cs.restore_output(name, dest, manifest=manifest, mode=args.mode)
    print(written.describe(), file=sys.stderr)
    target = dest / name
    if info.kind == "directory":
        target.mkdir(parents=True, exist_ok=True)  # an empty directory output has no file to create it
        listed = [(p.relative_to(target).as_posix(), p.stat().st_size, _sha256_of(p)) for p in written]
    else:
        listed = [("", target.stat().st_size, _sha256_of(target))]
    found = content_sha256(info.kind, listed)
    if found != info.sha256:
        raise CheckpointCorruptError(
            f"output {name!r} downloaded to {target} has SHA-256 {found}, not the {info.sha256} checkpoint "
            f"{manifest.seq} recorded: do not use it"
        )
    if args.json:
        restore = written.to_json()
        print(
            json.dumps(
                {**info.to_json(), "path": str(target), "files": len(written), "restore": restore}, indent=2
            )
        )
    else:
        print(target)
    return EXIT_OK


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _cmd_show(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity)
    head = cs.head()
    assert head is not None
    latest = cs.latest()
    cursors, cursor_error = (
        read_cursors(latest.extra, what=f"checkpoint {latest.seq}") if latest else ({}, None)
    )
    lease = head.lease
    info = {
        "identity": cs.identity.key,
        "store": store.url,
        "epoch": head.epoch,
        "lease": None
        if lease is None
        else {
            "holder": lease.holder.to_json(),
            "epoch": lease.epoch,
            "acquired_at": lease.acquired_at,
            "renewed_at": lease.last_renewed,
            "expires_at": lease.expires_at,
        },
        "kept": [e.seq for e in reversed(head.checkpoints)],
        # Checkpoints retention never evicts: set aside by older code during a deploy rollback.
        "pinned": {str(e.seq): e.pinned.to_json() for e in head.checkpoints if e.pinned is not None},
        # How the newest try ended, in Airflow's words: what GC judges this identity's lifetime by.
        "outcome": head.outcome.to_json() if head.outcome else None,
        "latest": None
        if latest is None
        else {
            "seq": latest.seq,
            "created_at": latest.created_at,
            "schema_version": latest.schema_version,
            "writer": latest.writer.to_json(),
            "code": latest.code.to_json() if latest.code else None,
            "files": [{"path": f.path, "size": f.size, "objects": len(f.keys)} for f in cs.files(latest)],
            "cursors": cursors_to_json(cursors),
            **({"cursors_error": cursor_error} if cursor_error else {}),
            "value": latest.value if latest.value_codec == "json" else f"<{latest.value_codec}>",
        },
    }
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        for field in ("identity", "store", "epoch", "lease", "kept"):
            print(f"{field + ':':<10} {info[field] if info[field] is not None else '-'}")
        print(f"{'outcome:':<10} {head.outcome.describe() if head.outcome else '-'}")
        for entry in head.pinned:
            assert entry.pinned is not None
            print(
                f"{'pinned:':<10} checkpoint {entry.seq} (schema {entry.schema_version}): {entry.pinned.reason}"
            )
        if latest is not None:
            print(
                f"latest:    checkpoint {latest.seq} by {latest.writer.describe()} at {latest.created_at}, "
                f"schema {latest.schema_version}, {latest.file_count} file(s)"
            )
            if latest.code is not None:
                print(f"code:      {latest.code.describe()}")
            print(f"cursors:   {cursor_error or describe_cursors(cursors)}")
            print(f"value:     {json.dumps(info['latest']['value'], default=str)[:200]}")  # type: ignore[index]
    return EXIT_OK


def _cmd_history(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity)
    rows = []
    for entry in cs.history():
        manifest = cs.get(entry.seq)
        writer = manifest.writer
        cursors, cursor_error = read_cursors(manifest.extra, what=f"checkpoint {entry.seq}")
        rows.append(
            {
                "seq": entry.seq,
                "created_at": entry.created_at,
                "schema": entry.schema_version,
                "epoch": entry.epoch,
                "files": entry.file_count,
                "bytes": entry.total_size,
                "writer": writer.describe(),
                "cursors": cursors_to_json(cursors) if args.json else describe_cursors(cursors),
                "pinned": "pinned" if entry.pinned is not None else None,
                "pin": entry.pinned.to_json() if entry.pinned is not None else None,
            }
        )
        if cursor_error:  # a malformed record is shown as such, never taken for "no cursors"
            rows[-1].update(cursors=None if args.json else "unreadable", cursors_error=cursor_error)
    columns = ["seq", "created_at", "schema", "epoch", "files", "bytes", "writer", "pinned", "cursors"]
    emit(rows, columns, as_json=args.json)
    return EXIT_OK


def _cmd_cat(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity)
    manifest = cs.get(args.seq) if args.seq is not None else cs.latest()
    if manifest is None:
        raise CheckpointNotFoundError(f"identity {args.identity!r} has no checkpoint yet")
    if not args.files:
        print(json.dumps(manifest.value, indent=2, default=str))
        return EXIT_OK
    with _mode_hint():
        restored = cs.restore_files(manifest, args.files, mode=args.mode)
    if args.json:
        print(json.dumps({"value": manifest.value, "restore": restored.to_json()}, indent=2, default=str))
    else:
        print(json.dumps(manifest.value, indent=2, default=str))
    print(restored.describe(), file=sys.stderr)
    return EXIT_OK


@contextlib.contextmanager
def _mode_hint() -> Iterator[None]:
    """A restore that mode "empty" refused says how to choose another mode here: with ``--mode``."""
    try:
        yield
    except DestinationNotEmptyError as exc:
        raise ValueError(
            f"{refusal(Path(str(exc.dest)), exc.names)}; nothing was restored (the default --mode empty never "
            "touches files that are already there). Pass --mode exact to make it hold exactly the checkpoint's "
            "files (the others are removed) or --mode merge to replace same-named files and keep the others, "
            "or choose an empty directory."
        ) from exc


def _cmd_rollback(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity)
    target = cs.get(args.to)
    lease = cs.acquire(holder=WriterInfo.current(task_id="airflow-stateful rollback"), steal=args.force)
    try:
        new = cs.commit(
            lease,
            target.value,
            encoded=True,  # copied as stored: a pickled value stays the same pickle, never unpickled here
            schema_version=target.schema_version,
            value_codec=target.value_codec,
            keep_files_from=target,
            extra={**target.extra, "rolled_back_from": target.seq},
            code=target.code,
            # A pinned checkpoint rolled back to is the newest now: its pin has done its job.
            unpin=[target.commit_id],
        )
    finally:
        cs.release(lease)
    emit(
        [{"identity": cs.identity.key, "seq": new.seq, "copy_of": target.seq}],
        ["identity", "seq", "copy_of"],
        as_json=args.json,
    )
    return EXIT_OK


def _cmd_unlock(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity)
    head = cs.head()
    assert head is not None
    if head.lease is not None and not head.lease.expired(cs.clock()) and not args.force:
        raise LeaseHeldError(
            f"{cs.identity} is leased by {head.lease.holder.describe()} until {head.lease.expires_at}; "
            "breaking a live lease fences that writer: pass --force if it is really gone."
        )
    after = cs.break_lease()
    assert after is not None
    emit(
        [{"identity": cs.identity.key, "epoch": after.epoch, "lease": None}],
        ["identity", "epoch", "lease"],
        as_json=args.json,
    )
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace, store: ObjectStore) -> int:
    keys = [i.key for i in list_identities(store)] if args.all else [args.identity]
    if not keys:
        raise CheckpointNotFoundError(f"no identity in {store.url}")
    rows, bad = [], 0
    bar = progress("verify", len(keys))
    for key in keys:
        bar()
        try:
            cs = checkpoints_of(store, key)
        except CheckpointNotFoundError:
            if not args.all:
                raise
            continue  # listed for objects of its own but no head: no state to verify (gc removes them)
        except CheckpointCorruptError as exc:
            if not args.all:
                raise
            rows.append({"identity": key, "seq": None, "files": None, "status": f"CORRUPT: {exc}"})
            bad += 1
            continue
        for entry in cs.history():
            status = "ok"
            try:
                cs.verify(cs.get(entry.seq))  # read back and hash every byte, then throw it away
            except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
                status, bad = f"CORRUPT: {exc}", bad + 1
            rows.append({"identity": key, "seq": entry.seq, "files": entry.file_count, "status": status})
    bar.finish()
    emit(rows, ["identity", "seq", "files", "status"], as_json=args.json)
    return EXIT_PROBLEM if bad else EXIT_OK


def _airflow_run_states(args: argparse.Namespace) -> tuple[RunStates | None, str]:
    """Where GC asks whether runs are finished (``--airflow-conn-id``: the REST API; ``--airflow db``/``auto``: the
    metadata database), and a line saying which or why not. ``--airflow db`` without a database is an error."""
    if args.airflow_conn_id:
        from airflow_stateful.hooks.airflow_api import AirflowApiHook

        states = AirflowApiHook(airflow_conn_id=args.airflow_conn_id).run_states()
        return states, f"Airflow's REST API at {states.base_url} (connection {args.airflow_conn_id!r})"
    if args.airflow == "no":
        return None, "Airflow not asked (--airflow no): the heads' recorded outcomes decide"
    from airflow_stateful.cli.airflow_db import metadata_db_run_states

    db, line = metadata_db_run_states()
    logs_to_stderr()  # opening Airflow's database configures Airflow's logging, which points it at stdout
    if db is None and args.airflow == "db":
        raise ConfigurationError(f"--airflow db: {line}")
    if db is None:
        return None, f"Airflow not asked: {line}; the heads' recorded outcomes decide"
    return db, line


def _cmd_gc(args: argparse.Namespace, store: ObjectStore) -> int:
    """Plan, then (unless ``--dry-run``) apply: both print the same rows for an unchanged store, one per identity,
    each saying why it is kept or deleted (the ``why`` column; ``lifetime`` in ``--json``)."""
    groups = group_by_identity(store, args.prefix or "")
    lives = lifetimes(args)
    airflow, asked = _airflow_run_states(args)
    print(f"gc: asking {asked}" if airflow is not None else f"gc: {asked}", file=sys.stderr)
    bar = progress("gc: planning", len(groups))
    plan = plan_gc(
        store,
        idle_for=lives.idle_for,
        release_after_success=lives.release_after_success,
        keep_failed_for=lives.keep_failed_for,
        airflow=airflow,
        keep_last=args.keep_last,
        min_age=args.min_age,
        grace=args.lease_grace,
        prefix=args.prefix or "",
        progress=bar,
        groups=groups,
    )
    bar.finish()
    skipped: dict[str, str] = {}
    if not args.dry_run:
        bar = progress("gc: deleting", len(plan.identities))
        skipped = apply_gc(plan, progress=bar).skipped
        bar.finish()
    rows = []
    for item in plan.everything:
        if item.reasons or item.skipped:
            action = item.action(dry_run=args.dry_run, skipped=skipped.get(item.identity))
        else:
            action = "kept"
        rows.append(
            {
                "identity": item.identity,
                "reasons": ",".join(item.reasons) or None,
                "objects": len(item.keys),
                "bytes": item.bytes,
                "action": action,
                "why": item.why or None,
                "keys": item.keys,
            }
        )
    emit(rows, ["identity", "reasons", "objects", "bytes", "action", "why"], as_json=args.json)
    return EXIT_OK


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    days, rest = divmod(int(seconds), 86400)
    return f"{days}d{rest // 3600}h" if days else f"{rest // 3600}h{rest % 3600 // 60}m"


def _cmd_du(args: argparse.Namespace, store: ObjectStore) -> int:
    """One full listing (sizes are only in listings), then the heads read a few at a time, each identity's row
    printed as soon as it is read, and a TOTAL row. A head that cannot be read leaves its row with an
    ``error`` (its bytes still count) and the exit code 1."""
    price = args.price_per_gb_month
    total = {"checkpoints": 0, "objects": 0, "bytes": 0, "garbage_bytes": 0}
    errors = 0
    lives = lifetimes(args)

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal errors
        for u in disk_usage(store, prefix=args.prefix or ""):
            for field in total:
                total[field] += getattr(u, field)
            row = {
                "identity": u.identity,
                "checkpoints": u.checkpoints,
                "objects": u.objects,
                "bytes": u.bytes,
                "garbage_bytes": u.garbage_bytes,
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
            "idle": None,
            "idle_seconds": None,
            "usd_per_month": round(total["bytes"] / GB * price, 6),
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
        "idle",
        "usd_per_month",
        "outcome",
        "lifetime",
    ]
    emit(rows(), columns, as_json=args.json, page=TABLE_PAGE)
    return EXIT_PROBLEM if errors else EXIT_OK


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


def _duration(text: str) -> timedelta:
    """argparse type for ``--min-age`` / ``--idle-for``: ``30m``, ``12h``, ``30d``, seconds."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _interval(text: str) -> timedelta:
    """argparse type for ``--default-interval``: a duration of at least a second."""
    interval = _duration(text)
    if interval < timedelta(seconds=1):
        raise argparse.ArgumentTypeError(f"must be at least 1 second, not {text!r}")
    return interval


def _statuses(text: str) -> list[str]:
    """argparse type for ``--status``: one status or a comma list (the option may also be repeated)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in STATUSES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose from {', '.join(STATUSES)} (several: a comma list or --status again)"
        )
    return names


def _add_default_interval(p: argparse.ArgumentParser) -> None:
    default = hms(EXPECTED_CHECKPOINT_INTERVAL.total_seconds())
    p.add_argument(
        "--default-interval",
        type=_interval,
        metavar="DURATION",
        help="how long a live lease may go without a commit before it is stuck, for leases that record no "
        "expected_checkpoint_interval of their own (default: [stateful] expected_checkpoint_interval, "
        f"{default} unless configured)",
    )


def _add_lifetimes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--release-after-success",
        type=_duration,
        metavar="DURATION",
        help="delete per-run state this long after its task succeeded (default: [stateful] "
        "release_after_success, unset: by --idle-for)",
    )
    p.add_argument(
        "--keep-failed-for",
        type=_duration,
        metavar="DURATION",
        help="keep per-run state of a task that failed for good at least this long, so a cleared task resumes "
        f"(default: [stateful] keep_failed_for, {hms(KEEP_FAILED_FOR.total_seconds())}; 0: no minimum)",
    )


def _add_restore_mode(p: argparse.ArgumentParser, dest: str) -> None:
    p.add_argument(
        "--mode",
        choices=MODES,
        default=EMPTY,
        help=f"what the restore does with what {dest} already holds: empty (default: refuse unless {dest} is "
        f"missing or empty, so your files are never deleted unasked), exact ({dest} ends holding exactly the "
        "checkpoint's files: the others are removed), merge (replace same-named files, keep the others)",
    )


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--backend", help="s3://bucket/prefix or file:///path (default: [stateful] backend_url)"
    )
    common.add_argument("--endpoint-url", help="S3-compatible endpoint (default: STATEFUL_S3_ENDPOINT_URL)")
    common.add_argument(
        "--conn-id", help="Airflow connection with S3 credentials (default: [stateful] conn_id)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser = argparse.ArgumentParser(
        prog="airflow-stateful", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser(
        "ls", parents=[common], help="list identities with their status (active, stuck, dead, idle)"
    )
    p.add_argument("prefix", nargs="?")
    p.add_argument(
        "--status",
        type=_statuses,
        action="extend",
        metavar="STATUS",
        help=f"only identities with this status: {', '.join(STATUSES)}; a comma list or repeated for several",
    )
    _add_default_interval(p)
    p.set_defaults(run=_cmd_ls)
    p = sub.add_parser(
        "stuck",
        parents=[common],
        help="list stuck identities (live lease, no commit for too long); exit 0 none, 1 some, 2 error",
        description="List identities whose writer is alive (its lease is renewed) but has committed nothing "
        "for longer than its expected checkpoint interval. Dead identities (lease expired) are not stuck: "
        "they are named on stderr and do not change the exit code. Exit codes: 0 nothing stuck; 1 at least "
        "one identity stuck; 2 the check could not be made or is incomplete (bad usage or configuration, the "
        "store could not be listed, a head could not be read) and nothing was found stuck.",
    )
    p.add_argument("prefix", nargs="?", help="only identities whose key starts with this (or --prefix)")
    p.add_argument(
        "--prefix", dest="prefix_option", metavar="PREFIX", help="the same as the positional prefix"
    )
    _add_default_interval(p)
    p.set_defaults(run=_cmd_stuck, error_exit=EXIT_USAGE)
    p = sub.add_parser(
        "outputs",
        parents=[common],
        help="list the outputs committed with a checkpoint, or download one (--get NAME --to DIR)",
    )
    p.add_argument("identity")
    p.add_argument("--seq", type=int, help="a kept checkpoint (default: the newest)")
    p.add_argument(
        "--get", metavar="NAME", help="download this output (verified) to DIR/NAME; print the path"
    )
    p.add_argument("--to", type=Path, metavar="DIR", help="where --get puts the output")
    _add_restore_mode(p, "DIR/NAME")
    p.set_defaults(run=_cmd_outputs)
    for name, fn, text in (
        ("show", _cmd_show, "an identity's head and latest checkpoint"),
        ("history", _cmd_history, "kept checkpoints"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("identity")
        p.set_defaults(run=fn)
    p = sub.add_parser(
        "cat",
        parents=[common],
        help="print a checkpoint's value (and restore its files)",
        description="Print a checkpoint's value as JSON; with --files DEST also restore its files into DEST "
        '(verified, all or nothing). With --json and --files the JSON is {"value": ..., "restore": '
        "{files, removed, mode, ...}}.",
    )
    p.add_argument("identity")
    p.add_argument("--seq", type=int)
    p.add_argument("--files", type=Path, metavar="DEST", help="restore the checkpoint's files into DEST")
    _add_restore_mode(p, "DEST")
    p.set_defaults(run=_cmd_cat)
    p = sub.add_parser(
        "rollback", parents=[common], help="commit a copy of an older checkpoint as the newest"
    )
    p.add_argument("identity")
    p.add_argument("--to", type=int, required=True, metavar="SEQ")
    p.add_argument("--force", action="store_true", help="take the lease from a live writer (fencing it)")
    p.set_defaults(run=_cmd_rollback)
    p = sub.add_parser("unlock", parents=[common], help="break an identity's lease (fences its holder)")
    p.add_argument("identity")
    p.add_argument("--force", action="store_true", help="break a lease that has not expired")
    p.set_defaults(run=_cmd_unlock)
    p = sub.add_parser("verify", parents=[common], help="re-check every checksum (report, never repair)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("identity", nargs="?")
    target.add_argument("--all", action="store_true")
    p.set_defaults(run=_cmd_verify)
    p = sub.add_parser(
        "gc", parents=[common], help="apply retention and delete idle, orphaned and crash-left objects"
    )
    p.add_argument("prefix", nargs="?")
    p.add_argument(
        "--min-age", type=_duration, default=timedelta(hours=1), help="leave younger objects (default 1h)"
    )
    p.add_argument(
        "--idle-for", type=_duration, metavar="DURATION", help="delete identities not updated for this long"
    )
    p.add_argument("--keep-last", type=int, metavar="N", help="keep at most N checkpoints per identity")
    _add_lifetimes(p)
    p.add_argument(
        "--airflow",
        choices=("auto", "db", "no"),
        default="auto",
        help="ask Airflow's metadata database whether a run is finished before deleting its state: auto (if this "
        "installation's database can be read), db (it must be), no (the heads' recorded outcomes decide)",
    )
    p.add_argument(
        "--airflow-conn-id",
        metavar="CONN_ID",
        help="ask Airflow's REST API instead, through this connection (type http: the API server URL, a user)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list every identity and why it is kept or deleted; change nothing",
    )
    p.set_defaults(run=_cmd_gc)
    p = sub.add_parser(
        "du", parents=[common], help="bytes, checkpoints, idle age and monthly cost per identity"
    )
    p.add_argument("prefix", nargs="?")
    p.add_argument(
        "--price-per-gb-month",
        type=float,
        default=DEFAULT_PRICE_PER_GB_MONTH,
        help=f"storage price in USD (default {DEFAULT_PRICE_PER_GB_MONTH}, S3 Standard)",
    )
    p.add_argument(
        "--idle-for",
        type=_duration,
        metavar="DURATION",
        help="judge the lifetime column as `gc --idle-for` would (default: no age limit)",
    )
    _add_lifetimes(p)
    p.set_defaults(run=_cmd_du)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace, ObjectStore], int] = args.run
    # A command whose exit 1 means a finding (``stuck``) turns every failure into this code instead, so a
    # monitor never takes a broken check for a finding.
    error_exit: int | None = getattr(args, "error_exit", None)
    try:
        store = open_store(args)
        try:
            return run(args, store)
        finally:
            store.close()
    except CheckpointNotFoundError as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except (LeaseHeldError, FencedError) as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_LEASE
    except (ConfigurationError, ValueError) as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StatefulError as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_PROBLEM if error_exit is None else error_exit
    except Exception as exc:
        if error_exit is None:
            raise
        print(f"airflow-stateful: {type(exc).__name__}: {exc}", file=sys.stderr)
        return error_exit

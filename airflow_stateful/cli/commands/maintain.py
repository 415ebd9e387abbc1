"""``verify``, ``unlock``, ``rollback`` and ``gc``: looking after the store, the verbs that check or change it.

Together because each is an operator's act on stored state rather than a look at it: re-hash every byte,
break a lease, commit an older checkpoint again, delete what nothing needs. None takes an identity from a live
writer unasked: ``unlock`` and ``rollback`` need ``--force`` for that, and ``gc`` breaks only leases dead past
their grace.
"""

from __future__ import annotations

import argparse
import sys

from airflow_stateful.cli.common import checkpoints_of, lifetimes, progress, selected_groups
from airflow_stateful.cli.exit_codes import EXIT_OK, EXIT_PROBLEM
from airflow_stateful.cli.opening import logs_to_stderr
from airflow_stateful.cli.output import emit
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigurationError,
    LeaseHeldError,
)
from airflow_stateful.core.fleet.catalog import list_identities
from airflow_stateful.core.fleet.gc import apply_gc, plan_gc
from airflow_stateful.core.fleet.lifetimes import RunStates
from airflow_stateful.core.protocol.rollback import commit_copy
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import ObjectStore


def cmd_verify(args: argparse.Namespace, store: ObjectStore) -> int:
    keys = [i.key for i in list_identities(store)] if args.all else [args.identity]
    if not keys:
        raise CheckpointNotFoundError(f"no identity in {store.url}")
    rows, bad = [], 0
    bar = progress("verify", len(keys))
    for key in keys:
        bar()
        try:
            cs = checkpoints_of(store, key, signer=args.signer, marks=args.marks)
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
    emit(rows, ["identity", "seq", "files", "status"], as_json=args.json, out=args.out)
    return EXIT_PROBLEM if bad else EXIT_OK


def cmd_unlock(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity, signer=args.signer, marks=args.marks)
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
        out=args.out,
    )
    return EXIT_OK


def cmd_rollback(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity, signer=args.signer, marks=args.marks)
    target = cs.get(args.to)
    lease = cs.acquire(holder=WriterInfo.current(task_id="airflow-stateful rollback"), steal=args.force)
    try:
        new = commit_copy(cs, lease, target)  # records that it copies target (``copy_of``), for history
    finally:
        cs.release(lease)
    emit(
        [{"identity": cs.identity.key, "seq": new.seq, "copy_of": target.seq}],
        ["identity", "seq", "copy_of"],
        as_json=args.json,
        out=args.out,
    )
    return EXIT_OK


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


def cmd_gc(args: argparse.Namespace, store: ObjectStore) -> int:
    """Plan, then (unless ``--dry-run``) apply: both print the same rows for an unchanged store, one per identity,
    each saying why it is kept or deleted (the ``why`` column; ``lifetime`` in ``--json``)."""
    groups = selected_groups(args, store)
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
        signer=args.signer,
        marks=args.marks,
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
        repack = item.repack if item.identity not in skipped else None
        after = item.packs_after(repacked=repack is not None)
        rows.append(
            {
                "identity": item.identity,
                "reasons": ",".join(item.reasons) or None,
                "objects": len(item.keys),
                "bytes": item.bytes,
                "action": action,
                "why": item.why or None,
                # Its packs after this pass (repacked, unless the pass skipped that): the dead bytes are those
                # inside kept packs that no kept checkpoint needs (docs/adr/0006-packs.md).
                "packs": after.packs,
                "pack_bytes": after.bytes,
                "dead_pack_bytes": after.dead_bytes,
                "repacked_packs": len(repack.packs) if repack else 0,
                "repack_copied_bytes": repack.live_bytes if repack else 0,
                "keys": item.keys,
            }
        )
    columns = ["identity", "reasons", "objects", "bytes", "dead_pack_bytes", "action", "why"]
    emit(
        rows,
        columns,
        as_json=args.json,
        out=args.out,
        sizes=("bytes", "dead_pack_bytes"),
        exact=args.exact_sizes,
    )
    return EXIT_OK

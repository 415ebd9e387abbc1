"""``show``, ``history``, ``cat`` and ``outputs``: one identity's checkpoints, read and never changed.

Together because each reads one identity (its head, its kept checkpoints, a checkpoint's value, files or
outputs) and leaves the store as it was; ``cat --files`` and ``outputs --get`` write only to the local
destination, in the restore mode ``--mode`` names (``empty`` by default, so a user's files are never deleted
unasked).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from airflow_stateful.cli.common import checkpoint_size, checkpoints_of
from airflow_stateful.cli.exit_codes import EXIT_OK
from airflow_stateful.cli.output import emit
from airflow_stateful.core.data.restore_modes import refusal
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DestinationNotEmptyError,
)
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.cursors import cursors_to_json, describe_cursors, read_cursors
from airflow_stateful.core.records.lineage import CopyOf
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import OutputInfo, check_output_name, content_sha256
from airflow_stateful.core.stores.base import ObjectStore


def cmd_show(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity, signer=args.signer, marks=args.marks)
    head = cs.head()
    assert head is not None
    latest = cs.latest()
    cursors, cursor_error = (
        read_cursors(latest.extra, what=f"checkpoint {latest.seq}") if latest else ({}, None)
    )
    lease = head.lease
    kept = {e.commit_id for e in head.checkpoints}
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
            "copy_of": lineage_json(latest.copy_of, kept),
            "files": [{"path": f.path, "size": f.size, "objects": len(f.keys)} for f in cs.files(latest)],
            "cursors": cursors_to_json(cursors),
            **({"cursors_error": cursor_error} if cursor_error else {}),
            "value": latest.value if latest.value_codec == "json" else f"<{latest.value_codec}>",
        },
    }
    if args.json:
        print(json.dumps(info, indent=2, default=str), file=args.out)
    else:
        for field in ("identity", "store", "epoch", "lease", "kept"):
            print(f"{field + ':':<10} {info[field] if info[field] is not None else '-'}", file=args.out)
        print(f"{'outcome:':<10} {head.outcome.describe() if head.outcome else '-'}", file=args.out)
        for entry in head.pinned:
            assert entry.pinned is not None
            print(
                f"{'pinned:':<10} checkpoint {entry.seq} (schema {entry.schema_version}): {entry.pinned.reason}",
                file=args.out,
            )
        if latest is not None:
            print(
                f"latest:    checkpoint {latest.seq} by {latest.writer.describe()} at {latest.created_at}, "
                f"schema {latest.schema_version}, {latest.file_count} file(s)",
                file=args.out,
            )
            if latest.code is not None:
                print(f"code:      {latest.code.describe()}", file=args.out)
            if latest.copy_of is not None:
                print(f"lineage:   {describe_lineage(latest.copy_of, kept)}", file=args.out)
            print(f"cursors:   {cursor_error or describe_cursors(cursors)}", file=args.out)
            print(f"value:     {json.dumps(info['latest']['value'], default=str)[:200]}", file=args.out)  # type: ignore[index]
    return EXIT_OK


def cmd_history(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity, signer=args.signer, marks=args.marks)
    rows = []
    entries = cs.history()
    kept = {e.commit_id for e in entries}
    for entry in entries:
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
                "size": checkpoint_size(entry),
                "writer": writer.describe(),
                "cursors": cursors_to_json(cursors) if args.json else describe_cursors(cursors),
                "pinned": "pinned" if entry.pinned is not None else None,
                "pin": entry.pinned.to_json() if entry.pinned is not None else None,
                "copy_of": lineage_json(manifest.copy_of, kept)
                if args.json
                else describe_lineage(manifest.copy_of, kept),
            }
        )
        if cursor_error:  # a malformed record is shown as such, never taken for "no cursors"
            rows[-1].update(cursors=None if args.json else "unreadable", cursors_error=cursor_error)
    columns = [
        "seq",
        "created_at",
        "schema",
        "epoch",
        "files",
        "size",
        "writer",
        "pinned",
        "copy_of",
        "cursors",
    ]
    emit(rows, columns, as_json=args.json, out=args.out, sizes=("size",), exact=args.exact_sizes)
    return EXIT_OK


def lineage_json(copy_of: CopyOf | None, kept: Collection[str]) -> dict[str, Any] | None:
    """The ``copy_of`` of ``--json``: the original's seq and commit id, and whether the head still keeps it (a
    script can tell a rollback whose original retention dropped)."""
    if copy_of is None:
        return None
    return {**copy_of.to_json(), "kept": copy_of.commit_id in kept}


def describe_lineage(copy_of: CopyOf | None, kept: Collection[str]) -> str | None:
    """``copy of seq 2``, and ``(no longer kept, commit <id>)`` once the original is gone: then its seq may be
    unfamiliar, and the commit id is what logs and events named it by."""
    if copy_of is None:
        return None
    if copy_of.commit_id in kept:
        return copy_of.describe()
    return f"{copy_of.describe()} (no longer kept, commit {copy_of.commit_id})"


def cmd_cat(args: argparse.Namespace, store: ObjectStore) -> int:
    cs = checkpoints_of(store, args.identity, signer=args.signer, marks=args.marks)
    manifest = cs.get(args.seq) if args.seq is not None else cs.latest()
    if manifest is None:
        raise CheckpointNotFoundError(f"identity {args.identity!r} has no checkpoint yet")
    if not args.files:
        print(json.dumps(manifest.value, indent=2, default=str), file=args.out)
        return EXIT_OK
    with _mode_hint():
        # durable: what the CLI restores outlives it (no retry restores it again after a power cut).
        restored = cs.restore_files(
            manifest, args.files, mode=args.mode, shared_dest=args.shared_dest, durable=True
        )
    if args.json:
        print(
            json.dumps({"value": manifest.value, "restore": restored.to_json()}, indent=2, default=str),
            file=args.out,
        )
    else:
        print(json.dumps(manifest.value, indent=2, default=str), file=args.out)
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


OUTPUT_COLUMNS = ["name", "kind", "size", "sha256", "seq", "committed_at", "try", "location"]


def cmd_outputs(args: argparse.Namespace, store: ObjectStore) -> int:
    """The outputs committed with the newest checkpoint (or ``--seq``); ``--get NAME --to DIR`` downloads one."""
    if (args.get is None) != (args.to is None):
        raise ValueError("--get NAME and --to DIR go together")
    cs = checkpoints_of(store, args.identity, signer=args.signer, marks=args.marks)
    manifest = cs.get(args.seq) if args.seq is not None else cs.latest()
    if manifest is None:
        raise CheckpointNotFoundError(f"identity {args.identity!r} has no checkpoint yet, so no outputs")
    outputs = cs.outputs(manifest)
    if args.get is not None:
        return _get_output(args, cs, manifest, outputs)
    if args.json:
        emit([info.to_json() for info in outputs.values()], OUTPUT_COLUMNS, as_json=True, out=args.out)
    else:
        rows = [{**info.to_json(), "try": info.try_number} for info in outputs.values()]
        emit(rows, OUTPUT_COLUMNS, as_json=False, out=args.out, sizes=("size",), exact=args.exact_sizes)
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
        written = cs.restore_output(
            name, dest, manifest=manifest, mode=args.mode, shared_dest=args.shared_dest
        )
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
            ),
            file=args.out,
        )
    else:
        print(target, file=args.out)
    return EXIT_OK


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()

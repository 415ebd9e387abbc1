"""Issue 32's many-small-files comparison: a tree of small files saved, re-saved with 1 % of its files
rewritten, and restored cold, by this library (packs), by restic and by a plain boto3 pool, on one SeaweedFS.

Run it with ``.venv/bin/python benchmarks/bench_small_files.py`` (``--help``; about 6 minutes with the
defaults on two cores, ``--trees 500x4 --repeat 1`` for a smoke run). It starts SeaweedFS on 127.0.0.1 (a real
S3 server: see bench_restic.py for why not moto) and, per tree (``--trees``, default ``10000x4,1000x100``:
10,000 files of 4 KiB and 1,000 of 100 KiB, random bytes, 100 files per directory), times with the order of
the sides rotating per repetition:

``first save``
    ``restic backup --compression off`` into a new repository (init untimed) vs ``CheckpointStore.commit`` to
    a new identity vs boto3 ``put_object`` of every file as an object of its own, by 8 threads (what a
    one-object-per-file client does at its best: no hashing, no tree, no commit).
``1% rewritten, re-save``
    before each repetition (untimed) 1 % of the files, spread over the tree, get fresh bytes; then ``restic
    backup`` with its parent snapshot vs ``commit`` on the identity holding the previous version vs boto3
    ``put_object`` of only the rewritten files by 8 threads (a client that knows which files changed).
``cold restore``
    ``restic restore latest --no-cache`` vs a new ``CheckpointStore`` (nothing in memory) with ``latest()`` and
    ``restore_files`` (no restore cache; task files are not fsynced, as in a task: docs/adr/0006-packs.md) vs
    boto3 ``get_object`` of every file by 8 threads, written to files.
``objects after one save``
    the objects each side's first save left in the bucket (the figure itself, unit "objects"; goal: at most
    files / 100 + 5).

Each scenario also times its **floor** in the same rotation, given over restic on the restic row: what any
client that packs small files and checks them by SHA-256 must do on this server and disk, with nothing else
(no tree, commit, index, staging or journal): the first save reads and hashes every file into 8 MiB packs PUT
by 8 threads; a re-save lstats every file and reads, hashes and PUTs as one pack only the rewritten ones, by the
same writer (its file index) and by a new process alike (it trusts the statuses the previous tree recorded, as
restic trusts its parent snapshot; before 2026-12-07 a new process read every file, and that floor was
0.19-0.21x restic); a cold restore GETs those packs whole by
8 threads and checks and writes every file (no fsync). A missed goal with a floor below it is the library's
own cost; at or above it, the server's or the disk's.

Goals (issue 32): first save and cold restore <= 0.5x restic, re-save <= 0.3x restic, each also reported
against the boto3 pool (goal 1.0x). ``--json-out PATH`` writes the rows ``run_all.py`` collects; the exit code
is 0 whether or not the goals are met. Without restic (``apt-get install restic``) its rows are skipped, saying
why.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_restic import Restic, Timed, delete_prefix, log, ratio_row, restic_binary, rotate
from bench_rows import skipped_row, write_json_out
from bench_server import Endpoint, add_server_option, start_server
from bench_store import CpuClock, RequestCounter, endpoint_client, settle

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.stores.s3 import S3ObjectStore

KIB = 1024
POOL = 8
"""Threads of the plain boto3 side (issue 32: "an 8-thread boto3 pool")."""
FLOOR_PACK = 8 * 1024 * KIB
"""The floors' pack size: the library's (``airflow_stateful.core.data.packs.PACK_TARGET``)."""
GOALS = {
    "first save": 0.5,
    "1% rewritten, re-save": 0.3,
    "1% rewritten, re-save by the same writer": 0.3,
    "cold restore": 0.5,
}


def parse_trees(text: str) -> list[tuple[int, int]]:
    """``"10000x4,1000x100"`` -> [(10000, 4096), (1000, 102400)]: file count x KiB."""
    trees = []
    for part in text.split(","):
        count, _, kib = part.strip().partition("x")
        if not count.isdigit() or not kib.isdigit() or int(count) < 100:
            raise argparse.ArgumentTypeError(f"--trees: {part!r} is not COUNTxKIB with COUNT >= 100")
        trees.append((int(count), int(kib) * KIB))
    return trees


def make_tree(root: Path, count: int, size: int) -> list[Path]:
    paths = []
    for n in range(count):
        path = root / f"part={n // 100:04d}" / f"f{n:06d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def pool_put(client: Any, bucket: str, prefix: str, root: Path, paths: list[Path]) -> None:
    def put(path: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root)}", Body=path.read_bytes())

    with ThreadPoolExecutor(POOL) as pool:
        list(pool.map(put, paths))


def pool_get(client: Any, bucket: str, prefix: str, keys: list[str], dest: Path) -> None:
    def get(key: str) -> None:
        target = dest / key[len(prefix) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    with ThreadPoolExecutor(POOL) as pool:
        list(pool.map(get, keys))


Layout = list[tuple[str, list[tuple[Path, int, int, bytes]]]]
"""The floor's packs: each key with its files (path, offset, size, SHA-256 digest)."""


def floor_save(client: Any, bucket: str, prefix: str, paths: list[Path]) -> Layout:
    """What any packing client must do to save ``paths``: read and SHA-256 every file, append it to a pack, PUT
    each pack of :data:`FLOOR_PACK` bytes as it fills, 8 threads. No tree, no commit, no index."""
    layout: Layout = []
    with ThreadPoolExecutor(POOL) as pool:
        futures = []
        buf = bytearray()
        entries: list[tuple[Path, int, int, bytes]] = []

        def flush(body: bytes, packed: list[tuple[Path, int, int, bytes]]) -> None:
            key = f"{prefix}/pack-{len(layout)}"
            layout.append((key, packed))
            futures.append(pool.submit(client.put_object, Bucket=bucket, Key=key, Body=body))

        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.read(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            entries.append((path, len(buf), len(data), hashlib.sha256(data).digest()))
            buf += data
            if len(buf) >= FLOOR_PACK:
                flush(bytes(buf), entries)
                buf, entries = bytearray(), []
        if entries:
            flush(bytes(buf), entries)
        for future in futures:
            future.result()
    return layout


def floor_resave(client: Any, bucket: str, key: str, paths: list[Path], changed: list[Path]) -> None:
    """A re-save's floor: lstat every file, read and hash only the rewritten ones (whose status moved) and PUT
    their bytes as one pack. No tree, no commit. A client that trusted no file metadata would read and hash
    every file instead: 0.19-0.21x restic on SeaweedFS (docs/performance.md)."""
    wanted = set(changed)
    buf = bytearray()
    for path in paths:
        os.lstat(path)
        if path not in wanted:
            continue
        data = path.read_bytes()
        hashlib.sha256(data).digest()
        buf += data
    client.put_object(Bucket=bucket, Key=key, Body=bytes(buf))


def floor_restore(client: Any, bucket: str, layout: Layout, src: Path, dest: Path) -> None:
    """A cold restore's floor: GET every pack whole, 8 threads, check each file's SHA-256 and write it to a file
    of its own (open, write, close; no fsync, no staging, no journal)."""
    for parent in {path.parent for _, entries in layout for path, *_ in entries}:
        (dest / parent.relative_to(src)).mkdir(parents=True, exist_ok=True)

    def get(pack: tuple[str, list[tuple[Path, int, int, bytes]]]) -> None:
        key, entries = pack
        body = memoryview(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        for path, offset, size, digest in entries:
            data = body[offset : offset + size]
            if hashlib.sha256(data).digest() != digest:
                raise RuntimeError(f"floor: {key} at {offset} does not hash to what was saved")
            fd = os.open(dest / path.relative_to(src), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    with ThreadPoolExecutor(POOL) as pool:
        list(pool.map(get, layout))


def count_objects(client: Any, bucket: str, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return sum(len(page.get("Contents", [])) for page in pages)


def run_tree(
    args: argparse.Namespace, endpoint: Endpoint, work: Path, count: int, size: int, binary: str | None
) -> list[dict[str, Any]]:
    label = f"{count:,} x {size // KIB} KiB"
    bucket = f"bench-small-{uuid.uuid4().hex[:8]}"
    store = S3ObjectStore(bucket=bucket, prefix="candidate", **endpoint.store_kwargs())
    client = endpoint_client(endpoint, POOL)
    client.create_bucket(Bucket=bucket)
    restic = Restic(binary, endpoint, bucket, work) if binary else None
    clock = CpuClock(endpoint.pid)
    bcount, ccount = RequestCounter(client), RequestCounter(store.client)
    rng = random.Random(32)
    src = work / "src"
    log(f"{label}: writing the tree")
    paths = make_tree(src, count, size)
    lib, rest, boto = Timed("library"), Timed("restic"), Timed("boto3 pool")
    rows: list[dict[str, Any]] = []
    objects: dict[str, int] = {}
    layout: Layout = []

    def identity(i: int) -> Identity:
        return Identity.for_task(dag_id="bench", task_id="small", name=f"r{i}")

    def commit(i: int) -> None:
        cs = CheckpointStore(store=store, identity=identity(i))
        lease = cs.acquire(steal=True)
        cs.commit(lease, {"rep": i}, files=src)
        cs.release(lease)

    try:
        # Warm-up, untimed: connections, the server's paths, restic's start.
        commit(-1)
        pool_put(client, bucket, "warm", src, paths[:50])
        if restic is not None:
            restic.init("warm")
            restic.backup("warm", src)

        # -- first save
        def first_lib(i: int) -> None:
            lib.run(lambda: commit(i), clock, ccount)

        def first_boto(i: int) -> None:
            boto.run(lambda: pool_put(client, bucket, f"boto/r{i}", src, paths), clock, bcount)

        def first_restic(i: int) -> None:
            assert restic is not None
            restic.init(f"restic/r{i}")
            rest.run(lambda: restic.backup(f"restic/r{i}", src), clock)

        low = Timed("floor")

        def first_floor(i: int) -> None:
            def go() -> None:
                layout[:] = floor_save(client, bucket, f"floor/r{i}", paths)  # the restore floor reads these

            low.run(go, clock)

        sides = [first_lib, first_boto, first_floor] + ([first_restic] if restic else [])
        rotate(args.repeat, None, sides)
        objects["library"] = count_objects(client, bucket, f"candidate/{identity(0).key}")
        objects["boto3 pool"] = count_objects(client, bucket, "boto/r0")
        if restic is not None:
            objects["restic"] = count_objects(client, bucket, "restic/r0")
        rows += table(
            label,
            "first save",
            lib,
            rest,
            boto,
            restic,
            "boto3 put_object of every file, 8 threads",
            low=low,
            low_what="every file read and SHA-256-hashed, appended to 8 MiB packs PUT by 8 threads",
        )
        log(f"{label}: first save: {lib.cpu('seaweedfs')}; {boto.cpu('seaweedfs')}")

        # -- 1% rewritten, re-save: every side saves the same new version of the tree, in turn
        lib, rest, boto = Timed("library"), Timed("restic"), Timed("boto3 pool")
        changed: list[Path] = []

        def rewrite(i: int) -> None:
            changed[:] = rng.sample(paths, max(1, count // 100))
            for path in changed:
                path.write_bytes(os.urandom(size))

        def resave_lib(i: int) -> None:
            lib.run(lambda: commit(0), clock, ccount)

        # The same re-save by a writer that saved the tree before (a task's next `state.save`): its file index
        # vouches for the files whose status did not change, so it reads only the rewritten ones. The other
        # row is a new process (a retry): it has no index, and trusts the statuses the previous tree recorded
        # (as restic trusts its parent snapshot), so it too reads only the rewritten files.
        writer = CheckpointStore(store=store, identity=identity(-2))
        writer_lease = writer.acquire(steal=True)
        writer.commit(writer_lease, {"rep": "warm"}, files=src)  # untimed: the writer has saved the tree once
        same = Timed("library")

        def resave_same(i: int) -> None:
            same.run(lambda: writer.commit(writer_lease, {"rep": i}, files=src), clock, ccount)

        def resave_boto(i: int) -> None:
            boto.run(lambda: pool_put(client, bucket, "boto/r0", src, changed), clock, bcount)

        def resave_restic(i: int) -> None:
            assert restic is not None
            rest.run(lambda: restic.backup("restic/r0", src), clock)

        low = Timed("floor")  # both rows: neither reads a file whose status says it is unchanged

        def resave_floor(i: int) -> None:
            low.run(lambda: floor_resave(client, bucket, f"floor/rs{i}", paths, changed), clock)

        rotate(
            args.repeat,
            rewrite,
            [resave_lib, resave_same, resave_boto, resave_floor] + ([resave_restic] if restic else []),
        )
        rows += table(
            label,
            "1% rewritten, re-save",
            lib,
            rest,
            boto,
            restic,
            "boto3 put_object of the rewritten files only, 8 threads",
            boto_goal=None,  # it is told which files changed; a re-save must find out (1,000s of stats)
            low=low,
            low_what="every file lstat'ed, the rewritten ones read, SHA-256-hashed and PUT as one pack",
        )
        rows += table(
            label,
            "1% rewritten, re-save by the same writer",
            same,
            rest,
            boto,
            restic,
            "boto3 put_object of the rewritten files only, 8 threads",
            boto_goal=None,
            low=low,
            low_what="every file lstat'ed, the rewritten ones read, SHA-256-hashed and PUT as one pack",
        )
        writer.release(writer_lease)

        # -- cold restore of the latest version
        lib, rest, boto = Timed("library"), Timed("restic"), Timed("boto3 pool")
        keys = [f"boto/r0/{p.relative_to(src)}" for p in paths]
        out = work / "out"

        def fresh() -> Path:
            shutil.rmtree(out, ignore_errors=True)
            return out

        def restore_lib(i: int) -> None:
            def go() -> None:
                cs = CheckpointStore(store=store, identity=identity(0))
                cs.restore_files(cs.latest(), fresh())  # type: ignore[arg-type]

            lib.run(go, clock, ccount)

        def restore_boto(i: int) -> None:
            boto.run(lambda: pool_get(client, bucket, "boto/r0", keys, fresh()), clock, bcount)

        def restore_restic(i: int) -> None:
            assert restic is not None
            rest.run(lambda: restic.restore("restic/r0", fresh()), clock)

        low = Timed("floor")

        def restore_floor(i: int) -> None:
            low.run(lambda: floor_restore(client, bucket, layout, src, fresh()), clock)

        rotate(
            args.repeat,
            None,
            [restore_lib, restore_boto, restore_floor] + ([restore_restic] if restic else []),
        )
        rows += table(
            label,
            "cold restore",
            lib,
            rest,
            boto,
            restic,
            "boto3 get_object of every file, 8 threads",
            low=low,
            low_what="8 MiB packs GET whole by 8 threads, each file SHA-256-checked and written (no fsync)",
        )
        rows.append(objects_row(label, count, objects))
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(work / "out", ignore_errors=True)
        delete_prefix(client, bucket, "")
        client.delete_bucket(Bucket=bucket)
    return rows


def table(
    label: str,
    name: str,
    lib: Timed,
    rest: Timed,
    boto: Timed,
    restic: Restic | None,
    boto_what: str,
    *,
    boto_goal: float | None = 1.0,
    low: Timed,
    low_what: str,
) -> list[dict[str, Any]]:
    """The rows of one scenario: ours / restic (issue 32's goal) and ours / the boto3 pool (``boto_goal``;
    ``None``: the pool does less than the scenario asks, so its row is a reference, with no verdict). ``low``
    is the scenario's floor (``low_what`` says what it did), given over restic on the restic row."""
    scenario = f"{label}, {name}"
    candidate = "CheckpointStore (packs)"
    out = []
    if restic is None:
        out.append(
            skipped_row(
                scenario=scenario, baseline="restic", candidate=candidate, goal=GOALS[name], why=RESTIC_WHY[0]
            )
        )
    else:
        out.append(
            ratio_row(
                scenario=scenario,
                baseline="restic (same server, --compression off)",
                candidate=candidate,
                base=rest,
                cand=lib,
                goal=GOALS[name],
                notes=f"{rest.cpu('seaweedfs')}; {lib.cpu('seaweedfs')}; {low.cpu('seaweedfs')}",
                floor_of=(low.median / rest.median, low_what),
            )
        )
    row = ratio_row(
        scenario=scenario,
        baseline=boto_what,
        candidate=candidate,
        base=boto,
        cand=lib,
        goal=boto_goal if boto_goal is not None else 0.0,
        notes=f"{boto.cpu('seaweedfs')}; {lib.cpu('seaweedfs')}",
    )
    if boto_goal is None:
        row.update(goal=None, verdict="REFERENCE")
    out.append(row)
    return out


def objects_row(label: str, count: int, objects: dict[str, int]) -> dict[str, Any]:
    goal = count / 100 + 5
    mine = objects["library"]
    return {
        "scenario": f"{label}, objects after one save",
        "baseline": ", ".join(f"{side}: {n}" for side, n in objects.items() if side != "library"),
        "candidate": "CheckpointStore (packs)",
        "ratio": mine,
        "ratio_min": mine,
        "ratio_max": mine,
        "goal": goal,
        "verdict": "PASS" if mine <= goal else "MISS",
        "requests_baseline": None,
        "requests_candidate": None,
        "notes": f"objects in the bucket after one save: {objects}",
        "unit": "objects",
        "runs": 1,
    }


RESTIC_WHY = [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=parse_trees, default=parse_trees("10000x4,1000x100"))
    parser.add_argument("--repeat", type=int, default=3, help="runs per side and scenario (default 3)")
    parser.add_argument("--restic", help="the restic binary (default: `restic` on PATH)")
    parser.add_argument("--json-out", type=Path, help="write the rows here (bench_rows.py's schema)")
    add_server_option(parser, choices=("seaweedfs",))
    args = parser.parse_args(argv)
    binary, why = restic_binary(args.restic)
    RESTIC_WHY[0] = why
    log(f"restic: {why}")
    rows: list[dict[str, Any]] = []
    with start_server(args.server) as endpoint, tempfile.TemporaryDirectory(prefix="bench-small-") as tmp:
        for count, size in args.trees:
            work = Path(tmp) / f"{count}x{size}"
            work.mkdir()
            rows += run_tree(args, endpoint, work, count, size, binary)
            settle()
        print_table(rows)
        if args.json_out is not None:
            write_json_out(args.json_out, rows, endpoint=endpoint.description, server=endpoint.server)
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| scenario | baseline | ratio (min-max) | goal | verdict | floor |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        goal = "-" if row["goal"] is None else f"<= {row['goal']:g}"
        if row["ratio"] is None:
            print(
                f"| {row['scenario']} | {row['baseline']} | skipped: {row['notes']} | {goal} | SKIPPED | - |"
            )
        elif row.get("unit") == "objects":
            print(
                f"| {row['scenario']} | {row['baseline']} | {row['ratio']} objects | {goal} | {row['verdict']} | - |"
            )
        else:
            low = row.get("floor")
            shown = f"{low['ratio']:.2f}x: {low['what']}" if low else "-"
            print(
                f"| {row['scenario']} | {row['baseline']} | {row['ratio']:.2f}x ({row['ratio_min']:.2f}-"
                f"{row['ratio_max']:.2f}) | {goal}x | {row['verdict']} | {shown} |"
            )


if __name__ == "__main__":
    sys.exit(main())

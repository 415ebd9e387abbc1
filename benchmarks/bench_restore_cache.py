"""A retry on the same worker restoring an unchanged checkpoint, with the worker's restore cache (issue 13).

Run it with ``.venv/bin/python benchmarks/bench_restore_cache.py`` (``--help`` for options; about 3 minutes at
the default 1 GiB on two cores, ``--quick`` about half that). It starts an S3 server on 127.0.0.1 in a
subprocess (``--server moto``, the default, or ``--server seaweedfs``: see ``bench_server.py``), commits one N
MiB file of random bytes
(default 1024) as a checkpoint, stores the same bytes as one plain object, fills a
:class:`~airflow_stateful.core.data.chunk_cache.LocalChunkCache` with one untimed restore, and then times,
interleaved (the order rotates every repetition, so no side always runs first, on a warmer server):

* **baseline**: ``boto3 download_file`` of the same bytes as one object (what a task without this library
  would do to get its file back);
* **warm cache**: what a retry does: a new ``CheckpointStore`` and a new ``LocalChunkCache`` on the same
  directory (a new process would build both), ``latest()`` + ``restore_files(manifest, dest, cache=...)``.
  Every chunk comes from the cache, read and checked against its SHA-256; only the head and the tree are read
  from S3 (the requests column shows it);
* **no cache** (skipped with ``--quick``): the same restore without the cache: every chunk downloaded.

The figure is the ratio of the medians, warm cache / download_file; the goal is <= 0.1. Ratios, never
absolute times: the server (moto: one Python process on the same cores, about 40 MiB/s down; SeaweedFS about
200-250 MiB/s here) dominates the baseline, and a faster endpoint makes the baseline shorter and the ratio larger; the warm restore's own cost (reading,
hashing twice, writing and fsyncing the restored file) depends only on the machine's disk and CPU.

Fairness: the baseline client is built as ``S3ObjectStore`` builds its own (``bench_store.make_client``),
with boto3's default ``TransferConfig``. ``os.sync()`` runs between runs, untimed, so one run's writeback is
not billed to the next. By default the cache files are in the page cache (they were just written, as after a
failed try a moment ago); ``--cold`` evicts them from the page cache before each warm run
(``posix_fadvise(DONTNEED)``), so the cache is read from disk.

``--json-out PATH`` writes the rows of issue 13's target table (schema in ``bench_rows.py``) that
``benchmarks/run_all.py`` collects. The exit code is 0 whether or not the goal is met (printed PASS or MISS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench_server import Endpoint, add_server_option, start_server
from bench_store import (  # the same helpers as the store benchmark (this folder)
    CpuClock,
    RequestCounter,
    Side,
    endpoint_client,
    settle,
    write_random_file,
)

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.data.chunk_cache import LocalChunkCache
from airflow_stateful.core.stores.s3 import MIB, S3ObjectStore

GOAL = 0.1  # issue 13: "retry on the same worker restoring 1 GiB unchanged | baseline: download | <= 0.1x"
IDENTITY = Identity.for_task(dag_id="bench", task_id="restore_cache", name="model")


def evict_from_page_cache(directory: Path) -> None:
    """Drop the files below ``directory`` from the page cache (no root needed), so the next read hits disk."""
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def local_copy_floor(work: Path, out_dir: Path, restore: Callable[[], None], runs: int = 3) -> float:
    """Median seconds to copy the restored file to a new file here and fsync it (untimed restore first): the
    least a restore from a local cache must do (read the bytes, write them, make them durable), no hashing."""
    restore()
    [src] = [p for p in out_dir.rglob("*") if p.is_file()]
    times = []
    for _ in range(runs):
        settle()
        dst = work / "floor-copy.bin"
        start = time.perf_counter()
        shutil.copyfile(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - start)
        dst.unlink()
    shutil.rmtree(out_dir)
    return statistics.median(times)


def size_label(size_mib: int) -> str:
    return f"{size_mib // 1024} GiB" if size_mib % 1024 == 0 else f"{size_mib} MiB"


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    with start_server(args.server) as server:
        return run_on(server, args, log)


def run_on(server: Endpoint, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    size = args.size_mib * MIB
    store: S3ObjectStore | None = None
    try:
        log(f"{server.server} server on {server.url}")
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        store = S3ObjectStore(bucket=bucket, prefix="candidate", **server.store_kwargs())
        client = endpoint_client(server, store.max_concurrency)
        client.create_bucket(Bucket=bucket)
        clock = CpuClock(server.pid)
        base_count, cand_count = RequestCounter(client), RequestCounter(store.client)
        with tempfile.TemporaryDirectory(prefix="stateful-bench-cache-") as tmp:
            work = Path(tmp)
            src = work / "model" / "weights.bin"
            src.parent.mkdir()
            log(f"writing a {args.size_mib} MiB file, committing it, uploading it as one object (untimed)")
            write_random_file(src, size)
            cs = CheckpointStore(store=store, identity=IDENTITY)
            lease = cs.acquire()
            manifest = cs.commit(lease, {"epoch": 1}, files=src.parent)
            cs.release(lease)
            key = "baseline/weights.bin"
            client.upload_file(str(src), bucket, key)
            tree = cs.tree(manifest)
            assert tree is not None
            chunks = sum(len(f.chunks) for f in tree.files)

            cache_dir = work / "worker-cache"
            cap = max(2 * 1024 * MIB, size + size // 4)
            log(f"filling the cache (one untimed restore of {chunks} chunks) and warming the baseline's path")
            filler = LocalChunkCache(directory=cache_dir, max_bytes=cap)
            cs.restore_files(manifest, work / "fill", cache=filler)
            filler.close()
            shutil.rmtree(work / "fill")
            client.download_file(bucket, key, str(work / "warm.bin"))
            (work / "warm.bin").unlink()
            src.unlink()  # not needed any more; the restores are checked against the tree's hashes
            settle()

            baseline = Side("boto3 download_file")
            warm = Side("restore, warm cache")
            nocache = Side("restore, no cache")
            out_file, out_dir = work / "download.bin", work / "restore"
            hits: list[int] = []

            def do_baseline() -> None:
                baseline.run(lambda: client.download_file(bucket, key, str(out_file)), base_count, clock)
                out_file.unlink()

            def restore(cache: LocalChunkCache | None) -> None:
                retry = CheckpointStore(
                    store=store, identity=IDENTITY
                )  # a new process's view: nothing cached
                latest = retry.latest()
                assert latest is not None
                retry.restore_files(latest, out_dir, cache=cache)

            def do_warm() -> None:
                if args.cold:
                    evict_from_page_cache(cache_dir)
                cache = LocalChunkCache(directory=cache_dir, max_bytes=cap)
                warm.run(lambda: restore(cache), cand_count, clock)
                hits.append(cache.stats.hits)
                cache.close()
                shutil.rmtree(out_dir)

            def do_nocache() -> None:
                nocache.run(lambda: restore(None), cand_count, clock)
                shutil.rmtree(out_dir)

            sides: list[tuple[Side, Callable[[], None]]] = [(baseline, do_baseline), (warm, do_warm)]
            if not args.quick:
                sides.append((nocache, do_nocache))
            log(f"{args.repeat} x {len(sides)} runs, interleaved (order rotates)")
            for i in range(args.repeat):
                for side, fn in sides[i % len(sides) :] + sides[: i % len(sides)]:
                    fn()
                    settle()
                    log(
                        f"  {side.name:<22} #{i + 1}: {side.seconds[-1]:.2f} s, {side.requests[-1]} request(s)"
                    )
            client.delete_object(Bucket=bucket, Key=key)
            copy = local_copy_floor(work, out_dir, lambda: restore(None))
            log(
                f"local floor: copying the {args.size_mib} MiB file here (read + write + fsync): {copy:.2f} s"
            )
    finally:
        if store is not None:
            store.close()
    return {
        "server": server.server,
        "endpoint": server.description,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "size_mib": args.size_mib,
        "chunks": chunks,
        "cold": args.cold,
        "cache_hits_per_warm_run": hits,
        "sides": [s for s in (baseline, warm, nocache) if s.seconds],
        "local_copy_s": copy,
    }


def report_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The target row (bench_rows.py's schema): warm cache vs download_file; vs no cache in its notes."""
    from bench_rows import floor, sides_row  # only with --json-out: the table's shared schema

    baseline, warm, *rest = result["sides"]
    label = size_label(result["size_mib"])
    page = "read from disk (--cold)" if result["cold"] else "in the page cache"
    notes = (
        f"{result['chunks']} chunks, every one from the cache ({page}), each hashed; requests per restore: "
        f"{statistics.fmean(warm.requests):.0f} (head + tree)"
    )
    if rest and rest[0].seconds:  # for reference, not a target: the same restore without the cache
        nocache = statistics.median(rest[0].seconds)
        notes += (
            f"; vs the same restore without a cache ({nocache:.2f} s): "
            f"{statistics.median(warm.seconds) / nocache:.2f}x (hashing, staging and fsyncing {label} locally "
            "remain)"
        )
    rows = [
        sides_row(
            scenario=f"retry on the same worker restoring {label} unchanged",
            baseline="boto3 download_file of the same bytes as one object",
            candidate="latest() + restore_files(cache=LocalChunkCache), warm",
            base=baseline,
            cand=warm,
            goal=GOAL,
            notes=notes
            + f"; floor: copying the file here (read + write + fsync) {result['local_copy_s']:.2f} s",
            floor=floor(
                result["local_copy_s"] / statistics.median(baseline.seconds),
                "copying the file here (read + write + fsync), no request, no hashing",
            ),
        )
    ]
    return rows


def print_table(result: dict[str, Any]) -> None:
    sides: list[Side] = result["sides"]
    label = size_label(result["size_mib"])
    print()
    print(
        f"restore cache benchmark, {result['date']}, {result['cpus']} CPU(s), {result['server']} on loopback; {label} in "
        f"{result['chunks']} chunks; cache {'read from disk (--cold)' if result['cold'] else 'in the page cache'}"
    )
    header = f"{'side':<24} {'runs':>4} {'median':>9} {'min':>9} {'max':>9} {'req/op':>7} {'client CPU':>10} {'srv CPU':>9}"
    print(header)
    print("-" * len(header))
    for side in sides:
        srv = f"{statistics.fmean(side.server_cpu):.2f} s" if side.server_cpu else "n/a"
        print(
            f"{side.name:<24} {len(side.seconds):>4} {statistics.median(side.seconds):>8.2f}s "
            f"{min(side.seconds):>8.2f}s {max(side.seconds):>8.2f}s {statistics.fmean(side.requests):>7.1f} "
            f"{statistics.fmean(side.client_cpu):>9.2f}s {srv:>9}"
        )
    print()
    baseline, warm = sides[0], sides[1]
    print(f"{'comparison (ratio of medians)':<48} {'ratio':>7} {'of mins':>8} {'goal':>7} {'verdict':>7}")
    for name, base in [("warm cache / boto3 download_file", baseline)] + (
        [("warm cache / restore without cache", sides[2])] if len(sides) > 2 else []
    ):
        ratio = statistics.median(warm.seconds) / statistics.median(base.seconds)
        of_mins = min(warm.seconds) / min(base.seconds)
        verdict = "PASS" if ratio <= GOAL else "MISS"
        print(f"{name:<48} {ratio:>7.3f} {of_mins:>8.3f} {'<= ' + format(GOAL, '.2f'):>7} {verdict:>7}")
    print(
        f"chunks served by the cache per warm run: {result['cache_hits_per_warm_run']} of {result['chunks']}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--size-mib", type=int, default=1024, help="size of the checkpointed file (default 1024)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help="skip the comparison with a restore without cache"
    )
    parser.add_argument("--cold", action="store_true", help="read the cache from disk, not the page cache")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of the table")
    parser.add_argument(
        "--json-out", type=Path, default=None, help="write the target rows here (bench_rows.py)"
    )
    add_server_option(parser)
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeat < 1:
        parser.error("--size-mib and --repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    started = time.perf_counter()
    result = run(args, log)
    if args.json:
        summary = {k: v for k, v in result.items() if k != "sides"}
        summary["sides"] = [s.summary() for s in result["sides"]]
        print(json.dumps(summary, indent=2))
    else:
        print_table(result)
        print(f"total wall time: {time.perf_counter() - started:.0f} s")
    if args.json_out is not None:
        from bench_rows import write_json_out

        write_json_out(
            args.json_out, report_rows(result), endpoint=result["endpoint"], server=result["server"]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

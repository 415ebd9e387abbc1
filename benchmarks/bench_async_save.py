"""How long a background save blocks the task, against a synchronous save of the same checkpoint (issue 13).

Run it with ``.venv/bin/python benchmarks/bench_async_save.py`` (``--help`` for options). It starts an S3
server on 127.0.0.1 (``--server moto``, the default: moto's, threaded; ``--server seaweedfs``: a real S3 server,
see ``bench_server.py``), opens a writer
session and a :class:`~airflow_stateful.task_state.TaskState` on it, and times, interleaved (S A, A S, ...):

* **sync**: ``state.save(value, files=dir)`` of a directory holding one N MiB file (default 256): upload and
  commit, the whole time the task is blocked;
* **async**: ``state.save(value, files=dir, wait=False)``: only the time until the call returns (the snapshot:
  the value encoded, the file copied into the staging directory, the thread started). The background commit
  is then waited for *outside* the timing, and its total (call + background) is reported beside it.

The figure is the ratio of the medians, blocked / sync; the goal is <= 0.1.

Fairness and what the numbers mean:

* Before every timed save the file is rewritten with fresh random bytes (untimed), so a store that skips data
  it already holds (content-addressed chunks) has to upload everything on both sides, every time.
* ``os.sync()`` runs between saves, untimed, so one run's disk writeback is not billed to the next.
* By default the file is in the page cache when saved (it was just written, as a task's checkpoint usually
  is). ``--cold`` drops it from the cache before each save (``posix_fadvise(DONTNEED)``, no root needed): both
  sides then read it from disk.
* The synchronous save's time is mostly the server's (moto: a single Python process on the same two cores,
  ~80-100 MiB/s up; SeaweedFS ~100 MiB/s here); a faster endpoint shrinks the denominator and makes the ratio
  larger. The snapshot's cost is a local
  copy (``copy_file_range``), which depends only on the disk: read the absolute ``blocked`` figure too.

``--json`` writes this script's own summary; ``--json-out PATH`` writes the row of issue 13's target table
(``{"machine", "endpoint", "rows"}``, schema in ``bench_rows.py``) that ``benchmarks/run_all.py`` collects.

The exit code is 0 whether or not the goal is met; the goal is printed as PASS or MISS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
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

from bench_rows import timed_row, write_json_out
from bench_server import add_server_option, start_server
from bench_store import (  # the same helpers as the store benchmark (this folder)
    RequestCounter,
    endpoint_client,
    write_random_file,
)

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
from airflow_stateful.core.stores.s3 import MIB, S3ObjectStore
from airflow_stateful.task_state import TaskState

GOAL = 0.1


def drop_from_cache(path: Path) -> None:
    """Write the file out and evict it from the page cache, so the next read comes from disk."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=256, help="size of the checkpoint file (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="timed saves per side (default 5)")
    parser.add_argument(
        "--cold", action="store_true", help="evict the file from the page cache before a save"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoint directory lives")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    parser.add_argument(
        "--json-out",
        type=Path,
        default=None,
        help="also write the target row here as JSON (see bench_rows.py; benchmarks/run_all.py)",
    )
    add_server_option(parser)
    args = parser.parse_args(argv)
    size = args.size_mib * MIB
    log = print

    work = Path(tempfile.mkdtemp(prefix="bench-async-save-", dir=args.workdir))
    servers = contextlib.ExitStack()  # stops the server in the finally below
    server = servers.enter_context(start_server(args.server))
    try:
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        endpoint_client(server, 10).create_bucket(Bucket=bucket)
        store = S3ObjectStore(bucket=bucket, prefix="bench", **server.store_kwargs())
        checkpoints = CheckpointStore(
            store=store, identity=Identity.for_task(dag_id="bench", task_id="async", name="save"), keep_last=2
        )
        ckpt = work / "checkpoint"
        ckpt.mkdir()
        payload = ckpt / "weights.bin"
        results: dict[str, list[float]] = {"sync": [], "blocked": [], "async_total": [], "snapshot": []}
        counter = RequestCounter(store.client)
        requests: dict[str, list[int]] = {"sync": [], "async": []}
        methods: set[str] = set()

        with WriterSession(checkpoints=checkpoints, writer=WriterInfo(try_number=1)) as session:
            state = TaskState(session=session)

            def fresh() -> None:
                write_random_file(payload, size)
                if args.cold:
                    drop_from_cache(payload)
                else:
                    os.sync()

            # Warm-up, untimed: connections, moto's multipart paths, the staging directory's first use.
            write_random_file(payload, 8 * MIB)
            state.save({"warm": 1}, files=ckpt)
            state.save({"warm": 2}, files=ckpt, wait=False).wait()

            def sync(i: int) -> None:
                fresh()
                with counter.measure(requests["sync"]):
                    start = time.perf_counter()
                    state.save({"i": i, "side": "sync"}, files=ckpt)
                    results["sync"].append(time.perf_counter() - start)
                log(f"  sync  #{i + 1}: {results['sync'][-1]:.3f} s")

            def background(i: int) -> None:
                fresh()
                with counter.measure(requests["async"]):
                    start = time.perf_counter()
                    pending = state.save({"i": i, "side": "async"}, files=ckpt, wait=False)
                    blocked = time.perf_counter() - start
                    pending.wait()
                    total = time.perf_counter() - start
                results["blocked"].append(blocked)
                results["async_total"].append(total)
                assert pending.snapshot is not None
                results["snapshot"].append(pending.snapshot.seconds)
                methods.add(pending.snapshot.method)
                log(f"  async #{i + 1}: blocked {blocked:.3f} s, done after {total:.3f} s")

            log(
                f"{args.repeat} x 2 saves of {args.size_mib} MiB, interleaved ({'cold' if args.cold else 'warm'} cache)"
            )
            sides: tuple[Callable[[int], None], Callable[[int], None]] = (sync, background)
            for i in range(args.repeat):
                for fn in sides if i % 2 == 0 else tuple(reversed(sides)):
                    fn(i)
    finally:
        servers.close()
        shutil.rmtree(work, ignore_errors=True)

    ratio = median(results["blocked"]) / median(results["sync"])
    summary: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        },
        "endpoint": server.description,
        "size_mib": args.size_mib,
        "cache": "cold" if args.cold else "warm",
        "snapshot_method": sorted(methods),
        "median_s": {k: median(v) for k, v in results.items()},
        "runs_s": {k: [round(x, 4) for x in v] for k, v in results.items()},
        "ratio_blocked_to_sync": ratio,
        "ratio_min": min(results["blocked"]) / min(results["sync"]),
        "ratio_max": max(results["blocked"]) / min(results["sync"]),
        "goal": GOAL,
        "verdict": "PASS" if ratio <= GOAL else "MISS",
    }
    med = summary["median_s"]
    log("")
    log(f"| scenario ({args.size_mib} MiB, {summary['cache']} cache) | median s | vs sync |")
    log("| --- | --- | --- |")
    log(f"| synchronous save | {med['sync']:.3f} | 1.00 |")
    log(f"| save(wait=False): time blocked | {med['blocked']:.3f} | {ratio:.3f} |")
    log(f"|   of which the snapshot copy ({', '.join(sorted(methods))}) | {med['snapshot']:.3f} | |")
    log(
        f"| save(wait=False): until committed | {med['async_total']:.3f} | {med['async_total'] / med['sync']:.2f} |"
    )
    log(
        f"goal: blocked / sync <= {GOAL}: {summary['verdict']} ({ratio:.3f}; min/max runs {summary['ratio_min']:.3f}"
        f"..{summary['ratio_max']:.3f})"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.json_out:
        # Pairs are (sync i, async i): the two saves of one repetition, run back to back.
        row = timed_row(
            scenario=f"async save of {args.size_mib} MiB: time the task is blocked",
            baseline="synchronous save (state.save(value, files=dir))",
            candidate="state.save(value, files=dir, wait=False) until it returns",
            baseline_seconds=results["sync"],
            candidate_seconds=results["blocked"],
            goal=GOAL,
            requests_baseline=statistics.fmean(requests["sync"]),
            requests_candidate=statistics.fmean(requests["async"]),
            notes=(
                f"{summary['cache']} cache; blocked median {med['blocked']:.3f} s, of which the snapshot copy "
                f"({', '.join(sorted(methods))}) {med['snapshot']:.3f} s; until committed "
                f"{med['async_total'] / med['sync']:.2f}x the synchronous save; the async side's requests "
                "include its background upload and commit"
            ),
        )
        write_json_out(args.json_out, [row], endpoint=server.description, server=args.server)
    return 0


if __name__ == "__main__":
    sys.exit(main())

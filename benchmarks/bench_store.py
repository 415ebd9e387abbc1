"""Benchmark the S3 checkpoint store against plain boto3 on the same S3 endpoint.

Run it with ``.venv/bin/python benchmarks/bench_store.py`` (``--help`` for options). It starts an S3 server
on 127.0.0.1 in a subprocess (``--server moto``, the default: moto's,
:class:`~airflow_stateful.testing.s3_server.MotoServer`; ``--server seaweedfs``: SeaweedFS, a real S3 server,
see ``bench_server.py``), creates a bucket, and measures these cases, each against the plain-boto3 operation a
user would otherwise write:

1. **large commit**: ``CheckpointStore.commit(lease, value, files=<one N MiB file>)`` vs ``upload_file``;
   each commit goes to an identity of its own, so every chunk is uploaded (no dedup);
2. **large restore**: ``CheckpointStore.latest()`` + ``restore_files()`` vs ``download_file`` of the same
   bytes stored as one object (moto serves the ranged GETs of ``download_file`` at about 40 MiB/s, slower
   than whole-object GETs of chunks: that part of the ratio is moto's, see docs/performance.md);
3. **small commit**: a value-only commit of ~1 KB of JSON by a lease holder that commits repeatedly (steady
   state: head record cached, old checkpoints deleted in batches) vs one ``put_object`` of ~1 KB;
4. **large save** (issue 24's first row): ``TaskState.save(value, files=dir)`` on a :class:`WriterSession`,
   the way a task saves, of a directory holding the N MiB file, vs ``upload_file`` of the same file; before
   every pair the file gets fresh random bytes (untimed), so every save uploads everything.

Floors (issue 24: "for any goal missed, the measured floor that stops it"): the large commit, save and restore
also time, interleaved with the two sides, *plain boto3 sending the library's requests*: a pool of as many
threads as the library's parallelism doing ``put_object`` of the file's content-defined chunks, cut as it is
read by pyfastcdc with the library's chunk sizes and each named by its SHA-256, as content addressing with
content-defined chunking must (commit, save; until 2026-12-08 the floor put the library's own slices at known
offsets, leaving out the cutting, about 0.15 s of CPU per 256 MiB here), or ``get_object`` of the library's own chunk objects written into one file at their offsets,
each chunk's SHA-256 checked and the file fsynced (restore: what any restore that may be trusted after a crash
must do, and ``download_file`` does not; no staging, no journal). Its ratio to the baseline is the row's
``floor``: what the library's request pattern (and, for the restore, verification and durability) costs on
this server and this disk, so a ratio near the floor is theirs and a ratio far above it is the library's own
work.

Why ratios, and why interleaved: the absolute numbers say more about moto than about this library. moto is
a single Python process that shares the machine's cores (two, on CI) with the benchmark, so its speed
(roughly 80-100 MiB/s up and 40 MiB/s down on such a machine) and the machine's noise dominate every
absolute figure. What the library controls is its overhead relative to what boto3 does on the same server
at the same moment. So baseline (B) and candidate (C) runs alternate (B C, C B, B C, ...: the order flips
every repetition so that neither side always runs first, on a warmer server), each side's median is taken,
and the figure reported is the ratio of the medians, with min and max to show the spread. The large cases
use few repetitions (``--repeat``, default 5: each moves N MiB through moto), the small case many
(``--small-repeat``, default 200). Between large runs, outside the timing, ``os.sync()`` writes dirty pages
out, so one run's disk writeback (the downloaded file, moto's spooled objects) is not billed to the next.
Even so, one run's large-commit ratio can move by +-0.3 from one invocation to the next: run it several
times before concluding anything from a single figure.

Fairness: the baseline client is built exactly as :class:`S3ObjectStore` builds its own (same endpoint,
credentials, region, path addressing, connection pool and retry configuration); ``upload_file`` and
``download_file`` use boto3's default ``TransferConfig`` (8 MiB chunks, 10 threads), which is what a user
gets. HTTP requests are counted with a botocore ``before-send`` handler on each client (one count per
request sent, retries included).

Where the time goes: per operation, the table also shows the CPU seconds of this process (client) and of
the moto server process, both means. On two cores the server's CPU is nearly the wall time of a large
transfer, so a difference in moto's CPU between the two sides explains a difference in wall time.

Experiments: ``--part-size-mib`` and ``--max-concurrency`` are passed to the candidate's
:class:`S3ObjectStore`; ``--no-expect-continue`` strips ``Expect: 100-continue`` from both clients' requests (moto sometimes answers
that handshake ~10 ms late, which makes the small-commit medians bimodal).

Memory: the test file is written in 8 MiB chunks from ``os.urandom``; the peak resident memory of the
benchmark process (``ru_maxrss``) is printed, and, where Linux allows resetting it, the peak of each side of
the large cases (``VmHWM`` after ``/proc/self/clear_refs``).

``--json-out PATH`` also writes the cases as rows of issue 13's target table (``{"machine", "endpoint",
"rows"}``, schema in ``bench_rows.py``), plus a row for the library's worst peak RSS growth over the large
commits and restores (goal <= 64 MiB; its ``ratio`` field is that growth in MiB). ``benchmarks/run_all.py``
collects it.

The exit code is 0 whether or not the goals are met; each goal is printed as PASS or MISS.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
from bench_rows import floor, sides_row, write_json_out  # this folder
from bench_server import Endpoint, add_server_option, start_server
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.s3 import MIB, S3ObjectStore
from airflow_stateful.task_state import TaskState
from airflow_stateful.testing.s3_server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY

REGION = "us-east-1"
GOALS = {"large_commit": 1.10, "large_restore": 1.10, "small_commit": 1.3, "large_save": 1.0}  # 13's, 24's
SMALL_VALUE_BYTES = 1024
WARMUP_SMALL = 40  # > the delete batch (16) so the timed commits see the steady state


# -- measurement helpers -----------------------------------------------------------------------------------
class RequestCounter:
    """Counts the HTTP requests a boto3 client sends (botocore's ``before-send`` event)."""

    def __init__(self, client: Any) -> None:
        self._lock = threading.Lock()
        self.count = 0
        client.meta.events.register("before-send", self._on_send)

    def _on_send(self, **_: Any) -> None:  # must return None, or botocore skips the request
        with self._lock:
            self.count += 1

    @contextlib.contextmanager
    def measure(self, into: list[int]) -> Iterator[None]:
        start = self.count
        try:
            yield
        finally:
            into.append(self.count - start)


def _read_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            match = re.search(r"^VmHWM:\s+(\d+)\s+kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return True


class CpuClock:
    """CPU seconds (user + system, all threads) of this process and of the S3 server's process."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def client(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def server(self) -> float | None:
        if self.server_pid is None:
            return None
        try:
            with open(f"/proc/{self.server_pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # not Linux: no server CPU figures
            return None
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime


def settle() -> None:
    """Untimed, between runs: write dirty pages out so one run's writeback does not slow the next."""
    if hasattr(os, "sync"):
        os.sync()


@dataclass
class Side:
    """One side (baseline or candidate) of one case: wall time, requests, CPU and peak memory per run."""

    name: str
    seconds: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    peak_rss_mib: list[float] = field(default_factory=list)
    peak_growth_mib: list[float] = field(default_factory=list)

    def run(
        self,
        fn: Callable[[], object],
        counter: RequestCounter,
        clock: CpuClock,
        *,
        track_memory: bool = False,
    ) -> None:
        reset = track_memory and _reset_hwm()
        before = _read_hwm_kib() if reset else None  # right after the reset: the current RSS
        cpu0, srv0 = clock.client(), clock.server()
        with counter.measure(self.requests):
            start = time.perf_counter()
            fn()
            self.seconds.append(time.perf_counter() - start)
        self.client_cpu.append(clock.client() - cpu0)
        srv1 = clock.server()
        if srv0 is not None and srv1 is not None:
            self.server_cpu.append(srv1 - srv0)
        if before is not None:
            hwm = _read_hwm_kib()
            if hwm is not None:
                self.peak_rss_mib.append(hwm / 1024)
                self.peak_growth_mib.append((hwm - before) / 1024)

    def summary(self) -> dict[str, Any]:
        s = self.seconds
        return {
            "name": self.name,
            "runs": len(s),
            "median_s": statistics.median(s),
            "mean_s": statistics.fmean(s),
            "min_s": min(s),
            "max_s": max(s),
            "requests_per_op": statistics.fmean(self.requests),
            # Means, not medians: the server's CPU clock ticks in 10 ms steps, a small op takes a few ms.
            "client_cpu_s": statistics.fmean(self.client_cpu),
            "server_cpu_s": statistics.fmean(self.server_cpu) if self.server_cpu else None,
            "peak_rss_mib": max(self.peak_rss_mib) if self.peak_rss_mib else None,
            "peak_growth_mib": max(self.peak_growth_mib) if self.peak_growth_mib else None,
            "seconds": [round(x, 6) for x in s],
        }


@dataclass
class Case:
    key: str
    title: str
    baseline: Side
    candidate: Side
    size_bytes: int
    goal: float
    floor: Side | None = None  # plain boto3 sending the library's requests (issue 24's floor)

    def summary(self) -> dict[str, Any]:
        b, c = self.baseline.summary(), self.candidate.summary()
        ratio = c["median_s"] / b["median_s"]
        out: dict[str, Any] = {
            "case": self.key,
            "title": self.title,
            "size_bytes": self.size_bytes,
            "baseline": b,
            "candidate": c,
            "ratio_of_medians": ratio,
            "ratio_min": c["min_s"] / b["min_s"],
            "ratio_of_means": c["mean_s"] / b["mean_s"],
            "goal": self.goal,
            "verdict": "PASS" if ratio <= self.goal else "MISS",
        }
        if self.floor is not None and self.floor.seconds:
            out["floor"] = self.floor.summary()
            out["floor_ratio"] = out["floor"]["median_s"] / b["median_s"]
        if self.size_bytes >= MIB:
            for side in ("baseline", "candidate", "floor"):
                if side in out:
                    out[side]["mib_per_s"] = self.size_bytes / MIB / out[side]["median_s"]
        return out


def interleave(
    repeat: int,
    baseline: Callable[[int], object],
    candidate: Callable[[int], object],
    between: Callable[[], object] | None = None,
) -> None:
    """Alternate the two sides, flipping which goes first on every repetition (B C, C B, B C, ...)."""
    for i in range(repeat):
        order = (baseline, candidate) if i % 2 == 0 else (candidate, baseline)
        for fn in order:
            fn(i)
            if between is not None:
                between()


def rotate(
    repeat: int, sides: list[Callable[[int], object]], between: Callable[[], object] | None = None
) -> None:
    """Like :func:`interleave` for any number of sides: the order rotates every repetition (B C F, C F B, ...)."""
    for i in range(repeat):
        for fn in sides[i % len(sides) :] + sides[: i % len(sides)]:
            fn(i)
            if between is not None:
                between()


# -- floors: plain boto3 sending the library's requests ------------------------------------------------------
def chunk_layout(cs: CheckpointStore, manifest: Any) -> list[tuple[str, int, int]] | None:
    """(object key in the bucket, offset in the file, size) of every chunk of a one-file checkpoint, or None
    when the checkpoint does not look like that (a later format: then there is no floor)."""
    try:
        tree = cs.tree(manifest)
        files = list(tree.files) if tree is not None else []
        if len(files) != 1:
            return None
        store = cs.store
        prefix = f"{store.prefix}/" if getattr(store, "prefix", "") else ""  # type: ignore[attr-defined]
        out, offset = [], 0
        for chunk in files[0].chunks:
            out.append((prefix + chunk.key, offset, chunk.size))
            offset += chunk.size
        return out
    except (AttributeError, TypeError):
        return None


def put_slices(
    client: Any,
    bucket: str,
    src: Path,
    layout: list[tuple[str, int, int]],
    prefix: str,
    threads: int,
    *,
    hashed: bool = False,
) -> None:
    """``put_object`` of each (offset, size) slice of ``src`` under ``prefix``, ``threads`` at once; ``hashed``:
    each slice's SHA-256 computed first, as a content-addressed store must to name it."""
    fd = os.open(src, os.O_RDONLY)
    try:

        def one(item: tuple[int, tuple[str, int, int]]) -> None:
            n, (_, offset, size) = item
            body = os.pread(fd, size, offset)
            name = hashlib.sha256(body).hexdigest() if hashed else f"{n:05d}"
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, enumerate(layout)))
    finally:
        os.close(fd)


def put_cut(client: Any, bucket: str, src: Path, prefix: str, threads: int) -> list[str]:
    """``put_object`` of ``src``'s content-defined chunks, each named by its SHA-256, ``threads`` at once: the
    file cut as it is read by the library's own chunker (``iter_chunks``: pyfastcdc with its chunk sizes; at most
    ``2 * threads`` chunks held), the way any content-addressed client with content-defined chunking must at
    least work. Returns the keys."""
    from airflow_stateful.core.data.chunking import iter_chunks

    held = threading.BoundedSemaphore(2 * threads)

    def one(body: bytes) -> str:
        try:
            key = f"{prefix}/{hashlib.sha256(body).hexdigest()}"
            client.put_object(Bucket=bucket, Key=key, Body=body)
            return key
        finally:
            held.release()

    with ThreadPoolExecutor(threads) as pool:
        futures = []
        for chunk in iter_chunks(src, src.stat().st_size):
            held.acquire()
            futures.append(pool.submit(one, chunk))
        return [future.result() for future in futures]


def get_into(
    client: Any,
    bucket: str,
    layout: list[tuple[str, int, int]],
    dest: Path,
    threads: int,
    *,
    safe: bool = False,
) -> None:
    """``get_object`` of every chunk object, each written at its offset into ``dest``, ``threads`` at once.

    ``safe``: what a restore that may be trusted must do besides: each chunk's SHA-256 checked against its name
    (the library's chunk objects are named by it) and ``dest`` fsynced before it counts as restored, so that a
    crash cannot leave a file that reads as restored but holds other bytes. ``download_file`` does neither.
    """
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:

        def one(item: tuple[str, int, int]) -> None:
            key, offset, _ = item
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            if safe and hashlib.sha256(body).hexdigest() != key.rsplit("/", 1)[-1].split("-")[0]:
                raise AssertionError(f"chunk {key} does not match its SHA-256")
            os.pwrite(fd, body, offset)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, layout))
        if safe:
            os.fsync(fd)
    finally:
        os.close(fd)


# -- setup -------------------------------------------------------------------------------------------------
def make_client(
    endpoint_url: str,
    max_concurrency: int,
    *,
    access_key: str = DUMMY_ACCESS_KEY,
    secret_key: str = DUMMY_SECRET_KEY,
) -> Any:
    """A client configured like the one S3ObjectStore builds for itself (see stores/s3.py)."""
    session = boto3.session.Session(
        aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=REGION
    )
    return session.client(
        "s3",
        endpoint_url=endpoint_url,
        config=Config(
            max_pool_connections=max(10, max_concurrency * 2),
            retries={"mode": "standard", "max_attempts": 5},
            s3={"addressing_style": "path"},
        ),
    )


def endpoint_client(endpoint: Endpoint, max_concurrency: int) -> Any:
    """:func:`make_client` for a running server (its URL and credentials)."""
    return make_client(
        endpoint.url, max_concurrency, access_key=endpoint.access_key, secret_key=endpoint.secret_key
    )


def make_store(endpoint: Endpoint, bucket: str, args: argparse.Namespace) -> S3ObjectStore:
    tuning: dict[str, int] = {}
    if args.part_size_mib is not None:
        tuning["part_size"] = args.part_size_mib * MIB
    if args.max_concurrency is not None:
        tuning["max_concurrency"] = args.max_concurrency
    store = S3ObjectStore(
        bucket=bucket,
        prefix="candidate",
        **endpoint.store_kwargs(),
        **tuning,  # type: ignore[arg-type]
    )
    return store


def _strip_expect(request: Any, **_: Any) -> None:
    request.headers.pop("Expect", None)


def write_random_file(path: Path, size: int, chunk: int = 8 * MIB) -> None:
    with open(path, "wb") as fh:
        left = size
        while left > 0:
            n = min(chunk, left)
            fh.write(os.urandom(n))
            left -= n


def small_value(i: int) -> dict[str, Any]:
    value: dict[str, Any] = {"offset": i, "cursor": f"2026-11-30T00:00:{i % 60:02d}Z", "pad": ""}
    pad = SMALL_VALUE_BYTES - len(json.dumps(value, separators=(",", ":")))
    value["pad"] = "x" * max(pad, 0)
    return value


# -- cases -------------------------------------------------------------------------------------------------
@dataclass
class Rig:
    """What every case needs: both clients, their request counters, the CPU clock, the bucket, a logger."""

    client: Any
    store: S3ObjectStore
    bucket: str
    clock: CpuClock
    log: Callable[[str], None]
    bcount: RequestCounter = field(init=False)
    ccount: RequestCounter = field(init=False)

    def __post_init__(self) -> None:
        self.bcount = RequestCounter(self.client)
        self.ccount = RequestCounter(self.store.client)


def bench_large(rig: Rig, *, work: Path, size: int, repeat: int, save: bool = True) -> list[Case]:
    """The large commit, the large (cold) restore and, with ``save``, the large save through ``state.save``:
    each against boto3, each with its floor (plain boto3 sending the library's requests) interleaved."""
    client, store, bucket, log = rig.client, rig.store, rig.bucket, rig.log
    src = work / "payload.bin"
    log(f"writing a {size / MIB:.0f} MiB test file to {work}")
    write_random_file(src, size)
    threads = int(getattr(store, "parallelism", store.max_concurrency))

    cs = CheckpointStore(store=store, identity=Identity.for_task(dag_id="bench", task_id="large", name="big"))
    lease = cs.acquire()

    # Warm-up, untimed: connections, thread pools and the server's code paths for multipart up and ranged down.
    warm = work / "warm.bin"
    write_random_file(warm, 2 * store.part_size + 1)
    client.upload_file(str(warm), bucket, "baseline/warm.bin")
    client.download_file(bucket, "baseline/warm.bin", str(work / "warm.out"))
    client.delete_object(Bucket=bucket, Key="baseline/warm.bin")
    cs.restore_files(cs.commit(lease, {"warm": True}, files=warm), work / "warm-restore")
    for p in (warm, work / "warm.out"):
        p.unlink()
    shutil.rmtree(work / "warm-restore")
    settle()

    # The chunk layout of this file (sizes and keys), for the floors: the library's requests, sent by boto3.
    layout = chunk_layout(cs, cs.commit(lease, {"layout": True}, files=src))
    if layout is None:
        log("the checkpoint is not one file of chunks: no floors measured")

    mib = f"{size / MIB:.0f} MiB"
    commit = Case(
        "large_commit",
        f"commit {mib} file vs upload_file",
        Side("boto3 upload_file"),
        Side("CheckpointStore.commit"),
        size,
        GOALS["large_commit"],
        floor=Side(f"boto3 put_object x{threads} of pyfastcdc chunks cut here, each SHA-256-named")
        if layout
        else None,
    )

    def up_baseline(i: int) -> None:
        key = f"baseline/upload-{i}.bin"
        commit.baseline.run(
            lambda: client.upload_file(str(src), bucket, key), rig.bcount, rig.clock, track_memory=True
        )
        client.delete_object(Bucket=bucket, Key=key)  # keep the server's storage flat; untimed
        log(f"  upload_file   #{i + 1}: {commit.baseline.seconds[-1]:.2f} s")

    def up_candidate(i: int) -> None:
        # Each run commits to an identity of its own: chunks are deduplicated within an identity, and this
        # case measures a full upload (the re-save cases are in bench_targets.py).
        fresh = CheckpointStore(
            store=store, identity=Identity.for_task(dag_id="bench", task_id="large", name=f"big-{i}")
        )
        fresh_lease = fresh.acquire()
        commit.candidate.run(
            lambda: fresh.commit(fresh_lease, {"i": i}, files=src), rig.ccount, rig.clock, track_memory=True
        )
        fresh.purge(fresh_lease)  # keep the server's storage flat; untimed
        log(f"  commit        #{i + 1}: {commit.candidate.seconds[-1]:.2f} s")

    def up_floor(case: Case, path: Path) -> Callable[[int], None]:
        """The floor side of a commit or save: ``put_object`` of ``path``'s chunks, cut here, deleted after."""

        def run(i: int) -> None:
            assert case.floor is not None and layout is not None
            prefix = f"floor/{case.key}-{i}"
            keys: list[str] = []
            case.floor.run(
                lambda: keys.extend(put_cut(client, bucket, path, prefix, threads)), rig.bcount, rig.clock
            )
            for start in range(0, len(keys), 1000):
                batch = [{"Key": key} for key in keys[start : start + 1000]]
                client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            log(f"  floor (puts)  #{i + 1}: {case.floor.seconds[-1]:.2f} s")

        return run

    log(f"large commit: {repeat} x {3 if layout else 2} runs, interleaved")
    rotate(repeat, [up_baseline, up_candidate, *([up_floor(commit, src)] if layout else [])], between=settle)
    cases = [commit]

    if save:
        # Issue 24's row: the way a task saves, TaskState.save(value, files=dir) on a writer session (no worker
        # restore cache: a session given none keeps no copy). Fresh bytes before every pair, untimed, so both
        # sides upload everything every time (the session would otherwise send only what changed).
        save_dir = work / "save"
        save_dir.mkdir()
        save_file = save_dir / "payload.bin"
        saver = CheckpointStore(
            store=store, identity=Identity.for_task(dag_id="bench", task_id="large", name="save"), keep_last=2
        )
        large_save = Case(
            "large_save",
            f"state.save of a {mib} file vs upload_file",
            Side("boto3 upload_file"),
            Side("TaskState.save"),
            size,
            GOALS["large_save"],
            floor=Side(f"boto3 put_object x{threads} of pyfastcdc chunks cut here, each SHA-256-named")
            if layout
            else None,
        )
        with WriterSession(checkpoints=saver, writer=WriterInfo(try_number=1)) as session:
            state = TaskState(session=session)
            write_random_file(save_file, 8 * MIB)
            state.save({"warm": True}, files=save_dir)  # untimed: the session's first save

            def sv_baseline(i: int) -> None:
                key = f"baseline/save-{i}.bin"
                large_save.baseline.run(
                    lambda: client.upload_file(str(save_file), bucket, key),
                    rig.bcount,
                    rig.clock,
                    track_memory=True,
                )
                client.delete_object(Bucket=bucket, Key=key)
                log(f"  upload_file   #{i + 1}: {large_save.baseline.seconds[-1]:.2f} s")

            def sv_candidate(i: int) -> None:
                large_save.candidate.run(
                    lambda: state.save({"i": i}, files=save_dir), rig.ccount, rig.clock, track_memory=True
                )
                log(f"  state.save    #{i + 1}: {large_save.candidate.seconds[-1]:.2f} s")

            sides: list[Callable[[int], None]] = [
                sv_baseline,
                sv_candidate,
                *([up_floor(large_save, save_file)] if layout else []),
            ]
            log(f"large save: {repeat} x {len(sides)} runs, interleaved, fresh bytes before each round")
            for i in range(repeat):
                write_random_file(save_file, size)  # untimed
                settle()
                for fn in sides[i % len(sides) :] + sides[: i % len(sides)]:
                    fn(i)
                    settle()
        shutil.rmtree(save_dir)
        cases.append(large_save)

    cs.commit(lease, {"restore": True}, files=src)
    manifest = cs.latest()
    assert manifest is not None and [f.path for f in cs.files(manifest)] == ["payload.bin"]
    restore_layout = chunk_layout(cs, manifest)
    full_key = "baseline/download.bin"  # the same bytes as one object, what a user would download
    client.upload_file(str(src), bucket, full_key)
    restore = Case(
        "large_restore",
        f"restore {mib} file vs download_file",
        Side("boto3 download_file"),
        Side("latest() + restore_files"),
        size,
        GOALS["large_restore"],
        floor=Side(f"boto3 get_object x{threads}, SHA-256-checked, fsynced") if restore_layout else None,
    )
    out_file = work / "download.bin"
    out_dir = work / "restore"

    def down_baseline(i: int) -> None:
        restore.baseline.run(
            lambda: client.download_file(bucket, full_key, str(out_file)),
            rig.bcount,
            rig.clock,
            track_memory=True,
        )
        out_file.unlink()
        log(f"  download_file #{i + 1}: {restore.baseline.seconds[-1]:.2f} s")

    def down_candidate(i: int) -> None:
        def run() -> None:
            m = cs.latest()
            assert m is not None
            cs.restore_files(m, out_dir)  # cold: a CheckpointStore has no restore cache unless given one

        restore.candidate.run(run, rig.ccount, rig.clock, track_memory=True)
        shutil.rmtree(out_dir)
        log(f"  restore       #{i + 1}: {restore.candidate.seconds[-1]:.2f} s")

    def down_floor(i: int) -> None:
        assert restore.floor is not None and restore_layout is not None
        restore.floor.run(
            lambda: get_into(client, bucket, restore_layout, out_file, threads, safe=True),
            rig.bcount,
            rig.clock,
        )
        out_file.unlink()
        log(f"  floor (gets)  #{i + 1}: {restore.floor.seconds[-1]:.2f} s")

    log(f"large restore: {repeat} x {3 if restore_layout else 2} runs, interleaved")
    rotate(
        repeat,
        [down_baseline, down_candidate, *([down_floor] if restore_layout else [])],
        between=settle,
    )
    cases.append(restore)
    cs.release(lease)
    client.delete_object(Bucket=bucket, Key=full_key)
    src.unlink()
    return cases


def bench_small(rig: Rig, *, repeat: int) -> Case:
    client, bucket = rig.client, rig.bucket
    cs = CheckpointStore(
        store=rig.store, identity=Identity.for_task(dag_id="bench", task_id="small", name="json")
    )
    lease = cs.acquire()
    body = json.dumps(small_value(0), separators=(",", ":")).encode()
    warm_requests: list[int] = []
    for i in range(WARMUP_SMALL):  # untimed: connections, cached head, retention and delete batches in play
        client.put_object(Bucket=bucket, Key="baseline/small.json", Body=body)
        with rig.ccount.measure(warm_requests):
            cs.commit(lease, small_value(i))
    settle()
    # The floor: as many ~1 KB PUTs, one after the other, as a steady-state commit sends requests (its median),
    # each conditional (If-Match on the ETag the previous one returned), as a fenced commit's must be: on
    # SeaweedFS a conditional PUT costs more than a plain one (the server reads the object's metadata first).
    puts = max(1, round(statistics.median(warm_requests[WARMUP_SMALL // 2 :])))
    etags = [
        client.put_object(Bucket=bucket, Key=f"floor/small-{n}.json", Body=body)["ETag"] for n in range(puts)
    ]

    case = Case(
        "small_commit",
        f"commit ~{SMALL_VALUE_BYTES} B JSON value vs put_object",
        Side("boto3 put_object"),
        Side("CheckpointStore.commit"),
        len(body),
        GOALS["small_commit"],
        floor=Side(f"{puts} x boto3 put_object If-Match"),
    )

    def baseline(i: int) -> None:
        case.baseline.run(
            lambda: client.put_object(Bucket=bucket, Key="baseline/small.json", Body=body),
            rig.bcount,
            rig.clock,
        )

    def candidate(i: int) -> None:
        value = small_value(WARMUP_SMALL + i)  # built outside the timing, like the baseline's body
        case.candidate.run(lambda: cs.commit(lease, value), rig.ccount, rig.clock)

    def floor_side(i: int) -> None:
        def run() -> None:
            for n in range(puts):
                etags[n] = client.put_object(
                    Bucket=bucket, Key=f"floor/small-{n}.json", Body=body, IfMatch=etags[n]
                )["ETag"]

        assert case.floor is not None
        case.floor.run(run, rig.bcount, rig.clock)

    rig.log(f"small commit: {repeat} x 3 runs, interleaved (floor: {puts} PUT(s) per commit)")
    rotate(repeat, [baseline, candidate, floor_side])
    cs.release(lease)
    return case


# -- output ------------------------------------------------------------------------------------------------
def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.2f} ms"


def print_table(report: dict[str, Any]) -> None:
    tune = report["candidate_store"]
    print()
    print(
        f"airflow_stateful store benchmark, {report['date']}, {report['cpus']} CPU(s), {report['endpoint']}; "
        f"candidate part_size {tune['part_size_mib']:g} MiB, max_concurrency {tune['max_concurrency']}"
        + ("" if report["expect_100_continue"] else ", no Expect: 100-continue (experiment, both sides)")
    )
    print("times are per operation; CPU: mean per operation (client = this process, server = the S3 server)")
    header = (
        f"{'case':<44} {'side':<25} {'runs':>4} {'median':>10} {'min':>10} {'max':>10} {'req/op':>6} "
        f"{'client CPU':>10} {'server CPU':>10}"
    )
    print(header)
    print("-" * len(header))
    for case in report["cases"]:
        for label in ("baseline", "candidate", "floor"):
            if label not in case:
                continue
            side = case[label]
            title = case["title"] if label == "baseline" else ""
            rate = f"  {side['mib_per_s']:.0f} MiB/s" if "mib_per_s" in side else ""
            print(
                f"{title:<44} {side['name']:<25} {side['runs']:>4} {_fmt_s(side['median_s']):>10} "
                f"{_fmt_s(side['min_s']):>10} {_fmt_s(side['max_s']):>10} {side['requests_per_op']:>6.2f} "
                f"{_fmt_s(side['client_cpu_s']):>10} {_fmt_s(side['server_cpu_s']):>10}{rate}"
            )
    print()
    print(
        f"{'goal (verdict on the ratio of medians)':<44} {'ratio of medians':>16} {'of means':>9} "
        f"{'of mins':>8} {'goal':>7} {'verdict':>7}"
    )
    for case in report["cases"]:
        print(
            f"{case['title']:<44} {case['ratio_of_medians']:>16.3f} {case['ratio_of_means']:>9.3f} "
            f"{case['ratio_min']:>8.3f} {'<= ' + format(case['goal'], '.2f'):>7} {case['verdict']:>7}"
        )
    print()
    for case in report["cases"]:
        b, c = case["baseline"], case["candidate"]
        if b["peak_rss_mib"] is not None and c["peak_rss_mib"] is not None:
            print(
                f"peak RSS during {case['case']} (growth over the RSS before the run): "
                f"{b['name']} {b['peak_rss_mib']:.0f} MiB (+{b['peak_growth_mib']:.0f}), "
                f"{c['name']} {c['peak_rss_mib']:.0f} MiB (+{c['peak_growth_mib']:.0f})"
            )
    print(f"peak RSS of the benchmark process (ru_maxrss): {report['ru_maxrss_mib']:.0f} MiB")
    print(f"total wall time: {report['wall_s']:.0f} s")


RSS_GOAL_MIB = 64.0  # issue 13: peak RSS growth of a commit or a restore, any size


FLOOR_WHAT = {
    "large_commit": "the library's chunk-sized PUTs, each named by its SHA-256 as content addressing needs",
    "large_save": "the library's chunk-sized PUTs, each named by its SHA-256 as content addressing needs",
    "large_restore": "GETs of the library's own chunk objects into one file, each SHA-256-checked, the file "
    "fsynced: a restore that may be trusted after a crash (download_file does neither)",
    "small_commit": "as many ~1 KB PUTs, one after the other, as the commit sends requests",
}


def cpu_figures(a: Side, b: Side | None, server: str) -> str:
    """'client X / Y s, <server> X / Y s (Z% / W% of the wall time)': CPU seconds per op, means."""

    def share(side: Side) -> str:
        wall = statistics.fmean(side.seconds)
        return f"{100 * statistics.fmean(side.server_cpu) / wall:.0f}%" if side.server_cpu and wall else "n/a"

    sides = [a] if b is None else [a, b]
    client = " / ".join(f"{statistics.fmean(s.client_cpu):.2f}" for s in sides)
    out = f"client {client} s"
    if all(s.server_cpu for s in sides):
        srv = " / ".join(f"{statistics.fmean(s.server_cpu):.2f}" for s in sides)
        out += f", {server} {srv} s ({' / '.join(share(s) for s in sides)} of one core over the wall time)"
    return out


def json_rows(cases: list[Case], *, size_mib: int, server: str = "moto") -> list[dict[str, Any]]:
    """The ``--json-out`` rows (schema in bench_rows.py): one per case, and the peak RSS growth of the library."""
    titles = {
        "large_commit": (
            f"large commit ({size_mib} MiB)",
            "boto3 upload_file (default TransferConfig)",
            "CheckpointStore.commit(lease, value, files=file)",
        ),
        "large_restore": (
            f"large restore ({size_mib} MiB)",
            "boto3 download_file",
            "latest() + restore_files(manifest, dest)",
        ),
        "small_commit": (
            f"small JSON commit (~{SMALL_VALUE_BYTES} B value)",
            "one put_object",
            "CheckpointStore.commit(lease, value), same lease, steady state",
        ),
        "large_save": (
            f"large save through state.save ({size_mib} MiB)",
            "boto3 upload_file (default TransferConfig)",
            "TaskState.save(value, files=dir) on a WriterSession, fresh bytes",
        ),
    }
    rows = []
    for case in cases:
        scenario, baseline, candidate = titles[case.key]
        b, c = case.baseline, case.candidate
        notes = f"CPU per op (baseline / candidate): {cpu_figures(b, c, server)}"
        extra: dict[str, Any] = {}
        if case.floor is not None and case.floor.seconds:
            f = case.floor
            ratio = statistics.median(f.seconds) / statistics.median(b.seconds)
            extra["floor"] = floor(ratio, f"{f.name}: {FLOOR_WHAT[case.key]}")
            extra["floor_median_s"] = round(statistics.median(f.seconds), 6)
            notes += (
                f"; floor ({f.name}: {FLOOR_WHAT[case.key]}) {ratio:.3f}x, median "
                f"{statistics.median(f.seconds):.3f} s, {statistics.fmean(f.requests):.1f} requests, "
                f"{cpu_figures(f, None, server)}"
            )
        if case.size_bytes >= MIB:
            notes += (
                f"; medians {statistics.median(b.seconds):.2f} / {statistics.median(c.seconds):.2f} s "
                f"({case.size_bytes / MIB / statistics.median(b.seconds):.0f} / "
                f"{case.size_bytes / MIB / statistics.median(c.seconds):.0f} MiB/s)"
            )
        rows.append(
            sides_row(
                scenario=scenario,
                baseline=baseline,
                candidate=candidate,
                base=b,
                cand=c,
                goal=case.goal,
                notes=notes,
                **extra,
            )
        )
    growth = {c.key: c.candidate.peak_growth_mib for c in cases if c.candidate.peak_growth_mib}
    if "large_save" in growth and "large_commit" in growth:
        growth["large_commit"] = growth["large_commit"] + growth["large_save"]
    if "large_commit" in growth and "large_restore" in growth:
        commit, restore = growth["large_commit"], growth["large_restore"]
        base = {c.key: c.baseline.peak_growth_mib for c in cases if c.baseline.peak_growth_mib}
        worst = max(max(commit), max(restore))
        rows.append(
            {
                "scenario": f"peak RSS growth, commit / restore {size_mib} MiB",
                "baseline": "-",
                "candidate": "VmHWM growth over the RSS before the operation (after a clear_refs reset)",
                "ratio": round(worst, 1),
                "ratio_min": round(min(min(commit), min(restore)), 1),
                "ratio_max": round(worst, 1),
                "goal": RSS_GOAL_MIB,
                "verdict": "PASS" if worst <= RSS_GOAL_MIB else "MISS",
                "requests_baseline": None,
                "requests_candidate": None,
                "notes": (
                    f"MiB, worst run: commit +{max(commit):.0f}, restore +{max(restore):.0f} (boto3 "
                    f"upload_file +{max(base.get('large_commit', [0])):.0f}, download_file "
                    f"+{max(base.get('large_restore', [0])):.0f}); a lower bound, freed memory is reused"
                ),
                "unit": "MiB",
                "runs": len(commit) + len(restore),
            }
        )
    return rows


# -- main --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=256, help="size of the large file (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per side for the large cases (default 5)")
    parser.add_argument(
        "--small-repeat", type=int, default=200, help="runs per side for the small commit (default 200)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument(
        "--json-out",
        type=Path,
        default=None,
        help="also write the target rows to this file as JSON (see bench_rows.py; benchmarks/run_all.py)",
    )
    parser.add_argument("--skip-large", action="store_true", help="skip the large commit and restore")
    parser.add_argument("--skip-small", action="store_true", help="skip the small commit")
    parser.add_argument(
        "--skip-save", action="store_true", help="skip the large save through state.save (issue 24's row)"
    )
    add_server_option(parser)
    parser.add_argument(
        "--part-size-mib",
        type=int,
        default=None,
        help="S3ObjectStore part_size for the candidate (default: the library's default)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="S3ObjectStore max_concurrency for the candidate (default: the library's default)",
    )
    parser.add_argument(
        "--no-expect-continue",
        action="store_true",
        help="experiment: strip 'Expect: 100-continue' from the requests of BOTH clients (moto answers it "
        "with a ~10 ms stall on a share of requests; see docs/performance.md)",
    )
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeat < 1 or args.small_repeat < 1:
        parser.error("--size-mib, --repeat and --small-repeat must be at least 1")
    if args.part_size_mib is not None and args.part_size_mib < 5:
        parser.error("--part-size-mib must be at least 5 (S3's minimum part size)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    started = time.perf_counter()
    cases: list[Case] = []
    store: S3ObjectStore | None = None
    with start_server(args.server) as endpoint:
        try:
            log(f"{args.server} server on {endpoint.url}")
            bucket = f"bench-{uuid.uuid4().hex[:10]}"
            store = make_store(endpoint, bucket, args)
            client = endpoint_client(endpoint, store.max_concurrency)
            client.create_bucket(Bucket=bucket)
            if args.no_expect_continue:
                for c in (client, store.client):
                    c.meta.events.register_first("before-send", _strip_expect)
            rig = Rig(client=client, store=store, bucket=bucket, clock=CpuClock(endpoint.pid), log=log)
            with tempfile.TemporaryDirectory(prefix="stateful-bench-") as tmp:
                if not args.skip_large:
                    cases.extend(
                        bench_large(
                            rig,
                            work=Path(tmp),
                            size=args.size_mib * MIB,
                            repeat=args.repeat,
                            save=not args.skip_save,
                        )
                    )
                if not args.skip_small:
                    cases.append(bench_small(rig, repeat=args.small_repeat))
        finally:
            if store is not None:
                store.close()

    transfer = TransferConfig()
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "boto3": boto3.__version__,
        "candidate_store": {
            "part_size_mib": store.part_size / MIB if store else None,
            "max_concurrency": store.max_concurrency if store else None,
        },
        "endpoint": endpoint.description,
        "expect_100_continue": not args.no_expect_continue,
        "baseline_transfer_config": {
            "multipart_chunksize_mib": transfer.multipart_chunksize / MIB,
            "max_concurrency": transfer.max_request_concurrency,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
        "cases": [c.summary() for c in cases],
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    if args.json_out is not None:
        write_json_out(
            args.json_out,
            json_rows(cases, size_mib=args.size_mib, server=args.server),
            endpoint=endpoint.description,
            server=args.server,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

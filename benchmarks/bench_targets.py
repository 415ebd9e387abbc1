"""Benchmark issue 13's targets for content-addressed checkpoints against plain boto3 on the same S3 endpoint.

Run it with ``.venv/bin/python benchmarks/bench_targets.py`` (``--help`` for options; about 6 minutes with the
issue's sizes, ``--scale 0.05 --repeat 2 --small-repeat 30`` for a smoke run of a minute). Like
``bench_store.py`` it starts an S3 server on 127.0.0.1 in a subprocess (``--server moto``, the default, or
``--server seaweedfs``, a real S3 server: see ``bench_server.py``), builds a baseline boto3 client
exactly as :class:`S3ObjectStore` builds its own, alternates baseline (B) and candidate (C) runs flipping the
order every repetition (B C, C B, ...), and reports the ratio of the medians with the spread of the pairs
(see ``bench_rows.py``), the HTTP requests per operation, and the CPU seconds of this process and of the
server's. Never an absolute time as a claim: the server is a process on the same cores.

Cases (``--cases``, default all):

``tree``
    re-save a 512 MiB tree of 32 files with one file changed, the way a task does it: ``TaskState.save(value,
    files=dir)`` on a :class:`WriterSession` after the same task saved the tree before (the writer's file
    index lets it read only the changed file) vs boto3 ``upload_file`` of the changed file alone. Before each pair one file (a
    different one each time) gets fresh random bytes, untimed. Goal <= 1.2x.
``bigfile``
    re-save a 1 GiB file with 1 % of its bytes changed vs ``upload_file`` of the whole new file, in two
    variants: *in place* (a contiguous 1 % region at a random offset overwritten) and *inserted* (1 % of fresh
    bytes inserted near the middle; the file grows by 1 % per repetition). Goal <= 0.05x. Also reported: the
    bytes the commit sent (request bodies, all PUTs; chunks alone) over the file's size.
``smallfiles``
    commit 2,000 x 4 KiB files (each run to an identity of its own, so nothing is deduplicated) vs a
    ``ThreadPoolExecutor(8)`` of ``put_object``; restore them (``latest()`` + ``restore_files``) vs the same
    pool of ``get_object`` + write. Goal <= 1.2x each.
``json``
    a small JSON commit (~1 KB value, a lease holder committing repeatedly, steady state) vs one
    ``put_object`` (as ``bench_store.py``'s small commit). Goal <= 1.3x.
``valueonly``
    a value-only save after a 1,000-file checkpoint, the way a task does it: a :class:`WriterSession` and
    ``TaskState.save(value)`` (``files=None`` keeps the previous files by reference; the session also sweeps
    what retention dropped, in the background, and the next commit waits for a sweep in progress) vs one
    ``put_object`` of the same ~1 KB. Goal <= 1.5x.

Sizes: ``--scale`` multiplies every size (tree, big file, file counts); the per-case options set one size.
Untimed, between runs: ``os.sync()`` (one run's disk writeback is not billed to the next); files are in the
page cache when saved (they were just written, as a task's checkpoint usually is).

``--json-out PATH`` writes ``{"machine", "endpoint", "rows"}`` (schema in ``bench_rows.py``);
``benchmarks/run_all.py`` collects it. The exit code is 0 whether or not the goals are met.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_rows import floor, sides_row, write_json_out
from bench_server import add_server_option, start_server
from bench_store import (  # the store benchmark's rig (this folder)
    WARMUP_SMALL,
    Case,
    CpuClock,
    Rig,
    Side,
    endpoint_client,
    rotate,
    settle,
    small_value,
    write_random_file,
)

from airflow_stateful.core.data.chunking import iter_chunks
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.lease import Lease
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.s3 import MIB, S3ObjectStore
from airflow_stateful.task_state import TaskState

REGION = "us-east-1"
CASES = ("tree", "bigfile", "smallfiles", "json", "valueonly")
METHODS = {"json": "small_json"}  # a case's method on Bench, where it is not the case's name
GOALS = {
    "tree": 1.2,
    "bigfile": 0.05,
    "smallfiles_commit": 1.2,
    "smallfiles_restore": 1.2,
    "json": 1.3,
    "valueonly": 1.5,
}
WARMUP_VALUE_ONLY = 40  # saves before timing: retention, the background sweep and its cadence in play
POOL_THREADS = 8  # the baseline's ThreadPoolExecutor, as the issue states it


# -- what the candidate's client sends ------------------------------------------------------------------------
class Traffic:
    """Bytes in PUT bodies (all, and chunks alone) and requests by operation, of one boto3 client."""

    def __init__(self, client: Any) -> None:
        self._lock = threading.Lock()
        self.put_bytes = 0
        self.chunk_bytes = 0
        self.ops: dict[str, int] = {}
        client.meta.events.register("before-send", self._on_send)
        client.meta.events.register("before-call", self._on_call)

    def _on_send(self, request: Any, **_: Any) -> None:  # must return None, or botocore skips the request
        if request.method != "PUT":
            return
        size = int(request.headers.get("Content-Length") or 0)
        chunk = "/~chunks/" in request.url or "/%7Echunks/" in request.url
        with self._lock:
            self.put_bytes += size
            if chunk:
                self.chunk_bytes += size

    def _on_call(self, model: Any, **_: Any) -> None:
        with self._lock:
            self.ops[model.name] = self.ops.get(model.name, 0) + 1

    def snapshot(self) -> tuple[int, int, dict[str, int]]:
        with self._lock:
            return self.put_bytes, self.chunk_bytes, dict(self.ops)


class UploadLog(logging.Handler):
    """Keeps the library's "uploaded N new chunk(s) ..., reused M" figures of the last commit."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last: tuple[int, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and "uploaded %d new chunk" in record.msg and record.args:
            args = record.args
            if isinstance(args, tuple) and isinstance(args[1], int) and isinstance(args[3], int):
                self.last = (args[1], args[3])


class Measured:
    """What the candidate's commits sent, run by run: PUT bytes, chunk bytes, chunks sent/reused, requests."""

    def __init__(self, traffic: Traffic, upload_log: UploadLog) -> None:
        self.traffic, self.upload_log = traffic, upload_log
        self.put_bytes: list[int] = []
        self.chunk_bytes: list[int] = []
        self.chunks: list[tuple[int, int]] = []
        self.ops: dict[str, int] = {}
        self.runs = 0

    def around(self, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            put0, chunk0, ops0 = self.traffic.snapshot()
            self.upload_log.last = None
            try:
                return fn()
            finally:
                put1, chunk1, ops1 = self.traffic.snapshot()
                self.put_bytes.append(put1 - put0)
                self.chunk_bytes.append(chunk1 - chunk0)
                if self.upload_log.last is not None:
                    self.chunks.append(self.upload_log.last)
                for name, n in ops1.items():
                    if n - ops0.get(name, 0):
                        self.ops[name] = self.ops.get(name, 0) + n - ops0.get(name, 0)
                self.runs += 1

        return run

    def ops_per_run(self) -> str:
        if not self.runs:
            return ""
        return ", ".join(f"{name} {n / self.runs:.2f}" for name, n in sorted(self.ops.items()))


# -- helpers ------------------------------------------------------------------------------------------------
def pairs(
    repeat: int,
    prepare: Callable[[int], object] | None,
    baseline: Callable[[int], object],
    candidate: Callable[[int], object],
) -> None:
    """``prepare(i)`` untimed, then both sides, the order flipping every repetition; ``os.sync()`` between."""
    for i in range(repeat):
        if prepare is not None:
            prepare(i)
            settle()
        order = (baseline, candidate) if i % 2 == 0 else (candidate, baseline)
        for fn in order:
            fn(i)
            settle()


def fmt_bytes(n: float) -> str:
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    """Delete the baseline's objects below ``prefix`` (untimed; keeps the server's storage flat)."""
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for obj in page.get("Contents", [])
    ]
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def write_small_files(folder: Path, count: int, size: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"f{n:05d}.bin" for n in range(count)]
    for path in paths:
        path.write_bytes(os.urandom(size))
    return paths


def insert_bytes(path: Path, at: int, data: bytes) -> None:
    """Rewrite ``path`` with ``data`` inserted at offset ``at`` (through a new file renamed over it)."""
    new = path.with_name(path.name + ".new")
    with open(path, "rb") as src, open(new, "wb") as dst:
        left = at
        while left > 0:
            block = src.read(min(8 * MIB, left))
            if not block:
                break
            dst.write(block)
            left -= len(block)
        dst.write(data)
        shutil.copyfileobj(src, dst, 8 * MIB)
    os.replace(new, path)


def overwrite_bytes(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(data)


def local_floor(paths: list[Path], runs: int = 3) -> tuple[float, float]:
    """Median seconds, on this thread, to (read + SHA-256) and to (read + cut into chunks + SHA-256) ``paths``:
    the work a commit does before it knows what changed, with no request at all (untimed, for attribution)."""
    plain: list[float] = []
    chunked: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        for path in paths:
            with open(path, "rb") as fh:
                while block := fh.read(8 * MIB):
                    hashlib.sha256(block).digest()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        for path in paths:
            for data in iter_chunks(path, path.stat().st_size):
                hashlib.sha256(data).digest()
        chunked.append(time.perf_counter() - start)
    return statistics.median(plain), statistics.median(chunked)


def write_floor(folder: Path, paths: list[Path]) -> tuple[float, float]:
    """Seconds to write ``paths``' bytes as new files in ``folder``: plainly, and with an fsync per file
    (the library's restore fsyncs every staged file); local only, untimed, for attribution."""
    data = [p.read_bytes() for p in paths]
    out = []
    for sync in (False, True):
        target = folder / f"floor-{int(sync)}"
        target.mkdir()
        start = time.perf_counter()
        for path, body in zip(paths, data, strict=True):
            fd = os.open(target / path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, body)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        out.append(time.perf_counter() - start)
        shutil.rmtree(target)
    return out[0], out[1]


def mean_of(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def peak_note(side: Side) -> str:
    if not side.peak_growth_mib:
        return ""
    return f"; peak RSS growth {max(side.peak_growth_mib):.0f} MiB"


SERVER = "server"  # the S3 server's name in the notes (main sets it from --server)


def cpu_note(case: Case) -> str:
    b, c = case.baseline, case.candidate
    moto = ""
    if b.server_cpu and c.server_cpu:
        moto = f", {SERVER} {mean_of(b.server_cpu):.2f} / {mean_of(c.server_cpu):.2f} s"
    return (
        f"CPU per op (baseline / candidate): client {mean_of(b.client_cpu):.2f} / "
        f"{mean_of(c.client_cpu):.2f} s{moto}; wall medians {statistics.median(b.seconds):.3f} / "
        f"{statistics.median(c.seconds):.3f} s"
    )


# -- cases --------------------------------------------------------------------------------------------------
class Bench:
    """The rig of this script: bench_store's Rig plus byte and operation counts of the candidate's client."""

    def __init__(self, rig: Rig, work: Path, args: argparse.Namespace) -> None:
        self.rig, self.work, self.args = rig, work, args
        self.traffic = Traffic(rig.store.client)
        self.upload_log = UploadLog()
        logger = logging.getLogger("airflow_stateful")
        logger.addHandler(self.upload_log)
        logger.setLevel(logging.INFO)  # the upload line is INFO; nothing else prints it (no root handler)
        self.rng = random.Random(13)

    def log(self, msg: str) -> None:
        self.rig.log(msg)

    def checkpoints(self, name: str) -> CheckpointStore:
        return CheckpointStore(
            store=self.rig.store, identity=Identity.for_task(dag_id="targets", task_id=name, name="bench")
        )

    # tree: 32 files, one changed -------------------------------------------------------------------------
    def tree(self) -> list[dict[str, Any]]:
        rig, args = self.rig, self.args
        total = int(args.tree_mib * args.scale * MIB)
        count = args.tree_files
        each = max(total // count, 1)
        folder = self.work / "tree"
        folder.mkdir()
        paths = [folder / f"part-{n:02d}.bin" for n in range(count)]
        self.log(f"tree: writing {count} files of {fmt_bytes(each)} ({fmt_bytes(each * count)})")
        for path in paths:
            write_random_file(path, each)
        cs = self.checkpoints("tree")
        session = WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1)).open()
        state = TaskState(session=session)
        state.save({"v": 0}, files=folder)  # the first, full save: untimed
        case = Case(
            "tree",
            "re-save tree, 1 file changed",
            Side("boto3 upload_file of the changed file"),
            Side("TaskState.save(value, files=dir)"),
            each * count,
            GOALS["tree"],
        )
        measured = Measured(self.traffic, self.upload_log)
        changed: list[Path] = []

        def prepare(i: int) -> None:
            path = paths[(i * 7 + 3) % count]  # a different file each time
            write_random_file(path, each)
            changed[:] = [path]

        def baseline(i: int) -> None:
            key = f"baseline/tree/{i}.bin"
            case.baseline.run(
                lambda: rig.client.upload_file(str(changed[0]), rig.bucket, key),
                rig.bcount,
                rig.clock,
                track_memory=True,
            )
            rig.client.delete_object(Bucket=rig.bucket, Key=key)

        def candidate(i: int) -> None:
            case.candidate.run(
                measured.around(lambda: state.save({"v": i + 1}, files=folder)),
                rig.ccount,
                rig.clock,
                track_memory=True,
            )
            self.log(
                f"  re-save #{i + 1}: {case.candidate.seconds[-1]:.3f} s (upload_file of the changed file "
                f"{case.baseline.seconds[-1] if case.baseline.seconds else float('nan'):.3f} s)"
            )

        # Warm-up pair, untimed: connections, moto's multipart path, the tree cached by the store.
        prepare(args.repeat)
        rig.client.upload_file(str(changed[0]), rig.bucket, "baseline/tree/warm.bin")
        state.save({"v": "warm"}, files=folder)
        settle()
        self.log(f"tree: {args.repeat} x 2 runs, interleaved")
        pairs(args.repeat, prepare, baseline, candidate)
        session.close()
        delete_prefix(rig.client, rig.bucket, "baseline/tree/")
        hashed, chunked = local_floor(paths)
        shutil.rmtree(folder)
        sent = mean_of(measured.chunk_bytes)
        chunks = mean_of(c for c, _ in measured.chunks)
        notes = (
            f"{count} files of {fmt_bytes(each)}; per re-save the commit sent {chunks:.1f} chunk(s), "
            f"{fmt_bytes(sent)} of chunk data (the changed file is {fmt_bytes(each)}) and read only the changed "
            f"file (the writer's file index vouched for the other {count - 1}; reading all "
            f"{fmt_bytes(each * count)} would cost, locally, read + SHA-256 {hashed:.3f} s, read + chunk + "
            f"SHA-256 {chunked:.3f} s); requests: {measured.ops_per_run()}; {cpu_note(case)}"
            f"{peak_note(case.candidate)}"
        )
        return [
            sides_row(
                scenario=f"re-save {fmt_bytes(each * count)} tree, 1 of {count} files changed",
                baseline="upload only the changed file (boto3 upload_file)",
                candidate="TaskState.save(value, files=dir) on a WriterSession",
                base=case.baseline,
                cand=case.candidate,
                goal=GOALS["tree"],
                notes=notes,
                chunk_bytes_sent=sent,
                local_hash_s=round(hashed, 4),
                local_chunk_hash_s=round(chunked, 4),
            )
        ]

    # bigfile: 1 % changed, in place and inserted ----------------------------------------------------------
    def bigfile(self) -> list[dict[str, Any]]:
        rig, args = self.rig, self.args
        size = int(args.big_mib * args.scale * MIB)
        path = self.work / "big.bin"
        self.log(f"bigfile: writing a {fmt_bytes(size)} file")
        write_random_file(path, size)
        cs = self.checkpoints("bigfile")
        lease = cs.acquire()
        self.log("bigfile: first, full save (untimed)")
        cs.commit(lease, {"v": 0}, files=path)
        # Warm-up, untimed: the baseline's multipart path on a file of this size.
        rig.client.upload_file(str(path), rig.bucket, "baseline/big/warm.bin")
        rig.client.delete_object(Bucket=rig.bucket, Key="baseline/big/warm.bin")
        settle()
        rows = [self._bigfile_variant(cs, lease, path, variant) for variant in ("in place", "inserted")]
        cs.release(lease)
        path.unlink()
        return rows

    def _bigfile_variant(self, cs: CheckpointStore, lease: Lease, path: Path, variant: str) -> dict[str, Any]:
        rig, args = self.rig, self.args
        size = path.stat().st_size
        case = Case(
            f"bigfile {variant}",
            f"re-save big file, 1% changed {variant}",
            Side("boto3 upload_file of the whole file"),
            Side("CheckpointStore.commit(files=file)"),
            size,
            GOALS["bigfile"],
        )
        measured = Measured(self.traffic, self.upload_log)
        sizes: list[int] = []

        def prepare(i: int) -> None:
            current = path.stat().st_size
            delta = max(current // 100, 1)
            if variant == "in place":
                overwrite_bytes(path, self.rng.randrange(0, current - delta), os.urandom(delta))
            else:
                middle = current // 2 + self.rng.randrange(-current // 16, current // 16 + 1)
                insert_bytes(path, middle, os.urandom(delta))
            sizes.append(path.stat().st_size)

        def baseline(i: int) -> None:
            key = f"baseline/big/{i}.bin"
            case.baseline.run(
                lambda: rig.client.upload_file(str(path), rig.bucket, key),
                rig.bcount,
                rig.clock,
                track_memory=True,
            )
            rig.client.delete_object(Bucket=rig.bucket, Key=key)
            self.log(f"  upload_file #{i + 1}: {case.baseline.seconds[-1]:.2f} s")

        def candidate(i: int) -> None:
            case.candidate.run(
                measured.around(lambda: cs.commit(lease, {"v": i + 1}, files=path)),
                rig.ccount,
                rig.clock,
                track_memory=True,
            )
            self.log(
                f"  commit      #{i + 1}: {case.candidate.seconds[-1]:.2f} s, sent "
                f"{fmt_bytes(measured.chunk_bytes[-1])} of chunks"
            )

        self.log(f"bigfile {variant}: {args.big_repeat} x 2 runs, interleaved")
        pairs(args.big_repeat, prepare, baseline, candidate)
        hashed, chunked = local_floor([path])
        fraction = [b / s for b, s in zip(measured.put_bytes, sizes, strict=True)]
        chunk_fraction = [b / s for b, s in zip(measured.chunk_bytes, sizes, strict=True)]
        sent = mean_of(c for c, _ in measured.chunks)
        reused = mean_of(r for _, r in measured.chunks)
        notes = (
            f"bytes uploaded / file size: {statistics.median(fraction):.4f} (all PUT bodies; chunks alone "
            f"{statistics.median(chunk_fraction):.4f}, range {min(chunk_fraction):.4f}-"
            f"{max(chunk_fraction):.4f}) for 1% changed; chunks sent {sent:.1f}, reused {reused:.1f} per "
            f"re-save; file {fmt_bytes(sizes[0])}-{fmt_bytes(sizes[-1])}; locally, no request: read + SHA-256 "
            f"{hashed:.3f} s, read + chunk + SHA-256 {chunked:.3f} s; requests: "
            f"{measured.ops_per_run()}; {cpu_note(case)}{peak_note(case.candidate)}"
        )
        return sides_row(
            floor=floor(
                chunked / statistics.median(case.baseline.seconds),
                "read + chunk + SHA-256 of the whole file here, no request",
            ),
            scenario=f"re-save {fmt_bytes(size)} file, 1% of bytes changed ({variant})",
            baseline="full upload (boto3 upload_file of the new file)",
            candidate="CheckpointStore.commit(lease, value, files=file)",
            base=case.baseline,
            cand=case.candidate,
            goal=GOALS["bigfile"],
            notes=notes,
            uploaded_fraction=round(statistics.median(fraction), 5),
            chunk_fraction=round(statistics.median(chunk_fraction), 5),
            local_hash_s=round(hashed, 4),
            local_chunk_hash_s=round(chunked, 4),
        )

    # smallfiles: 2,000 x 4 KiB, commit and restore ------------------------------------------------------
    def smallfiles(self) -> list[dict[str, Any]]:
        rig, args = self.rig, self.args
        count = max(int(args.small_files * args.scale), 1)
        size = args.small_kib * 1024
        folder = self.work / "small"
        paths = write_small_files(folder, count, size)
        self.log(f"smallfiles: {count} files of {fmt_bytes(size)}")

        def put_all(prefix: str) -> None:
            def one(p: Path) -> None:
                rig.client.put_object(Bucket=rig.bucket, Key=f"{prefix}/{p.name}", Body=p.read_bytes())

            with ThreadPoolExecutor(POOL_THREADS) as pool:
                list(pool.map(one, paths))

        def get_all(prefix: str, dest: Path) -> None:
            dest.mkdir(parents=True)

            def one(p: Path) -> None:
                body = rig.client.get_object(Bucket=rig.bucket, Key=f"{prefix}/{p.name}")["Body"].read()
                (dest / p.name).write_bytes(body)

            with ThreadPoolExecutor(POOL_THREADS) as pool:
                list(pool.map(one, paths))

        # Warm-up, untimed: connections, the pools, moto's code paths.
        put_all("baseline/small/warm")
        delete_prefix(rig.client, rig.bucket, "baseline/small/warm/")
        warm = self.checkpoints("small-warm")
        warm_lease = warm.acquire()
        warm.commit(warm_lease, {"warm": True}, files=folder)
        warm.purge(warm_lease)

        commit = Case(
            "smallfiles commit",
            f"commit {count} x {fmt_bytes(size)}",
            Side(f"ThreadPoolExecutor({POOL_THREADS}) put_object"),
            Side("CheckpointStore.commit(files=dir)"),
            count * size,
            GOALS["smallfiles_commit"],
        )
        measured = Measured(self.traffic, self.upload_log)

        def up_baseline(i: int) -> None:
            prefix = f"baseline/small/{i}"
            commit.baseline.run(lambda: put_all(prefix), rig.bcount, rig.clock)
            delete_prefix(rig.client, rig.bucket, prefix + "/")
            self.log(f"  put_object pool #{i + 1}: {commit.baseline.seconds[-1]:.2f} s")

        def up_candidate(i: int) -> None:
            # An identity of its own each time: nothing to deduplicate against, every file is sent.
            fresh = self.checkpoints(f"small-{i}-{uuid.uuid4().hex[:6]}")
            lease = fresh.acquire()
            commit.candidate.run(
                measured.around(lambda: fresh.commit(lease, {"i": i}, files=folder)), rig.ccount, rig.clock
            )
            fresh.purge(lease)
            self.log(f"  commit          #{i + 1}: {commit.candidate.seconds[-1]:.2f} s")

        settle()
        self.log(f"smallfiles commit: {args.repeat} x 2 runs, interleaved")
        pairs(args.repeat, None, up_baseline, up_candidate)

        # Restore: one checkpoint, one copy of the same files under a baseline prefix.
        cs = self.checkpoints("small-restore")
        lease = cs.acquire()
        cs.commit(lease, {"restore": True}, files=folder)
        cs.release(lease)
        put_all("baseline/small-restore")
        out = self.work / "small-out"
        restore = Case(
            "smallfiles restore",
            f"restore {count} x {fmt_bytes(size)}",
            Side(f"ThreadPoolExecutor({POOL_THREADS}) get_object + write"),
            Side("latest() + restore_files"),
            count * size,
            GOALS["smallfiles_restore"],
        )

        def down_baseline(i: int) -> None:
            restore.baseline.run(lambda: get_all("baseline/small-restore", out), rig.bcount, rig.clock)
            shutil.rmtree(out)
            self.log(f"  get_object pool #{i + 1}: {restore.baseline.seconds[-1]:.2f} s")

        def down_candidate(i: int) -> None:
            def run() -> None:
                manifest = cs.latest()
                assert manifest is not None
                cs.restore_files(manifest, out)

            restore.candidate.run(run, rig.ccount, rig.clock)
            shutil.rmtree(out)
            self.log(f"  restore         #{i + 1}: {restore.candidate.seconds[-1]:.2f} s")

        get_all("baseline/small-restore", out)  # warm-up, untimed
        shutil.rmtree(out)
        manifest = cs.latest()
        assert manifest is not None
        cs.restore_files(manifest, out)
        shutil.rmtree(out)
        settle()
        self.log(f"smallfiles restore: {args.repeat} x 2 runs, interleaved")
        pairs(args.repeat, None, down_baseline, down_candidate)
        delete_prefix(rig.client, rig.bucket, "baseline/small-restore/")
        plain, synced = write_floor(self.work, paths)
        shutil.rmtree(folder)
        parallel = rig.store.parallelism
        return [
            sides_row(
                scenario=f"commit {count:,} x {fmt_bytes(size)}",
                baseline=f"{POOL_THREADS}-thread boto3 pool (put_object)",
                candidate="CheckpointStore.commit(lease, value, files=dir)",
                base=commit.baseline,
                cand=commit.candidate,
                goal=GOALS["smallfiles_commit"],
                notes=(
                    f"each commit to a fresh identity (no dedup); library parallelism {parallel}; requests: "
                    f"{measured.ops_per_run()}; {cpu_note(commit)}"
                ),
            ),
            sides_row(
                scenario=f"restore {count:,} x {fmt_bytes(size)}",
                baseline=f"{POOL_THREADS}-thread boto3 pool (get_object + write)",
                candidate="latest() + restore_files(manifest, dest)",
                base=restore.baseline,
                cand=restore.candidate,
                goal=GOALS["smallfiles_restore"],
                notes=(
                    f"library parallelism {parallel}; the library verifies every chunk's SHA-256, stages and "
                    f"fsyncs every file, then renames it into place; the baseline only writes (locally, one "
                    f"thread, no request: writing the {count} files takes {plain:.3f} s, with an fsync each "
                    f"{synced:.3f} s); {cpu_note(restore)}"
                ),
            ),
        ]

    # json: small commit, steady state ---------------------------------------------------------------------
    def small_json(self) -> list[dict[str, Any]]:
        rig = self.rig
        cs = self.checkpoints("json")
        lease = cs.acquire()
        body = json.dumps(small_value(0), separators=(",", ":")).encode()
        warm_requests: list[int] = []
        for i in range(WARMUP_SMALL):  # untimed: connections, the cached head, retention in play
            rig.client.put_object(Bucket=rig.bucket, Key="baseline/small.json", Body=body)
            with rig.ccount.measure(warm_requests):
                cs.commit(lease, small_value(i))
        settle()
        # The floor: as many requests as a steady-state commit sends, each a compare-and-swap PUT (If-Match on
        # the ETag of the previous write) of the same body, one after the other, by plain boto3.
        puts = max(1, round(statistics.median(warm_requests[WARMUP_SMALL // 2 :])))
        etag = [rig.client.put_object(Bucket=rig.bucket, Key="floor/small.json", Body=body)["ETag"]]
        case = Case(
            "json",
            "small JSON commit",
            Side("boto3 put_object"),
            Side("CheckpointStore.commit"),
            len(body),
            GOALS["json"],
            floor=Side(f"{puts} x boto3 put_object(IfMatch=etag)"),
        )
        measured = Measured(self.traffic, self.upload_log)

        def baseline(i: int) -> None:
            case.baseline.run(
                lambda: rig.client.put_object(Bucket=rig.bucket, Key="baseline/small.json", Body=body),
                rig.bcount,
                rig.clock,
            )

        def candidate(i: int) -> None:
            value = small_value(WARMUP_SMALL + i)  # built outside the timing, like the baseline's body
            case.candidate.run(measured.around(lambda: cs.commit(lease, value)), rig.ccount, rig.clock)

        def floor_side(i: int) -> None:
            def run() -> None:
                for _ in range(puts):
                    done = rig.client.put_object(
                        Bucket=rig.bucket, Key="floor/small.json", Body=body, IfMatch=etag[0]
                    )
                    etag[0] = done["ETag"]

            assert case.floor is not None
            case.floor.run(run, rig.bcount, rig.clock)

        self.log(
            f"json: {self.args.small_repeat} x 3 runs, interleaved (floor: {puts} CAS PUT(s) per commit)"
        )
        rotate(self.args.small_repeat, [baseline, candidate, floor_side])
        cs.release(lease)
        f = case.floor
        assert f is not None
        floor_ratio = statistics.median(f.seconds) / statistics.median(case.baseline.seconds)
        return [
            sides_row(
                scenario=f"small JSON commit (~{len(body)} B value)",
                baseline="one put_object",
                candidate="CheckpointStore.commit(lease, value), same lease, steady state",
                base=case.baseline,
                cand=case.candidate,
                goal=GOALS["json"],
                notes=(
                    f"requests per commit: {measured.ops_per_run()}; {cpu_note(case)}; floor ({f.name}, "
                    f"the commit's requests by plain boto3): {floor_ratio:.3f}x, median "
                    f"{statistics.median(f.seconds) * 1000:.2f} ms"
                ),
                floor=floor(
                    floor_ratio, f"{f.name}: the commit's requests by plain boto3, one after the other"
                ),
            )
        ]

    # valueonly: state.save(value) after a 1,000-file checkpoint -------------------------------------------
    def valueonly(self) -> list[dict[str, Any]]:
        rig, args = self.rig, self.args
        count = max(int(args.value_files * args.scale), 1)
        folder = self.work / "value-files"
        write_small_files(folder, count, args.small_kib * 1024)
        cs = self.checkpoints("value-only")
        body = json.dumps(small_value(0), separators=(",", ":")).encode()
        case = Case(
            "valueonly",
            "value-only save after a file checkpoint",
            Side("boto3 put_object"),
            Side("TaskState.save(value)"),
            len(body),
            GOALS["valueonly"],
        )
        measured = Measured(self.traffic, self.upload_log)
        with WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1)) as session:
            state = TaskState(session=session)
            self.log(f"valueonly: a checkpoint of {count} files, then value-only saves")
            state.save(small_value(0), files=folder)
            for i in range(WARMUP_VALUE_ONLY):  # untimed: steady state, sweeps included
                rig.client.put_object(Bucket=rig.bucket, Key="baseline/value.json", Body=body)
                state.save(small_value(i + 1))
            latest = session.latest
            assert latest is not None and latest.file_count == count, "a value-only save lost the files"

            def baseline(i: int) -> None:
                case.baseline.run(
                    lambda: rig.client.put_object(Bucket=rig.bucket, Key="baseline/value.json", Body=body),
                    rig.bcount,
                    rig.clock,
                )

            def candidate(i: int) -> None:
                value = small_value(WARMUP_VALUE_ONLY + 1 + i)  # built outside the timing, like the body
                case.candidate.run(measured.around(lambda: state.save(value)), rig.ccount, rig.clock)

            self.log(f"valueonly: {args.small_repeat} x 2 runs, interleaved")
            for i in range(args.small_repeat):
                for fn in (baseline, candidate) if i % 2 == 0 else (candidate, baseline):
                    fn(i)
            latest = session.latest
            assert latest is not None and latest.file_count == count, "a value-only save lost the files"
        shutil.rmtree(folder)
        slow = sorted(case.candidate.seconds)[int(len(case.candidate.seconds) * 0.9)]
        return [
            sides_row(
                scenario=f"value-only save after a {count:,}-file checkpoint",
                baseline="one put_object",
                candidate="TaskState.save(value) on a WriterSession (files kept by reference)",
                base=case.baseline,
                cand=case.candidate,
                goal=GOALS["valueonly"],
                notes=(
                    f"requests per save inside the timed calls: {measured.ops_per_run()} (the session's "
                    f"background sweep runs between saves; a save waits for one in progress); candidate p90 "
                    f"{slow * 1000:.1f} ms; {cpu_note(case)}"
                ),
            )
        ]


# -- output -------------------------------------------------------------------------------------------------
def print_table(rows: list[dict[str, Any]], endpoint: str) -> None:
    print()
    print(f"issue 13 targets on {endpoint}")
    print("ratio = candidate median / baseline median (spread: min-max over pairs or blocks of pairs)")
    header = (
        f"{'scenario':<52} {'runs':>4} {'baseline':>10} {'candidate':>10} {'ratio':>7} {'min-max':>13} "
        f"{'goal':>7} {'verdict':>7} {'req B/C':>13}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
        req = f"{row['requests_baseline']:g}/{row['requests_candidate']:g}"
        print(
            f"{row['scenario']:<52} {row['runs']:>4} {_fmt_s(row['baseline_median_s']):>10} "
            f"{_fmt_s(row['candidate_median_s']):>10} {row['ratio']:>7.3f} {spread:>13} "
            f"{'<= ' + format(row['goal'], 'g'):>7} {row['verdict']:>7} {req:>13}"
        )
    print()
    for row in rows:
        print(f"- {row['scenario']}: {row['notes']}")


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


# -- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated cases to run, of {', '.join(CASES)} (default: all)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every size and file count (default 1.0)"
    )
    parser.add_argument("--tree-mib", type=float, default=512, help="tree size (default 512)")
    parser.add_argument("--tree-files", type=int, default=32, help="files in the tree (default 32)")
    parser.add_argument("--big-mib", type=float, default=1024, help="the big file's size (default 1024)")
    parser.add_argument("--small-files", type=int, default=2000, help="small files (default 2000)")
    parser.add_argument("--small-kib", type=int, default=4, help="size of a small file (default 4)")
    parser.add_argument(
        "--value-files", type=int, default=1000, help="files before the value-only saves (default 1000)"
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="runs per side, tree and smallfiles (default 5)"
    )
    parser.add_argument(
        "--big-repeat", type=int, default=5, help="runs per side and variant, bigfile (default 5)"
    )
    parser.add_argument(
        "--small-repeat", type=int, default=200, help="runs per side, json and valueonly (default 200)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where the test files are written")
    parser.add_argument("--json-out", type=Path, default=None, help="write the rows here as JSON")
    add_server_option(parser)
    args = parser.parse_args(argv)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    args.cases = [c for c in CASES if c in chosen]
    if args.scale <= 0 or min(args.repeat, args.big_repeat, args.small_repeat, args.tree_files) < 1:
        parser.error("--scale must be positive; --repeat, --big-repeat, --small-repeat, --tree-files >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = time.perf_counter()
    global SERVER
    SERVER = args.server
    rows: list[dict[str, Any]] = []
    store: S3ObjectStore | None = None
    with start_server(args.server) as server:
        endpoint = server.description
        try:
            log(f"{args.server} server on {server.url}; cases: {', '.join(args.cases)}")
            bucket = f"bench-{uuid.uuid4().hex[:10]}"
            store = S3ObjectStore(bucket=bucket, prefix="candidate", **server.store_kwargs())
            client = endpoint_client(server, store.max_concurrency)
            client.create_bucket(Bucket=bucket)
            rig = Rig(client=client, store=store, bucket=bucket, clock=CpuClock(server.pid), log=log)
            with tempfile.TemporaryDirectory(prefix="stateful-targets-", dir=args.workdir) as tmp:
                bench = Bench(rig, Path(tmp), args)
                for name in args.cases:
                    case_started = time.perf_counter()
                    rows.extend(getattr(bench, METHODS.get(name, name))())
                    log(f"{name}: done in {time.perf_counter() - case_started:.0f} s")
        finally:
            if store is not None:
                store.close()
    print_table(rows, endpoint)
    print(f"total wall time: {time.perf_counter() - started:.0f} s")
    if args.json_out is not None:
        write_json_out(args.json_out, rows, endpoint=endpoint, server=args.server)
    return 0


if __name__ == "__main__":
    sys.exit(main())

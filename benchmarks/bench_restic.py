"""Issue 24's restic comparison: a 512 MiB file saved, re-saved with 1 % overwritten, and restored cold, by
restic and by this library, on the same SeaweedFS, with plain boto3 beside both.

Run it with ``.venv/bin/python benchmarks/bench_restic.py`` (``--help`` for options; about 4 minutes at 512 MiB
on two cores, ``--size-mib 64 --repeat 1`` for a smoke run). It starts SeaweedFS on 127.0.0.1 (``--server
seaweedfs``, the only choice: the comparison is about a real server's costs; moto answers every ranged GET, and
restic's restore reads its packs by ranges, by reading the whole object, and is one Python process, so it would
decide the figures instead of restic or the library), writes one file of random bytes and times, per
repetition, with the order of the sides rotating (B C F, C F B, ...):

``first save``
    ``restic backup --compression off`` into a new repository (``init --repository-version 2``, untimed) vs
    ``CheckpointStore.commit(lease, value, files=file)`` to a new identity vs boto3 ``upload_file``; and the
    floors: boto3 ``put_object`` of the library's chunk-sized slices, as many threads as the library's
    parallelism, with no hashing (what the library's requests cost on this server) and with each slice named by
    its SHA-256 (what content addressing must add: the row's floor).
``1 % overwritten, re-save``
    before each repetition (untimed) a contiguous 1 % of the file, at a random offset, gets fresh bytes; then
    ``restic backup`` into the repository that holds the previous version (its parent snapshot: restic rereads
    the changed file and uploads only new blobs) vs ``commit`` to the identity that holds the previous version
    (it rereads the file and uploads only new chunks) vs boto3 ``upload_file`` of the whole new file (a full
    upload). Floor: reading, chunking and hashing the whole file here with no request at all (what any re-save
    that does not know which bytes changed must do), over restic and over the full upload.
``cold restore``
    ``restic restore latest --no-cache`` vs a new ``CheckpointStore`` (nothing cached in memory) with
    ``latest()`` + ``restore_files`` and no restore cache (a ``CheckpointStore`` has none unless one is passed;
    the worker's restore cache is the writer session's) vs boto3 ``download_file`` of the same bytes as one
    object. Floors: boto3 ``get_object`` of the library's chunk objects into one file, as they come, and with
    each chunk's SHA-256 checked and the file fsynced (what a restore that can be trusted after a crash must
    do, which ``download_file`` does not: the row's floor, over restic too).

Like with like, and where it is not: restic always encrypts (AES-256 in CTR mode with Poly1305-AES, no way to
turn it off) and this library does not; ``--compression off`` turns restic's compression off as the library
has none; restic keeps its usual local cache (``--cache-dir`` in a temporary directory) for backups, the
restore runs with ``--no-cache``; restic's pack size is its default (16 MiB). restic's CPU (its own process,
all cores) is reported beside the library's and the server's.

Goals (issue 24): first save <= 0.5x restic and <= 1.0x boto3; re-save <= 0.3x restic and <= 0.1x a full
upload; cold restore <= 0.5x restic and <= 1.0x boto3: one row each. Without a ``restic`` binary (``apt-get
install restic``; ``--restic PATH``) the restic rows are emitted as skipped, saying why, and the rest is
measured. ``--json-out PATH`` writes the rows (``bench_rows.py``) that ``benchmarks/run_all.py`` collects; the
exit code is 0 whether or not the goals are met.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_rows import floor, skipped_row, timed_row, write_json_out
from bench_server import Endpoint, add_server_option, start_server
from bench_store import (
    CpuClock,
    RequestCounter,
    _read_hwm_kib,
    _reset_hwm,
    chunk_layout,
    endpoint_client,
    get_into,
    put_slices,
    settle,
    write_random_file,
)

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.data.chunking import iter_chunks
from airflow_stateful.core.stores.s3 import MIB, S3ObjectStore

GOALS = {
    "first_restic": 0.5,
    "first_boto3": 1.0,
    "resave_restic": 0.3,
    "resave_full": 0.1,
    "restore_restic": 0.5,
    "restore_boto3": 1.0,
}
CHANGED = 0.01  # the share of the file overwritten before each re-save
RSS_GOAL_MIB = 64.0  # issue 13/24: peak RSS growth of a commit or a restore, any size


def log(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Timed:
    """One side: wall seconds, requests (None where not counted: restic), CPU of this process and its
    children (restic), CPU of the server, and peak RSS growth of this process, per run."""

    name: str
    seconds: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    peak_growth_mib: list[float] = field(default_factory=list)

    def run(
        self,
        fn: Callable[[], object],
        clock: CpuClock,
        counter: RequestCounter | None = None,
        *,
        track_memory: bool = False,
    ) -> None:
        reset = track_memory and _reset_hwm()
        before = _read_hwm_kib() if reset else None
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        srv0 = clock.server()
        sent = counter.count if counter is not None else 0
        start = time.perf_counter()
        fn()
        self.seconds.append(time.perf_counter() - start)
        me1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        self.client_cpu.append(
            me1.ru_utime
            + me1.ru_stime
            - me.ru_utime
            - me.ru_stime
            + kids1.ru_utime
            + kids1.ru_stime
            - kids.ru_utime
            - kids.ru_stime
        )
        srv1 = clock.server()
        if srv0 is not None and srv1 is not None:
            self.server_cpu.append(srv1 - srv0)
        if counter is not None:
            self.requests.append(counter.count - sent)
        if before is not None:
            hwm = _read_hwm_kib()
            if hwm is not None:
                self.peak_growth_mib.append((hwm - before) / 1024)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def cpu(self, server: str) -> str:
        wall = statistics.fmean(self.seconds)
        out = f"{self.name}: {self.median:.2f} s, client CPU {statistics.fmean(self.client_cpu):.2f} s"
        if self.server_cpu:
            srv = statistics.fmean(self.server_cpu)
            out += f", {server} CPU {srv:.2f} s ({100 * srv / wall:.0f}% of one core)"
        return out


class Restic:
    """The ``restic`` command line against one S3 repository on the server, with its own cache directory."""

    def __init__(self, binary: str, endpoint: Endpoint, bucket: str, work: Path) -> None:
        self.binary = binary
        self.endpoint = endpoint
        self.bucket = bucket
        self.cache = work / "restic-cache"
        self.password = secrets.token_hex(16)

    def env(self, repo: str) -> dict[str, str]:
        address = self.endpoint.url.removeprefix("http://")
        return {
            **os.environ,
            **self.endpoint.env(),
            "RESTIC_REPOSITORY": f"s3:http://{address}/{self.bucket}/{repo}",
            "RESTIC_PASSWORD": self.password,
            "RESTIC_CACHE_DIR": str(self.cache),
        }

    def __call__(self, repo: str, *args: str) -> str:
        done = subprocess.run(
            [self.binary, *args], env=self.env(repo), capture_output=True, text=True, timeout=1800
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"restic {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-2000:]}"
            )
        return done.stdout

    def init(self, repo: str) -> None:
        self(repo, "init", "--repository-version", "2")

    def backup(self, repo: str, path: Path) -> None:
        self(repo, "backup", "--compression", "off", "--host", "bench", "--quiet", str(path))

    def restore(self, repo: str, target: Path) -> None:
        self(repo, "restore", "latest", "--no-cache", "--target", str(target), "--quiet")


def restic_binary(given: str | None) -> tuple[str | None, str]:
    """The restic binary and its version, or None and why it is missing."""
    binary = given or shutil.which("restic")
    if binary is None or not os.access(binary, os.X_OK):
        where = f"{given!r} is not an executable" if given else "no `restic` on PATH"
        return None, f"restic is not installed here ({where}; Debian: apt-get install restic)"
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"restic at {binary} does not run: {exc}"
    return binary, out


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def chunk_floor(path: Path, runs: int = 3) -> float:
    """Median seconds to read, chunk and SHA-256 ``path`` here, no request (what a blind re-save must do)."""
    import hashlib

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for data in iter_chunks(path, path.stat().st_size):
            hashlib.sha256(data).digest()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rotate(repeat: int, prepare: Callable[[int], object] | None, sides: list[Callable[[int], None]]) -> None:
    for i in range(repeat):
        if prepare is not None:
            prepare(i)
            settle()
        for fn in sides[i % len(sides) :] + sides[: i % len(sides)]:
            fn(i)
            settle()


def ratio_row(
    *,
    scenario: str,
    baseline: str,
    candidate: str,
    base: Timed,
    cand: Timed,
    goal: float,
    notes: str,
    floor_of: tuple[float, str] | None = None,
) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if floor_of is not None:
        extra["floor"] = floor(*floor_of)
    return timed_row(
        scenario=scenario,
        baseline=baseline,
        candidate=candidate,
        baseline_seconds=base.seconds,
        candidate_seconds=cand.seconds,
        goal=goal,
        requests_baseline=statistics.fmean(base.requests) if base.requests else None,
        requests_candidate=statistics.fmean(cand.requests) if cand.requests else None,
        notes=notes,
        **extra,
    )


def run(args: argparse.Namespace, endpoint: Endpoint, work: Path) -> list[dict[str, Any]]:
    binary, restic_why = restic_binary(args.restic)
    if binary is None:
        log(f"restic rows skipped: {restic_why}")
    else:
        log(f"restic: {restic_why}")
    size = args.size_mib * MIB
    label = f"{args.size_mib} MiB"
    bucket = f"bench-restic-{uuid.uuid4().hex[:8]}"
    store = S3ObjectStore(bucket=bucket, prefix="candidate", **endpoint.store_kwargs())
    client = endpoint_client(endpoint, store.max_concurrency)
    client.create_bucket(Bucket=bucket)
    clock = CpuClock(endpoint.pid)
    bcount, ccount = RequestCounter(client), RequestCounter(store.client)
    restic = Restic(binary, endpoint, bucket, work) if binary else None
    threads = int(getattr(store, "parallelism", store.max_concurrency))
    server = endpoint.server
    rng = random.Random(24)
    rows: list[dict[str, Any]] = []
    try:
        src_dir = work / "data"
        src_dir.mkdir()
        src = src_dir / "payload.bin"
        log(f"writing a {label} file of random bytes")
        write_random_file(src, size)

        # Warm-up, untimed: connections, the server's paths for multipart up and ranged down, restic's start.
        warm_cs = CheckpointStore(
            store=store, identity=Identity.for_task(dag_id="restic", task_id="warm", name="bench")
        )
        warm_lease = warm_cs.acquire()
        warm = warm_cs.commit(warm_lease, {"warm": True}, files=src)
        layout = chunk_layout(warm_cs, warm)
        warm_cs.restore_files(warm, work / "warm-out")
        shutil.rmtree(work / "warm-out")
        warm_cs.purge(warm_lease)
        client.upload_file(str(src), bucket, "baseline/warm.bin")
        client.download_file(bucket, "baseline/warm.bin", str(work / "warm.bin"))
        client.delete_object(Bucket=bucket, Key="baseline/warm.bin")
        (work / "warm.bin").unlink()
        if restic is not None:
            restic.init("warm")
            restic.backup("warm", src)
            delete_prefix(client, bucket, "warm/")
        settle()

        # -- first save ---------------------------------------------------------------------------------
        first = {
            "restic": Timed("restic backup"),
            "lib": Timed("CheckpointStore.commit"),
            "boto3": Timed("boto3 upload_file"),
            "floor": Timed(f"boto3 put_object x{threads}"),
            "safe": Timed(f"boto3 put_object x{threads}, each slice SHA-256-named"),
        }
        kept: dict[str, Any] = {}

        def first_restic(i: int) -> None:
            assert restic is not None
            repo = f"restic-first-{i}"
            restic.init(repo)  # untimed
            first["restic"].run(lambda: restic.backup(repo, src), clock)
            if i < args.repeat - 1:
                delete_prefix(client, bucket, repo + "/")
            else:
                kept["repo"] = repo
            log(f"  restic backup #{i + 1}: {first['restic'].seconds[-1]:.2f} s")

        def first_lib(i: int) -> None:
            cs = CheckpointStore(
                store=store, identity=Identity.for_task(dag_id="restic", task_id=f"first-{i}", name="bench")
            )
            lease = cs.acquire()
            first["lib"].run(lambda: cs.commit(lease, {"v": 0}, files=src), clock, ccount, track_memory=True)
            if i < args.repeat - 1:
                cs.purge(lease)
            else:
                kept["cs"], kept["lease"] = cs, lease
            log(f"  commit        #{i + 1}: {first['lib'].seconds[-1]:.2f} s")

        def first_boto3(i: int) -> None:
            first["boto3"].run(
                lambda: client.upload_file(str(src), bucket, "baseline/first.bin"), clock, bcount
            )
            client.delete_object(Bucket=bucket, Key="baseline/first.bin")
            log(f"  upload_file   #{i + 1}: {first['boto3'].seconds[-1]:.2f} s")

        def first_floor(i: int) -> None:
            assert layout is not None
            prefix = f"floor/first-{i}"
            first["floor"].run(
                lambda: put_slices(client, bucket, src, layout, prefix, threads), clock, bcount
            )
            delete_prefix(client, bucket, prefix + "/")
            log(f"  floor (puts)  #{i + 1}: {first['floor'].seconds[-1]:.2f} s")

        def first_safe(i: int) -> None:
            assert layout is not None
            prefix = f"floor/safe-{i}"
            first["safe"].run(
                lambda: put_slices(client, bucket, src, layout, prefix, threads, hashed=True), clock, bcount
            )
            delete_prefix(client, bucket, prefix + "/")
            log(f"  floor (hashed) #{i + 1}: {first['safe'].seconds[-1]:.2f} s")

        sides: list[Callable[[int], None]] = [
            first_lib,
            first_boto3,
            *([first_floor, first_safe] if layout else []),
            *([first_restic] if restic else []),
        ]
        log(f"first save: {args.repeat} x {len(sides)} runs, interleaved")
        rotate(args.repeat, None, sides)

        # -- 1 % overwritten, re-save ------------------------------------------------------------------
        resave = {
            "restic": Timed("restic backup (parent snapshot)"),
            "lib": Timed("CheckpointStore.commit (same identity)"),
            "boto3": Timed("boto3 upload_file (full upload)"),
        }
        cs, lease = kept["cs"], kept["lease"]
        changed = max(int(size * CHANGED), 1)

        def overwrite(i: int) -> None:
            at = rng.randrange(0, max(size - changed, 1))
            with open(src, "r+b") as fh:
                fh.seek(at)
                fh.write(os.urandom(changed))

        def resave_restic(i: int) -> None:
            assert restic is not None
            resave["restic"].run(lambda: restic.backup(kept["repo"], src), clock)
            log(f"  restic backup #{i + 1}: {resave['restic'].seconds[-1]:.2f} s")

        def resave_lib(i: int) -> None:
            resave["lib"].run(
                lambda: cs.commit(lease, {"v": i + 1}, files=src), clock, ccount, track_memory=True
            )
            log(f"  commit        #{i + 1}: {resave['lib'].seconds[-1]:.2f} s")

        def resave_boto3(i: int) -> None:
            resave["boto3"].run(
                lambda: client.upload_file(str(src), bucket, "baseline/resave.bin"), clock, bcount
            )
            client.delete_object(Bucket=bucket, Key="baseline/resave.bin")
            log(f"  upload_file   #{i + 1}: {resave['boto3'].seconds[-1]:.2f} s")

        sides = [resave_lib, resave_boto3, *([resave_restic] if restic else [])]
        log(f"re-save, {CHANGED:.0%} overwritten: {args.repeat} x {len(sides)} runs, interleaved")
        rotate(args.repeat, overwrite, sides)
        local = chunk_floor(src)
        log(f"  read + chunk + SHA-256 of the file here, no request: {local:.2f} s")

        # -- cold restore --------------------------------------------------------------------------------
        restore = {
            "restic": Timed("restic restore --no-cache"),
            "lib": Timed("latest() + restore_files, no cache"),
            "boto3": Timed("boto3 download_file"),
            "floor": Timed(f"boto3 get_object x{threads}"),
            "safe": Timed(f"boto3 get_object x{threads}, each chunk SHA-256-checked, the file fsynced"),
        }
        client.upload_file(str(src), bucket, "baseline/restore.bin")
        restore_layout = chunk_layout(cs, cs.latest())
        out = work / "out"

        def restore_restic(i: int) -> None:
            assert restic is not None
            restore["restic"].run(lambda: restic.restore(kept["repo"], out), clock)
            shutil.rmtree(out)
            log(f"  restic restore #{i + 1}: {restore['restic'].seconds[-1]:.2f} s")

        def restore_lib(i: int) -> None:
            def go() -> None:
                fresh = CheckpointStore(store=store, identity=cs.identity)  # a new process's view
                manifest = fresh.latest()
                assert manifest is not None
                fresh.restore_files(manifest, out)

            restore["lib"].run(go, clock, ccount, track_memory=True)
            shutil.rmtree(out)
            log(f"  restore        #{i + 1}: {restore['lib'].seconds[-1]:.2f} s")

        def restore_boto3(i: int) -> None:
            out.mkdir()
            restore["boto3"].run(
                lambda: client.download_file(bucket, "baseline/restore.bin", str(out / "payload.bin")),
                clock,
                bcount,
            )
            shutil.rmtree(out)
            log(f"  download_file  #{i + 1}: {restore['boto3'].seconds[-1]:.2f} s")

        def restore_floor(i: int) -> None:
            assert restore_layout is not None
            out.mkdir()
            restore["floor"].run(
                lambda: get_into(client, bucket, restore_layout, out / "payload.bin", threads), clock, bcount
            )
            shutil.rmtree(out)
            log(f"  floor (gets)   #{i + 1}: {restore['floor'].seconds[-1]:.2f} s")

        def restore_safe(i: int) -> None:
            assert restore_layout is not None
            out.mkdir()
            restore["safe"].run(
                lambda: get_into(client, bucket, restore_layout, out / "payload.bin", threads, safe=True),
                clock,
                bcount,
            )
            shutil.rmtree(out)
            log(f"  floor (safe)   #{i + 1}: {restore['safe'].seconds[-1]:.2f} s")

        sides = [
            restore_lib,
            restore_boto3,
            *([restore_floor, restore_safe] if restore_layout else []),
            *([restore_restic] if restic else []),
        ]
        log(f"cold restore: {args.repeat} x {len(sides)} runs, interleaved")
        rotate(args.repeat, None, sides)
        cs.release(lease)

        # -- rows ----------------------------------------------------------------------------------------
        growth = max(
            first["lib"].peak_growth_mib + resave["lib"].peak_growth_mib + restore["lib"].peak_growth_mib,
            default=0.0,
        )

        def cpu(*sides: Timed) -> str:
            return "; ".join(s.cpu(server) for s in sides if s.seconds)

        restic_note = "restic encrypts (always) and --compression off; " if restic is not None else ""
        specs = [
            (
                "first_restic",
                f"{label}, first save",
                "restic backup to the same server (new repository)",
                first["restic"],
                first["lib"],
                (
                    first["safe"].median / first["restic"].median,
                    first["safe"].name + ": plain boto3 storing the same chunks as content addressing needs",
                )
                if restic is not None and first["restic"].seconds and first["safe"].seconds
                else None,
            ),
            (
                "first_boto3",
                f"{label}, first save",
                "boto3 upload_file",
                first["boto3"],
                first["lib"],
                (
                    first["safe"].median / first["boto3"].median,
                    first["safe"].name + ": the library's chunk-sized PUTs, each named by its SHA-256 as "
                    "content addressing needs",
                )
                if first["safe"].seconds
                else None,
            ),
            (
                "resave_restic",
                f"{label}, 1% overwritten, re-save",
                "restic backup (parent snapshot)",
                resave["restic"],
                resave["lib"],
                (local / resave["restic"].median, "read + chunk + SHA-256 of the whole file here, no request")
                if restic is not None and resave["restic"].seconds
                else None,
            ),
            (
                "resave_full",
                f"{label}, 1% overwritten, re-save",
                "a full upload (boto3 upload_file of the new file)",
                resave["boto3"],
                resave["lib"],
                (local / resave["boto3"].median, "read + chunk + SHA-256 of the whole file here, no request"),
            ),
            (
                "restore_restic",
                f"{label}, cold restore",
                "restic restore --no-cache",
                restore["restic"],
                restore["lib"],
                (
                    restore["safe"].median / restore["restic"].median,
                    restore["safe"].name + ": plain boto3 restoring the same chunks verified and durably",
                )
                if restic is not None and restore["restic"].seconds and restore["safe"].seconds
                else None,
            ),
            (
                "restore_boto3",
                f"{label}, cold restore",
                "boto3 download_file",
                restore["boto3"],
                restore["lib"],
                (
                    restore["safe"].median / restore["boto3"].median,
                    restore["safe"].name + ": the library's chunk GETs, verified and durable (download_file "
                    "does neither)",
                )
                if restore["safe"].seconds
                else None,
            ),
        ]
        phase_sides = {"first": first, "resave": resave, "restore": restore}
        for key, scenario, baseline, base, cand, floor_of in specs:
            candidate = "the library: " + cand.name
            if key.endswith("restic") and restic is None:
                rows.append(
                    skipped_row(
                        scenario=scenario,
                        baseline=baseline,
                        candidate=candidate,
                        goal=GOALS[key],
                        why=restic_why,
                    )
                )
                continue
            phase = phase_sides[key.split("_")[0]]
            notes = (
                f"{restic_note if key.endswith('restic') else ''}{cpu(*phase.values())}; library peak RSS growth "
                f"{growth:.0f} MiB (worst run of the three phases)"
            )
            if key.startswith("resave"):
                notes += f"; {changed / MIB:.1f} MiB overwritten at a random offset before each round"
            rows.append(
                ratio_row(
                    scenario=scenario,
                    baseline=baseline,
                    candidate=candidate,
                    base=base,
                    cand=cand,
                    goal=GOALS[key],
                    notes=notes,
                    floor_of=floor_of,
                )
            )
        worst = [
            (name, max(side["lib"].peak_growth_mib))
            for name, side in phase_sides.items()
            if side["lib"].peak_growth_mib
        ]
        if worst:
            top = max(g for _, g in worst)
            rows.append(
                {
                    "scenario": f"peak RSS growth, {label} save / re-save / restore",
                    "baseline": "-",
                    "candidate": "VmHWM growth over the RSS before the operation (after a clear_refs reset)",
                    "ratio": round(top, 1),
                    "ratio_min": round(min(g for _, g in worst), 1),
                    "ratio_max": round(top, 1),
                    "goal": RSS_GOAL_MIB,
                    "verdict": "PASS" if top <= RSS_GOAL_MIB else "MISS",
                    "requests_baseline": None,
                    "requests_candidate": None,
                    "notes": "MiB, worst run per phase: " + ", ".join(f"{n} +{g:.0f}" for n, g in worst),
                    "unit": "MiB",
                    "runs": sum(len(side["lib"].peak_growth_mib) for side in phase_sides.values()),
                }
            )
    finally:
        store.close()
    return rows


def print_table(rows: list[dict[str, Any]], endpoint: str) -> None:
    print()
    print(f"issue 24: restic and boto3 on {endpoint}")
    print("| scenario | baseline | ratio (min-max) | goal | verdict | floor |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if row.get("skipped"):
            print(f"| {row['scenario']} | {row['baseline']} | - | <= {row['goal']:g}x | SKIPPED | - |")
            continue
        fl = row.get("floor")
        floor_text = f"{fl['ratio']:.3f}x ({fl['what']})" if fl else "-"
        unit = "x" if row.get("unit", "x") == "x" else f" {row['unit']}"
        print(
            f"| {row['scenario']} | {row['baseline']} | {row['ratio']:.3f}{unit} ({row['ratio_min']:.3f}-"
            f"{row['ratio_max']:.3f}) | <= {row['goal']:g}{unit} | {row['verdict']} | {floor_text} |"
        )
    print()
    for row in rows:
        print(f"- {row['scenario']} vs {row['baseline']}: {row['notes']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=512, help="size of the file (default 512)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side and phase (default 3)")
    parser.add_argument("--restic", default=None, help="the restic binary (default: restic on PATH)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the file and restores are written")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here, with the machine")
    parser.add_argument("--json-out", type=Path, default=None, help="write the rows here (bench_rows.py)")
    add_server_option(parser, choices=("seaweedfs",))
    args = parser.parse_args(argv)
    if args.size_mib < 16 or args.repeat < 1:
        parser.error("--size-mib must be at least 16 and --repeat at least 1")
    started = time.perf_counter()
    with (
        start_server(args.server) as endpoint,
        tempfile.TemporaryDirectory(prefix="stateful-restic-", dir=args.workdir) as tmp,
    ):
        log(f"{args.server} server on {endpoint.url}")
        rows = run(args, endpoint, Path(tmp))
    print_table(rows, endpoint.description)
    print(f"total wall time: {time.perf_counter() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.json_out is not None:
        write_json_out(args.json_out, rows, endpoint=endpoint.description, server=args.server)
    return 0


if __name__ == "__main__":
    sys.exit(main())

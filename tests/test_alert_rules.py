"""deploy/prometheus and deploy/grafana are built on ``airflow_stateful.metrics.METRICS`` and nothing else.

* The statsd_exporter mapping maps every metric, each to one explicit Prometheus name of the kind it is.
* Every metric name in an alert expression, a dashboard query or a dashboard variable is one the mapping
  produces (a histogram's ``_bucket``/``_sum``/``_count``), and it is filtered or grouped only by labels the
  metric has (``dag_id``/``task_id`` come from tags; the fleet-wide gauges have none).
* Every alert has ``for``, a severity and ``summary``/``description``/``runbook_url``, and its runbook anchor
  is a heading of docs/observability.md.
* With ``promtool`` (Debian's ``prometheus`` package ships it; no PyPI or npm package does), ``check rules``
  passes and every alert fires on a synthetic series that should fire it, and not on one that should not.
* With a ``statsd_exporter`` binary (no registry reachable here ships one), the real exporter turns the packets
  Airflow sends into the Prometheus names of docs/observability.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_stateful.metrics import METRICS, Metric

REPO = Path(__file__).resolve().parent.parent
MAPPING = REPO / "deploy" / "prometheus" / "statsd-mapping.yaml"
RULES = REPO / "deploy" / "prometheus" / "stateful-alerts.rules.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "airflow-stateful-dashboard.json"
DOC = REPO / "docs" / "observability.md"
STATSD_PREFIX = "airflow"
SEVERITIES = {"critical", "warning", "info"}
RUNBOOK_BASE = (
    "https://github.com/airflow-provider-stateful/airflow-provider-stateful/blob/main/docs/observability.md#"
)
MAPPED_TYPE = {"counter": "counter", "gauge": "gauge", "timer": "observer"}
"""``Metric.kind`` -> the statsd_exporter ``match_metric_type`` its StatsD packets have."""


# -- PromQL: the metric names and labels an expression uses ---------------------------------------------------

TOKEN = re.compile(
    r"""
    "(?:[^"\\]|\\.)*" | '(?:[^'\\]|\\.)*' | `[^`]*`   # string literals (label values, regexes)
    | \{[^}]*\}                                          # label matchers
    | \[[^\]]*\]                                         # range and subquery durations ([5m], [$__rate_interval])
    | (?:\d+(?:ms|[smhdwy]))+(?![\w])                    # durations outside brackets (offset 1d)
    | \d+(?:\.\d+)?(?:[eE][+-]?\d+)?                     # numbers (1e-05 is no identifier)
    | [A-Za-z_:][A-Za-z0-9_:]*                           # identifiers: metric names, functions, keywords
    | \S                                                 # operators, parentheses, commas
    """,
    re.VERBOSE,
)
AGGREGATIONS = {
    *("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"),
    *("bottomk", "topk", "quantile", "limitk", "limit_ratio"),
}
"""Aggregation operators: ``max by (dag_id) (x)`` puts ``by``, not ``(``, after the operator."""
KEYWORDS = {
    *AGGREGATIONS,
    *(
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ),
}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


@dataclass
class Uses:
    """What one PromQL expression reads: metric name -> labels its matchers name, and its grouping labels."""

    metrics: dict[str, set[str]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)


def promql_uses(expr: str) -> Uses:
    """The metric names of ``expr`` (identifiers not called as functions, not keywords), with their matchers.

    ``by (dag_id, task_id)``-style label lists are grouping labels, not metrics; ``{...}`` after a name are its
    label matchers; strings, numbers and ``[...]`` durations (Grafana's ``$__rate_interval`` included) are
    skipped whole, so nothing inside them is taken for a name.
    """
    tokens = TOKEN.findall(expr)
    uses = Uses()
    i = 0
    while i < len(tokens):
        token = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in GROUPING and following == "(":
            end = tokens.index(")", i)
            uses.grouping |= {t for t in tokens[i + 2 : end] if t != ","}
            i = end + 1
            continue
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token) and token not in KEYWORDS and following != "(":
            labels = uses.metrics.setdefault(token, set())
            if following.startswith("{"):
                labels |= set(MATCHER_LABEL.findall(following))
                i += 1  # its matchers are read
        elif token.startswith("{"):
            raise AssertionError(f"a selector without a metric name in {expr!r}: name every metric")
        i += 1
    return uses


def test_the_promql_reader_finds_names_and_nothing_else() -> None:
    uses = promql_uses(
        'histogram_quantile(0.95, sum by (dag_id, task_id, le) (rate(a_seconds_bucket{dag_id=~"$dag_id"}'
        "[$__rate_interval]))) > 1e-05 and on() max_over_time(b_total[1h] offset 1d) > 2 * 3600 "
        "or vector(0) unless c"
    )
    assert uses.metrics == {"a_seconds_bucket": {"dag_id"}, "b_total": set(), "c": set()}
    assert uses.grouping == {"dag_id", "task_id", "le"}


# -- the mapping ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapped:
    metric: Metric
    name: str
    observer: str | None  # "histogram" or "summary" for timers

    @property
    def series(self) -> set[str]:
        """Every series name Prometheus gets for this metric."""
        if self.observer == "histogram":
            return {f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count"}
        if self.observer == "summary":
            return {self.name, f"{self.name}_sum", f"{self.name}_count"}
        return {self.name}


def glob_matches(pattern: str, name: str) -> bool:
    """statsd_exporter's glob: ``*`` stands for exactly one dot-separated component (or part of one)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        re.fullmatch(re.escape(p).replace(r"\*", "[^.]*"), n) for p, n in zip(parts, names, strict=True)
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def mapped() -> dict[str, Mapped]:
    """Every metric's mapping, found as statsd_exporter finds it: the first one that matches name and type."""
    config = load_yaml(MAPPING)
    defaults, mappings = config.get("defaults", {}), config["mappings"]
    result = {}
    for metric in METRICS:
        wire = f"{STATSD_PREFIX}.{metric.name}"
        found = [
            m
            for m in mappings
            if glob_matches(m["match"], wire)
            and m.get("match_metric_type", MAPPED_TYPE[metric.kind]) == MAPPED_TYPE[metric.kind]
        ]
        assert found, f"{wire} ({metric.kind}) has no mapping in {MAPPING.name}"
        first = found[0]
        observer = (
            first.get("observer_type", defaults.get("observer_type", "summary"))
            if metric.kind == "timer"
            else None
        )
        result[metric.name] = Mapped(metric=metric, name=first["name"], observer=observer)
    return result


def test_every_metric_is_mapped_once_to_an_explicit_name_of_its_kind() -> None:
    config = load_yaml(MAPPING)
    matches = [m["match"] for m in config["mappings"]]
    assert len(matches) == len(set(matches)) == len(METRICS), "one mapping per metric, no catch-all"
    assert {m.removeprefix(f"{STATSD_PREFIX}.") for m in matches} == {m.name for m in METRICS}
    names = [m.name for m in mapped().values()]
    assert len(set(names)) == len(names), "two metrics under one Prometheus name"
    for m in mapped().values():
        assert re.fullmatch(r"airflow_stateful_[a-z0-9_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.metric.kind == "counter"), (
            f"{m.name}: counters, and only they, end in _total"
        )
        if m.metric.kind == "timer":
            assert m.observer == "histogram" and m.name.endswith("_seconds"), (
                f"{m.name}: a histogram in seconds"
            )
    for mapping in config["mappings"]:
        assert set(mapping) <= {"match", "match_metric_type", "name", "help", "ttl"}, mapping
        assert mapping.get("help"), f"{mapping['match']}: a help text"
        assert "labels" not in mapping, "dag_id/task_id come from the packets' tags, not from the mapping"
    buckets = config["defaults"]["histogram_options"]["buckets"]
    assert buckets == sorted(buckets) and buckets[-1] >= 1800, "restores of large checkpoints take minutes"


def test_the_per_writer_gauges_expire_and_the_rest_do_not() -> None:
    """A finished writer's last ``stuck`` 1 must not stay forever; a daily GC gauge must outlive a day."""
    config = load_yaml(MAPPING)
    ttl = {m["match"].removeprefix(f"{STATSD_PREFIX}."): m.get("ttl") for m in config["mappings"]}
    assert {name for name, value in ttl.items() if value} == {"stateful.checkpoint_age", "stateful.stuck"}
    assert ttl["stateful.stuck"] == "30m" and config["defaults"]["ttl"] == 0


# -- what the rules and the dashboard read --------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """``(where, expr)`` for every panel target and every query variable of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    queries = [
        (f"panel {p['title']!r} target {t['refId']}", t["expr"])
        for p in board["panels"]
        for t in p.get("targets", [])
    ]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_]\w*)\)", query)
            assert inner, f"variable {var['name']}: {query!r}"
            queries.append((f"variable {var['name']}", inner.group(1)))
    return queries


def check_uses(where: str, expr: str, series: dict[str, Mapped]) -> set[str]:
    """Assert ``expr`` reads only mapped series, filtered and grouped by labels they have; the metrics read."""
    uses = promql_uses(expr)
    assert uses.metrics, f"{where}: no metric in {expr!r}"
    read = set()
    for name, labels in uses.metrics.items():
        assert name in series, f"{where}: {name} is not produced by {MAPPING.name} from METRICS ({expr!r})"
        metric = series[name].metric
        known = set(metric.tags) | ({"le"} if name.endswith("_bucket") else set())
        assert labels <= known, f"{where}: {name} has no label {sorted(labels - known)} ({expr!r})"
        assert uses.grouping <= known | {"le"}, (
            f"{where}: {name} cannot be grouped by {sorted(uses.grouping - known)}"
        )
        read.add(metric.name)
    return read


def produced_series() -> dict[str, Mapped]:
    return {s: m for m in mapped().values() for s in m.series}


def test_alert_expressions_read_only_mapped_metrics_by_labels_they_have() -> None:
    series = produced_series()
    for rule in alert_rules():
        check_uses(f"alert {rule['alert']}", rule["expr"], series)


def test_the_dashboard_reads_only_mapped_metrics_and_shows_every_metric() -> None:
    series = produced_series()
    shown = set()
    for where, expr in dashboard_queries():
        shown |= check_uses(where, expr, series)
    assert shown == {m.name for m in METRICS}, (
        f"not on the dashboard: {sorted({m.name for m in METRICS} - shown)}"
    )


def test_the_dashboard_is_a_grafana_model_on_a_templated_prometheus_source() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert 36 <= board["schemaVersion"] <= 41 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("dag_id", "task_id"):
        assert (
            variables[name]["multi"] and variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
        )
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["description"] and panel["targets"], panel["title"]
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            if "dag_id" in promql_uses(target["expr"]).grouping:
                assert all(f'{v}=~"${v}"' in target["expr"] for v in ("dag_id", "task_id")), (
                    f"{panel['title']}: per task, but not filtered by the dag_id/task_id variables"
                )


# -- the rules' form and their runbooks ----------------------------------------------------------------------


def doc_anchors() -> set[str]:
    """GitHub's anchors of the headings of docs/observability.md."""
    headings = re.findall(r"^#+ (.+)$", DOC.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_alert_says_what_it_means_and_links_its_runbook() -> None:
    anchors = doc_anchors()
    names = [rule.get("alert") for rule in alert_rules()]
    assert len(names) == len(set(names)) and all(names)
    for rule in alert_rules():
        name = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"\d+[smhd]", rule["for"]), f"{name}: for {rule['for']!r}"
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, name
        assert len(notes["summary"]) < 120 and len(notes["description"]) > 150, name
        assert notes["runbook_url"] == RUNBOOK_BASE + name.lower(), name
        assert name.lower() in anchors, f"docs/observability.md has no section {name}"
    doc = DOC.read_text()
    assert all(f"[{name}](#{name.lower()})" in doc for name in names), (
        "the doc's alert table lists every alert"
    )


# -- promtool ------------------------------------------------------------------------------------------------

TRIED = (
    "PyPI and npm have no package that ships promtool (their package lists, searched for promtool/prometheus, "
    "list only clients and PromQL parsers); Debian's `prometheus` package ships /usr/bin/promtool: "
    "`apt-get install prometheus` (it also installs the server's service), or without the service "
    "`apt-get download prometheus && dpkg-deb -x prometheus_*.deb DIR` and PROMTOOL=DIR/usr/bin/promtool"
)


def find_tool(env: str, name: str) -> str | None:
    """``$env``, else ``name`` on PATH, else beside this Python (a setup step may put it in the venv)."""
    beside = Path(sys.executable).parent / name
    path = os.environ.get(env) or shutil.which(name) or (str(beside) if beside.exists() else None)
    return path if path and os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def promtool() -> str:
    path = find_tool("PROMTOOL", "promtool")
    if path is None:
        reason = f"promtool not found ($PROMTOOL, PATH, beside this Python). {TRIED}"
        print(reason)
        pytest.skip(reason)
    return path


def run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_promtool_checks_the_rules(promtool: str, tmp_path: Path) -> None:
    out = run([promtool, "check", "rules", str(RULES)], tmp_path)
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


GiB = 1024**3
TASK = 'dag_id="etl",task_id="load"'
FLEET_SEVERITY = {"severity"}

# For each alert: input series (1-minute samples), then (minute, fires?) checks. An alert of a per-task rule
# carries dag_id/task_id; a fleet-wide one carries only its severity.
SCENARIOS: dict[str, tuple[list[tuple[str, str]], list[tuple[int, bool]]]] = {
    "StatefulWriterStuck": ([(f"airflow_stateful_stuck{{{TASK}}}", "0 0 1x30")], [(11, False), (13, True)]),
    "StatefulCheckpointAgeHigh": (
        [(f"airflow_stateful_checkpoint_age_seconds{{{TASK}}}", "0+60x200")],  # one more minute every minute
        [(125, False), (140, True)],
    ),
    "StatefulCommitFailures": (
        [(f"airflow_stateful_commit_failures_total{{{TASK}}}", "0+1x60")],  # one failure a minute
        [(2, False), (40, True)],
    ),
    "StatefulFencedWrites": (
        [(f"airflow_stateful_fenced_writes_total{{{TASK}}}", "0 0 0 0 0 1x40")],
        [(4, False), (8, True), (35, False)],  # the window slid past the one fenced write
    ),
    "StatefulRestoreSlow": (
        [  # a restore of 10-30 minutes every minute
            (f'airflow_stateful_restore_duration_seconds_bucket{{{TASK},le="600"}}', "0x60"),
            (f'airflow_stateful_restore_duration_seconds_bucket{{{TASK},le="1800"}}', "0+1x60"),
            (f'airflow_stateful_restore_duration_seconds_bucket{{{TASK},le="+Inf"}}', "0+1x60"),
        ],
        [(3, False), (30, True)],
    ),
    "StatefulStuckIdentities": ([("airflow_stateful_stuck_identities", "0 3x60")], [(20, False), (40, True)]),
    "StatefulGCBacklogHigh": (
        [("airflow_stateful_gc_garbage_bytes", f"{20 * GiB}x90")],
        [(30, False), (70, True)],
    ),
    "StatefulGCBacklogGrowing": (
        [("airflow_stateful_gc_garbage_objects", "1000+1x600")],  # growing for 10 hours
        [(300, False), (480, True)],
    ),
    "StatefulIdleStateHigh": (
        [("airflow_stateful_idle_bytes", f"{200 * GiB}x90")],
        [(30, False), (70, True)],
    ),
    "StatefulIdleStateCostHigh": (
        [("airflow_stateful_idle_monthly_cost", "75x90")],
        [(30, False), (70, True)],
    ),
}
QUIET: dict[str, list[tuple[str, str]]] = {
    "StatefulWriterStuck": [(f"airflow_stateful_stuck{{{TASK}}}", "0x60")],
    "StatefulCheckpointAgeHigh": [
        (f"airflow_stateful_checkpoint_age_seconds{{{TASK}}}", "0+60x100 0+60x100")
    ],
    "StatefulCommitFailures": [(f"airflow_stateful_commit_failures_total{{{TASK}}}", "0 1x60")],
    "StatefulFencedWrites": [(f"airflow_stateful_fenced_writes_total{{{TASK}}}", "3x60")],
    "StatefulRestoreSlow": [
        (f'airflow_stateful_restore_duration_seconds_bucket{{{TASK},le="60"}}', "0+1x60"),
        (f'airflow_stateful_restore_duration_seconds_bucket{{{TASK},le="+Inf"}}', "0+1x60"),
    ],
    "StatefulStuckIdentities": [("airflow_stateful_stuck_identities", "0x60")],
    "StatefulGCBacklogHigh": [("airflow_stateful_gc_garbage_bytes", f"{9 * GiB}x90")],
    "StatefulGCBacklogGrowing": [("airflow_stateful_gc_garbage_objects", "5000x600")],
    "StatefulIdleStateHigh": [("airflow_stateful_idle_bytes", f"{99 * GiB}x90")],
    "StatefulIdleStateCostHigh": [("airflow_stateful_idle_monthly_cost", "49.99x90")],
}
"""Series that must never fire the alert: healthy values, or just under the threshold."""


def test_every_alert_fires_when_it_should_and_only_then(promtool: str, tmp_path: Path) -> None:
    """``promtool test rules`` on the shipped expressions (annotations left out: ``check rules`` covers them)."""
    rules = load_yaml(RULES)
    for group in rules["groups"]:
        for rule in group["rules"]:
            del rule["annotations"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    by_name = {rule["alert"]: rule for rule in alert_rules()}
    assert set(SCENARIOS) == set(QUIET) == set(by_name), "a scenario for every alert"
    tests = []
    for name, (series, checks) in SCENARIOS.items():
        per_task = "dag_id" in promql_uses(by_name[name]["expr"]).grouping
        labels = {"severity": by_name[name]["labels"]["severity"]}
        if per_task:
            labels |= {"dag_id": "etl", "task_id": "load"}
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {
                        "eval_time": f"{minute}m",
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": labels}] if fires else [],
                    }
                    for minute, fires in checks
                ],
            }
        )
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in QUIET[name]],
                "alert_rule_test": [
                    {"eval_time": f"{minute}m", "alertname": name, "exp_alerts": []} for minute, _ in checks
                ],
            }
        )
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    run([promtool, "test", "rules", "tests.yaml"], tmp_path)


# -- statsd_exporter -----------------------------------------------------------------------------------------

STATSD_EXPORTER_TRIED = (
    "statsd_exporter not found ($STATSD_EXPORTER, PATH, beside this Python). Looked for it in every registry "
    "reachable here: PyPI's `statsd-exporter` is a StatsD client fork, not the exporter; npm has none; Debian "
    "bookworm has no prometheus-statsd-exporter package (`apt-cache search statsd` lists clients only). It "
    "ships as a Go binary on GitHub releases, the quay.io/prometheus/statsd-exporter image and Go source (go "
    "install, through the Go module proxy), none reachable from these machines. The mapping's glob matching is "
    "checked in Python above"
)


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_statsd_exporter_maps_what_airflow_sends(tmp_path: Path) -> None:
    exporter = find_tool("STATSD_EXPORTER", "statsd_exporter")
    if exporter is None:
        print(STATSD_EXPORTER_TRIED)
        pytest.skip(STATSD_EXPORTER_TRIED)
    udp, web = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [
            exporter,
            f"--statsd.mapping-config={MAPPING}",
            f"--statsd.listen-udp=127.0.0.1:{udp}",
            "--statsd.listen-tcp=",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # What Airflow's StatsD client sends with statsd_influxdb_enabled (see tests/test_metrics.py).
        value = {"counter": "1|c", "gauge": "1|g", "timer": "250.000000|ms"}
        lines = [
            f"{STATSD_PREFIX}.{m.name}{',dag_id=etl,task_id=load' if m.tags else ''}:{value[m.kind]}"
            for m in METRICS
        ]
        deadline = time.monotonic() + 10
        text = ""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            while time.monotonic() < deadline:
                for line in lines:
                    sock.sendto(line.encode(), ("127.0.0.1", udp))
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=2) as answer:
                        text = answer.read().decode()
                except OSError:
                    text = ""
                if all(m.name in text for m in mapped().values()):
                    break
                time.sleep(0.2)
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        for m in mapped().values():
            for series in m.series:
                found = [line for line in samples if re.match(rf"{series}[{{ ]", line)]
                assert found, f"{series} ({m.metric.name}) is missing from the exporter's /metrics"
                if m.metric.tags:
                    assert all('dag_id="etl"' in line and 'task_id="load"' in line for line in found), found
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_doc_lists_every_metric_under_its_wire_and_prometheus_names() -> None:
    rows = re.findall(r"^\| `([a-z_.]+)` \| (\w+) \| ([^|]+) \| `(\w+)`", DOC.read_text(), flags=re.MULTILINE)
    documented = {wire: (kind, tags.strip(), name) for wire, kind, tags, name in rows}
    expected = {
        f"{STATSD_PREFIX}.{m.metric.name}": (m.metric.kind, ", ".join(m.metric.tags) or "none", m.name)
        for m in mapped().values()
    }
    assert documented == expected

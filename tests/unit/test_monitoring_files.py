"""deploy/monitoring without Prometheus: the alert rules and the Grafana dashboard only
query series the agent really exports (read off its metrics registry), every alert says
how bad it is and what to do, and every alert has a promtool test that fires it and one
that keeps it silent. tests/e2e/test_monitoring.py runs promtool and a real Prometheus."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.server.metrics import AgentMetrics

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "sliceproxy-rules.yaml"
RULE_TESTS = MONITORING / "sliceproxy-rules.test.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
JOB = "sliceproxy"

# Series Prometheus itself adds to every target.
SCRAPE_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
             "summary": ("", "_count", "_sum"), "gauge": ("",), "unknown": ("",)}
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "by", "without", "on", "ignoring",
                       "group_left", "group_right", "offset", "inf", "nan"})
# Grafana's variables, as the e2e test substitutes them to run a panel's query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
                     "$job": JOB, "$instance": ".*"}


def exported_names() -> frozenset[str]:
    """Every sample name the agent's /metrics can carry: its registry's families, the
    collectors that read the model and the reflectors included, with each type's
    suffixes (a counter `x` is sampled as `x_total`)."""
    metrics = AgentMetrics()
    metrics.watch_model(lambda: None)
    metrics.watch_reflectors(lambda: [])
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return frozenset(names)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, keywords, label
    names, durations or numbers). Enough PromQL for our files; never a full parser."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+\S+", " ", s)
    found = set()
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?", s):
        name, call = match.groups()
        if call is None and name.lower() not in _KEYWORDS:
            found.add(name)
    return found


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in load_rules() if "alert" in rule]


def load_dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row's own panels


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every query the dashboard runs: its panels' targets, and the series a template
    variable's `label_values(series, label)` reads."""
    return [t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", [])] \
        + variable_exprs(dashboard)


def variable_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            assert match, f"variable {var['name']}: {query}"
            exprs.append(match.group(1))
    return exprs


def grafana_to_promql(expr: str) -> str:
    for var, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable left in {expr}"
    return expr


def queried_names() -> dict[str, set[str]]:
    """Metric name -> where it is used ("alert X", "panel 'Y'")."""
    used: dict[str, set[str]] = {}
    for rule in load_rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(f"alert {rule.get('alert', rule.get('record'))}")
    dashboard = load_dashboard()
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            for name in metric_names(target["expr"]):
                used.setdefault(name, set()).add(f"panel {panel['title']!r}")
    for expr in variable_exprs(dashboard):
        for name in metric_names(expr):
            used.setdefault(name, set()).add("a template variable")
    return used


def unknown(names: set[str] | dict[str, set[str]], known: frozenset[str]) -> dict[str, str]:
    return {n: ", ".join(sorted(names[n])) if isinstance(names, dict) else ""
            for n in names if n not in known and n not in SCRAPE_SERIES}


# --- the PromQL name reader itself ----------------------------------------------------


@pytest.mark.parametrize(("expr", "want"), [
    ('up{job="sliceproxy"} == 0', {"up"}),
    ('histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{job="x", le!="1e3"}[5m]))) > 30',
     {"a_bucket"}),
    ("(time() - b > 60) and on (instance) (c > b offset 5m)", {"b", "c"}),
    ("sum without (kind) (increase(d_total[$__rate_interval])) or vector(0) > bool 1e3",
     {"d_total"}),
    ('label_replace(e, "dst", "$1", "src", "(.*)") unless ignoring(code) f', {"e", "f"}),
    ("max_over_time(g[5m:1m]) / Inf", {"g"}),
])
def test_metric_names_reads_selectors_only(expr: str, want: set[str]) -> None:
    assert metric_names(expr) == want


def test_a_wrong_name_is_caught() -> None:
    known = exported_names()
    assert "kubeproxy_sync_proxy_rules_duration_seconds_count" in known
    assert "sliceproxy_syncs_total" in known and "sliceproxy_watch_relists_total" in known
    assert "sliceproxy_syncs" not in known  # a counter is only ever sampled as _total
    typo = metric_names("rate(kubeproxy_sync_proxy_rule_duration_seconds_count[5m]) > 0")
    assert unknown(typo, known) == {"kubeproxy_sync_proxy_rule_duration_seconds_count": ""}


# --- the files ----------------------------------------------------------------------


def test_rules_and_dashboard_query_only_exported_metrics() -> None:
    used = queried_names()
    assert unknown(used, exported_names()) == {}
    # What the issue asks the files to watch is there.
    for name in ("up", "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
                 "kubeproxy_network_programming_duration_seconds_bucket",
                 "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
                 "sliceproxy_syncs_total", "sliceproxy_watch_relists_total",
                 "sliceproxy_skipped_objects", "sliceproxy_endpoint_conflicts"):
        assert name in used, name


def test_every_alert_says_how_bad_and_what_to_do() -> None:
    found = alerts()
    assert {a["alert"] for a in found} == {
        "SliceproxyDown", "SliceproxySyncFailing", "SliceproxyRulesStale",
        "SliceproxyNetworkProgrammingSlow", "SliceproxyWatchRelistLoop",
        "SliceproxyWatchFailing", "SliceproxySkippedObjects", "SliceproxyForeignProxy"}
    for alert in found:
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        assert re.fullmatch(r"\d+[smh]", alert["for"]), name
        assert alert["annotations"]["summary"].strip(), name
        assert len(alert["annotations"]["description"]) > 150, name
        assert f'job="{JOB}"' in alert["expr"], name
        assert metric_names(alert["expr"]), name


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            expected = check.get("exp_alerts") or []
            (firing if expected else silent).add(check["alertname"])
            for alert in expected:
                assert alert["exp_annotations"]["summary"], check["alertname"]
    names = {a["alert"] for a in alerts()}
    assert firing == names
    assert silent == names


def test_dashboard_is_a_standard_grafana_dashboard_on_a_datasource_variable() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(dashboard_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    queried = [p for p in panels if p["type"] != "row"]
    assert len(queried) >= 12
    for panel in queried:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"] and target["refId"], panel["title"]
            grafana_to_promql(target["expr"])
    # No two panels overlap on the 24-column grid.
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_dashboard_shows_what_an_operator_needs() -> None:
    dashboard = load_dashboard()
    by_type: dict[str, list[str]] = {}
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            by_type.setdefault(panel["type"], []).append(target["expr"])
    everything = " ".join(e for exprs in by_type.values() for e in exprs)
    # Sync duration and rate; programming latency as a histogram (a heatmap of buckets).
    assert "kubeproxy_sync_proxy_rules_duration_seconds_bucket" in everything
    assert "rate(sliceproxy_syncs_total" in everything
    assert any("kubeproxy_network_programming_duration_seconds_bucket" in e
               for e in by_type["heatmap"])
    assert "kubeproxy_sync_proxy_rules_endpoint_changes_pending" in everything
    # Watch health broken down per resource, conflicts and skips.
    watch = [e for exprs in by_type.values() for e in exprs if "sliceproxy_watch_" in e]
    assert len(watch) >= 4 and all("by (resource)" in e for e in watch)
    assert "sliceproxy_endpoint_conflicts" in everything
    assert "by (kind, reason) (sliceproxy_skipped_objects" in everything

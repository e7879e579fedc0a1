"""deploy/monitoring against the real tools: promtool checks and unit-tests the alert
rules, and a real Prometheus, inside a lab namespace, scrapes the real agent running
against the simulator, loads the rules, evaluates every alert and every dashboard query
on live data, and sees the agent go down when it stops.

Prometheus runs in the lab's client namespace and scrapes the node at 198.18.0.1:10249
(the agent's --metrics-bind-address), as a cluster's Prometheus scrapes a node from
elsewhere; nothing listens in the host's namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.netns_lab import Lab
from proxy.netns_lab.topology import CLIENT4, NODE_LAN4
from tests.e2e.agent_support import (
    METRICS_PORT,
    AgentProcess,
    endpoint,
    endpoint_slice,
    http_get,
    node_object,
    service,
    start_sim,
    wait_for,
)
from tests.unit.test_monitoring_files import (
    JOB,
    MONITORING,
    RULE_TESTS,
    RULES,
    SCRAPE_SERIES,
    SUFFIXES,
    alerts,
    dashboard_exprs,
    grafana_to_promql,
    load_dashboard,
    queried_names,
)

pytestmark = pytest.mark.root

PROM_PORT = 9090
TARGET = f"{NODE_LAN4}:{METRICS_PORT}"
VIP = "198.18.128.10"


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `./run setup` installs Debian's prometheus package"
    return path


def run(*argv: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60,
                          check=False)


# --- promtool ----------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    result = run(tool("promtool"), "check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run(tool("promtool"), "test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


# --- a real Prometheus scraping a real agent ----------------------------------------


class Prometheus:
    """Prometheus' HTTP API, reached from inside the client namespace."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab

    def get(self, path: str) -> tuple[int, Any]:
        status, body = http_get(self.lab.client_ns, str(CLIENT4), PROM_PORT, path)
        try:
            return status, json.loads(body) if body else None
        except ValueError:
            return status, body

    def api(self, path: str) -> Any:
        status, doc = self.get(path)
        assert status == 200 and doc["status"] == "success", (path, status, doc)
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result; fails on a query Prometheus refuses."""
        status, doc = self.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert status == 200 and isinstance(doc, dict) and doc["status"] == "success", \
            f"{expr}: {status} {doc}"
        data = doc["data"]
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" \
            else [{"value": data["result"]}]
        return result


def declared(metrics_text: str) -> tuple[set[str], set[str]]:
    """From a /metrics page: every sample name its # TYPE lines declare (with each
    type's suffixes), and the sample names that carry a value now."""
    names: set[str] = set()
    sampled: set[str] = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            # prometheus_client names a counter with its _total in # TYPE.
            if kind == "counter" and name.endswith("_total"):
                name = name.removesuffix("_total")
            names.update(name + s for s in SUFFIXES[kind])
        elif line and not line.startswith("#"):
            sampled.add(line.split("{")[0].split(" ")[0])
    return names, sampled


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(ipv6=False) as lab:
        yield lab


def test_prometheus_scrapes_the_agent_and_runs_every_rule_and_panel(
        lab: Lab, tmp_path: Path, host_untouched: None) -> None:
    prometheus_bin = tool("prometheus")
    headless = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "db", "namespace": "demo"},
                "spec": {"clusterIP": "None", "clusterIPs": ["None"],
                         "ports": [{"name": "pg", "port": 5432, "protocol": "TCP"}]}}
    sim = start_sim(lab, [node_object(), service("web", [VIP]), headless,
                          endpoint_slice("web-1", "web", [endpoint("198.18.1.10")])])
    try:
        agent = AgentProcess(lab, sim, tmp_path, "--metrics-bind-address", TARGET).start()
        agent.wait_ready()

        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": JOB,
                                "static_configs": [{"targets": [TARGET]}]}],
        }))
        log = (tmp_path / "prometheus.log").open("wb")
        proc = lab.popen(lab.client_ns, [
            prometheus_bin, f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={CLIENT4}:{PROM_PORT}", "--log.level=warn"],
            stdout=log, stderr=log, cwd=str(tmp_path))
        log.close()
        prom = Prometheus(lab)

        def prometheus_log() -> str:
            return (tmp_path / "prometheus.log").read_text(errors="replace")[-3000:]

        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited:\n{prometheus_log()}"
            return prom.get("/-/ready")[0] == 200

        wait_for(ready, 20, "Prometheus to start")
        # `ip netns exec` execs Prometheus: that pid is Prometheus', in the lab namespace.
        assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{proc.pid}/exe") == os.path.realpath(prometheus_bin)
        wait_for(lambda: prom.query(f'up{{job="{JOB}"}} == 1'), 20, "a successful scrape")

        # A change after the first sync: a network programming latency to record.
        sim.apply(endpoint_slice("web-1", "web", [endpoint("198.18.1.10"),
                                                  endpoint("198.18.1.11")]))
        for expr in (
                f'kubeproxy_sync_proxy_rules_duration_seconds_count{{job="{JOB}"}} > 0',
                f'kubeproxy_network_programming_duration_seconds_count{{job="{JOB}"}} > 0',
                f'sliceproxy_syncs_total{{job="{JOB}", kind="partial", result="ok"}} > 0',
                f'count(count by (resource) (sliceproxy_watch_events_total{{job="{JOB}"}})) == 3',
                f'sliceproxy_skipped_objects{{job="{JOB}", reason="headless"}} == 1'):
            wait_for(partial(prom.query, expr), 20, f"Prometheus to see {expr}")

        # Every name the rules and the dashboard use is one the live agent declares, and
        # Prometheus has it unless nothing has happened to it yet (a labelled counter
        # without children, as apply failures on a healthy node).
        status, body = agent.get("/metrics", host=str(NODE_LAN4))
        assert status == 200
        live, sampled = declared(body.decode())
        used = queried_names()
        assert {n: w for n, w in used.items() if n not in live | SCRAPE_SERIES} == {}
        scraped = set(prom.api("/api/v1/label/__name__/values"))
        not_scraped = set(used) - scraped
        assert not_scraped <= live - sampled, (not_scraped, sampled)

        # Prometheus loaded every alert and has evaluated each without an error.
        def evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in prom.api("/api/v1/rules")["groups"] for r in g["rules"]]
            if all(r["health"] == "ok" for r in rules):
                return rules
            assert all(r["health"] != "err" for r in rules), rules
            return None
        rules = wait_for(evaluated, 20, "every rule to be evaluated")
        assert {r["name"] for r in rules} == {a["alert"] for a in alerts()}
        # ... and each expression runs on live data; a healthy agent fires nothing.
        for alert in alerts():
            prom.query(alert["expr"])
        assert prom.api("/api/v1/alerts")["alerts"] == []

        # Every panel's query runs, and the main ones have data.
        for expr in dashboard_exprs(load_dashboard()):
            prom.query(grafana_to_promql(expr))
        assert prom.query(f'sum(up{{job="{JOB}"}})')[0]["value"][1] == "1"
        assert prom.query(grafana_to_promql(
            'max(sliceproxy_service_ports{job="$job", instance=~"$instance"})'
        ))[0]["value"][1] == "1"

        # The agent stops: SliceproxyDown's expression holds, and the alert is pending.
        agent.stop()
        down = next(a for a in alerts() if a["alert"] == "SliceproxyDown")
        result = wait_for(lambda: prom.query(down["expr"]), 20, "up == 0")
        assert [r["metric"]["instance"] for r in result] == [TARGET]

        def pending() -> list[dict[str, Any]]:
            return [a for a in prom.api("/api/v1/alerts")["alerts"]
                    if a["labels"]["alertname"] == "SliceproxyDown"]
        (alert,) = wait_for(pending, 10, "SliceproxyDown to be pending")
        assert alert["state"] == "pending" and alert["labels"]["severity"] == "critical"
    finally:
        sim.stop()

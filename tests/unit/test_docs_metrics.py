"""docs/monitoring.md's metrics table is the agent's own: every metric the agent
registers is in it with its type and labels, and it lists nothing the agent does not
serve. The metrics are read from a scrape of a fresh `AgentMetrics` with every collector
attached and every labelled metric given a child, so each family shows its labels."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from proxy.dataplane.base import Counted, PortTraffic
from proxy.kube.reflector import ReflectorStats
from proxy.kube.resources import SERVICES
from proxy.model.types import Family, ServicePortKey
from proxy.server.metrics import AgentMetrics
from proxy.server.traffic import TrafficReading
from tests.unit.builders import model_of, service

PAGE = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"


@dataclass
class _Reflector:
    resource: object = SERVICES
    stats: ReflectorStats = field(default_factory=ReflectorStats)


def served() -> dict[str, tuple[str, frozenset[str]]]:
    """Each metric as scraped (a counter's name with `_total`): its type and labels."""
    metrics = AgentMetrics()
    for metric in vars(metrics).values():  # a labelled metric shows once it has a child
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*("x",) * len(metric._labelnames))
    model = model_of(service("bad", ips=("198.18.128.300",)))  # one skip record
    model.resolve()
    metrics.watch_model(lambda: model)
    metrics.watch_reflectors(lambda: [_Reflector()])
    # Traffic as the IPVS mode reads it (packets and bytes too), counted per endpoint.
    reading = TrafficReading()
    reading.update({ServicePortKey("demo", "web", "http", Family.V4): PortTraffic(
        Counted(1, 2, 3), {(ip_address("198.18.1.10"), 8080): Counted(1, 2, 3)})})
    metrics.watch_traffic(reading)
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {key for sample in family.samples for key in sample.labels} - {"le"}
        out[name] = (family.type, frozenset(labels))
    return out


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    """The rows of the table headed `| metric | type | labels | meaning |`."""
    rows: dict[str, tuple[str, frozenset[str]]] = {}
    inside = False
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:3] == ["metric", "type", "labels"]:
            inside = True
        elif inside and not line.startswith("|"):
            break
        elif inside and not set(cells[0]) <= set("-: "):
            name = cells[0].strip("`")
            assert name not in rows, f"{name} documented twice"
            rows[name] = (cells[1], frozenset(re.findall(r"`([^`]+)`", cells[2])))
    assert rows, "docs/monitoring.md has no metrics table"
    return rows


def test_the_metrics_table_lists_exactly_what_the_agent_serves() -> None:
    have, doc = served(), documented()
    assert sorted(set(have) - set(doc)) == [], "served, missing from docs/monitoring.md"
    assert sorted(set(doc) - set(have)) == [], "in docs/monitoring.md, not served"
    wrong = {name: (doc[name], have[name]) for name in have if doc[name] != have[name]}
    assert wrong == {}, "type or labels differ (docs, code)"


def test_the_check_sees_collectors_and_labels() -> None:
    """The scrape the table is checked against includes scrape-time collectors and
    labels, so a watch counter or a label added later cannot slip past."""
    have = served()
    assert have["sliceproxy_watch_relists_total"] == ("counter", frozenset({"resource"}))
    assert have["sliceproxy_skipped_objects"] == ("gauge", frozenset({"kind", "reason"}))
    assert have["sliceproxy_foreign_proxy_active"] == ("gauge", frozenset({"proxy"}))
    assert have["kubeproxy_network_programming_duration_seconds"][1] == frozenset()

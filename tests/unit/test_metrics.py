"""Metric names (kube-proxy's where they exist) and the scrape-time collectors."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.kube.ingest import apply_object
from proxy.kube.reflector import ReflectorStats
from proxy.kube.resources import SERVICES
from proxy.server.metrics import AgentMetrics
from tests.unit.builders import ep, eps_slice, model_of, service

UPSTREAM = {
    "kubeproxy_sync_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_full_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_network_programming_duration_seconds": "histogram",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": "gauge",
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": "gauge",
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": "gauge",
    "kubeproxy_sync_proxy_rules_service_changes_pending": "gauge",
    "kubeproxy_sync_proxy_rules_endpoint_changes": "counter",
    "kubeproxy_sync_proxy_rules_service_changes": "counter",
    "kubeproxy_sync_proxy_rules_iptables_restore_failures": "counter",
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures": "counter",
    "kubeproxy_proxy_healthz": "counter",
    "kubeproxy_proxy_livez": "counter",
}
OURS = {
    "sliceproxy_syncs": "counter",
    "sliceproxy_sync_apply_failures": "counter",
    "sliceproxy_conntrack_entries_cleared": "counter",
    "sliceproxy_conntrack_entries_deleted": "counter",
    "sliceproxy_tcp_flows_reset": "counter",
    "sliceproxy_first_sync_seconds": "gauge",
    "sliceproxy_skipped_objects": "gauge",
    "sliceproxy_endpoint_conflicts": "gauge",
    "sliceproxy_service_ports": "gauge",
    "sliceproxy_watch_lists": "counter",
    "sliceproxy_watch_relists": "counter",
    "sliceproxy_watch_watch_restarts": "counter",
    "sliceproxy_watch_errors": "counter",
    "sliceproxy_watch_stalls": "counter",
}


@dataclass
class FakeReflector:
    resource: object = SERVICES
    stats: ReflectorStats = field(default_factory=ReflectorStats)


def families(metrics: AgentMetrics) -> dict[str, str]:
    text = metrics.render().decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_names_and_types() -> None:
    m = AgentMetrics()
    m.watch_model(lambda: None)
    m.watch_reflectors(lambda: [])
    got = families(m)
    for name, kind in {**UPSTREAM, **OURS}.items():
        assert got.get(name) == kind, f"{name}: {got.get(name)}"
    assert "_created" not in m.render().decode()


def test_model_collector_counts_skips_by_reason_and_conflicts() -> None:
    model = model_of(
        service("web", ips=("198.18.128.10",)),
        service("bad", ips=("198.18.128.300",)),
        service("headless", ips=(), clusterIP="None"),
        eps_slice("w1", [ep("198.18.1.10"), ep("198.18.1.11")], service_name="web"),
        eps_slice("w2", [ep("198.18.1.10", ready=False), ep("198.18.1.999")],
                  service_name="web"),
    )
    model.resolve()
    m = AgentMetrics()
    m.watch_model(lambda: model)
    reg = m.registry
    assert reg.get_sample_value("sliceproxy_skipped_objects",
                                {"kind": "EndpointSlice", "reason": "invalid-ip"}) == 1
    assert reg.get_sample_value("sliceproxy_skipped_objects",
                                {"kind": "Service", "reason": "headless"}) == 1
    assert reg.get_sample_value("sliceproxy_skipped_objects",
                                {"kind": "Service", "reason": "invalid-ip"}) == 1
    assert reg.get_sample_value("sliceproxy_endpoint_conflicts") == 1
    assert reg.get_sample_value("sliceproxy_service_ports") == 1


def test_endpoint_conflicts_follow_every_change() -> None:
    """The gauge is kept as ports change (a scrape no longer sums every port): after each
    step it is what summing every port's conflicts says, and what the slices imply."""
    model = model_of(service("web", ips=("198.18.128.10",)),
                     service("api", ips=("198.18.128.11",)))
    m = AgentMetrics()
    m.watch_model(lambda: model)

    def gauge() -> float | None:
        model.resolve()
        assert model.state.conflicts == sum(len(p.conflicts) for p in model.state)
        return m.registry.get_sample_value("sliceproxy_endpoint_conflicts")

    def both(name: str, svc: str, ready: bool, *more: str) -> None:
        apply_object(model, eps_slice(name, [ep("198.18.1.10", ready=ready),
                                             *(ep(a) for a in more)], service_name=svc))

    assert gauge() == 0
    both("w1", "web", True, "198.18.1.11")
    both("w2", "web", False)  # 198.18.1.10 listed twice, its copies disagree
    assert gauge() == 1
    both("a1", "api", True, "198.18.1.12")
    both("a2", "api", False, "198.18.1.12")  # .10 disagrees; .12 is an identical copy
    assert gauge() == 2
    both("w2", "web", True)  # the copies agree again
    assert gauge() == 1
    apply_object(model, service("api", ips=(), clusterIP="None"))
    assert gauge() == 0  # api is headless now: no port, no conflict


def test_watch_collector_reads_reflector_stats_at_scrape_time() -> None:
    refl = FakeReflector()
    m = AgentMetrics()
    m.watch_reflectors(lambda: [refl])
    labels = {"resource": "services.v1"}
    assert m.registry.get_sample_value("sliceproxy_watch_relists_total", labels) == 0
    refl.stats.relists = 2
    refl.stats.watch_restarts = 5
    refl.stats.errors = 1
    assert m.registry.get_sample_value("sliceproxy_watch_relists_total", labels) == 2
    assert m.registry.get_sample_value("sliceproxy_watch_watch_restarts_total", labels) == 5
    assert m.registry.get_sample_value("sliceproxy_watch_errors_total", labels) == 1


def test_every_watch_counter_says_what_it_counts() -> None:
    """An operator reading /metrics gets a sentence per counter, not a field name."""
    m = AgentMetrics()
    m.watch_reflectors(lambda: [FakeReflector()])
    text = generate_latest(m.registry).decode()
    watch = [f for f in text_string_to_metric_families(text)
             if f.name.startswith("sliceproxy_watch_")]
    assert len(watch) >= 15
    generic = [f.name for f in watch if "(ReflectorStats)" in f.documentation]
    assert not generic, generic


def test_each_agent_has_its_own_registry() -> None:
    a, b = AgentMetrics(), AgentMetrics()
    a.service_changes.inc()
    assert a.registry.get_sample_value("kubeproxy_sync_proxy_rules_service_changes_total") == 1
    assert b.registry.get_sample_value("kubeproxy_sync_proxy_rules_service_changes_total") == 0

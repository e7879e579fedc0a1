"""The real agent process in a node namespace, judged by real traffic: services created,
changed and deleted in the simulator; Endpoints mode against EndpointSlice mode; health
when syncs are blocked by the real xtables lock; health-check node ports; and the
network programming latency, measured from the simulator write to the traffic."""

from __future__ import annotations

import contextlib
import fcntl
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.netns_lab import BackendSpec, Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    endpoints_object,
    http_get,
    namespace_object,
    node_object,
    quiet_icmp_limits,
    run_cli,
    service,
    start_sim,
    wait_for,
)

pytestmark = pytest.mark.root

WEB4, WEB6 = "198.18.128.10", "fd00:198:18::10"
BOTH = (("http", 80, 8080, "TCP"), ("dns", 53, 8081, "UDP"))


@pytest.fixture
def lab() -> Iterator[Lab]:
    specs = [BackendSpec("web-1"), BackendSpec("web-2", node="node-b"),
             BackendSpec("web-3", node="node-b")]
    with Lab(specs) as lab:
        quiet_icmp_limits(lab)
        lab.start_backends()
        yield lab


@pytest.fixture
def sim(lab: Lab) -> Iterator[SimServer]:
    with start_sim(lab, [node_object(), namespace_object("demo")]) as server:
        yield server


@pytest.fixture(params=["iptables", "nftables"])
def agent(lab: Lab, sim: SimServer, tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[AgentProcess]:
    proc = AgentProcess(lab, sim, tmp_path, "--proxy-mode", request.param).start()
    proc.wait_ready()
    yield proc
    if proc.alive():
        proc.stop()


def web_slices(lab: Lab, names: tuple[str, ...], ports: Any = BOTH) -> list[dict[str, Any]]:
    b = lab.backends
    return [
        endpoint_slice("web-v4", "web", [endpoint(b[n].ipv4, node=b[n].node) for n in names],
                       ports),
        endpoint_slice("web-v6", "web", [endpoint(b[n].ipv6, node=b[n].node) for n in names],
                       ports, family="IPv6"),
    ]


def test_create_change_delete_follow_in_traffic(lab: Lab, sim: SimServer,
                                                agent: AgentProcess) -> None:
    c = lab.client_ns
    # Created: dual stack, TCP and UDP.
    sim.apply(service("web", [WEB4, WEB6], BOTH))
    for obj in web_slices(lab, ("web-1", "web-2")):
        sim.apply(obj)
    for vip in (WEB4, WEB6):
        lab.wait_for(c, vip, 80, {"web-1", "web-2"})
        lab.wait_for(c, vip, 53, {"web-1", "web-2"}, proto="udp")
    # Endpoints changed: web-2 leaves, web-3 arrives.
    for obj in web_slices(lab, ("web-1", "web-3")):
        sim.apply(obj)
    for vip in (WEB4, WEB6):
        lab.wait_for(c, vip, 80, {"web-1", "web-3"})
        lab.wait_for(c, vip, 53, {"web-1", "web-3"}, proto="udp")
    # Service changed: port 80 becomes 8000.
    moved = (("http", 8000, 8080, "TCP"), ("dns", 53, 8081, "UDP"))
    sim.apply(service("web", [WEB4, WEB6], moved))
    lab.wait_for(c, WEB4, 8000, {"web-1", "web-3"})
    # nftables rejects every port of a cluster IP that no service port serves, as
    # upstream's nftables mode; iptables lets the packet be routed on.
    gone = "refused" if "nftables" in agent.argv else "timeout"
    wait_for(lambda: set(lab.ask(c, WEB4, 80, count=3, timeout=0.3)) == {gone}, 15,
             "the old port to stop answering")
    # No endpoints left: REJECT (refused), not a black hole.
    for obj in web_slices(lab, ()):
        sim.apply(obj)
    wait_for(lambda: set(lab.ask(c, WEB4, 8000, count=3, timeout=0.5)) == {"refused"}, 15,
             "connections to be refused")
    # Deleted: the address is nothing any more.
    sim.delete("v1", "Service", "web", "demo")
    wait_for(lambda: set(lab.ask(c, WEB4, 8000, count=3, timeout=0.3)) == {"timeout"}, 15,
             "the service's rules to go")
    dump = agent.dump()
    assert dump["services"] == []
    changed = [s["changed"] for s in dump["syncs"] if s["trigger"] == "change"]
    assert any("demo/web:http (IPv6)" in c for c in changed)
    assert not [s for s in dump["syncs"] if s["error"]]


def test_debug_dump_shows_decisions_and_applied_rules(lab: Lab, sim: SimServer,
                                                      agent: AgentProcess) -> None:
    sim.apply(service("web", [WEB4]))
    sim.apply(web_slices(lab, ("web-1", "web-2"), (("http", 80, 8080, "TCP"),))[0])
    lab.wait_for(lab.client_ns, WEB4, 80, {"web-1", "web-2"})
    doc = agent.dump("demo/web")
    (entry,) = doc["services"]
    assert entry["cluster_endpoints"] == ["198.18.1.10:8080", "198.18.1.11:8080"]
    assert entry["applied_rules"], "the iptables rules or nftables objects of demo/web:http"
    # A DNAT rule's target, or (nftables, a picked port) its pick map's element.
    assert any("198.18.1.10:8080" in r or ": 198.18.1.10 . 8080" in r
               for r in entry["applied_rules"])
    assert doc["config"]["proxy-mode"] in ("iptables", "nftables")
    assert doc["node"]["name"] == "node-a"
    assert doc["watch"]["endpoints_resource"] == "endpointslices.discovery.k8s.io/v1"
    assert doc["health"]["ready"] is True


def _answers(lab: Lab, targets: list[tuple[str, int, str]]) -> dict[str, set[str]]:
    out = {}
    for vip, port, proto in targets:
        got = lab.ask(lab.client_ns, vip, port, proto, count=30, timeout=0.5)
        out[f"{vip}:{port}/{proto}"] = set(got)
    return out


def test_endpoints_mode_gives_the_same_traffic_as_endpointslices(
        lab: Lab, sim: SimServer, tmp_path: Path) -> None:
    b = lab.backends
    multi = (("http", 80, 8080, "TCP"), ("dns", 53, 8081, "UDP"))
    objects = [
        # Two ready endpoints and a not-ready one, on two ports.
        service("web", [WEB4], multi),
        endpoint_slice("web-x", "web", [endpoint(b["web-1"].ipv4),
                                        endpoint(b["web-2"].ipv4, node="node-b"),
                                        endpoint(b["web-3"].ipv4, node="node-b", ready=False)],
                       multi),
        endpoints_object("web", [b["web-1"].ipv4, b["web-2"].ipv4], multi,
                         not_ready=[b["web-3"].ipv4]),
        # internalTrafficPolicy Local: only web-1 lives on this node.
        service("near", ["198.18.128.11"], internalTrafficPolicy="Local"),
        endpoint_slice("near-x", "near", [endpoint(b["web-1"].ipv4),
                                          endpoint(b["web-2"].ipv4, node="node-b")]),
        endpoints_object("near", [b["web-1"].ipv4]),
        # Nothing ready at all: REJECT in both modes (Endpoints has no terminating info).
        service("down", ["198.18.128.12"]),
        endpoint_slice("down-x", "down", [endpoint(b["web-3"].ipv4, ready=False)]),
        endpoints_object("down", [], not_ready=[b["web-3"].ipv4]),
    ]
    # Endpoints for "near" must name web-2's node too, or it would look local.
    objects[5]["subsets"][0]["addresses"].append({"ip": str(b["web-2"].ipv4),
                                                  "nodeName": "node-b"})
    for obj in objects:
        sim.apply(obj)
    targets = [(WEB4, 80, "tcp"), (WEB4, 53, "udp"), ("198.18.128.11", 80, "tcp"),
               ("198.18.128.12", 80, "tcp")]
    seen: dict[str, dict[str, set[str]]] = {}
    decisions: dict[str, list[Any]] = {}
    for source in ("endpointslices", "endpoints"):
        agent = AgentProcess(lab, sim, tmp_path, "--endpoints-source", source,
                             name=source).start()
        agent.wait_ready()
        seen[source] = _answers(lab, targets)
        decisions[source] = [(s["service"], s["port"], s["cluster_endpoints"],
                              s["local_endpoints"]) for s in agent.dump()["services"]]
        assert agent.dump()["watch"]["endpoints_resource"] == (
            "endpointslices.discovery.k8s.io/v1" if source == "endpointslices"
            else "endpoints.v1")
        agent.stop()
        assert run_cli(lab, ["--cleanup", "--hostname-override", "node-a"]).returncode == 0
    assert seen["endpointslices"] == seen["endpoints"]
    assert seen["endpoints"] == {
        f"{WEB4}:80/tcp": {"web-1", "web-2"}, f"{WEB4}:53/udp": {"web-1", "web-2"},
        "198.18.128.11:80/tcp": {"web-1"}, "198.18.128.12:80/tcp": {"refused"}}
    assert decisions["endpointslices"] == decisions["endpoints"]


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold an xtables lock file as another iptables user would (flock, exclusive)."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def test_healthz_fails_while_syncs_are_blocked_and_recovers(
        lab: Lab, sim: SimServer, tmp_path: Path) -> None:
    # A node whose kubelet uses legacy iptables (its hint chain), so the agent picks
    # the legacy back end, whose every write takes the xtables lock (iptables-restore
    # -w). The lock file is this test's own (XTABLES_LOCKFILE), not the host's.
    lab.exec(lab.node_ns, ["iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
             check=True)
    lock = tmp_path / "xtables.lock"
    lock.touch()
    b = lab.backends
    sim.apply(service("web", [WEB4]))
    sim.apply(endpoint_slice("web-x", "web", [endpoint(b["web-1"].ipv4),
                                              endpoint(b["web-2"].ipv4, node="node-b")]))
    agent = AgentProcess(lab, sim, tmp_path, "--healthz-threshold", "2s",
                         env={"XTABLES_LOCKFILE": str(lock)}).start()
    agent.wait_ready()
    assert 'backend=legacy' in agent.log_text()
    lab.wait_for(lab.client_ns, WEB4, 80, {"web-1", "web-2"})
    with held(lock):
        sim.apply(endpoint_slice("web-x", "web", [endpoint(b["web-1"].ipv4)]))
        _, body = wait_for(lambda: (s := agent.healthz())[0] == 503 and s, 15,
                           "/healthz to fail while the lock is held")
        assert body["nodeEligible"] is True and agent.livez() == 503
        # The previous rules stay in place meanwhile.
        assert set(lab.ask(lab.client_ns, WEB4, 80, count=20)) == {"web-1", "web-2"}
        wait_for(lambda: agent.metrics().get(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", 0) >= 1, 20,
            "a restore to give up on the lock")
    wait_for(lambda: agent.healthz()[0] == 200, 40, "/healthz to recover once the lock is free")
    lab.wait_for(lab.client_ns, WEB4, 80, {"web-1"})
    syncs = agent.dump()["syncs"]
    assert any(s["error"] for s in syncs), syncs
    assert "holding the xtables lock" in agent.log_text()
    assert syncs[0]["error"] is None and syncs[0]["full"]  # the retry is a full sync
    agent.stop()


def test_health_check_node_port_for_local_traffic_policy(
        lab: Lab, sim: SimServer, agent: AgentProcess) -> None:
    b = lab.backends
    hc = 32100
    sim.apply(service("lb", ["198.18.128.20"], type="LoadBalancer",
                      externalTrafficPolicy="Local", healthCheckNodePort=hc))
    sim.apply(endpoint_slice("lb-x", "lb", [endpoint(b["web-1"].ipv4),
                                            endpoint(b["web-2"].ipv4, node="node-b")]))

    def check() -> tuple[int, dict[str, Any]]:
        # From outside the node, as a cloud load balancer would ask.
        status, body = http_get(lab.client_ns, str(lab.node_ip4), hc, "/")
        return status, (json.loads(body) if body else {})

    _, body = wait_for(lambda: (s := check())[0] == 200 and s, 15, "the port to open")
    assert body == {"service": {"namespace": "demo", "name": "lb"}, "localEndpoints": 1,
                    "serviceProxyHealthy": True}
    sim.apply(endpoint_slice("lb-x", "lb", [endpoint(b["web-1"].ipv4, ready=False),
                                            endpoint(b["web-2"].ipv4, node="node-b")]))
    _, body = wait_for(lambda: (s := check())[0] == 503 and s, 15, "503")
    assert body["localEndpoints"] == 0
    assert agent.dump()["health"]["health_check_node_ports"] == {"demo/lb": hc}
    sim.delete("v1", "Service", "lb", "demo")
    wait_for(lambda: check()[0] == 0, 15, "the port to close")


def _bucket_quantile(metrics: dict[str, float], name: str, q: float) -> float:
    """Upper bound of the histogram bucket holding quantile q (what Prometheus's
    histogram_quantile would interpolate within)."""
    buckets = sorted((float(k.split('le="')[1].rstrip('"}')), v) for k, v in metrics.items()
                     if k.startswith(f"{name}_bucket{{") and "+Inf" not in k)
    total = metrics[f"{name}_count"]
    for bound, cumulative in buckets:
        if cumulative >= q * total:
            return bound
    return float("inf")


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def test_network_programming_latency(lab: Lab, sim: SimServer, agent: AgentProcess,
                                     tmp_path: Path) -> None:
    b = lab.backends
    sim.apply(service("web", [WEB4]))
    sim.apply(endpoint_slice("web-x", "web", [endpoint(b["web-1"].ipv4)]))
    lab.wait_for(lab.client_ns, WEB4, 80, {"web-1"})
    observed: list[float] = []
    flips = 10  # 1.1 s apart each: the test's length
    for i in range(flips):
        # Paced 1.1s apart: each change arrives after a quiet period, as most do.
        time.sleep(1.1)
        name = "web-2" if i % 2 == 0 else "web-1"
        began = time.monotonic()
        sim.apply(endpoint_slice("web-x", "web", [endpoint(b[name].ipv4, node=b[name].node)]))
        # Until a fresh connection reaches the new endpoint.
        wait_for(lambda n=name: set(lab.ask(lab.client_ns, WEB4, 80, count=1,
                                            timeout=0.2)) == {n}, 10, f"flip {i}",
                 interval=0.001)
        observed.append(time.monotonic() - began)
    m = agent.metrics()
    count = m["kubeproxy_network_programming_duration_seconds_count"]
    total = m["kubeproxy_network_programming_duration_seconds_sum"]
    assert count >= flips
    syncs = [s for s in agent.dump()["syncs"] if s["trigger"] == "change"]
    durations = [s["duration_seconds"] for s in syncs]
    report = {
        "flips": flips,
        "client_observed_p50_ms": round(statistics.median(observed) * 1000, 1),
        "client_observed_p99_ms": round(_p(observed, 0.99) * 1000, 1),
        "metric_mean_ms": round(total / count * 1000, 1),
        "metric_p50_bucket_ms": _bucket_quantile(
            m, "kubeproxy_network_programming_duration_seconds", 0.5) * 1000,
        "metric_p99_bucket_ms": _bucket_quantile(
            m, "kubeproxy_network_programming_duration_seconds", 0.99) * 1000,
        "sync_duration_p50_ms": round(statistics.median(durations) * 1000, 1),
        "sync_duration_max_ms": round(max(durations) * 1000, 1),
        "agent_rss_mib": round(agent.rss_kib() / 1024, 1),
    }
    (tmp_path / "latency.json").write_text(json.dumps(report))
    print("\nnetwork programming:", json.dumps(report))
    # Each change came after a quiet period: none waited (a change to an idle agent
    # syncs at once; kube-proxy's --min-sync-period of 1s is not set).
    assert max(observed) < 1.0, observed

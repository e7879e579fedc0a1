"""The agent in-process against the simulator, through the real client library and its
HTTP servers, with a recording data plane: watch faults, API outages, discovery of the
EndpointSlice version, bad objects, node eligibility."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.sim import SimServer
from tests.integration.agent_harness import FAST_WATCH, AgentThread, running_agent, wait_until
from tests.unit.builders import ep, eps_slice, node, service

NS = "ns"


def namespace(name: str = NS) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def web_slice(*ips: str, name: str = "web-1") -> dict[str, Any]:
    return eps_slice(name, [ep(ip, node="node-a") for ip in ips], service_name="web")


@pytest.fixture
def sim() -> Iterator[SimServer]:
    server = SimServer(objects=[namespace(), node("node-a"),
                                service("web", ips=("198.18.128.10",)),
                                web_slice("198.18.1.10")],
                       bookmark_interval=0.2)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def get(agent: AgentThread, path: str, which: str = "metrics") -> tuple[int, bytes]:
    host, port = (agent.config.metrics_bind_address if which == "metrics"
                  else agent.config.healthz_bind_address)
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError:  # not listening (yet)
        return 0, b""


def metric(agent: AgentThread, sample: str) -> float:
    for line in get(agent, "/metrics")[1].decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def endpoints(agent: AgentThread) -> set[str]:
    return agent.dataplane.endpoints("ns/web", "http")


def test_follows_changes_across_cut_and_expired_watches(sim: SimServer, tmp_path: Path) -> None:
    with running_agent(sim, tmp_path) as agent:
        wait_until(lambda: endpoints(agent) == {"198.18.1.10:8080"}, what="first sync")
        wait_until(lambda: sim.open_watches() == 3, what="three watches")
        sim.cut_watches(abrupt=True)
        sim.apply(web_slice("198.18.1.11"))
        wait_until(lambda: endpoints(agent) == {"198.18.1.11:8080"}, what="after a cut")
        label = '{resource="endpointslices.discovery.k8s.io/v1"}'
        assert metric(agent, f"sliceproxy_watch_watch_restarts_total{label}") + metric(
            agent, f"sliceproxy_watch_errors_total{label}") >= 1
        wait_until(lambda: sim.open_watches() == 3, what="watches back")
        sim.compact()
        sim.expire_watches()
        sim.apply(web_slice("198.18.1.12"))
        wait_until(lambda: endpoints(agent) == {"198.18.1.12:8080"}, what="after 410 Gone")
        wait_until(lambda: metric(agent, f"sliceproxy_watch_relists_total{label}") >= 1,
                   what="a relist counted")
        assert agent.dataplane.syncs[0][0] and not any(f for f, _ in agent.dataplane.syncs[1:])


def test_an_api_outage_keeps_the_rules_and_catches_up(sim: SimServer, tmp_path: Path) -> None:
    with running_agent(sim, tmp_path) as agent:
        wait_until(lambda: endpoints(agent) == {"198.18.1.10:8080"}, what="first sync")
        syncs = len(agent.dataplane.syncs)
        sim.stop()
        wait_until(lambda: metric(agent, 'sliceproxy_watch_errors_total'
                                  '{resource="services.v1"}') >= 1, what="errors counted")
        assert len(agent.dataplane.syncs) == syncs  # nothing removed for lack of an API
        assert get(agent, "/healthz", "healthz")[0] == 200
        sim.start()
        sim.apply(web_slice("198.18.1.20"))
        wait_until(lambda: endpoints(agent) == {"198.18.1.20:8080"}, 20, "catching up")


def test_an_agent_started_during_an_outage_retries_at_the_watch_cap(
        sim: SimServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Discovery, the first thing the agent asks, retries no slower than its reflectors:
    with client-go's 30 s cap an agent started while the server is away would wait up to
    that long after the server's return (docs/watch.md)."""
    sim.stop()
    caplog.set_level(logging.WARNING, logger="proxy.agent.app")

    def delays() -> list[float]:
        return [float(r.__dict__["retry_in"])
                for r in caplog.records
                if r.getMessage().startswith("EndpointSlice API discovery failed")]

    with running_agent(sim, tmp_path) as agent:
        # Enough failures in a row for an uncapped backoff to pass the cap several times.
        wait_until(lambda: len(delays()) >= 8, 30, "discovery retried 8 times")
        sim.start()
        wait_until(lambda: endpoints(agent) == {"198.18.1.10:8080"}, 20, "first sync")
    assert max(delays()) <= FAST_WATCH.backoff_max, delays()


def test_discovery_falls_back_to_v1beta1_on_a_1_20_server(tmp_path: Path) -> None:
    beta_slice = {
        "apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice",
        "metadata": {"name": "web-1", "namespace": NS,
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": ["198.18.1.30"], "conditions": {"ready": True},
                       "topology": {"kubernetes.io/hostname": "node-a"}}],
    }
    with SimServer(objects=[namespace(), node("node-a"), service("web", ips=("198.18.128.10",)),
                            beta_slice], api_level="1.20") as sim, \
            running_agent(sim, tmp_path) as agent:
        wait_until(lambda: endpoints(agent) == {"198.18.1.30:8080"}, what="first sync")
        doc = json.loads(get(agent, "/debug/dump")[1])
        assert doc["watch"]["endpoints_resource"] == "endpointslices.discovery.k8s.io/v1beta1"


def test_bad_objects_are_skipped_counted_and_shown(sim: SimServer, tmp_path: Path) -> None:
    sim.set_validate(False)
    sim.apply(eps_slice("bad", [ep("198.18.1.300"), ep("198.18.1.40", node="node-a")],
                        service_name="web"))
    with running_agent(sim, tmp_path) as agent:
        wait_until(lambda: endpoints(agent) == {"198.18.1.10:8080", "198.18.1.40:8080"},
                   what="the good endpoint of the bad slice")
        assert metric(agent, 'sliceproxy_skipped_objects'
                             '{kind="EndpointSlice",reason="invalid-ip"}') == 1
        doc = json.loads(get(agent, "/debug/dump")[1])
        assert doc["skipped"] == [{"kind": "EndpointSlice", "namespace": "ns", "name": "bad",
                                   "reason": "invalid-ip",
                                   "detail": "'198.18.1.300' is not an IPv4 address",
                                   "part": "endpoints[0]"}]
        (web,) = json.loads(get(agent, "/debug/dump?service=ns/web")[1])["services"]
        assert web["applied_rules"] == ["-> 198.18.1.10:8080", "-> 198.18.1.40:8080"]


def test_a_node_marked_for_deletion_is_not_ready(sim: SimServer, tmp_path: Path) -> None:
    with running_agent(sim, tmp_path) as agent:
        wait_until(lambda: get(agent, "/healthz", "healthz")[0] == 200, what="ready")
        tainted = node("node-a")
        tainted["spec"] = {"taints": [{"key": "ToBeDeletedByClusterAutoscaler",
                                       "effect": "NoSchedule"}]}
        sim.apply(tainted)
        _, body = wait_until(
            lambda: (r := get(agent, "/healthz", "healthz"))[0] == 503 and r, what="503")
        assert json.loads(body)["nodeEligible"] is False
        assert get(agent, "/livez", "healthz")[0] == 200
        sim.apply(node("node-a"))
        wait_until(lambda: get(agent, "/healthz", "healthz")[0] == 200, what="eligible again")


def test_zone_label_change_resyncs_topology(sim: SimServer, tmp_path: Path) -> None:
    sim.apply(service("near", ips=("198.18.128.11",),
                      annotations={"sliceproxy.io/topology-preference":
                                   "topology.kubernetes.io/zone,*"}))
    sim.apply(eps_slice("near-1", [ep("198.18.1.50", node="node-b", zone="zone-a"),
                                   ep("198.18.1.51", node="node-c", zone="zone-b")],
                        service_name="near"))
    with running_agent(sim, tmp_path) as agent:
        near = lambda: agent.dataplane.endpoints("ns/near", "http")  # noqa: E731
        wait_until(lambda: near() == {"198.18.1.50:8080"}, what="zone-a preferred")
        sim.apply(node("node-a", zone="zone-b"))
        wait_until(lambda: near() == {"198.18.1.51:8080"}, what="zone-b preferred")

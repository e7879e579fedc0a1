"""Real inputs: Pods made ready through the API, the real v1.20.2 Endpoints and
EndpointSlice controllers writing what the agent reads, and real traffic through the
agent's iptables rules in a lab node namespace, for both endpoint sources."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from labs.realcp.clusters import service, services_path
from labs.realcp.controlplane import ControlPlane
from labs.realcp.nodes import (
    Sliceproxy,
    Workload,
    dnat_targets,
    endpoints_ips,
    ensure_node,
    nat_rules,
    slice_ips,
)
from labs.realcp.rawapi import RawApi
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.poll import wait

pytestmark = [pytest.mark.realcp, pytest.mark.root, pytest.mark.slow]

NODE = "node-a"
SOURCES = ["endpointslices", "endpoints"]
SCALE = 150
CONVERGE = 90.0  # seconds for controllers + agent to follow a change (a loaded CI box)


def _api(cp: ControlPlane) -> RawApi:
    return RawApi(cp.host_url, token=cp.token, context=cp.ssl_context())


def _lab(cp: ControlPlane, backends: int) -> Iterator[Lab]:
    specs = [BackendSpec(f"web-{i}", node=NODE) for i in range(backends)]
    with Lab(specs, node_name=NODE, ipv6=False) as lab:
        cp.attach(lab.node_ns)
        try:
            ensure_node(_api(cp), NODE, str(lab.node_ip4))
            lab.start_backends()
            yield lab
        finally:
            cp.detach(lab.node_ns)


@pytest.fixture
def small_lab(control_plane: ControlPlane) -> Iterator[Lab]:
    yield from _lab(control_plane, 6)


@pytest.fixture
def big_lab(control_plane: ControlPlane) -> Iterator[Lab]:
    yield from _lab(control_plane, SCALE)


@pytest.fixture
def apps() -> Iterator[list[Workload]]:
    """Workloads a test made; their pods and Service are deleted afterwards, so the
    proxies of later tests (which see every namespace) do not carry them."""
    made: list[Workload] = []
    yield made
    for wl in made:
        wl.remove_all()
        wl.api.request("DELETE", f"{services_path(wl.namespace)}/web")


def _ip(lab: Lab, i: int) -> str:
    return str(lab.backends[f"web-{i}"].ipv4)


def _setup(cp: ControlPlane, lab: Lab, apps: list[Workload], hint: str,
           pods: int) -> tuple[RawApi, Workload, str, str]:
    """A namespace, `pods` ready pods web-0.. on NODE, and a Service selecting them."""
    api = _api(cp)
    ns = f"{hint}-{int(time.time() * 1000) % 10**8}"
    api.must("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": ns}})
    wl = Workload(api, ns, "web")
    apps.append(wl)
    for i in range(pods):
        wl.add(f"web-{i}", _ip(lab, i), NODE)
    svc = api.must("POST", services_path(ns), service(
        "web", ns, selector={"app": "web"},
        ports=[{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]))
    return api, wl, ns, svc["spec"]["clusterIP"]


def _agent(cp: ControlPlane, lab: Lab, tmp_path: Path, source: str) -> Sliceproxy:
    agent = Sliceproxy.make(lab, cp.node_kubeconfig, tmp_path, source).start()
    agent.wait_healthy()
    return agent


def _wait_applied(agent: Sliceproxy, lab: Lab, ns: str, want: set[str]) -> None:
    """Until the agent reports `want` (ip:port) for ns/web:http AND the kernel's nat table
    DNATs to exactly those: the agent's sync is done and in the kernel."""
    def done() -> bool:
        agent.check_alive()
        return (agent.endpoints(f"{ns}/web") == want
                and dnat_targets(nat_rules(lab), f"{ns}/web:http") == want)

    wait(done, CONVERGE, f"agent and kernel to hold {len(want)} endpoints")


@pytest.mark.parametrize("source", SOURCES)
def test_real_controllers_feed_the_agent_and_traffic_follows_readiness(
        control_plane: ControlPlane, small_lab: Lab, apps: list[Workload], tmp_path: Path,
        source: str) -> None:
    cp, lab = control_plane, small_lab
    api, wl, ns, cluster_ip = _setup(cp, lab, apps, f"traffic-{source}", 3)
    # The real controllers, not the test, write what the agent reads.
    wait(lambda: endpoints_ips(api, ns, "web") == {_ip(lab, i) for i in range(3)}, CONVERGE,
         "the Endpoints controller")
    wait(lambda: slice_ips(api, ns, "web") == {_ip(lab, i) for i in range(3)}, CONVERGE,
         "the EndpointSlice controller")
    agent = _agent(cp, lab, tmp_path, source)
    try:
        lab.wait_for(lab.client_ns, cluster_ip, 80, {"web-0", "web-1", "web-2"},
                     count=30, deadline=CONVERGE)
        # Not ready: out of the rotation; ready again: back in.
        wl.set_ready("web-1", _ip(lab, 1), ready=False)
        lab.wait_for(lab.client_ns, cluster_ip, 80, {"web-0", "web-2"}, deadline=CONVERGE)
        wl.add("web-3", _ip(lab, 3), NODE)
        wl.set_ready("web-1", _ip(lab, 1), ready=True)
        lab.wait_for(lab.client_ns, cluster_ip, 80, {f"web-{i}" for i in range(4)},
                     count=40, deadline=CONVERGE)
        # A deleted pod is gone for good.
        wl.remove("web-0")
        lab.wait_for(lab.client_ns, cluster_ip, 80, {"web-1", "web-2", "web-3"},
                     count=30, deadline=CONVERGE)
        log = agent.log_path.read_text(errors="replace")
        if source == "endpointslices":
            # The startup log names the API it fell back to on this v1.20 server.
            assert "discovery.k8s.io/v1beta1" in log, agent.log_tail()
    finally:
        agent.stop()


@pytest.mark.parametrize("source", SOURCES)
def test_scale_3_to_150_and_back_never_reaches_a_removed_backend(
        control_plane: ControlPlane, big_lab: Lab, apps: list[Workload], tmp_path: Path,
        source: str) -> None:
    cp, lab = control_plane, big_lab
    api, wl, ns, cluster_ip = _setup(cp, lab, apps, f"scale-{source}", 3)
    agent = _agent(cp, lab, tmp_path, source)
    try:
        three = {f"{_ip(lab, i)}:8080" for i in range(3)}
        _wait_applied(agent, lab, ns, three)
        for i in range(3, SCALE):
            wl.add(f"web-{i}", _ip(lab, i), NODE)
        everyone = {f"{_ip(lab, i)}:8080" for i in range(SCALE)}
        # 150 endpoints: the slice controller (100 per slice) splits them in two.
        _wait_applied(agent, lab, ns, everyone)
        status, slices = api.get(f"/apis/discovery.k8s.io/v1beta1/namespaces/{ns}/"
                                 "endpointslices", labelSelector="kubernetes.io/service-name=web")
        assert status == 200 and len(slices["items"]) >= 2, "the controller did not split"
        got = lab.ask(lab.client_ns, cluster_ip, 80, count=300, timeout=2.0)
        assert set(got) <= {f"web-{i}" for i in range(SCALE)}, got
        assert len(got) > 50, f"300 connections reached only {len(got)} backends"
        for i in range(3, SCALE):
            wl.remove(f"web-{i}")
        _wait_applied(agent, lab, ns, three)
        # After the agent's sync nothing may reach a removed backend (they all still
        # listen, so a stale rule would show here).
        got = lab.ask(lab.client_ns, cluster_ip, 80, count=100, timeout=2.0)
        assert set(got) == {"web-0", "web-1", "web-2"}, got
    finally:
        agent.stop()

"""sliceproxy and upstream kube-proxy v1.20.2 (iptables mode) side by side: each in its
own lab node namespace (both as node "node-a"), both watching the same real API server,
the same Pods and Services. For every scenario both implement, the set of backends that
answers (or the failure) must be the same. Where we differ on purpose, the test says so.

Pods (IPs are the lab's backends, answering with their names):
  web-0..2  ready, node-a        web-3..4  ready, node-b (their named port "http" is 8082)
  web-5     NOT ready, node-a    lone-0    the only pod of app=lonely, ready, node-a
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from labs.realcp.clusters import service, services_path
from labs.realcp.controlplane import ControlPlane
from labs.realcp.nodes import KubeProxy, NodeProxy, Sliceproxy, Workload, ensure_node, slice_ips
from labs.realcp.rawapi import RawApi
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.poll import wait

pytestmark = [pytest.mark.realcp, pytest.mark.root, pytest.mark.slow]

NODE = "node-a"
CONVERGE = 90.0
BACKENDS = ["web-0", "web-1", "web-2", "web-3", "web-4", "web-5", "lone-0"]
READY = {"web-0", "web-1", "web-2", "web-3", "web-4"}
LOCAL = {"web-0", "web-1", "web-2"}
HTTP8080, HTTP8082 = (("http", 8080, "TCP"),), (("http", 8082, "TCP"),)


@dataclass
class Side:
    name: str
    lab: Lab
    proxy: NodeProxy


@dataclass
class World:
    api: RawApi
    ns: str
    sides: list[Side]
    services: dict[str, dict[str, Any]]

    def ip(self, svc: str) -> str:
        return str(self.services[svc]["spec"]["clusterIP"])

    def node_port(self, svc: str, index: int = 0) -> int:
        return int(self.services[svc]["spec"]["ports"][index]["nodePort"])


def _svc(ns: str, name: str, app: str, ports: list[dict[str, Any]] | None = None,
         **spec: Any) -> dict[str, Any]:
    return service(name, ns, selector={"app": app}, ports=ports or [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}], **spec)


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, realcp_binaries: Any,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cp = control_plane
    api = RawApi(cp.host_url, token=cp.token, context=cp.ssl_context())
    ns = f"side-{int(time.time() * 1000) % 10**8}"
    api.must("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": ns}})
    workdir = tmp_path_factory.mktemp("side-by-side")
    labs: list[Lab] = []
    sides: list[Side] = []
    try:
        for name in ("sliceproxy", "kube-proxy"):
            lab = Lab([BackendSpec(b) for b in BACKENDS], node_name=NODE, ipv6=False)
            lab.__enter__()
            labs.append(lab)
            cp.attach(lab.node_ns)
            # Rejects are ICMP errors from the node; the kernel rate-limits those per peer
            # (1/s after a small burst), which would turn a burst of probes' "refused"
            # into timeouts for either proxy.
            lab.sysctl(lab.node_ns, "net.ipv4.icmp_ratelimit", "0")
            lab.start_backends(tcp_ports=(8080, 8082))
            sides.append(Side(name, lab, _proxy(name, cp, lab, realcp_binaries, workdir)))
        first = labs[0]
        ensure_node(api, NODE, str(first.node_ip4))
        ensure_node(api, "node-b", "198.18.0.99")
        ip = {b: str(spec.ipv4) for b, spec in first.backends.items()}  # same in every lab
        web = Workload(api, ns, "web")
        for i in range(3):
            web.add(f"web-{i}", ip[f"web-{i}"], NODE, ports=HTTP8080)
        for i in (3, 4):
            web.add(f"web-{i}", ip[f"web-{i}"], "node-b", ports=HTTP8082)
        web.add("web-5", ip["web-5"], NODE, ready=False, ports=HTTP8080)
        Workload(api, ns, "lonely").add("lone-0", ip["lone-0"], NODE, ports=HTTP8080)
        services = {}
        for body in (
            _svc(ns, "clusterip", "web"),
            _svc(ns, "nodeport", "web", type="NodePort"),
            _svc(ns, "multi", "web", ports=[
                {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
                {"name": "alt", "port": 81, "targetPort": 8082, "protocol": "TCP"}]),
            _svc(ns, "affinity", "web", sessionAffinity="ClientIP"),
            _svc(ns, "local", "web", type="NodePort", externalTrafficPolicy="Local"),
            _svc(ns, "empty", "nobody"),
            _svc(ns, "lonely", "lonely"),
        ):
            created = api.must("POST", services_path(ns), body)
            services[created["metadata"]["name"]] = created
        wait(lambda: slice_ips(api, ns, "clusterip") == {ip[b] for b in READY}, CONVERGE,
             "the EndpointSlice controller")
        for side in sides:
            side.proxy.start()
        for side in sides:
            side.proxy.wait_healthy(CONVERGE)
        yield World(api, ns, sides, services)
    finally:
        for side in sides:
            side.proxy.stop()
        for lab in labs:
            cp.detach(lab.node_ns)
            lab.__exit__(None, None, None)


def _proxy(name: str, cp: ControlPlane, lab: Lab, bins: Any, workdir: Path) -> NodeProxy:
    if name == "sliceproxy":
        return Sliceproxy.make(lab, cp.node_kubeconfig, workdir, "endpointslices")
    return KubeProxy.make(lab, bins.path("kube-proxy"), cp.node_kubeconfig, workdir,
                          "endpointslices")


def _settled(world: World, target: str, port: int, want: set[str], *, client: bool = True,
             count: int = 30) -> dict[str, Counter[str]]:
    """Poll every side until its answers are exactly `want`; return the last answers.
    `target` is a Service name (its cluster IP) or "node" (the side's node address)."""
    out: dict[str, Counter[str]] = {}
    for side in world.sides:
        lab = side.lab
        ip = str(lab.node_ip4) if target == "node" else world.ip(target)
        try:
            out[side.name] = lab.wait_for(lab.client_ns if client else lab.node_ns, ip, port,
                                          want, count=count, deadline=CONVERGE)
        except Exception as exc:
            raise AssertionError(f"{side.name}: {exc}\n{side.proxy.log_tail(15)}") from exc
    return out


def test_cluster_ip_reaches_every_ready_pod_on_any_node(world: World) -> None:
    _settled(world, "clusterip", 80, READY, count=60)


def test_node_port_from_outside_the_node(world: World) -> None:
    _settled(world, "node", world.node_port("nodeport"), READY, count=60)


def test_each_port_of_a_multi_port_service(world: World) -> None:
    _settled(world, "multi", 80, READY, count=60)
    _settled(world, "multi", 81, READY, count=60)


def test_named_target_ports_resolve_per_pod(world: World) -> None:
    # web-0..2 name 8080 "http", web-3..4 name 8082 "http": two slices, two port numbers.
    # Every backend listens on both, so a wrong resolution would still answer; the
    # port numbers in each proxy's rules are what proves it.
    _settled(world, "clusterip", 80, READY, count=60)
    for side in world.sides:
        rules = side.lab.exec(side.lab.node_ns, ["iptables-save", "-t", "nat"]).stdout
        rules += side.lab.exec(side.lab.node_ns, ["iptables-legacy-save", "-t", "nat"]).stdout
        ips = {b: str(s.ipv4) for b, s in side.lab.backends.items()}
        for b in ("web-0", "web-1", "web-2"):
            assert f"--to-destination {ips[b]}:8080" in rules, (side.name, b)
        for b in ("web-3", "web-4"):
            assert f"--to-destination {ips[b]}:8082" in rules, (side.name, b)


def test_not_ready_pods_get_no_traffic(world: World) -> None:
    answers = _settled(world, "clusterip", 80, READY, count=80)
    for side, got in answers.items():
        assert "web-5" not in got, side


def test_client_ip_affinity_sticks_to_one_backend(world: World) -> None:
    for side in world.sides:
        lab = side.lab
        got = lab.ask(lab.client_ns, world.ip("affinity"), 80, count=20)
        assert len(got) == 1 and set(got) <= READY, (side.name, got)


def test_external_traffic_policy_local_uses_only_this_nodes_pods(world: World) -> None:
    _settled(world, "node", world.node_port("local"), LOCAL, count=40)
    # Cluster-internal traffic to the same service still uses every ready pod.
    _settled(world, "local", 80, READY, count=60)


def test_a_service_without_endpoints_rejects(world: World) -> None:
    _settled(world, "empty", 80, {"refused"}, count=5)


def test_terminating_pods_differ_on_purpose(world: World) -> None:
    """The one place we differ on purpose. A pod deleted gracefully stays terminating (no
    kubelet confirms it). With the EndpointSliceTerminatingCondition gate (alpha in
    v1.20, on in this control plane) its endpoint is ready=false, serving=true,
    terminating=true. When a service has no ready endpoint left, sliceproxy falls back to
    serving+terminating ones (upstream's later behaviour, KEP-1669, default since 1.26:
    connections keep working while the last pods drain); kube-proxy v1.20 only uses
    ready endpoints, so it rejects."""
    world.api.must("DELETE", f"/api/v1/namespaces/{world.ns}/pods/lone-0",
                   {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 300})
    try:
        by_side = {s.name: s for s in world.sides}
        slp, kp = by_side["sliceproxy"].lab, by_side["kube-proxy"].lab
        kp.wait_for(kp.client_ns, world.ip("lonely"), 80, {"refused"}, count=5,
                    deadline=CONVERGE)
        # Ours keeps sending to the draining pod.
        got = slp.wait_for(slp.client_ns, world.ip("lonely"), 80, {"lone-0"}, count=10,
                           deadline=CONVERGE)
        assert got == Counter({"lone-0": 10})
    finally:
        world.api.request("DELETE", f"/api/v1/namespaces/{world.ns}/pods/lone-0",
                          {"apiVersion": "v1", "kind": "DeleteOptions",
                           "gracePeriodSeconds": 0})

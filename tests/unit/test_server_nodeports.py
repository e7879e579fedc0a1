"""Health-check node ports: which services get one, the local ready count, and real
HTTP servers opening and closing (bound to 127.0.0.1 through --nodeport-addresses, so
this test listens on nothing else)."""

from __future__ import annotations

import asyncio
import json
import socket
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
from aiohttp import ClientSession

from proxy.server import nodeports
from proxy.server.nodeports import HealthCheckPorts, LocalEndpointTracker
from tests.unit.builders import ep, eps_slice, model_of, service


def local_service(name: str, hc: int, policy: str = "Local", **spec: Any) -> dict[str, Any]:
    return service(name, ips=("198.18.128.50",), type="LoadBalancer",
                   externalTrafficPolicy=policy, healthCheckNodePort=hc,
                   ports=({"name": "http", "port": 80, "nodePort": 30050},
                          {"name": "alt", "port": 81, "nodePort": 30051}), **spec)


def test_tracker_counts_distinct_local_ready_endpoints_over_ports() -> None:
    both_ports = ({"name": "http", "port": 8080}, {"name": "alt", "port": 8080})
    model = model_of(
        local_service("lb", 32100),
        service("plain", ips=("198.18.128.51",)),
        eps_slice("lb-1", [ep("198.18.1.10", node="node-a"),
                           ep("198.18.1.11", node="node-a", ready=False, serving=True,
                              terminating=True),
                           ep("198.18.1.12", node="node-b")],
                  service_name="lb", ports=both_ports),
    )
    state = model.resolve()
    tracker = LocalEndpointTracker("node-a")
    assert tracker.update(state, state.ports)
    assert tracker.wanted() == {("ns", "lb"): 32100}
    # 198.18.1.10:8080 serves both ports: one endpoint. Terminating ones do not count
    # (as upstream: the load balancer drains the node).
    assert tracker.counts() == {("ns", "lb"): 1}
    assert not tracker.update(state, state.ports)  # nothing changed

    apply_changes = model_of(local_service("lb", 32100))  # every endpoint gone
    state2 = apply_changes.resolve()
    assert tracker.update(state2, state.ports)
    assert tracker.counts() == {("ns", "lb"): 0}
    gone = model_of().resolve()
    assert tracker.update(gone, state.ports)
    assert tracker.wanted() == {}


def test_tracker_follows_a_service_between_local_and_cluster_policy() -> None:
    endpoints = eps_slice("lb-1", [ep("198.18.1.10", node="node-a")], service_name="lb",
                          ports=({"name": "http", "port": 8080},
                                 {"name": "alt", "port": 8080}))
    local = model_of(local_service("lb", 32100), endpoints).resolve()
    cluster = model_of(local_service("lb", 32100, policy="Cluster"),
                       endpoints).resolve()
    tracker = LocalEndpointTracker("node-a")
    assert tracker.update(local, local.ports)
    assert (tracker.wanted(), tracker.counts()) == ({("ns", "lb"): 32100}, {("ns", "lb"): 1})
    # Cluster policy: no health-check port to serve, so no count either.
    assert tracker.update(cluster, cluster.ports)
    assert (tracker.wanted(), tracker.counts()) == ({}, {})
    assert not tracker.update(cluster, cluster.ports)
    # One of its two ports back to Local first: wanted again, with the endpoint counted.
    http_only = {k for k in local.ports if k.port == "http"}
    assert tracker.update(local, http_only)
    assert (tracker.wanted(), tracker.counts()) == ({("ns", "lb"): 32100}, {("ns", "lb"): 1})
    assert not tracker.update(local, local.ports)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_servers_answer_like_upstream_and_close_when_the_service_goes() -> None:
    healthy = {"value": True}
    ports = HealthCheckPorts(lambda: healthy["value"], (ip_network("127.0.0.0/8"),))
    port = free_port()
    ref = ("ns", "lb")

    async def get(session: ClientSession) -> tuple[int, str, str]:
        async with session.get(f"http://127.0.0.1:{port}/") as resp:
            return resp.status, resp.headers["Content-Type"], await resp.text()

    async def go() -> None:
        async with ClientSession() as session:
            await ports.update({ref: port}, {ref: 2})
            assert ports.open_ports == {ref: port}
            status, ctype, text = await get(session)
            assert status == 200 and ctype == "application/json"
            assert json.loads(text) == {"service": {"namespace": "ns", "name": "lb"},
                                        "localEndpoints": 2, "serviceProxyHealthy": True}
            assert text.startswith('{\n\t"service": {\n\t\t"namespace": "ns"')
            await ports.update({ref: port}, {ref: 0})
            status, _, text = await get(session)
            assert status == 503 and json.loads(text)["localEndpoints"] == 0
            await ports.update({ref: port}, {ref: 1})
            healthy["value"] = False
            status, _, text = await get(session)
            assert status == 503 and json.loads(text)["serviceProxyHealthy"] is False
        await ports.update({}, {})
        assert refused(port) and ports.open_ports == {}
        await ports.close()

    asyncio.run(go())


def test_a_port_in_use_is_logged_and_retried_later() -> None:
    ports = HealthCheckPorts(lambda: True, (ip_network("127.0.0.0/8"),))
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    ref = ("ns", "lb")

    async def go() -> None:
        await ports.update({ref: port}, {ref: 1})
        assert ports.open_ports == {}
        blocker.close()
        await ports.update({ref: port}, {ref: 1})
        assert ports.open_ports == {ref: port}
        await ports.close()

    try:
        asyncio.run(go())
    finally:
        blocker.close()


def test_primary_listens_on_the_nodes_primary_address_and_moves_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`primary`: the servers listen where the Node's primary address is, and open again
    when it moves. Node addresses stand in for loopback ones here (the unit tier has no
    namespace of its own): 198.18.0.1 is served on 127.0.0.2, 198.18.0.2 on 127.0.0.3."""
    stand_in = {ip_network("198.18.0.1/32"): "127.0.0.2",
                ip_network("198.18.0.2/32"): "127.0.0.3"}

    async def local_addresses(cidrs: Any) -> list[str]:
        return [stand_in[c] for c in cidrs if c in stand_in]

    monkeypatch.setattr(nodeports, "node_addresses", local_addresses)
    ports = HealthCheckPorts(lambda: True, (), nodeport_primary=True)
    port = free_port()
    ref = ("ns", "lb")

    def answers(host: str) -> bool:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0

    async def go() -> None:
        await ports.update({ref: port}, {ref: 1}, (ip_address("198.18.0.1"),))
        assert answers("127.0.0.2") and not answers("127.0.0.3")
        await ports.update({ref: port}, {ref: 1}, (ip_address("198.18.0.2"),))
        assert answers("127.0.0.3") and not answers("127.0.0.2")
        assert ports.open_ports == {ref: port}
        await ports.close()

    asyncio.run(go())

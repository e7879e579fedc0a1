"""Which conntrack entries go stale when a service port changes (pure part of
proxy.dataplane.common.conntrack; the kernel part is exercised in tests/e2e)."""

from __future__ import annotations

import random
from ipaddress import ip_address
from typing import Any

import pytest

from proxy.dataplane.common.conntrack import StaleFlows, _matches, stale_flows
from proxy.dataplane.common.ctnetlink import CtEntry
from proxy.dataplane.common.netlink_constants import IPS_DST_NAT
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family, Protocol
from tests.unit.builders import NODE, ep, eps_slice, node, resolve_one, service
from tests.unit.test_nftables_delta import POOL, Pod, step, with_delta


def udp(*eps: dict[str, Any], protocol: str = "UDP", node_port: bool = True,
        **spec: Any) -> ResolvedServicePort:
    port: dict[str, Any] = {"name": "dns", "port": 53, "protocol": protocol}
    if node_port:
        port["nodePort"] = 30053
        spec["type"] = "NodePort"
    slice_ports = ({"name": "dns", "port": 5353, "protocol": protocol},)
    return resolve_one(node(), service(ports=(port,), **spec),
                       eps_slice("s1", list(eps), ports=slice_ports), port="dns")


def described(flows: list[StaleFlows]) -> list[str]:
    return [f"{f.reason}: {f.dst or '*'}:{f.dport} -> {f.endpoint or '*'}" for f in flows]


def test_removed_udp_endpoint_is_cleared_on_every_address_of_the_port() -> None:
    old = udp(ep("198.18.1.10"), ep("198.18.1.11"), externalIPs=["198.18.2.100"])
    new = udp(ep("198.18.1.11"), externalIPs=["198.18.2.100"])
    assert described(stale_flows(old, new)) == [
        "endpoint gone: 198.18.128.1:53 -> 198.18.1.10",
        "endpoint gone: 198.18.2.100:53 -> 198.18.1.10",
        "endpoint gone: *:30053 -> 198.18.1.10",
    ]
    assert all(f.endpoint_port == 5353 and f.protocol is Protocol.UDP
               for f in stale_flows(old, new))


def test_deleted_udp_service_clears_all_its_endpoints() -> None:
    old = udp(ep("198.18.1.10"), ep("198.18.1.11"))
    assert len(stale_flows(old, None)) == 4  # 2 endpoints x (cluster IP, NodePort)


def test_udp_service_gaining_its_first_endpoint_clears_its_addresses() -> None:
    assert described(stale_flows(udp(), udp(ep("198.18.1.10")))) == [
        "first endpoint: 198.18.128.1:53 -> *", "first endpoint: *:30053 -> *"]
    assert described(stale_flows(None, udp(ep("198.18.1.10")))) == [
        "first endpoint: 198.18.128.1:53 -> *", "first endpoint: *:30053 -> *"]
    # A second endpoint is no "first" one.
    assert stale_flows(udp(ep("198.18.1.10")), udp(ep("198.18.1.10"), ep("198.18.1.11"))) == []


def test_tcp_needs_nothing_and_sctp_only_removals() -> None:
    tcp_old, tcp_new = udp(ep("198.18.1.10"), protocol="TCP"), udp(protocol="TCP")
    assert stale_flows(tcp_old, tcp_new) == []
    sctp_old, sctp_new = udp(ep("198.18.1.10"), protocol="SCTP"), udp(protocol="SCTP")
    assert [f.protocol for f in stale_flows(sctp_old, sctp_new)] == [Protocol.SCTP] * 2
    assert stale_flows(sctp_new, sctp_old) == []


def test_an_endpoint_still_receiving_some_traffic_is_not_cleared() -> None:
    # internalTrafficPolicy Local: the remote endpoint was never used, so it has no
    # flows to clear when it goes.
    old = udp(ep("198.18.1.10", node=NODE), ep("198.18.1.11", node="node-b"),
              internalTrafficPolicy="Local", node_port=False)
    new = udp(ep("198.18.1.10", node=NODE), internalTrafficPolicy="Local", node_port=False)
    assert stale_flows(old, new) == []
    # A not-ready endpoint that becomes ready again was not in use either way.
    assert stale_flows(udp(ep("198.18.1.10"), ep("198.18.1.11", ready=False)),
                       udp(ep("198.18.1.10"))) == []


def entry(dst: str, dport: int, reply_src: str, reply_sport: int, dnat: bool = True
          ) -> CtEntry:
    """A UDP flow from a client to `dst`:`dport`, answered by `reply_src` (DNATed to it,
    or, with dnat False, not DNATed: answered by whoever `dst` is)."""
    return CtEntry(Family.V4, 17, ip_address("198.18.0.99"), 40000, ip_address(dst), dport,
                   ip_address(reply_src), reply_sport, IPS_DST_NAT if dnat else 0)


def test_matching_uses_the_original_destination_and_the_reply_source() -> None:
    flow = StaleFlows("ns/svc:dns", Family.V4, Protocol.UDP, ip_address("198.18.128.1"), 53,
                      ip_address("198.18.1.10"), 5353)
    vip, pod = "198.18.128.1", "198.18.1.10"
    assert _matches(flow, entry(vip, 53, pod, 5353))
    assert not _matches(flow, entry(vip, 53, "198.18.1.11", 5353))  # other endpoint
    assert not _matches(flow, entry(vip, 53, pod, 5354))
    assert not _matches(flow, entry("198.18.128.2", 53, pod, 5353))
    anywhere = StaleFlows("ns/svc:dns", Family.V4, Protocol.UDP, None, 30053)
    assert _matches(anywhere, entry("198.18.0.1", 30053, pod, 5353))
    assert not _matches(anywhere, entry("198.18.0.1", 30054, pod, 5353))


def test_a_first_endpoint_clears_only_flows_no_rule_dnated() -> None:
    """A flow sent while the port had no endpoint was not DNATed: it goes. One our new
    rules already DNATed (a client quick to use them) stays where it is: deleting it
    would move it (upstream deletes both)."""
    (first, *_rest) = stale_flows(None, udp(ep("198.18.1.10")))
    assert first.reason == "first endpoint" and first.undnated
    vip = "198.18.128.1"
    assert _matches(first, entry(vip, 53, vip, 53, dnat=False))
    assert not _matches(first, entry(vip, 53, "198.18.1.10", 5353))


UDP = ({"name": "http", "port": 80, "protocol": "UDP", "nodePort": 30080},)


@pytest.mark.parametrize("local", [False, True])
def test_stale_flows_from_an_endpoint_delta_are_those_from_comparing_every_endpoint(
        local: bool) -> None:
    def resolve(pods: dict[str, Pod]) -> ResolvedServicePort:
        eps = [ep(a, node=NODE if p.local else "node-b", ready=p.ready)
               for a, p in pods.items()]
        spec = {"type": "NodePort", "externalTrafficPolicy": "Local" if local else "Cluster"}
        return resolve_one(node(), service(ports=UDP, **spec),
                           eps_slice("s1", eps, ports=({"name": "http", "port": 8080,
                                                        "protocol": "UDP"},)))

    rng = random.Random(28)
    pods = {a: Pod(local=rng.random() < 0.5) for a in POOL[:30]}
    old = resolve(pods)
    found = 0
    for n in range(40):
        step(pods, rng, shrink=n % 10 < 5)
        new = resolve(pods)
        flows = stale_flows(old, new)
        assert stale_flows(old, with_delta(old, new)) == flows, n
        found += len(flows)
        old = new
    assert found

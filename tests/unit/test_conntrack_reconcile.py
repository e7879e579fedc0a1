"""Which conntrack entries the reconcile deletes, from the kernel's table and the rules
just applied (pure part of proxy.dataplane.common.conntrack_reconcile; with real traffic
across agent restarts: tests/faults/)."""

from __future__ import annotations

import socket
from ipaddress import ip_address
from typing import Any

from proxy.dataplane.common.conntrack_reconcile import (
    MISSING_DNAT,
    STALE_DNAT,
    Frontends,
    counted,
    stale,
    verdict,
)
from proxy.dataplane.common.ctnetlink import IPS_DST_NAT, CtEntry
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family
from tests.unit.builders import ep, eps_slice, node, resolve_one, service

UDP, TCP, SCTP = socket.IPPROTO_UDP, socket.IPPROTO_TCP, 132
CLUSTER_IP = "198.18.128.1"  # builders.service's
NODE_IP = ip_address("198.18.0.1")


CLIENT = ip_address("198.18.3.3")


def entry(dst: str, dport: int, answerer: str | None = None, aport: int = 5353,
          protocol: int = UDP) -> CtEntry:
    """An entry to dst:dport, DNATed to answerer:aport (not NATed when None)."""
    d = ip_address(dst)
    client = CLIENT if d.version == 4 else ip_address("fd00:3::3")
    if answerer is None:
        return CtEntry(Family.of(d), protocol, client, 40000, d, dport, d, dport)
    return CtEntry(Family.of(d), protocol, client, 40000, d, dport, ip_address(answerer), aport,
                   IPS_DST_NAT)


def port(*eps: dict[str, Any], protocol: str = "UDP", node_port: bool = True,
         family: Family = Family.V4, **spec: Any) -> ResolvedServicePort:
    p: dict[str, Any] = {"name": "dns", "port": 53, "protocol": protocol}
    if node_port:
        p["nodePort"] = 30053
        spec["type"] = "NodePort"
    slice_ports = ({"name": "dns", "port": 5353, "protocol": protocol},)
    return resolve_one(node(), service(ports=(p,), **spec),
                       eps_slice("s1", list(eps), ports=slice_ports,
                                 address_type="IPv4" if family is Family.V4 else "IPv6"),
                       port="dns", family=family)


def frontends(*ports: ResolvedServicePort) -> Frontends:
    return Frontends(ports, [NODE_IP, ip_address("127.0.0.1")])


def reasons(entries: list[CtEntry], fronts: Frontends) -> list[str | None]:
    return [None if (v := verdict(e, fronts)) is None else v[0] for e in entries]


def test_flows_to_live_endpoints_stay_whatever_the_agent_knew_before() -> None:
    fronts = frontends(port(ep("198.18.1.10"), ep("198.18.1.11"),
                            externalIPs=["198.18.2.100"]))
    kept = [entry(CLUSTER_IP, 53, "198.18.1.10"), entry(CLUSTER_IP, 53, "198.18.1.11"),
            entry("198.18.2.100", 53, "198.18.1.11"), entry(str(NODE_IP), 30053, "198.18.1.10")]
    assert reasons(kept, fronts) == [None] * 4


def test_flows_dnated_to_an_endpoint_that_left_are_stale_on_every_address() -> None:
    fronts = frontends(port(ep("198.18.1.11"), externalIPs=["198.18.2.100"]))
    gone = [entry(CLUSTER_IP, 53, "198.18.1.10"), entry("198.18.2.100", 53, "198.18.1.10"),
            entry(str(NODE_IP), 30053, "198.18.1.10"),
            entry(CLUSTER_IP, 53, "198.18.1.11", aport=9999)]  # the right pod, old port
    assert reasons(gone, fronts) == [STALE_DNAT] * 4


def test_flows_never_dnated_are_stale_once_the_port_has_endpoints() -> None:
    before = entry(CLUSTER_IP, 53)  # sent while the port had no endpoint
    assert reasons([before], frontends(port(ep("198.18.1.10")))) == [MISSING_DNAT]
    # With no endpoint there is nothing better: the entry stays (REJECT rules answer).
    assert reasons([before], frontends(port())) == [None]


def test_only_our_udp_and_sctp_service_addresses_are_judged() -> None:
    fronts = frontends(port(ep("198.18.1.11")))
    others = [
        entry(CLUSTER_IP, 53, "198.18.1.10", protocol=TCP),  # TCP: never
        entry(CLUSTER_IP, 54, "198.18.1.10"),  # another port of the address
        entry("198.18.1.10", 5353),  # pod to pod, no service
        entry("198.18.9.9", 30053, "198.18.1.10"),  # NodePort number, not our address
    ]
    assert reasons(others, fronts) == [None] * 4
    sctp = frontends(port(ep("198.18.1.11"), protocol="SCTP"))
    assert reasons([entry(CLUSTER_IP, 53, "198.18.1.10", protocol=SCTP)], sctp) == [STALE_DNAT]
    assert len(frontends(port(ep("198.18.1.11"), protocol="TCP"))) == 0


def test_a_host_network_endpoint_on_the_nodeport_itself_is_live_not_missing_dnat() -> None:
    fronts = frontends(port(ep(str(NODE_IP))))
    # Answered by the node's own address on the endpoint port: DNATed by port only.
    assert reasons([entry(str(NODE_IP), 30053, str(NODE_IP))], fronts) == [None]


def test_local_policy_keeps_flows_to_local_endpoints_only_when_only_those_are_used() -> None:
    fronts = frontends(port(ep("198.18.1.10", node="node-a"), ep("198.18.1.11", node="elsewhere"),
                            internalTrafficPolicy="Local", node_port=False))
    found = reasons([entry(CLUSTER_IP, 53, "198.18.1.10"), entry(CLUSTER_IP, 53, "198.18.1.11")],
                    fronts)
    assert found == [None, STALE_DNAT]


def test_ipv6_entries_match_ipv6_addresses() -> None:
    fronts = frontends(port(ep("fd00:18:1::10"), ips=("fd00::53",), ipFamilies=["IPv6"],
                            family=Family.V6))
    assert reasons([entry("fd00::53", 53, "fd00:18:1::10"), entry("fd00::53", 53, "fd00:18:1::9")],
                   fronts) == [None, STALE_DNAT]


def test_counted_by_reason_and_only_what_the_kernel_deleted() -> None:
    fronts = frontends(port(ep("198.18.1.11")))
    found = stale([entry(CLUSTER_IP, 53, "198.18.1.10"), entry(CLUSTER_IP, 53),
                   entry(CLUSTER_IP, 53, "198.18.1.11")], fronts)
    assert [r for _, r, _ in found] == [STALE_DNAT, MISSING_DNAT]
    assert counted(found, [0, 2]) == {STALE_DNAT: 1, MISSING_DNAT: 0}  # ENOENT: went by itself


def test_scaled_to_zero_flows_to_the_gone_endpoints_are_stale() -> None:
    # kubernetes #139628: one-way senders kept DNATing to a deleted pod for 13 hours
    # because upstream's reconciler skipped services without endpoints.
    fronts = frontends(port())
    assert reasons([entry(CLUSTER_IP, 53, "198.18.1.10"), entry(str(NODE_IP), 30053,
                                                               "198.18.1.10")],
                   fronts) == [STALE_DNAT, STALE_DNAT]


def test_a_failing_reconcile_is_logged_never_raised(monkeypatch: Any, caplog: Any) -> None:
    """It runs after rules are applied: a netlink or decoding error must not turn that
    sync into a failure (the next reconcile tries again)."""
    from proxy.dataplane.common import conntrack_reconcile

    class Broken:
        def __init__(self) -> None:
            raise ValueError("undecodable dump")

    monkeypatch.setattr(conntrack_reconcile, "ConntrackSocket", Broken)
    assert conntrack_reconcile.reconcile({Family.V4: [port(ep("198.18.1.10"))]}, ()) == {}
    assert any(r.getMessage() == "conntrack reconcile failed" for r in caplog.records)

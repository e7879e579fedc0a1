"""Which TCP flows are ended when an endpoint vanishes, and the segment and nf_tables text
that end them (pure part of proxy.dataplane.common.fail_fast; the kernel part, with real
connections, is tests/e2e/test_fail_fast.py, and for IPVS the kernel lab's
tests/kernel/scenarios/scenario_fail_fast.py)."""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any

import pytest

from proxy.agent.app import dataplane_options
from proxy.config.options import parse_args
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.ctnetlink import CtEntry
from proxy.dataplane.common.fail_fast import (
    REJECT_SECONDS,
    TABLE,
    FailFast,
    Vanished,
    elements_script,
    flows_of,
    provoking_ack,
    table_script,
    vanished,
)
from proxy.dataplane.common.netlink_constants import IPS_DST_NAT, IPS_SRC_NAT
from proxy.kube.decode import decode_service
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family
from tests.fakekernel.ipvs import FakeIpvs, on_fakes
from tests.unit.builders import NODE, ep, eps_slice, node, resolve_one, service

ON = {"sliceproxy.io/fail-fast": "true"}
OFF = {"sliceproxy.io/fail-fast": "false"}


def web(*eps: dict[str, Any], protocol: str = "TCP", annotations: dict[str, str] | None = ON,
        **spec: Any) -> ResolvedServicePort:
    port = {"name": "http", "port": 80, "protocol": protocol, "nodePort": 30080}
    slice_ports = ({"name": "http", "port": 8080, "protocol": protocol},)
    return resolve_one(node(), service(ports=(port,), annotations=annotations,
                                       type="NodePort", **spec),
                       eps_slice("s1", list(eps), ports=slice_ports), port="http")


def gone(old: ResolvedServicePort | None, new: ResolvedServicePort | None,
         default: bool = False) -> list[str]:
    return [f"{v.endpoint}:{v.port}" for v in vanished(old, new, default)]


A, B = "198.18.1.10", "198.18.1.11"


def test_endpoint_that_left_the_slice_has_its_flows_ended_on_every_address() -> None:
    old = web(ep(A), ep(B), externalIPs=["198.18.2.100"])
    found = vanished(old, web(ep(B), externalIPs=["198.18.2.100"]), False)
    assert [(str(v.endpoint), v.port, v.service) for v in found] == [(A, 8080, "ns/svc:http")]
    assert found[0].frontends == ((ip_address("198.18.128.1"), 80),
                                  (ip_address("198.18.2.100"), 80), (None, 30080))
    # A deleted service: every endpoint it used.
    assert gone(old, None) == [f"{A}:8080", f"{B}:8080"]


@pytest.mark.parametrize(("annotations", "node_wide", "ended"), [
    (None, False, False),  # the default: off
    (None, True, True),  # --fail-fast
    (ON, False, True),  # the annotation alone
    (OFF, True, False),  # the annotation opts a service out of the node's default
])
def test_opt_in_by_node_flag_or_annotation(annotations: dict[str, str] | None,
                                           node_wide: bool, ended: bool) -> None:
    old = web(ep(A), ep(B), annotations=annotations)
    new = web(ep(B), annotations=annotations)
    assert gone(old, new, node_wide) == ([f"{A}:8080"] if ended else [])


def test_endpoint_still_listed_keeps_its_flows_unless_it_stopped_serving_for_good() -> None:
    old = web(ep(A), ep(B))
    # Terminating and still serving: its pod is draining its connections.
    assert gone(old, web(ep(A, ready=False, serving=True, terminating=True), ep(B))) == []
    # Only not ready (a failing readiness probe): no traffic, but alive.
    assert gone(old, web(ep(A, ready=False, serving=False), ep(B))) == []
    # Terminating and no longer serving: done.
    assert gone(old, web(ep(A, ready=False, serving=False, terminating=True), ep(B))) == [
        f"{A}:8080"]


def test_endpoint_still_used_and_udp_ports_are_not_this_modules() -> None:
    assert gone(web(ep(A), ep(B)), web(ep(A), ep(B))) == []
    assert gone(None, web(ep(A))) == []
    # UDP flows move by conntrack.py's deletion of their entries.
    assert gone(web(ep(A), ep(B), protocol="UDP"), web(ep(B), protocol="UDP")) == []


def entry(dst: str, dport: int, endpoint: str, port: int = 8080, protocol: int = 6,
          status: int = IPS_DST_NAT, src: str = "198.18.0.2") -> CtEntry:
    return CtEntry(Family.V4, protocol, IPv4Address(src), 40000, IPv4Address(dst),
                   dport, IPv4Address(endpoint), port, status=status, ct_id=1)


def test_flows_of_are_the_dnated_tcp_entries_of_that_port_only() -> None:
    v = Vanished("ns/svc:http", Family.V4, IPv4Address(A), 8080,
                 ((IPv4Address("198.18.128.1"), 80), (None, 30080)))
    entries = [
        entry("198.18.128.1", 80, A),  # the cluster IP
        entry("198.18.0.1", 30080, A),  # the NodePort, on any node address
        entry("198.18.128.9", 80, A),  # another service sending to the same pod: kept
        entry("198.18.128.1", 80, B),  # another endpoint
        entry("198.18.128.1", 80, A, port=9090),  # another port of the pod
        entry("198.18.128.1", 80, A, protocol=17),  # UDP
        entry("198.18.128.1", 80, A, status=0),  # not DNATed: straight to the pod
    ]
    assert [e for e, _ in flows_of(entries, [v])] == entries[:2]


def test_ipvs_flows_of_are_the_connections_ipvs_sent_to_it_from_that_port() -> None:
    """IPVS (net.ipv4.vs.conntrack=1) rewrites the entry's reply tuple to come from the
    real server without NAT: no IPS_DST_NAT, the client's masquerade alone (kernel lab:
    status 0x19e)."""
    v = Vanished("ns/svc:http", Family.V4, IPv4Address(A), 8080,
                 ((IPv4Address("198.18.128.1"), 80), (None, 30080)))
    ipvs = IPS_SRC_NAT | 0x18e  # seen reply, assured, confirmed, NAT done: masqueraded
    entries = [
        entry("198.18.128.1", 80, A, status=ipvs),  # the cluster IP, masqueraded
        entry("198.18.128.1", 80, A, status=0),  # from a pod: not masqueraded
        # The node itself (host network): its source is the cluster IP too.
        entry("198.18.128.1", 80, A, status=ipvs, src="198.18.128.1"),
        entry("198.18.0.1", 30080, A, status=ipvs),  # the NodePort, any node address
        entry("198.18.128.9", 80, A, status=0),  # another service to the same pod: kept
        entry("198.18.128.1", 80, B, status=0),  # another endpoint
        entry("198.18.128.1", 80, A, protocol=17, status=0),  # UDP
        entry(A, 30080, A, status=0),  # straight to the pod, on a port of that number
    ]
    assert [e for e, _ in flows_of(entries, [v], ipvs=True)] == entries[:4]


def _sum16(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def test_provoking_ack_is_a_bare_ack_with_valid_checksums() -> None:
    src, dst = IPv4Address(A), IPv4Address("198.18.0.2")
    packet = provoking_ack(src, 8080, dst, 40000, 0x12345678, 0x9ABCDEF0)
    assert len(packet) == 40 and packet[0] == 0x45 and packet[9] == 6
    assert packet[12:16] == src.packed and packet[16:20] == dst.packed
    assert _sum16(packet[:20]) == 0xFFFF  # the IP header's checksum holds
    tcp = packet[20:]
    assert struct.unpack("!HHII", tcp[:12]) == (8080, 40000, 0x12345678, 0x9ABCDEF0)
    assert tcp[13] == 0x10  # ACK alone: never RST, SYN or FIN
    pseudo = src.packed + dst.packed + struct.pack("!BBH", 0, 6, len(tcp))
    assert _sum16(pseudo + tcp) == 0xFFFF


def test_provoking_ack_over_ipv6() -> None:
    src, dst = IPv6Address("fd00:18:1::10"), IPv6Address("fd00:18::2")
    packet = provoking_ack(src, 8080, dst, 40000, 1, 2)
    assert packet[0] >> 4 == 6 and packet[6] == 6 and len(packet) == 60
    assert struct.unpack("!H", packet[4:6])[0] == 20
    tcp = packet[40:]
    pseudo = src.packed + dst.packed + struct.pack("!I3xB", len(tcp), 6)
    assert _sum16(pseudo + tcp) == 0xFFFF


def test_reject_table_and_elements_name_the_flows_themselves() -> None:
    script = table_script()
    # Made anew in one transaction, whether or not a previous agent left it.
    assert script.startswith(f"add table inet {TABLE}\ndelete table inet {TABLE}\n")
    # Forwarded clients' packets before DNAT (real nodes: a reset rejected in forward
    # went back out of the pod's bridge port from the endpoint's address, unknown to the
    # client), by the endpoint conntrack chose: another service's flows to the same pod,
    # the endpoint's own packets, or a new flow, never match.
    assert ("type filter hook prerouting priority -150; policy accept;\n"
            "    ct direction original ct status dnat ip saddr . tcp sport . "
            "ct reply ip saddr . ct reply proto-src @gone4 reject with tcp reset\n"
            "    ct direction original ct status dnat ip6 saddr . tcp sport . "
            "ct reply ip6 saddr . ct reply proto-src @gone6 reject with tcp reset\n") in script
    # Host-network clients' packets after DNAT.
    assert ("type filter hook output priority -10; policy accept;\n"
            "    ct status dnat ip saddr . tcp sport . ip daddr . tcp dport @gone4 "
            "reject with tcp reset\n") in script
    assert "forward" not in script
    v4 = entry("198.18.128.1", 80, A)
    v6 = CtEntry(Family.V6, 6, IPv6Address("fd00:18::2"), 40001,
                 IPv6Address("fd00:198:18::1"), 80, IPv6Address("fd00:18:1::10"), 8080)
    assert elements_script([v6, v4, v4]) == (
        f"add element inet {TABLE} gone4 {{ 198.18.0.2 . 40000 . {A} . 8080 "
        f"timeout {REJECT_SECONDS}s }}\n"
        f"add element inet {TABLE} gone6 {{ fd00:18::2 . 40001 . fd00:18:1::10 . 8080 "
        f"timeout {REJECT_SECONDS}s }}\n")


@pytest.mark.parametrize(("value", "expected"), [("true", True), (" False ", False),
                                                 ("yes", None)])
def test_annotation_is_decoded_and_a_bad_value_falls_back_to_the_node(
        value: str, expected: bool | None) -> None:
    svc, skips = decode_service(service(annotations={"sliceproxy.io/fail-fast": value}))
    assert svc is not None and svc.fail_fast is expected
    assert bool(skips) is (expected is None)


def test_node_flag_reaches_the_data_plane() -> None:
    assert dataplane_options(parse_args(["--fail-fast"])).fail_fast
    assert not dataplane_options(parse_args([])).fail_fast


def test_ipvs_table_rejects_before_ipvs_and_leaves_the_provoking_segments_untracked() -> None:
    script = table_script(ipvs=True)
    assert script.startswith(f"add table inet {TABLE}\ndelete table inet {TABLE}\n")
    # Before IPVS's hooks (local in at 98, local out at -99), after conntrack's (-200):
    # the client's packets still go to the service's address (kernel lab: a reject at
    # input priority 100 or output -10 never fired).
    for hook, priority in (("input", "-10"), ("output", "-150")):
        assert (f"type filter hook {hook} priority {priority}; policy accept;\n"
                "    ip saddr . tcp sport . ip daddr . tcp dport @gone4 reject with tcp reset\n"
                "    ip6 saddr . tcp sport . ip6 daddr . tcp dport @gone6 reject with tcp reset"
                ) in script
    # The same flows the other way, from the service's address: untracked (kernel lab:
    # tracked, the segment never reached the client's socket).
    assert ("type filter hook output priority raw; policy accept;\n"
            "    ip daddr . tcp dport . ip saddr . tcp sport @gone4 notrack\n") in script
    assert "ct status dnat" not in script and "forward" not in script
    flow = entry("198.18.128.1", 80, A, status=IPS_SRC_NAT)
    assert elements_script([flow], ipvs=True) == (
        f"add element inet {TABLE} gone4 {{ 198.18.0.2 . 40000 . 198.18.128.1 . 80 "
        f"timeout {REJECT_SECONDS}s }}\n")


def test_ipvs_plane_resets_the_flows_of_an_endpoint_that_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The IPVS plane's sync hands the endpoints that left to an IPVS-form FailFast and
    reports what it reset (the metric, the sync's details); over fake kernel handles."""
    calls: list[tuple[bool, list[str]]] = []

    def end(self: FailFast, gone: list[Vanished]) -> int:
        calls.append((self.ipvs, [f"{v.endpoint}:{v.port}" for v in gone]))
        return 3 * len(gone)

    monkeypatch.setattr(FailFast, "end", end)
    for opted in (ON, None):
        dp = on_fakes(DataplaneOptions(NODE, families=(Family.V4,)), FakeIpvs(applies=True))
        old, new = (resolve_one(node(), service(annotations=opted),
                                eps_slice("s1", eps, ports=({"name": "http", "port": 8080},)),
                                port="http") for eps in ([ep(A), ep(B)], [ep(B)]))
        dp.sync(DesiredState({old.key: old}), full=True)
        report = dp.sync(DesiredState({new.key: new}))
        assert not report.full
        expected = 3 if opted else 0
        assert (report.flows_reset, report.details["flows_reset"]) == (expected, expected)
    assert calls == [(True, [f"{A}:8080"]), (True, [])]

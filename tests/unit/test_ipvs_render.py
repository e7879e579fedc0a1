"""The IPVS renderer: service ports -> virtual servers, dummy addresses, ipset entries.

Every case goes API dicts -> decode -> model -> render, so what is checked is what the
agent would program. Entries are compared as ipset spells them ("ip,proto:port").
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from typing import Any

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.render import (
    FLAG_PERSISTENT,
    FLAG_SCHED1,
    FLAG_SCHED2,
    IpvsContext,
    SetRole,
    VsKind,
    describe_entries,
    describe_vs,
    ipset_nets,
    render_all,
    render_port,
    set_name,
)
from proxy.model.types import Family
from tests.unit.builders import ep, eps_slice, model_of, node, resolve_one, service

NODE_ADDRESSES = (ip_address("198.18.0.1"), ip_address("198.18.1.1"),
                  ip_address("fd00:18::1"), ip_address("127.0.0.1"), ip_address("::1"),
                  ip_address("fe80::1"))
HTTP = {"name": "http", "port": 80}


def ctx(**opts: Any) -> IpvsContext:
    return IpvsContext.build(DataplaneOptions(node_name="node-a", **opts), NODE_ADDRESSES)


def entries(rules: Any, role: SetRole) -> list[str]:
    return sorted(e.entry for e in rules.entries if e.role is role)


def vss(rules: Any) -> dict[str, Any]:
    return {str(v.key): v for v in rules.virtual_servers}


def test_cluster_ip_virtual_server_with_ready_endpoints_only() -> None:
    rsp = resolve_one(
        service(ips=("198.18.128.10",), ports=(HTTP,)),
        eps_slice("s1", [ep("198.18.1.10", node="node-a"), ep("198.18.1.11", node="node-b"),
                         ep("198.18.1.12", ready=False)]),
        node())
    rules = render_port(rsp, ctx())
    (vs,) = rules.virtual_servers
    assert str(vs.key) == "TCP 198.18.128.10:80"
    assert (vs.kind, vs.scheduler, vs.flags, vs.timeout) == (VsKind.CLUSTER_IP, "rr", 0, 0)
    assert [str(r) for r in vs.real_servers] == ["198.18.1.10:8080", "198.18.1.11:8080"]
    assert describe_vs(vs) == ["TCP 198.18.128.10:80 rr -> 198.18.1.10:8080 weight 1",
                               "TCP 198.18.128.10:80 rr -> 198.18.1.11:8080 weight 1"]
    assert [str(a) for a in rules.addresses] == ["198.18.128.10"]
    assert entries(rules, SetRole.SERVICES) == ["198.18.128.10,tcp:80"]
    assert entries(rules, SetRole.CLUSTER_IP) == ["198.18.128.10,tcp:80"]
    assert entries(rules, SetRole.VIPS) == ["198.18.128.10"]
    assert entries(rules, SetRole.EXTERNAL_MASQ) == []
    # Hairpin: only the endpoint on this node.
    assert entries(rules, SetRole.LOOPBACK) == ["198.18.1.10,tcp:8080,198.18.1.10"]


def test_client_ip_affinity_is_persistence_with_the_service_timeout() -> None:
    rsp = resolve_one(
        service(ports=(HTTP,), sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 600}}),
        eps_slice("s1", [ep("198.18.1.10")]))
    (vs,) = render_port(rsp, ctx()).virtual_servers
    assert (vs.flags, vs.timeout) == (FLAG_PERSISTENT, 600)
    assert describe_vs(vs) == ["TCP 198.18.128.1:80 rr persistent 600 -> 198.18.1.10:8080 "
                               "weight 1"]
    rsp = resolve_one(service(ports=(HTTP,), sessionAffinity="ClientIP"),
                      eps_slice("s1", [ep("198.18.1.10")]))
    (vs,) = render_port(rsp, ctx()).virtual_servers
    assert vs.timeout == 10800  # the API's default


def test_scheduler_from_options_and_mh_hashes_the_source_port() -> None:
    rsp = resolve_one(service(ports=(HTTP,)), eps_slice("s1", [ep("198.18.1.10")]))
    assert render_port(rsp, ctx(ipvs_scheduler="wlc")).virtual_servers[0].scheduler == "wlc"
    vs = render_port(rsp, ctx(ipvs_scheduler="mh")).virtual_servers[0]
    assert (vs.scheduler, vs.flags) == ("mh", FLAG_SCHED1 | FLAG_SCHED2)


def test_node_port_on_every_usable_node_address_masqueraded() -> None:
    rsp = resolve_one(
        service(ports=(dict(HTTP, nodePort=30080),), type="NodePort"),
        eps_slice("s1", [ep("198.18.1.10")]))
    rules = render_port(rsp, ctx())
    got = vss(rules)
    # IPv4 node addresses only (an IPv4 port), never loopback.
    assert sorted(got) == ["TCP 198.18.0.1:30080", "TCP 198.18.1.1:30080",
                           "TCP 198.18.128.1:80"]
    assert got["TCP 198.18.0.1:30080"].kind is VsKind.NODE_PORT
    assert entries(rules, SetRole.EXTERNAL_MASQ) == ["198.18.0.1,tcp:30080",
                                                     "198.18.1.1,tcp:30080"]
    # NodePorts live on the node's own addresses: nothing new on the dummy interface.
    assert [str(a) for a in rules.addresses] == ["198.18.128.1"]


def test_nodeport_addresses_select_node_addresses() -> None:
    assert [str(a) for a in ctx().nodeport_addresses] == ["198.18.0.1", "198.18.1.1",
                                                          "fd00:18::1"]
    c = ctx(nodeport_addresses=(ip_network("198.18.0.0/24"),))
    # IPv4 restricted; no IPv6 CIDR given, so every IPv6 address, as upstream.
    assert [str(a) for a in c.nodeport_addresses] == ["198.18.0.1", "fd00:18::1"]
    c = ctx(nodeport_addresses=(ip_network("fd00:18::/64"),))
    assert c.nodeport_addresses == (IPv4Address("198.18.0.1"), IPv4Address("198.18.1.1"),
                                    IPv6Address("fd00:18::1"))
    c = ctx(nodeport_addresses=(ip_network("fd00:99::/64"),))
    # An IPv6 CIDR that holds no node address: no IPv6 NodePort, IPv4 ones untouched.
    assert [str(a) for a in c.nodeport_addresses] == ["198.18.0.1", "198.18.1.1"]


def test_primary_nodeport_addresses_are_the_nodes_primary_ones() -> None:
    options = DataplaneOptions(node_name="node-a", nodeport_primary=True)
    c = IpvsContext.build(options, NODE_ADDRESSES, (ip_address("198.18.1.1"),))
    # The Node's IPv4 address only; it shows no IPv6 one, so every IPv6 address.
    assert [str(a) for a in c.nodeport_addresses] == ["198.18.1.1", "fd00:18::1"]
    rsp = resolve_one(service(ports=(dict(HTTP, nodePort=30080),), type="NodePort"),
                      eps_slice("s1", [ep("198.18.1.10")]))
    rules = render_port(rsp, c)
    assert sorted(vss(rules)) == ["TCP 198.18.1.1:30080", "TCP 198.18.128.1:80"]
    assert entries(rules, SetRole.EXTERNAL_MASQ) == ["198.18.1.1,tcp:30080"]


def test_external_ips_bound_unless_a_node_address_and_local_policy_not_masqueraded() -> None:
    rsp = resolve_one(
        service(ports=(HTTP,), externalIPs=["198.18.2.60", "198.18.0.1"]),
        eps_slice("s1", [ep("198.18.1.10", node="node-a")]), node())
    rules = render_port(rsp, ctx())
    assert [str(a) for a in rules.addresses] == ["198.18.2.60", "198.18.128.1"]
    assert entries(rules, SetRole.EXTERNAL_MASQ) == ["198.18.0.1,tcp:80", "198.18.2.60,tcp:80"]
    assert vss(rules)["TCP 198.18.2.60:80"].kind is VsKind.EXTERNAL_IP

    rsp = resolve_one(
        service(ports=(HTTP,), externalIPs=["198.18.2.60"], externalTrafficPolicy="Local"),
        eps_slice("s1", [ep("198.18.1.10", node="node-a"), ep("198.18.1.11", node="node-b")]),
        node())
    rules = render_port(rsp, ctx())
    assert entries(rules, SetRole.EXTERNAL_MASQ) == []
    ext = vss(rules)["TCP 198.18.2.60:80"]
    assert (ext.endpoint_set, [str(r) for r in ext.real_servers]) == (
        "local", ["198.18.1.10:8080"])
    # The cluster IP keeps the cluster set (internal policy Cluster).
    assert len(vss(rules)["TCP 198.18.128.1:80"].real_servers) == 2


def test_load_balancer_ips_with_source_ranges() -> None:
    svc = service(ports=(HTTP,), type="LoadBalancer",
                  loadBalancerSourceRanges=["198.18.0.0/24", "0.0.0.0/0"])
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.2.50"}]}}
    rsp = resolve_one(svc, eps_slice("s1", [ep("198.18.1.10")]))
    rules = render_port(rsp, ctx())
    assert vss(rules)["TCP 198.18.2.50:80"].kind is VsKind.LOAD_BALANCER
    assert entries(rules, SetRole.FIREWALL) == ["198.18.2.50,tcp:80"]
    # ipset refuses /0 in hash:*net sets: "anywhere" is both halves.
    assert entries(rules, SetRole.FIREWALL_ALLOW) == [
        "198.18.2.50,tcp:80,0.0.0.0/1", "198.18.2.50,tcp:80,128.0.0.0/1",
        "198.18.2.50,tcp:80,198.18.0.0/24"]
    assert "198.18.2.50" in entries(rules, SetRole.VIPS)


def test_ipset_nets_split_only_the_whole_space() -> None:
    assert [str(n) for n in ipset_nets(ip_network("::/0"))] == ["::/1", "8000::/1"]
    assert [str(n) for n in ipset_nets(ip_network("198.18.0.0/15"))] == ["198.18.0.0/15"]


def test_local_policy_without_local_endpoints_serves_only_pods_and_the_node() -> None:
    # As upstream's IPVS mode, the NodePort falls back to the cluster set; unlike it,
    # traffic from outside is dropped by the filter (INSIDE-ONLY), as upstream's
    # iptables mode drops what its EXT chain did not short-circuit.
    spec = {"type": "NodePort", "externalTrafficPolicy": "Local"}
    ports = (dict(HTTP, nodePort=30080),)
    rsp = resolve_one(service(ports=ports, **spec),
                      eps_slice("s1", [ep("198.18.1.11", node="node-b")]), node())
    rules = render_port(rsp, ctx())
    np = vss(rules)["TCP 198.18.0.1:30080"]
    assert ([str(r) for r in np.real_servers], np.endpoint_set, np.drop, np.inside_only) == (
        ["198.18.1.11:8080"], "cluster", False, True)
    assert entries(rules, SetRole.INSIDE_ONLY) == ["198.18.0.1,tcp:30080",
                                                   "198.18.1.1,tcp:30080"]
    assert entries(rules, SetRole.DROP) == []
    assert entries(rules, SetRole.EXTERNAL_MASQ) == []  # outside traffic is not forwarded
    assert describe_vs(np) == [
        "TCP 198.18.0.1:30080 rr -> 198.18.1.11:8080 weight 1 "
        "(pods and this node only: policy Local, no local endpoint)"]
    assert ("drop 198.18.0.1,tcp:30080 from outside the cluster CIDRs (traffic policy Local, "
            "no local endpoint; pods and this node, masqueraded, use the cluster set)"
            ) in describe_entries(rules)
    # The cluster IP (internal policy Cluster) reaches the remote endpoint as usual.
    assert vss(rules)["TCP 198.18.128.1:80"].real_servers

    # A local endpoint appears: the NodePort serves only it, for everyone.
    rsp = resolve_one(service(ports=ports, **spec), node(), eps_slice(
        "s1", [ep("198.18.1.10", node="node-a"), ep("198.18.1.11", node="node-b")]))
    rules = render_port(rsp, ctx())
    np = vss(rules)["TCP 198.18.0.1:30080"]
    assert ([str(r) for r in np.real_servers], np.endpoint_set, np.inside_only) == (
        ["198.18.1.10:8080"], "local", False)
    assert entries(rules, SetRole.INSIDE_ONLY) == []

    # No endpoint anywhere: an empty virtual server, which refuses.
    rsp = resolve_one(service(ports=ports, **spec), node())
    rules = render_port(rsp, ctx())
    assert entries(rules, SetRole.DROP) == entries(rules, SetRole.INSIDE_ONLY) == []
    assert describe_vs(vss(rules)["TCP 198.18.0.1:30080"]) == [
        "TCP 198.18.0.1:30080 rr -> (no endpoints: connections refused)"]


def test_both_policies_local() -> None:
    # Cluster IP: the local set, dropped for everyone when empty (iTP Local). External
    # addresses: the local set while there is one, else pods and the node only.
    svc = service(ports=(dict(HTTP, nodePort=30080),), type="LoadBalancer",
                  internalTrafficPolicy="Local", externalTrafficPolicy="Local",
                  externalIPs=["198.18.2.60"])
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.2.50"}]}}
    both = [ep("198.18.1.10", node="node-a"), ep("198.18.1.11", node="node-b")]
    rules = render_port(resolve_one(svc, node(), eps_slice("s1", both)), ctx())
    assert {k: (v.endpoint_set, [str(r) for r in v.real_servers])
            for k, v in vss(rules).items()} == {
        k: ("local", ["198.18.1.10:8080"])
        for k in ("TCP 198.18.128.1:80", "TCP 198.18.2.60:80", "TCP 198.18.2.50:80",
                  "TCP 198.18.0.1:30080", "TCP 198.18.1.1:30080")}
    assert entries(rules, SetRole.DROP) == entries(rules, SetRole.INSIDE_ONLY) == []

    remote = [ep("198.18.1.11", node="node-b")]
    rules = render_port(resolve_one(svc, node(), eps_slice("s1", remote)), ctx())
    cip = vss(rules)["TCP 198.18.128.1:80"]
    assert (cip.real_servers, cip.drop, cip.inside_only) == ((), True, False)
    assert entries(rules, SetRole.DROP) == ["198.18.128.1,tcp:80"]
    external = ["198.18.0.1,tcp:30080", "198.18.1.1,tcp:30080", "198.18.2.50,tcp:80",
                "198.18.2.60,tcp:80"]
    assert entries(rules, SetRole.INSIDE_ONLY) == external
    for key in ("TCP 198.18.2.60:80", "TCP 198.18.2.50:80", "TCP 198.18.0.1:30080"):
        vs = vss(rules)[key]
        assert (vs.endpoint_set, [str(r) for r in vs.real_servers]) == (
            "cluster", ["198.18.1.11:8080"]), key


def test_internal_traffic_policy_local_uses_the_local_set_for_the_cluster_ip() -> None:
    rsp = resolve_one(
        service(ports=(HTTP,), internalTrafficPolicy="Local"),
        eps_slice("s1", [ep("198.18.1.10", node="node-a"), ep("198.18.1.11", node="node-b")]),
        node())
    (vs,) = render_port(rsp, ctx()).virtual_servers
    assert (vs.endpoint_set, [str(r) for r in vs.real_servers]) == ("local",
                                                                    ["198.18.1.10:8080"])


def test_terminating_fallback_when_nothing_is_ready() -> None:
    rsp = resolve_one(service(ports=(HTTP,)), eps_slice("s1", [
        ep("198.18.1.10", ready=False, serving=True, terminating=True),
        ep("198.18.1.11", ready=False, serving=False, terminating=True)]))
    (vs,) = render_port(rsp, ctx()).virtual_servers
    assert [str(r) for r in vs.real_servers] == ["198.18.1.10:8080"]


def test_ipv6_port_uses_the_ipv6_sets_and_addresses() -> None:
    rsp = resolve_one(
        service(ips=("198.18.128.1", "fd00:198:18::1"),
                ports=(dict(HTTP, protocol="UDP", nodePort=30053),), type="NodePort"),
        eps_slice("s6", [ep("fd00:18:1::10", node="node-a")], address_type="IPv6",
                  ports=({"name": "http", "port": 8080, "protocol": "UDP"},)),
        node(), family=Family.V6, port="http")
    rules = render_port(rsp, ctx())
    assert sorted(vss(rules)) == ["UDP [fd00:18::1]:30053", "UDP [fd00:198:18::1]:80"]
    assert {e.family for e in rules.entries} == {Family.V6}
    assert entries(rules, SetRole.LOOPBACK) == ["fd00:18:1::10,udp:8080,fd00:18:1::10"]
    assert set_name(SetRole.SERVICES, Family.V6) == "SPX-IPVS6-SERVICES"
    assert describe_vs(vss(rules)["UDP [fd00:198:18::1]:80"]) == [
        "UDP [fd00:198:18::1]:80 rr -> [fd00:18:1::10]:8080 weight 1"]


def test_render_all_respects_families_and_is_deterministic() -> None:
    model = model_of(
        service("a", ips=("198.18.128.1", "fd00:198:18::1"), ports=(HTTP,)),
        eps_slice("a4", [ep("198.18.1.10")], service_name="a"),
        eps_slice("a6", [ep("fd00:18:1::10")], service_name="a", address_type="IPv6"))
    state = model.resolve()
    both = render_all(state, ctx())
    assert {k.family for k in both} == {Family.V4, Family.V6}
    assert render_all(state, ctx()) == both
    assert {k.family for k in render_all(state, ctx(), [Family.V4])} == {Family.V4}


def test_describe_vs_shows_draining_real_servers() -> None:
    rsp = resolve_one(service(ports=(HTTP,)), eps_slice("s1", [ep("198.18.1.10")]))
    (vs,) = render_port(rsp, ctx()).virtual_servers
    from proxy.dataplane.ipvs.render import RsKey

    gone = RsKey(ip_address("198.18.1.11"), 8080)
    assert describe_vs(vs, {gone: 0}) == [
        "TCP 198.18.128.1:80 rr -> 198.18.1.10:8080 weight 1",
        "TCP 198.18.128.1:80 rr -> 198.18.1.11:8080 weight 0 (draining)"]


def test_hostile_names_reaching_the_renderer_never_reach_kernel_text() -> None:
    """Defence in depth, as for iptables' comments: names are the decoder's to refuse,
    and IPVS kernel input is built from addresses, protocols and numbers only. A service
    port whose names hold line breaks, NUL and non-ASCII renders exactly as the same
    port with plain names, and its ipset entries and our iptables rules are printable
    ASCII."""
    from dataclasses import replace

    from proxy.dataplane.ipvs.netfilter import iptables_rules

    rsp = resolve_one(
        service(ips=("198.18.128.10",), ports=({**HTTP, "nodePort": 30080},), type="NodePort",
                externalIPs=["198.18.0.20"], sessionAffinity="ClientIP"),
        eps_slice("s1", [ep("198.18.1.10", node="node-a")]), node())
    evil = "x\n-A INPUT -j ACCEPT\r\x00é\u2028" + "y" * 300
    hostile = replace(rsp, key=rsp.key._replace(namespace=evil, name=evil, port=evil),
                      service=replace(rsp.service, namespace=evil, name=evil),
                      port=replace(rsp.port, name=evil))
    plain, got = render_port(rsp, ctx()), render_port(hostile, ctx())
    assert (got.virtual_servers, got.addresses, got.entries) == (
        plain.virtual_servers, plain.addresses, plain.entries)
    text = [e.entry for e in got.entries] + [str(vs.key) for vs in got.virtual_servers]
    text += [r for rules in iptables_rules(Family.V4, DataplaneOptions(node_name="n")).values()
             for r in rules]
    for line in text:
        assert line.isascii() and line.isprintable() and "yyy" not in line, line

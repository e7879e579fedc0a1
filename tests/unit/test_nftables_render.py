"""Golden tests for the nftables renderer and its transactions: one service port in,
readable `nft` lines out. Hashed names are shown as <svc>, <svl>, <ext>, <fw>, and
<ep ip:port> / <aff ip:port> for affinity. The kernel accepts these lines: the e2e
traffic tests load them into nf_tables."""

from __future__ import annotations

import re
from dataclasses import replace
from ipaddress import ip_address, ip_network
from typing import Any

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.context import RenderContext, context_for
from proxy.dataplane.nftables import render
from proxy.dataplane.nftables.objects import parts_text
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    endpoint_object,
    port_chain,
    render_base,
    render_port,
    render_shard,
    shard_of,
    shards_for,
)
from proxy.dataplane.nftables.transaction import (
    KeptPort,
    element_map,
    full_lines,
    full_script,
    kept_slots,
    partial_script,
)
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family
from tests.unit.builders import NODE, ep, eps_slice, node, resolve_one, service

CIDR4 = RenderContext(Family.V4, local_cidrs=(ip_network("198.18.1.0/24"),))
T4 = "ip sliceproxy"
S0 = "sliceproxy-0"  # the one shard of a small table


@pytest.fixture
def chains_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """No port picked (render.PICK_MAX 0): each has a chain of its own, as a port with a
    NodePort, affinity or per-endpoint counters has."""
    monkeypatch.setattr(render, "PICK_MAX", 0)


def pretty(rsp: ResolvedServicePort, ctx: RenderContext = CIDR4) -> list[str]:
    proto = rsp.port.protocol.value.lower()
    names = {port_chain(kind, rsp.key, proto): f"<{kind}>"
             for kind in ("svc", "svl", "ext", "fw", "cnt")}
    for s in rsp.endpoints:
        e = s.endpoint
        text = f"[{e.address}]:{e.port}" if e.address.version == 6 else f"{e.address}:{e.port}"
        for kind in ("ep", "aff", "cep"):
            names[endpoint_object(kind, rsp.key, proto, text)] = f"<{kind} {text}>"
    out = []
    for line in render_port(rsp, ctx).lines(rsp.key.family):
        for name, label in names.items():
            line = line.replace(name, label)
        out.append(re.sub(r" ip6? sliceproxy(-\d+)? ", " ", line))
    return out


def resolve(*objects: dict[str, Any], family: Family = Family.V4) -> ResolvedServicePort:
    return resolve_one(node(), *objects, family=family, port="http")


@pytest.mark.usefixtures("chains_of_their_own")
def test_cluster_ip_dispatches_by_map_and_balances_with_numgen() -> None:
    rsp = resolve(service(), eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11"),
                                              ep("198.18.1.12"), ep("198.18.1.13", ready=False)]))
    assert pretty(rsp) == [
        "add element cluster-ips { 198.18.128.1 }",
        "add element hairpin { 198.18.1.10 . 198.18.1.10 }",
        "add element hairpin { 198.18.1.11 . 198.18.1.11 }",
        "add element hairpin { 198.18.1.12 . 198.18.1.12 }",
        "add element service-ips { 198.18.128.1 . tcp . 80 : goto <svc> }",
        "add counter <cnt>",
        "add chain <svc>",
        # Every new connection of the port counted (common/traffic.py).
        'add rule <svc> counter name "<cnt>"',
        # Off-cluster clients (not from --cluster-cidr) are masqueraded.
        "add rule <svc> ip daddr 198.18.128.1 tcp dport 80 ip saddr != 198.18.1.0/24 "
        "jump mark-for-masquerade",
        # 1/3, then 1/2 of what is left, then the rest: uniform.
        'add rule <svc> numgen random mod 3 0 meta l4proto tcp dnat to 198.18.1.10:8080 '
        'comment "ns/svc:http"',
        'add rule <svc> numgen random mod 2 0 meta l4proto tcp dnat to 198.18.1.11:8080 '
        'comment "ns/svc:http"',
        'add rule <svc> meta l4proto tcp dnat to 198.18.1.12:8080 comment "ns/svc:http"',
    ]


def test_a_cluster_ip_port_is_picked_by_its_shards_chain_without_one_of_its_own() -> None:
    """A port reached by its cluster IP alone, balanced at random, is map elements only:
    its dispatch to the shard's pick chain of its endpoint count, its counter, and its
    endpoints by slot in that count's pick map (scale-churn.md: a change is elements)."""
    rsp = resolve(service(), eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11"),
                                              ep("198.18.1.12", ready=False)]))
    assert pretty(rsp) == [
        "add element cluster-ips { 198.18.128.1 }",
        "add element hairpin { 198.18.1.10 . 198.18.1.10 }",
        "add element hairpin { 198.18.1.11 . 198.18.1.11 }",
        'add element port-counters { 198.18.128.1 . tcp . 80 : "<cnt>" }',
        "add element service-ips { 198.18.128.1 . tcp . 80 : goto pick-2 }",
        "add element eps-tcp-2 { 198.18.128.1 . 80 . 0 : 198.18.1.10 . 8080 }",
        "add element eps-tcp-2 { 198.18.128.1 . 80 . 1 : 198.18.1.11 . 8080 }",
        "add counter <cnt>",
    ]
    shard = {c.name: c.rules for c in render_shard(CIDR4, S0).chains}
    assert shard["pick-2"] == (
        "counter name ip daddr . meta l4proto . th dport map @port-counters",
        # Off-cluster clients (not from --cluster-cidr) are masqueraded.
        "ip saddr != 198.18.1.0/24 jump mark-for-masquerade",
        *(f"meta l4proto {p} dnat ip to ip daddr . {p} dport . numgen random mod 2 "
          f"map @eps-{p}-2" for p in ("tcp", "udp", "sctp")))
    assert len([c for c in shard if c.startswith("pick-")]) == render.PICK_MAX
    several = RenderContext(Family.V4, local_cidrs=(ip_network("198.18.1.0/24"),
                                                    ip_network("198.18.6.0/24")))
    assert "jump masq-unless-pod" in {c.name: c.rules for c in render_shard(
        several, S0).chains}["pick-1"]
    v6 = resolve(service(ips=("fd00::10",), ipFamilies=["IPv6"]),
                 eps_slice("s1", [ep("fd00:1::10")], address_type="IPv6"), family=Family.V6)
    lines = render_port(v6, RenderContext(Family.V6)).lines(Family.V6)
    assert f"add element ip6 {S0} eps-tcp-1 {{ fd00::10 . 80 . 0 : fd00:1::10 . 8080 }}" \
        in lines


def test_a_port_needs_a_chain_of_its_own_for_anything_but_its_cluster_ip_at_random() -> None:
    plain = (service(), eps_slice("s1", [ep("198.18.1.10")]))
    assert not render_port(resolve(*plain), CIDR4).chains
    for svc in (service(type="NodePort", ports=({"name": "http", "port": 80,
                                                 "nodePort": 30080},)),
                service(externalIPs=["198.18.200.1"]),
                service(sessionAffinity="ClientIP"),
                service(annotations={"sliceproxy.io/traffic-per-endpoint": "true"}),
                service(annotations={"sliceproxy.io/balancing": "maglev"})):
        assert render_port(resolve(svc, plain[1]), CIDR4).chains, svc
    many = eps_slice("s1", [ep(f"198.18.2.{i}") for i in range(render.PICK_MAX + 1)])
    assert render_port(resolve(service(), many), CIDR4).chains


def test_no_endpoints_is_rejected_by_the_unserved_map_without_a_chain() -> None:
    rsp = resolve(service(type="NodePort", externalIPs=["198.18.0.20"],
                          ports=({"name": "http", "port": 80, "nodePort": 30080},)))
    assert pretty(rsp) == [
        "add element cluster-ips { 198.18.128.1 }",
        "add element unserved { 198.18.0.20 . tcp . 80 : goto reject-chain }",
        "add element unserved { 198.18.128.1 . tcp . 80 : goto reject-chain }",
        "add element unserved-nodeports { tcp . 30080 : goto reject-chain }",
    ]


def test_local_external_policy_short_circuits_pods_and_the_node_and_drops_the_rest() -> None:
    obj = service(type="NodePort", externalTrafficPolicy="Local",
                  ports=({"name": "http", "port": 80, "nodePort": 30080},))
    rsp = resolve(obj, eps_slice("s1", [ep("198.18.1.11", node="node-b")]))
    lines = pretty(rsp)
    assert [line for line in lines if "<ext>" in line] == [
        "add element service-nodeports { tcp . 30080 : goto <ext> }",
        "add chain <ext>",
        "add rule <ext> ip saddr 198.18.1.0/24 goto <svc>",
        "add rule <ext> fib saddr type local jump mark-for-masquerade",
        "add rule <ext> fib saddr type local goto <svc>",
    ]
    # Nobody local: what the short-circuit did not take is dropped, not refused.
    assert "add element unserved-nodeports { tcp . 30080 : drop }" in lines
    # With a local endpoint, the rest goes to the local chain.
    rsp = resolve(obj, eps_slice("s1", [ep("198.18.1.10", node=NODE),
                                        ep("198.18.1.11", node="node-b")]))
    lines = pretty(rsp)
    assert "add rule <ext> goto <svl>" in lines
    assert not [line for line in lines if "unserved" in line]


def test_cluster_external_policy_masquerades_then_uses_the_cluster_chain() -> None:
    obj = service(type="NodePort", ports=({"name": "http", "port": 80, "nodePort": 30080},))
    lines = pretty(resolve(obj, eps_slice("s1", [ep("198.18.1.10")])))
    assert [line for line in lines if line.startswith("add rule <ext>")] == [
        "add rule <ext> jump mark-for-masquerade", "add rule <ext> goto <svc>"]


def test_internal_local_policy_without_local_endpoint_drops_cluster_ip_traffic() -> None:
    rsp = resolve(service(internalTrafficPolicy="Local"),
                  eps_slice("s1", [ep("198.18.1.11", node="node-b")]))
    assert pretty(rsp) == ["add element cluster-ips { 198.18.128.1 }",
                           "add element unserved { 198.18.128.1 . tcp . 80 : drop }"]


def test_load_balancer_source_ranges_go_through_a_firewall_chain() -> None:
    lb = service(type="LoadBalancer", loadBalancerSourceRanges=["198.18.0.0/24"],
                 ports=({"name": "http", "port": 80, "nodePort": 30080},))
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.0.200"}]}}
    rsp = resolve(lb, eps_slice("s1", [ep("198.18.1.10")]))
    lines = pretty(rsp)
    assert "add element service-ips { 198.18.0.200 . tcp . 80 : goto <fw> }" in lines
    # What the firewall chain did not send on keeps the LB IP and is dropped.
    assert "add element unserved { 198.18.0.200 . tcp . 80 : drop }" in lines
    assert [line for line in lines if line.startswith("add rule <fw>")] == [
        "add rule <fw> ip saddr 198.18.0.0/24 goto <ext>"]
    # A node inside the allowed range may reach its own LB IP (it is the source then).
    ctx = RenderContext(Family.V4, node_ips=(ip_address("198.18.0.1"),))
    assert "add rule <fw> ip saddr 198.18.0.200 goto <ext>" in pretty(rsp, ctx)


def test_client_ip_affinity_uses_a_dynamic_set_and_a_chain_per_endpoint() -> None:
    rsp = resolve(service(sessionAffinity="ClientIP",
                          sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
                  eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11")]))
    lines = pretty(rsp)
    a, b = "198.18.1.10:8080", "198.18.1.11:8080"
    assert f"add set <aff {a}> {{ type ipv4_addr; flags dynamic,timeout; timeout 60s; }}" \
        in lines
    assert [line for line in lines if line.startswith("add rule <svc>")][2:] == [
        f"add rule <svc> ip saddr @<aff {a}> goto <ep {a}>",
        f"add rule <svc> ip saddr @<aff {b}> goto <ep {b}>",
        f"add rule <svc> numgen random mod 2 0 goto <ep {a}>",
        f"add rule <svc> goto <ep {b}>",
    ]
    assert [line for line in lines if line.startswith(f"add rule <ep {a}>")] == [
        f"add rule <ep {a}> update @<aff {a}> {{ ip saddr }}",
        f'add rule <ep {a}> meta l4proto tcp dnat to {a} comment "ns/svc:http"',
    ]


@pytest.mark.usefixtures("chains_of_their_own")
def test_ipv6_uses_the_ip6_table_and_brackets() -> None:
    rsp = resolve(service(ips=("fd00::10",), ipFamilies=["IPv6"]),
                  eps_slice("s1", [ep("fd00:1::10")], address_type="IPv6"),
                  family=Family.V6)
    ctx = RenderContext(Family.V6, local_cidrs=(ip_network("fd00:1::/64"),))
    lines = render_port(rsp, ctx).lines(Family.V6)
    assert all(re.search(r" ip6 sliceproxy(-0)? ", line) for line in lines), lines
    assert any(line.endswith('dnat to [fd00:1::10]:8080 comment "ns/svc:http"')
               for line in lines), lines
    assert any("ip6 daddr fd00::10 tcp dport 80 ip6 saddr != fd00:1::/64" in line
               for line in lines), lines


@pytest.mark.usefixtures("chains_of_their_own")
def test_several_cluster_cidrs_go_through_one_shared_chain() -> None:
    ctx = RenderContext(Family.V4, local_cidrs=(ip_network("198.18.1.0/24"),
                                                ip_network("198.18.6.0/24")))
    lines = pretty(resolve(service(), eps_slice("s1", [ep("198.18.1.10")])), ctx)
    assert "add rule <svc> ip daddr 198.18.128.1 tcp dport 80 jump masq-unless-pod" in lines
    shard = {c.name: c.rules for c in render_shard(ctx, S0).chains}
    assert shard["masq-unless-pod"] == ("ip saddr 198.18.1.0/24 return",
                                       "ip saddr 198.18.6.0/24 return",
                                       "jump mark-for-masquerade")


def test_nodeport_addresses_become_a_set_in_each_table_that_matches_them() -> None:
    ctx = RenderContext(Family.V4, nodeport_ips=(ip_address("198.18.0.2"),))
    shard = render_shard(ctx, S0)
    rules = {c.name: c.rules for c in shard.chains}
    assert rules["nodeports"] == ("ip daddr @nodeport-ips meta l4proto . th dport "
                                  "vmap @service-nodeports",)
    assert [(e.table, e.key) for e in shard.elements if e.set != FINGERPRINTS] == [
        (S0, ("198.18.0.2",))]
    main = render_base(ctx)
    assert [(e.table, e.key) for e in main.elements if e.set != FINGERPRINTS] == [
        ("sliceproxy", ("198.18.0.2",))]
    every = {c.name: c.rules for c in render_shard(CIDR4, S0).chains}
    assert every["nodeports"][0].startswith("fib daddr type local ip daddr != 127.0.0.0/8 ")
    # Node ports are looked up after every shard's services (priority dstnat + 1).
    hooks = {c.name: c.declaration() for c in render_shard(CIDR4, S0).chains if c.hook}
    assert "priority dstnat;" in hooks["nat-prerouting"]
    assert "priority dstnat + 1;" in hooks["nodeport-prerouting"]
    assert "priority -99;" in hooks["nodeport-output"]


def test_primary_nodeport_addresses_become_the_set_of_the_nodes_primary_address() -> None:
    """`--nodeport-addresses primary` (nftables mode's default): the Node's InternalIP
    is the one node address in the set; another local address gets no NodePort."""
    options = DataplaneOptions(NODE, cluster_cidrs=(ip_network("198.18.1.0/24"),),
                               nodeport_primary=True)
    local = [ip_address(a) for a in ("198.18.0.1", "198.18.1.1", "127.0.0.1")]
    ctx = context_for(Family.V4, options, local, (ip_address("198.18.0.1"),))
    rsp = resolve(service(type="NodePort", ports=({"name": "http", "port": 80,
                                                   "nodePort": 30080},)),
                  eps_slice("s1", [ep("198.18.1.10")]))
    text, _ = full_script([render_base(ctx), render_shard(ctx, S0)],
                          {rsp.key: render_port(rsp, ctx)})
    ext = port_chain("ext", rsp.key, "tcp")
    assert [line for line in text.splitlines() if "nodeport-ips" in line] == [
        f"add set {T4} nodeport-ips {{ type ipv4_addr; }}",
        f"add set ip {S0} nodeport-ips {{ type ipv4_addr; }}",
        f"add rule {T4} unserved-nodeport-check ip daddr @nodeport-ips meta l4proto . "
        "th dport vmap @unserved-nodeports",
        f"add rule ip {S0} nodeports ip daddr @nodeport-ips meta l4proto . th dport "
        "vmap @service-nodeports",
        f"flush set {T4} nodeport-ips",
        f"flush set ip {S0} nodeport-ips",
        f"add element {T4} nodeport-ips {{ 198.18.0.1 }}",
        f"add element ip {S0} nodeport-ips {{ 198.18.0.1 }}",
    ]
    assert f"add element ip {S0} service-nodeports {{ tcp . 30080 : goto {ext} }}" in text
    # The Node shows no address yet: every local address, as upstream.
    every = context_for(Family.V4, options, local, ())
    assert every.nodeport_ips is None
    chains = {c.name: c.rules for c in render_shard(every, S0).chains}
    assert chains["nodeports"][0].startswith("fib daddr type local ")


def test_shards_grow_by_doubling_and_each_port_has_one() -> None:
    assert [shards_for(n) for n in (0, 1000, 1001, 10_000, 50_000, 10**7)] == [
        1, 1, 2, 16, 64, 64]
    rsp = resolve(service(), eps_slice("s1", [ep("198.18.1.10")]))
    objects = render_port(rsp, CIDR4, 16)
    assert objects.table == shard_of(rsp.key, 16)
    tables = {line.split()[3] for line in objects.lines(Family.V4)}
    assert tables == {"sliceproxy", objects.table}  # its shard, and the main table's sets
    spread = {shard_of(rsp.key._replace(name=f"s{i}"), 16) for i in range(200)}
    assert len(spread) == 16


@pytest.mark.usefixtures("chains_of_their_own")
def test_hostile_names_never_leave_the_comment() -> None:
    """Defence in depth: the decoder refuses such names, but whatever reaches the
    renderer stays one printable ASCII comment without quotes or backslashes."""
    rsp = resolve(service(), eps_slice("s1", [ep("198.18.1.10")]))
    evil = 'x"\n add rule ip filter input accept\\ \x00é' + "y" * 300
    hostile = replace(rsp, key=rsp.key._replace(namespace=evil, name=evil, port=evil))
    lines = render_port(hostile, CIDR4).lines(Family.V4)
    for line in lines:
        assert line.isascii() and line.isprintable(), repr(line)
        assert line.count('"') in (0, 2), line
    comments = [m.group(1) for line in lines for m in re.finditer(r'comment "([^"]*)"', line)]
    assert comments and all(len(c) <= 128 for c in comments)


# --- transactions ------------------------------------------------------------------------


@pytest.mark.usefixtures("chains_of_their_own")
def test_partial_script_touches_only_what_changed_and_counts_shared_elements() -> None:
    two_ports = service(ports=({"name": "http", "port": 80}, {"name": "alt", "port": 81}))
    slice_ = eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11")],
                       ports=({"name": "http", "port": 8080}, {"name": "alt", "port": 8081}))
    http = resolve_one(node(), two_ports, slice_, port="http")
    alt = resolve_one(node(), two_ports, slice_, port="alt")
    bases = [render_base(CIDR4), render_shard(CIDR4, S0)]
    objects = {http.key: render_port(http, CIDR4), alt.key: render_port(alt, CIDR4)}
    _text, state = full_script(bases, objects)
    # One port goes: the cluster IP and both endpoints are still another port's.
    text = partial_script(state, {alt.key: None})
    alt_chain = port_chain("svc", alt.key, "tcp")
    mark = parts_text(objects[alt.key].fingerprint)
    assert text.splitlines() == [
        # What stood for it goes with it.
        f"delete element ip {S0} fingerprints {{ {mark} }}",
        f"delete element ip {S0} service-ips {{ 198.18.128.1 . tcp . 81 }}",
        f"flush chain ip {S0} {alt_chain}",
        f"delete chain ip {S0} {alt_chain}",
        # Its counter goes once no rule counts into it.
        f"delete counter ip {S0} {port_chain('cnt', alt.key, 'tcp')}",
    ]
    # Nothing changed: nothing to send.
    assert partial_script(state, {http.key: objects[http.key]}) == ""
    # The last port goes: its shared elements (in the main table) go with it.
    gone = partial_script(state, {http.key: None})
    assert f"delete element {T4} cluster-ips {{ 198.18.128.1 }}" in gone
    assert (f"delete element {T4} hairpin {{ 198.18.1.10 . 198.18.1.10, "
            "198.18.1.11 . 198.18.1.11 }") in gone
    # What is left is the bases' own: their fingerprints.
    assert {k[1] for k, _ in state.owners.elements()} == {FINGERPRINTS} and not state.ports


def test_full_script_deletes_what_our_tables_hold_that_nobody_wants() -> None:
    bases = [render_base(CIDR4), render_shard(CIDR4, S0)]
    text, _state = full_script(bases, {},
                               kernel_chains=[(S0, "svc-OLD"), (S0, "services"),
                                              ("sliceproxy-3", "svc-X")],
                               kernel_sets={(S0, "aff-OLD"): "set", (S0, "service-ips"): "map"},
                               kernel_tables=["sliceproxy", S0, "sliceproxy-3"],
                               kernel_counters=[(S0, "cnt-OLD"), ("sliceproxy-3", "cnt-X")])
    lines = text.splitlines()
    # A shard no longer used goes whole, with whatever it holds.
    assert lines[-5:] == [f"flush chain ip {S0} svc-OLD", f"delete chain ip {S0} svc-OLD",
                          f"delete set ip {S0} aff-OLD", f"delete counter ip {S0} cnt-OLD",
                          "delete table ip sliceproxy-3"]
    assert f"flush map ip {S0} service-ips" in lines


def test_a_full_script_made_as_it_is_read_is_the_same_every_time() -> None:
    """The full sync encodes `full_lines` line by line (never the whole text at once);
    nft's fallback joins it, an error message finds one line by its number."""
    bases = [render_base(CIDR4), render_shard(CIDR4, S0)]
    kernel = {"kernel_chains": [(S0, "svc-OLD")], "kernel_tables": ["sliceproxy", S0]}
    text, _ = full_script(bases, {}, **kernel)  # type: ignore[arg-type]
    script, _ = full_lines(bases, {}, **kernel)  # type: ignore[arg-type]
    assert script.count is None
    assert list(script.lines()) == text.splitlines() and script.count == len(text.splitlines())
    assert script.text() == text
    assert [script.line(n) for n in (1, len(text.splitlines()))] == \
        [text.splitlines()[0], text.splitlines()[-1]]
    assert script.line(len(text.splitlines()) + 1) == ""


@pytest.mark.usefixtures("chains_of_their_own")
def test_a_full_script_adds_only_the_counters_the_kernel_lacks_and_never_flushes_one() -> None:
    rsp = resolve(service(), eps_slice("s1", [ep("198.18.1.10")]))
    bases = [render_base(CIDR4), render_shard(CIDR4, S0)]
    port = port_chain("cnt", rsp.key, "tcp")
    fresh, _ = full_script(bases, {rsp.key: render_port(rsp, CIDR4)})
    assert f"add counter ip {S0} {port}" in fresh.splitlines()
    again, _ = full_script(bases, {rsp.key: render_port(rsp, CIDR4)},
                           kernel_tables=["sliceproxy", S0], kernel_counters=[(S0, port)])
    assert not any(line.split()[:2] in (["add", "counter"], ["flush", "counter"])
                   for line in again.splitlines())
    assert f'counter name "{port}"' in again  # the rules still count into it


def test_a_picked_ports_change_is_elements_alone() -> None:
    """One endpoint replaced: its slot's element (the others keep theirs), its hairpin
    pairs and the port's fingerprint; one more endpoint: the dispatch to the next pick
    chain and the port's elements in the next pick map. No rule, no chain."""
    bases = [render_base(CIDR4), render_shard(CIDR4, S0)]
    pods = ["198.18.1.10", "198.18.1.11", "198.18.1.12"]
    three = resolve(service(), eps_slice("s1", [ep(p) for p in pods]))
    _text, state = full_script(bases, {three.key: render_port(three, CIDR4)})

    def change(addresses: list[str]) -> list[str]:
        rsp = resolve(service(), eps_slice("s1", [ep(p) for p in addresses]))
        new = render_port(rsp, CIDR4, 1, kept_slots(state.ports[rsp.key]))
        lines = partial_script(state, {rsp.key: new}).splitlines()
        assert not any(" rule " in line or " chain " in line for line in lines), lines
        return lines

    lines = change(["198.18.1.10", "198.18.1.13", "198.18.1.12"])
    assert f"delete element ip {S0} eps-tcp-3 {{ 198.18.128.1 . 80 . 1 }}" in lines
    assert f"add element ip {S0} eps-tcp-3 {{ 198.18.128.1 . 80 . 1 : 198.18.1.13 . 8080 }}" \
        in lines
    assert not any(" . 80 . 0" in line or " . 80 . 2" in line for line in lines), lines
    lines = change(["198.18.1.10", "198.18.1.13", "198.18.1.12", "198.18.1.14"])
    assert f"add element ip {S0} service-ips {{ 198.18.128.1 . tcp . 80 : goto pick-4 }}" \
        in lines
    assert any(line.startswith(f"delete element ip {S0} eps-tcp-3 ") for line in lines)
    assert any(line.startswith(f"add element ip {S0} eps-tcp-4 ") for line in lines)


def test_a_picked_ports_fingerprint_is_of_what_its_pick_map_holds() -> None:
    """A picked port's fingerprint spells its pick maps' elements by `picked`: whatever
    those hold, the endpoints' port and their slots, is in it (a restart keeps a port
    whose fingerprint the kernel holds: restart.py)."""
    def picked(port: int, kept: list[str] | None = None) -> render.PortObjects:
        slice_ = eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11")],
                           ports=({"name": "http", "port": port},))
        slots = None if kept is None else \
            {render.pick_map("tcp", 2): [(a, port) for a in kept]}
        return render_port(resolve(service(), slice_), CIDR4, 1, slots)

    first = picked(8080)
    assert first.picked, "not picked"
    assert picked(8080).fingerprint == first.fingerprint
    assert picked(9090).fingerprint != first.fingerprint
    swapped = picked(8080, ["198.18.1.11", "198.18.1.10"])
    assert swapped.slots != first.slots and swapped.fingerprint != first.fingerprint


@pytest.mark.parametrize("shape", ["one", "same address on two ports", "thirty-two", "IPv6"])
def test_a_picked_ports_kept_state_holds_every_element_it_rendered(shape: str) -> None:
    """KeptPort keeps a picked port's pick-map and hairpin elements in a shape of its own
    (`picked`: the hairpins are its values' addresses); read back, they are exactly what
    the port rendered, or a change would leave elements behind or delete others'."""
    family = Family.V6 if shape == "IPv6" else Family.V4
    if shape == "one":
        objects = [service(), eps_slice("s1", [ep("198.18.1.10")])]
    elif shape == "same address on two ports":
        objects = [service(), eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11")]),
                   eps_slice("s2", [ep("198.18.1.10")],
                             ports=({"name": "http", "port": 9090},))]
    elif shape == "thirty-two":
        objects = [service(), eps_slice("s1", [ep(f"198.18.1.{i}") for i in range(10, 42)])]
    else:
        objects = [service(ips=("fd00::10",), ipFamilies=["IPv6"]),
                   eps_slice("s1", [ep("fd00:1::10"), ep("fd00:1::11")], address_type="IPv6")]
    p = render_port(resolve(*objects, family=family), RenderContext(family))
    assert p.slots and p.slots[0][0].startswith(render.PICKS), "not picked"
    assert dict(KeptPort.of(p).elements()) == element_map(p)
    if shape == "same address on two ports":
        assert len(p.slots[0][1]) == 3 and \
            sum(e.set == render.HAIRPIN for e in p.elements) >= 2

"""Golden tests for the iptables renderer: one service port in, readable rules out.

Hashed chain names are shown as <SVC>, <SVL>, <EXT>, <FW> and <SEP ip:port>; every
line is what `iptables-save` prints back (the kernel tests check that spelling).
"""

from __future__ import annotations

import re
from dataclasses import replace
from ipaddress import ip_address, ip_network
from typing import Any

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.context import RenderContext, context_for
from proxy.dataplane.iptables.render import (
    endpoint_chain,
    endpoint_counter,
    port_chain,
    port_counter,
    probability,
    quote,
    render_base,
    render_port,
)
from proxy.dataplane.xtables.saved import Table
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family, ServicePortKey
from tests.unit.builders import NODE, ep, eps_slice, node, resolve_one, service

CIDR4 = RenderContext(Family.V4, local_cidrs=(ip_network("198.18.1.0/24"),))


def pretty(rsp: ResolvedServicePort, ctx: RenderContext = CIDR4, *,
           counted: bool = False, per_endpoint: bool = False) -> list[str]:
    """The port's lines with readable names; the traffic-counting rules (nfacct) left
    out unless `counted` (test_iptables_traffic.py shows them)."""
    rules = render_port(rsp, replace(ctx, traffic_per_endpoint=per_endpoint))
    proto = rsp.port.protocol.value.lower()
    names = {port_chain(kind, rsp.key, proto): f"<{kind}>" for kind in ("SVC", "SVL", "EXT", "FW")}
    names.update({endpoint_chain(rsp.key, proto, str(s.endpoint)): f"<SEP {s.endpoint}>"
                  for s in rsp.endpoints})
    names[port_counter(rsp.key, proto)] = "<COUNT>"
    names.update({endpoint_counter(rsp.key, proto, str(s.endpoint)): f"<COUNT {s.endpoint}>"
                  for s in rsp.endpoints})
    out = []
    for line in rules.lines():
        if not counted and " -m nfacct " in line:
            continue
        for name, label in names.items():
            line = line.replace(name, label)
        out.append(line.replace(' -m comment --comment "', ' "'))
    return out


def resolve(*objects: dict[str, Any], family: Family = Family.V4,
            port: str = "http") -> ResolvedServicePort:
    return resolve_one(node(), *objects, family=family, port=port)


def test_cluster_ip_balances_over_ready_endpoints_with_falling_probabilities() -> None:
    rsp = resolve(service(), eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11"),
                                              ep("198.18.1.12"), ep("198.18.1.13", ready=False)]))
    assert pretty(rsp) == [
        '-t nat -A SPX-SERVICES -d 198.18.128.1/32 -p tcp "ns/svc:http cluster IP" '
        "-m tcp --dport 80 -j <SVC>",
        "-t nat -N <SVC>",
        # Off-cluster clients (not from --cluster-cidr) are masqueraded.
        '-t nat -A <SVC> ! -s 198.18.1.0/24 -d 198.18.128.1/32 -p tcp "ns/svc:http cluster IP" '
        "-m tcp --dport 80 -j SPX-MARK-MASQ",
        '-t nat -A <SVC> "ns/svc:http -> 198.18.1.10:8080" -m statistic --mode random '
        "--probability 0.33333333349 -j <SEP 198.18.1.10:8080>",
        '-t nat -A <SVC> "ns/svc:http -> 198.18.1.11:8080" -m statistic --mode random '
        "--probability 0.50000000000 -j <SEP 198.18.1.11:8080>",
        '-t nat -A <SVC> "ns/svc:http -> 198.18.1.12:8080" -j <SEP 198.18.1.12:8080>',
        "-t nat -N <SEP 198.18.1.10:8080>",
        '-t nat -A <SEP 198.18.1.10:8080> -s 198.18.1.10/32 "ns/svc:http" -j SPX-MARK-MASQ',
        '-t nat -A <SEP 198.18.1.10:8080> -p tcp "ns/svc:http" -m tcp '
        "-j DNAT --to-destination 198.18.1.10:8080",
        "-t nat -N <SEP 198.18.1.11:8080>",
        '-t nat -A <SEP 198.18.1.11:8080> -s 198.18.1.11/32 "ns/svc:http" -j SPX-MARK-MASQ',
        '-t nat -A <SEP 198.18.1.11:8080> -p tcp "ns/svc:http" -m tcp '
        "-j DNAT --to-destination 198.18.1.11:8080",
        "-t nat -N <SEP 198.18.1.12:8080>",
        '-t nat -A <SEP 198.18.1.12:8080> -s 198.18.1.12/32 "ns/svc:http" -j SPX-MARK-MASQ',
        '-t nat -A <SEP 198.18.1.12:8080> -p tcp "ns/svc:http" -m tcp '
        "-j DNAT --to-destination 198.18.1.12:8080",
    ]


def test_no_endpoints_rejects_in_filter_and_writes_no_nat_chain() -> None:
    rsp = resolve(service(ports=({"name": "dns", "port": 53, "protocol": "UDP",
                                  "nodePort": 30053},),
                          type="NodePort", externalIPs=["198.18.0.50"]), port="dns")
    assert pretty(rsp) == [
        '-t filter -A SPX-SERVICES -d 198.18.128.1/32 -p udp "ns/svc:dns has no endpoints" '
        "-m udp --dport 53 -j REJECT --reject-with icmp-port-unreachable",
        '-t filter -A SPX-EXTERNAL-SERVICES -d 198.18.0.50/32 -p udp '
        '"ns/svc:dns has no endpoints" -m udp --dport 53 '
        "-j REJECT --reject-with icmp-port-unreachable",
        '-t filter -A SPX-EXTERNAL-SERVICES -p udp "ns/svc:dns has no endpoints" '
        "-m addrtype --dst-type LOCAL -m udp --dport 30053 "
        "-j REJECT --reject-with icmp-port-unreachable",
    ]


def test_only_terminating_endpoints_are_used_when_nothing_is_ready() -> None:
    draining = ep("198.18.1.10", ready=False, serving=True, terminating=True)
    ready = ep("198.18.1.11")
    with_ready = pretty(resolve(service(), eps_slice("s1", [draining, ready])))
    assert not any("198.18.1.10:8080 ->" in line or "-j <SEP 198.18.1.10:8080>" in line
                   for line in with_ready)
    alone = pretty(resolve(service(), eps_slice("s1", [draining])))
    assert '-t nat -A <SVC> "ns/svc:http -> 198.18.1.10:8080" -j <SEP 198.18.1.10:8080>' in alone


# Pod and node traffic to a port's external addresses, short-circuited to its cluster set
# (upstream's EXT chain): the same three rules whatever the policies.
SHORT_CIRCUIT = [
        '-t nat -A <EXT> -s 198.18.1.0/24 "pod traffic for ns/svc:http external destinations" '
        "-j <SVC>",
        '-t nat -A <EXT> "masquerade LOCAL traffic for ns/svc:http external destinations" '
        "-m addrtype --src-type LOCAL -j SPX-MARK-MASQ",
        '-t nat -A <EXT> "route LOCAL traffic for ns/svc:http external destinations" '
        "-m addrtype --src-type LOCAL -j <SVC>",
]


def test_nodeport_with_local_external_policy_short_circuits_pods_and_the_node() -> None:
    rsp = resolve(
        service(type="NodePort", externalTrafficPolicy="Local",
                ports=({"name": "http", "port": 80, "nodePort": 30080},)),
        eps_slice("s1", [ep("198.18.1.10", node=NODE), ep("198.18.1.11", node="node-b")]))
    lines = pretty(rsp)
    assert lines[:2] == [
        '-t nat -A SPX-SERVICES -d 198.18.128.1/32 -p tcp "ns/svc:http cluster IP" '
        "-m tcp --dport 80 -j <SVC>",
        '-t nat -A SPX-NODEPORTS -p tcp "ns/svc:http" -m tcp --dport 30080 -j <EXT>',
    ]
    ext = [line for line in lines if line.startswith("-t nat -A <EXT>")]
    assert ext == [*SHORT_CIRCUIT, "-t nat -A <EXT> -j <SVL>"]
    # The Local chain holds only this node's endpoint; the Cluster chain both.
    assert [line for line in lines if line.startswith("-t nat -A <SVL>")] == [
        '-t nat -A <SVL> "ns/svc:http -> 198.18.1.10:8080" -j <SEP 198.18.1.10:8080>']
    assert sum(line.startswith("-t nat -A <SVC> \"ns/svc:http ->") for line in lines) == 2


def test_local_external_policy_without_local_endpoint_drops_outside_traffic() -> None:
    rsp = resolve(
        service(type="NodePort", externalTrafficPolicy="Local",
                ports=({"name": "http", "port": 80, "nodePort": 30080},)),
        eps_slice("s1", [ep("198.18.1.11", node="node-b")]))
    lines = pretty(rsp)
    assert ('-t filter -A SPX-EXTERNAL-SERVICES -p tcp "ns/svc:http has no local endpoints" '
            "-m addrtype --dst-type LOCAL -m tcp --dport 30080 -j DROP") in lines
    # The EXT chain still exists for the short-circuits, with no final jump.
    assert [line for line in lines if line.startswith("-t nat -A <EXT>")][-1].endswith(
        "--src-type LOCAL -j <SVC>")


BOTH_LOCAL = service(type="NodePort", internalTrafficPolicy="Local",
                    externalTrafficPolicy="Local", externalIPs=["203.0.113.7"],
                    ports=({"name": "http", "port": 80, "nodePort": 30080},))



def test_both_policies_local_short_circuit_pods_and_the_node_to_the_cluster_chain() -> None:
    # Upstream: cluster IP -> SVL; outside -> EXT -> SVL; pods and the node -> EXT -> SVC.
    lines = pretty(resolve(BOTH_LOCAL, eps_slice("s1", [ep("198.18.1.10", node=NODE),
                                                        ep("198.18.1.11", node="node-b")])))
    assert [line for line in lines if "SPX-SERVICES" in line or "SPX-NODEPORTS" in line] == [
        '-t nat -A SPX-SERVICES -d 198.18.128.1/32 -p tcp "ns/svc:http cluster IP" '
        "-m tcp --dport 80 -j <SVL>",
        '-t nat -A SPX-SERVICES -d 203.0.113.7/32 -p tcp "ns/svc:http external IP" '
        "-m tcp --dport 80 -j <EXT>",
        '-t nat -A SPX-NODEPORTS -p tcp "ns/svc:http" -m tcp --dport 30080 -j <EXT>',
    ]
    assert [line for line in lines if line.startswith("-t nat -A <EXT>")] == [
        *SHORT_CIRCUIT, "-t nat -A <EXT> -j <SVL>"]
    assert [line for line in lines if line.startswith("-t nat -A <SVC>")] == [
        '-t nat -A <SVC> "ns/svc:http -> 198.18.1.10:8080" -m statistic --mode random '
        f"--probability {probability(2)} -j <SEP 198.18.1.10:8080>",
        '-t nat -A <SVC> "ns/svc:http -> 198.18.1.11:8080" -j <SEP 198.18.1.11:8080>',
    ]
    # The cluster-IP masquerade rule belongs to the internal chain, here the Local one.
    assert [line for line in lines if line.startswith("-t nat -A <SVL>")] == [
        '-t nat -A <SVL> ! -s 198.18.1.0/24 -d 198.18.128.1/32 -p tcp '
        '"ns/svc:http cluster IP" -m tcp --dport 80 -j SPX-MARK-MASQ',
        '-t nat -A <SVL> "ns/svc:http -> 198.18.1.10:8080" -j <SEP 198.18.1.10:8080>',
    ]
    assert not [line for line in lines if line.startswith("-t filter")]


def test_both_policies_local_without_local_endpoint_drops_only_what_is_not_short_circuited(
) -> None:
    lines = pretty(resolve(BOTH_LOCAL, eps_slice("s1", [ep("198.18.1.11", node="node-b")])))
    # Cluster-IP traffic and traffic from outside are dropped, in filter (after nat has
    # DNATed whatever the EXT chain short-circuited), not rejected: endpoints exist.
    assert [line for line in lines if line.startswith("-t filter")] == [
        '-t filter -A SPX-SERVICES -d 198.18.128.1/32 -p tcp '
        '"ns/svc:http has no local endpoints" -m tcp --dport 80 -j DROP',
        '-t filter -A SPX-EXTERNAL-SERVICES -d 203.0.113.7/32 -p tcp '
        '"ns/svc:http has no local endpoints" -m tcp --dport 80 -j DROP',
        '-t filter -A SPX-EXTERNAL-SERVICES -p tcp "ns/svc:http has no local endpoints" '
        "-m addrtype --dst-type LOCAL -m tcp --dport 30080 -j DROP",
    ]
    # Pods and the node still reach node-b's endpoint through the external addresses.
    assert [line for line in lines if line.startswith("-t nat -A <EXT>")] == SHORT_CIRCUIT
    assert [line for line in lines if line.startswith("-t nat -A <SVC>")] == [
        '-t nat -A <SVC> "ns/svc:http -> 198.18.1.11:8080" -j <SEP 198.18.1.11:8080>']
    assert "-t nat -N <SVL>" not in lines
    assert not [line for line in lines if line.endswith("-j <SVL>")]


def test_several_cluster_cidrs_in_a_family_all_count_as_pods() -> None:
    options = DataplaneOptions("node-a", cluster_cidrs=(
        ip_network("198.18.1.0/24"), ip_network("198.18.64.0/18"), ip_network("fd00:18:1::/64")))
    v4 = context_for(Family.V4, options)
    assert (Table.NAT, "SPX-MASQ-UNLESS-POD", (
        "-s 198.18.1.0/24 -j RETURN", "-s 198.18.64.0/18 -j RETURN", "-j SPX-MARK-MASQ",
    )) in render_base(v4).chains
    rsp = resolve(service(type="NodePort", externalTrafficPolicy="Local",
                          ports=({"name": "http", "port": 80, "nodePort": 30080},)),
                  eps_slice("s1", [ep("198.18.1.10", node=NODE)]))
    lines = pretty(rsp, v4)
    assert ('-t nat -A <SVC> -d 198.18.128.1/32 -p tcp "ns/svc:http cluster IP" '
            "-m tcp --dport 80 -j SPX-MASQ-UNLESS-POD") in lines
    assert [line for line in lines if "pod traffic" in line] == [
        f'-t nat -A <EXT> -s {c} "pod traffic for ns/svc:http external destinations" -j <SVC>'
        for c in ("198.18.1.0/24", "198.18.64.0/18")]
    # One CIDR in the family: upstream's rules, and no extra chain.
    v6 = context_for(Family.V6, options)
    assert "SPX-MASQ-UNLESS-POD" not in {name for _, name, _ in render_base(v6).chains}


def test_internal_local_policy_without_local_endpoint_drops_cluster_ip_traffic() -> None:
    rsp = resolve(service(internalTrafficPolicy="Local"),
                  eps_slice("s1", [ep("198.18.1.11", node="node-b")]))
    assert pretty(rsp) == [
        '-t filter -A SPX-SERVICES -d 198.18.128.1/32 -p tcp '
        '"ns/svc:http has no local endpoints" -m tcp --dport 80 -j DROP',
    ]


def test_internal_local_policy_sends_cluster_ip_to_the_local_chain() -> None:
    rsp = resolve(service(internalTrafficPolicy="Local"),
                  eps_slice("s1", [ep("198.18.1.10", node=NODE), ep("198.18.1.11", node="x")]))
    lines = pretty(rsp)
    assert lines[0].endswith("-j <SVL>")
    assert "-t nat -N <SVC>" not in lines
    assert [line for line in lines if "-j <SEP" in line] == [
        '-t nat -A <SVL> "ns/svc:http -> 198.18.1.10:8080" -j <SEP 198.18.1.10:8080>']


def test_load_balancer_source_ranges_go_through_a_firewall_chain() -> None:
    lb = service(type="LoadBalancer", loadBalancerSourceRanges=["198.18.0.0/24"],
                 ports=({"name": "http", "port": 80, "nodePort": 30080},))
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.0.200"}]}}
    rsp = resolve(lb, eps_slice("s1", [ep("198.18.1.10")]))
    lines = pretty(rsp)
    assert ('-t nat -A SPX-SERVICES -d 198.18.0.200/32 -p tcp "ns/svc:http loadbalancer IP" '
            "-m tcp --dport 80 -j <FW>") in lines
    assert [line for line in lines if line.startswith("-t nat -A <FW>")] == [
        '-t nat -A <FW> -s 198.18.0.0/24 "ns/svc:http loadbalancer IP" -j <EXT>',
        '-t nat -A <FW> "other traffic to ns/svc:http will be dropped by SPX-FIREWALL"',
    ]
    drop = [line for line in lines if line.startswith("-t filter -A SPX-FIREWALL")]
    assert len(drop) == 1 and drop[0].endswith("--dport 80 -j DROP")
    # A node inside the allowed range may reach its own LB IP (it is the source then).
    ctx = RenderContext(Family.V4, node_ips=(ip_address("198.18.0.1"),))
    assert '-t nat -A <FW> -s 198.18.0.200/32 "ns/svc:http loadbalancer IP" -j <EXT>' in (
        pretty(rsp, ctx))


def test_client_ip_affinity_checks_recent_lists_before_balancing() -> None:
    rsp = resolve(service(sessionAffinity="ClientIP",
                          sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
                  eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11")]))
    lines = pretty(rsp, RenderContext(Family.V4))
    # The recent list of an endpoint is named after its chain.
    assert lines[2] == (
        '-t nat -A <SVC> "ns/svc:http -> 198.18.1.10:8080" -m recent --rcheck --seconds 60 '
        "--reap --name <SEP 198.18.1.10:8080> --mask 255.255.255.255 --rsource "
        "-j <SEP 198.18.1.10:8080>")
    assert lines[4].endswith("--probability 0.50000000000 -j <SEP 198.18.1.10:8080>")
    assert ('-t nat -A <SEP 198.18.1.10:8080> -p tcp "ns/svc:http" -m recent --set '
            "--name <SEP 198.18.1.10:8080> --mask 255.255.255.255 --rsource -m tcp "
            "-j DNAT --to-destination 198.18.1.10:8080") in lines
    # Without --cluster-cidr or --masquerade-all there is no cluster-IP masquerade rule.
    assert not any("cluster IP\" -m tcp --dport 80 -j SPX-MARK-MASQ" in line for line in lines)


def test_ipv6_uses_ip6_masks_brackets_and_icmp6() -> None:
    obj = service(ips=("fd00:198:18::1",), ipFamilies=["IPv6"])
    empty = pretty(resolve(obj, family=Family.V6), RenderContext(Family.V6))
    assert empty == [
        '-t filter -A SPX-SERVICES -d fd00:198:18::1/128 -p tcp "ns/svc:http has no endpoints" '
        "-m tcp --dport 80 -j REJECT --reject-with icmp6-port-unreachable"]
    rsp = resolve(obj, eps_slice("s6", [ep("fd00:18:1::a")], address_type="IPv6"),
                  family=Family.V6)
    lines = pretty(rsp, RenderContext(Family.V6))
    assert ('-t nat -A <SEP [fd00:18:1::a]:8080> -p tcp "ns/svc:http" -m tcp '
            "-j DNAT --to-destination [fd00:18:1::a]:8080") in lines


def test_masquerade_all_marks_every_cluster_ip_packet() -> None:
    rsp = resolve(service(), eps_slice("s1", [ep("198.18.1.10")]))
    lines = pretty(rsp, RenderContext(Family.V4, masquerade_all=True))
    assert lines[2] == ('-t nat -A <SVC> -d 198.18.128.1/32 -p tcp "ns/svc:http cluster IP" '
                        "-m tcp --dport 80 -j SPX-MARK-MASQ")


def test_health_check_node_port_is_accepted_in_filter() -> None:
    rsp = resolve(service(type="LoadBalancer", externalTrafficPolicy="Local",
                          healthCheckNodePort=32000,
                          ports=({"name": "http", "port": 80, "nodePort": 30080},)),
                  eps_slice("s1", [ep("198.18.1.10", node=NODE)]))
    assert ('-t filter -A SPX-NODEPORTS -p tcp "ns/svc:http health check node port" '
            "-m tcp --dport 32000 -j ACCEPT") in pretty(rsp)


def test_base_rules_nodeports_catch_all_follows_nodeport_addresses() -> None:
    every = render_base(context_for(Family.V4, DataplaneOptions("n")))
    assert every.tail == ((Table.NAT, "SPX-SERVICES",
                           '! -d 127.0.0.0/8 -m comment --comment "sliceproxy service nodeports; '
                           'NOTE: this must be the last rule in this chain" '
                           "-m addrtype --dst-type LOCAL -j SPX-NODEPORTS"),)
    options = DataplaneOptions("n", nodeport_addresses=(ip_network("198.18.0.0/24"),))
    node_ips = [ip_address("198.18.0.1"), ip_address("198.18.1.1"), ip_address("127.0.0.1"),
                ip_address("fd00:18::1")]
    some = render_base(context_for(Family.V4, options, node_ips))
    assert [spec.split(" -m")[0] for _, _, spec in some.tail] == ["-d 198.18.0.1/32"]
    # No --nodeport-addresses CIDR of a family means every address of it (as upstream).
    six = render_base(context_for(Family.V6, options, node_ips))
    assert six.tail[0][2].startswith("! -d ::1/128 ")
    # `primary`: the Node's primary address of the family, alone or with the CIDRs.
    primary = DataplaneOptions("n", nodeport_primary=True)
    mine = (ip_address("198.18.1.1"), ip_address("fd00:18::1"))
    for opts, family, want in ((primary, Family.V4, ["-d 198.18.1.1/32"]),
                               (primary, Family.V6, ["-d fd00:18::1/128"]),
                               (replace(options, nodeport_primary=True), Family.V4,
                                ["-d 198.18.0.1/32", "-d 198.18.1.1/32"])):
        tail = render_base(context_for(family, opts, node_ips, mine)).tail
        assert [spec.split(" -m")[0] for _, _, spec in tail] == want


def test_chain_names_are_stable_hashes_of_what_the_chain_is_for() -> None:
    key = ServicePortKey("ns", "svc", "http", Family.V4)
    name = port_chain("SVC", key, "tcp")
    assert name == port_chain("SVC", key._replace(family=Family.V6), "tcp")
    assert name != port_chain("SVC", key._replace(port="https"), "tcp")
    assert name != port_chain("SVC", key, "udp")
    assert name.startswith("SPX-SVC-") and len(name) <= 28
    assert len(endpoint_chain(key, "tcp", "[fd00:18:1::a]:8080")) <= 28


def test_probability_is_spelled_as_the_kernel_prints_it() -> None:
    # Values read back from iptables-save after restoring upstream's "%0.10f" text.
    assert probability(2) == "0.50000000000"
    assert probability(3) == "0.33333333349"
    assert probability(7) == "0.14285714272"


def test_quote_follows_iptables_save() -> None:
    assert quote("abc-1_X") == "abc-1_X"
    assert quote("ns/svc:http") == '"ns/svc:http"'
    assert quote('a"b') == '"a\\"b"'


# Every character iptables-restore must never see raw in a rule: control characters
# (a line break ends the rule and starts another, NUL cuts it), DEL, and non-ASCII (xt_comment
# counts bytes, and we compare what iptables-save prints back as ASCII).
UNSAFE = "".join(map(chr, range(0x20))) + "\x7f\x80\xa0é\u2028\ufeff😀"


def test_quote_never_passes_control_or_non_ascii_characters() -> None:
    for c in UNSAFE:
        text = quote(f"a{c}b")
        assert text == '"a?b"', (c, text)
    assert quote("web\n-A INPUT -j ACCEPT") == '"web?-A INPUT -j ACCEPT"'
    # Escaping still applies next to a replaced character.
    assert quote('"\x00\\') == '"\\"?\\\\"'


def test_hostile_names_reaching_the_renderer_stay_inside_one_safe_comment() -> None:
    """Defence in depth: the decoder refuses such names, but the renderer must be safe
    on its own. A service port whose names hold line breaks, NUL, other control and
    non-ASCII characters renders to restore text that is printable ASCII, replays, and
    whose comments are within xt_comment's 255 bytes."""
    from dataclasses import replace

    from proxy.dataplane.iptables.ruleset import Wanted
    from tests.corpus import pipeline

    rsp = resolve(service(ports=({"name": "http", "port": 80, "nodePort": 30080},),
                          type="NodePort", externalIPs=["198.18.0.20"],
                          sessionAffinity="ClientIP"),
                  eps_slice("s1", [ep("198.18.1.1"), ep("198.18.1.2")]))
    evil = "x\n-A INPUT -j ACCEPT\r\x00\x1b[2J\x7fé\u2028" + "y" * 300
    hostile = replace(rsp, key=rsp.key._replace(namespace=evil, name=evil, port=evil),
                      service=replace(rsp.service, namespace=evil, name=evil),
                      port=replace(rsp.port, name=evil))
    ctx = CIDR4
    rules = render_port(hostile, ctx)
    text = Wanted(render_base(ctx), {hostile.key: rules}).full_restore({}).render()
    assert pipeline.restore_problems(text, Family.V4) == []
    assert "-A INPUT -j ACCEPT\n" not in text and "\x00" not in text
    for line in rules.lines():
        assert line.isascii() and line.isprintable(), repr(line)
        for m in re.finditer(r'--comment "((?:[^"\\]|\\.)*)"', line):
            assert len(m.group(1).replace("\\", "")) <= 255, m.group(1)

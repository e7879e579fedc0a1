"""The IPVS plane's fixed iptables rules and ipset commands (pure text).

Golden text for the rules; restore/cleanup round trips through the iptables plane's
restore simulator (strict like the kernel: jumps need chains, -X needs empty chains).
The same text against the real binaries and kernel: tests/kernel/test_ipvs_netfilter_tools.py.
"""

from __future__ import annotations

from ipaddress import ip_network

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.netfilter import (
    JUMPS,
    cleanup_text,
    ipset_replace,
    ipset_update,
    iptables_rules,
    parse_ipset_save,
    restore_text,
)
from proxy.dataplane.ipvs.render import SetEntry, SetRole
from proxy.dataplane.xtables.saved import parse_save
from proxy.dataplane.xtables.simulate import SimulatedRunner
from proxy.model.types import Family

CIDRS = (ip_network("198.18.1.0/24"), ip_network("198.18.64.0/18"),
         ip_network("fd00:18:1::/64"))


def test_ipv4_rules_with_cluster_cidrs_golden() -> None:
    rules = iptables_rules(Family.V4, DataplaneOptions(node_name="n", cluster_cidrs=CIDRS))
    assert rules["nat"] == [
        "-A SPX-IPVS-SERVICES -p tcp ! --syn -j RETURN",
        "-A SPX-IPVS-SERVICES -s 127.0.0.0/8 -j RETURN",
        "-A SPX-IPVS-SERVICES -m set --match-set SPX-IPVS4-CLUSTER-IP dst,dst "
        "-j SPX-IPVS-CLUSTER-IP",
        "-A SPX-IPVS-CLUSTER-IP -s 198.18.1.0/24 -j RETURN",
        "-A SPX-IPVS-CLUSTER-IP -s 198.18.64.0/18 -j RETURN",
        "-A SPX-IPVS-CLUSTER-IP -j SPX-IPVS-MARK-MASQ",
        "-A SPX-IPVS-SERVICES -m set --match-set SPX-IPVS4-EXT-MASQ dst,dst "
        "-j SPX-IPVS-MARK-MASQ",
        "-A SPX-IPVS-SERVICES -m set --match-set SPX-IPVS4-INSIDE-ONLY dst,dst "
        "-m addrtype --src-type LOCAL -j SPX-IPVS-MARK-MASQ",
        "-A SPX-IPVS-MARK-MASQ -j MARK --or-mark 0x4000",
        "-A SPX-IPVS-POSTROUTING -p tcp ! --syn -j RETURN",
        "-A SPX-IPVS-POSTROUTING -m set --match-set SPX-IPVS4-LOOPBACK dst,dst,src "
        "-j MASQUERADE",
        "-A SPX-IPVS-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A SPX-IPVS-POSTROUTING -j MARK --xor-mark 0x4000",
        "-A SPX-IPVS-POSTROUTING -j MASQUERADE --random-fully",
    ]
    assert rules["filter"] == [
        "-A SPX-IPVS-INPUT -m set --match-set SPX-IPVS4-DROP dst,dst -j DROP",
        "-A SPX-IPVS-INPUT -m set --match-set SPX-IPVS4-INSIDE-ONLY dst,dst "
        "-j SPX-IPVS-INSIDE-ONLY",
        "-A SPX-IPVS-INPUT -m set --match-set SPX-IPVS4-FW dst,dst -j SPX-IPVS-SOURCE-RANGES",
        "-A SPX-IPVS-INPUT -m conntrack --ctstate NEW -m set --match-set SPX-IPVS4-VIPS dst "
        "-m set ! --match-set SPX-IPVS4-SERVICES dst,dst -j REJECT",
        "-A SPX-IPVS-SOURCE-RANGES -m set --match-set SPX-IPVS4-FW-ALLOW dst,dst,src "
        "-j RETURN",
        "-A SPX-IPVS-SOURCE-RANGES -j DROP",
        # External addresses with policy Local and no local endpoint: pods and the node
        # pass (upstream's short-circuit), everyone else is dropped.
        "-A SPX-IPVS-INSIDE-ONLY -s 198.18.1.0/24 -j RETURN",
        "-A SPX-IPVS-INSIDE-ONLY -s 198.18.64.0/18 -j RETURN",
        "-A SPX-IPVS-INSIDE-ONLY -m addrtype --src-type LOCAL -j RETURN",
        "-A SPX-IPVS-INSIDE-ONLY -j DROP",
        "-A SPX-IPVS-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT",
        "-A SPX-IPVS-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    ]


def test_cluster_ip_masquerade_variants() -> None:
    every = iptables_rules(Family.V6, DataplaneOptions(node_name="n", masquerade_all=True,
                                                       cluster_cidrs=CIDRS))["nat"]
    assert ("-A SPX-IPVS-SERVICES -m set --match-set SPX-IPVS6-CLUSTER-IP dst,dst "
            "-j SPX-IPVS-MARK-MASQ") in every
    assert not any("SPX-IPVS-CLUSTER-IP -s" in r for r in every)
    v6 = iptables_rules(Family.V6, DataplaneOptions(node_name="n", cluster_cidrs=CIDRS))["nat"]
    assert "-A SPX-IPVS-CLUSTER-IP -s fd00:18:1::/64 -j RETURN" in v6
    assert "-A SPX-IPVS-SERVICES -s ::1/128 -j RETURN" in v6
    # No cluster CIDR: only the node's own connections (sourced from a service address).
    bare = iptables_rules(Family.V4, DataplaneOptions(node_name="n"))["nat"]
    assert ("-A SPX-IPVS-SERVICES -m set --match-set SPX-IPVS4-CLUSTER-IP src,dst "
            "-j SPX-IPVS-MARK-MASQ") in bare


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
@pytest.mark.parametrize("options", [
    DataplaneOptions(node_name="n", cluster_cidrs=CIDRS),
    DataplaneOptions(node_name="n", cluster_cidrs=CIDRS, masquerade_all=True),
    DataplaneOptions(node_name="n"),
], ids=["cluster-cidrs", "masquerade-all", "no-cluster-cidr"])
def test_a_connection_conntrack_first_saw_midstream_is_never_masqueraded(
        family: Family, options: DataplaneOptions) -> None:
    """Our first rules switch conntrack on where nothing used it (kube-proxy stopped
    before writing its iptables rules): a TCP connection made before then has its first
    packet through the nat table without a SYN. Before any rule that marks or
    masquerades, in each chain a packet enters from a built-in one, such a packet
    returns: masqueraded, it reached its endpoint from the node's address and was reset
    (the handover reset of tests/kernel/test_ipvs_mode_switch.py)."""
    nat = iptables_rules(family, options)["nat"]
    for chain in ("SPX-IPVS-SERVICES", "SPX-IPVS-POSTROUTING"):
        rules = [r for r in nat if r.startswith(f"-A {chain} ")]
        assert rules[0] == f"-A {chain} -p tcp ! --syn -j RETURN", rules
    # The built-in chains enter those two alone; the marking chains are entered from
    # behind the guard only.
    assert {j.target for j in JUMPS if j.table == "nat"} == {
        "SPX-IPVS-SERVICES", "SPX-IPVS-POSTROUTING"}
    for target in ("SPX-IPVS-CLUSTER-IP", "SPX-IPVS-MARK-MASQ"):
        assert {r.split()[1] for r in nat if r.endswith(f"-j {target}")} <= {
            "SPX-IPVS-SERVICES", "SPX-IPVS-CLUSTER-IP"}


def test_without_a_cluster_cidr_only_the_node_passes_inside_only_addresses() -> None:
    # Pods cannot be told from the outside then: dropped, as upstream's iptables mode
    # drops them without a local-traffic detector; the node's own traffic still passes.
    filt = iptables_rules(Family.V4, DataplaneOptions(node_name="n"))["filter"]
    assert [r for r in filt if r.startswith("-A SPX-IPVS-INSIDE-ONLY")] == [
        "-A SPX-IPVS-INSIDE-ONLY -m addrtype --src-type LOCAL -j RETURN",
        "-A SPX-IPVS-INSIDE-ONLY -j DROP",
    ]


def test_restore_adds_each_jump_once_and_cleanup_removes_everything() -> None:
    options = DataplaneOptions(node_name="n", cluster_cidrs=CIDRS)
    runner = SimulatedRunner(Family.V4)
    # Someone else's rules in the same tables stay untouched.
    runner.restore("*nat\n:OTHER - [0:0]\n-A PREROUTING -j OTHER\n-A OTHER -j RETURN\n"
                   "COMMIT\n*filter\n-A INPUT -j ACCEPT\nCOMMIT\n")
    for _ in range(3):
        runner.restore(restore_text(Family.V4, options, parse_save(runner.save())))
    saved_text = runner.save()
    for jump in JUMPS:
        assert saved_text.count(f"-A {jump.chain} {jump.spec()}") == 1, jump
    assert "-A SPX-IPVS-CLUSTER-IP -s 198.18.64.0/18 -j RETURN" in saved_text
    assert saved_text.count("-A SPX-IPVS-MARK-MASQ") == 1  # our chains are rewritten
    # The jumps went to the top of the built-in chains (as upstream prepends them).
    nat = runner.save("nat").splitlines()
    pre = [line for line in nat if line.startswith("-A PREROUTING")]
    assert pre[0].endswith("-j SPX-IPVS-SERVICES") and pre[1] == "-A PREROUTING -j OTHER"

    text = cleanup_text(parse_save(runner.save()))
    runner.restore(text)
    after = runner.save()
    assert "SPX-IPVS" not in after
    assert "-A PREROUTING -j OTHER" in after and "-A INPUT -j ACCEPT" in after
    assert cleanup_text(parse_save(runner.save())) == ""


def test_ipset_replace_swaps_every_set_of_every_family() -> None:
    entries = {SetEntry(SetRole.SERVICES, Family.V4, "198.18.128.10,tcp:80"),
               SetEntry(SetRole.SERVICES, Family.V4, "198.18.0.1,tcp:30080"),
               SetEntry(SetRole.VIPS, Family.V6, "fd00:198:18::10")}
    text = ipset_replace([Family.V4, Family.V6], entries).splitlines()
    assert text[:7] == [
        "create SPX-IPVS4-SERVICES hash:ip,port family inet maxelem 262144 -exist",
        "create SPX-IPVS4-SERVICES-T hash:ip,port family inet maxelem 262144 -exist",
        "flush SPX-IPVS4-SERVICES-T",
        "add SPX-IPVS4-SERVICES-T 198.18.0.1,tcp:30080",
        "add SPX-IPVS4-SERVICES-T 198.18.128.10,tcp:80",
        "swap SPX-IPVS4-SERVICES-T SPX-IPVS4-SERVICES",
        "destroy SPX-IPVS4-SERVICES-T",
    ]
    assert "add SPX-IPVS6-VIPS-T fd00:198:18::10" in text
    assert "create SPX-IPVS6-LOOPBACK hash:ip,port,ip family inet6 maxelem 262144 -exist" in text
    assert sum(1 for line in text if line.startswith("swap ")) == 2 * len(SetRole)
    # Every name fits ipset's 31 characters, temporary ones included.
    assert max(len(line.split()[1]) for line in text) <= 31


def test_ipset_update_adds_then_removes_and_parse_save() -> None:
    add = [SetEntry(SetRole.DROP, Family.V4, "198.18.0.1,tcp:30080")]
    remove = [SetEntry(SetRole.SERVICES, Family.V4, "198.18.128.10,tcp:80")]
    assert ipset_update(add, remove) == (
        "add SPX-IPVS4-DROP 198.18.0.1,tcp:30080 -exist\n"
        "del SPX-IPVS4-SERVICES 198.18.128.10,tcp:80 -exist\n")
    assert ipset_update([], []) == ""
    saved = ("create SPX-IPVS4-SERVICES hash:ip,port family inet hashsize 1024 maxelem 262144\n"
             "add SPX-IPVS4-SERVICES 198.18.0.1,tcp:30080\n"
             "create SPX-IPVS4-DROP hash:ip,port family inet hashsize 1024 maxelem 262144\n")
    assert parse_ipset_save(saved) == {"SPX-IPVS4-SERVICES": ["198.18.0.1,tcp:30080"],
                                       "SPX-IPVS4-DROP": []}

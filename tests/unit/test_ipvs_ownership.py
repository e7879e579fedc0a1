"""Whose IPVS virtual server is it (proxy/dataplane/ipvs/ownership.py): both proxies
program the same keys, so each clean-up may remove only what the other cannot claim."""

from __future__ import annotations

from ipaddress import ip_address

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.diff import KernelDest, KernelService
from proxy.dataplane.ipvs.handover import chains_text
from proxy.dataplane.ipvs.ownership import (
    Claims,
    is_kube_proxys,
    is_ours,
    node_port_claims,
    parse_set_entry,
)
from proxy.dataplane.ipvs.render import RsKey, VsKey
from proxy.dataplane.xtables.saved import parse_save
from proxy.model.types import Family, Protocol
from tests.fakekernel.ipvs import FakeIpvs, FakeLinks, on_fakes
from tests.unit.builders import NODE, ep, eps_slice, model_of, node, service
from tests.unit.test_nodeport_addresses import NODEPORT, SLICES, V4


def key(address: str, port: int = 80, protocol: Protocol = Protocol.TCP) -> VsKey:
    return VsKey(protocol, ip_address(address), port)


VIP, THEIRS_ONLY, NODE_IP = "10.96.0.10", "10.96.0.11", "192.168.1.5"
OURS = Claims(frozenset({ip_address(VIP)}), frozenset({key(VIP), key(NODE_IP, 30080)}))
KUBE = Claims(frozenset({ip_address(VIP), ip_address(THEIRS_ONLY)}),
              ports=frozenset({(Protocol.TCP, 30080)}))
NONE = Claims()


def test_a_key_both_claim_is_neither_clean_ups() -> None:
    shared = [key(VIP), key(NODE_IP, 30080)]
    for k in shared:
        assert not is_ours(k, OURS, {ip_address(VIP)}, KUBE)
        assert not is_kube_proxys(k, OURS.keys, KUBE)


def test_without_kube_proxy_everything_of_ours_is_ours() -> None:
    assert is_ours(key(VIP), OURS, set(), NONE)
    assert is_ours(key(NODE_IP, 30080), OURS, {ip_address(NODE_IP)}, NONE)
    assert is_ours(key(VIP, 81), OURS, set(), NONE)  # a stray port on our address


def test_our_address_on_another_interface_proves_nothing() -> None:
    # Not in our sets, on spx-ipvs0, but also on some other interface of the node.
    assert not is_ours(key(VIP, 81), OURS, {ip_address(VIP)}, NONE)
    assert not is_ours(key(THEIRS_ONLY), OURS, set(), NONE)


def test_kube_proxys_own_are_those_we_do_not_list() -> None:
    assert is_kube_proxys(key(THEIRS_ONLY), OURS.keys, KUBE)
    assert is_kube_proxys(key(VIP, 81), OURS.keys, KUBE)  # our address, not our port
    assert is_kube_proxys(key("192.168.1.6", 30080), OURS.keys, KUBE)  # its NodePort
    assert not is_kube_proxys(key(THEIRS_ONLY, 80, Protocol.UDP), frozenset(),
                              Claims(ports=frozenset({(Protocol.TCP, 80)})))
    assert not is_kube_proxys(key("10.1.1.1"), frozenset(), KUBE)  # nobody's: left


def test_node_port_sets_as_ipset_saves_them() -> None:
    ports, keys = node_port_claims({
        "KUBE-NODE-PORT-TCP": ["30080", "30081"], "KUBE-NODE-PORT-LOCAL-UDP": ["30053"],
        "KUBE-NODE-PORT-SCTP-HASH": ["192.168.1.5,sctp:30090"], "KUBE-CLUSTER-IP": ["x"]})
    assert ports == {(Protocol.TCP, 30080), (Protocol.TCP, 30081), (Protocol.UDP, 30053)}
    assert keys == {key(NODE_IP, 30090, Protocol.SCTP)}
    assert parse_set_entry("fd00::1,udp:53") == key("fd00::1", 53, Protocol.UDP)
    assert parse_set_entry("garbage") is None


SAVED = """*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-ROUTER-SERVICES - [0:0]
:SPX-IPVS-SERVICES - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j SPX-IPVS-SERVICES
-A POSTROUTING -j KUBE-POSTROUTING
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
-A INPUT -j KUBE-FIREWALL
-A FORWARD -j KUBE-FORWARD
COMMIT
"""


def test_kube_proxys_chains_go_and_nobody_elses() -> None:
    text = chains_text(parse_save(SAVED))
    removed = {ln for ln in text.splitlines() if ln.startswith(("-X", "-D"))}
    assert removed == {
        "-X KUBE-SERVICES", "-X KUBE-POSTROUTING", "-X KUBE-FORWARD",
        '-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        "-D POSTROUTING -j KUBE-POSTROUTING", "-D FORWARD -j KUBE-FORWARD"}
    # The kubelet's filter KUBE-FIREWALL, KUBE-MARK-DROP, kube-router's and ours stay.
    assert chains_text(parse_save(SAVED.replace("KUBE-SERVICES", "X").replace(
        "KUBE-POSTROUTING", "Y").replace("KUBE-FORWARD", "Z"))) == ""


def test_no_nodeport_on_kube_proxys_service_addresses() -> None:
    """Between the switch and kube-proxy's clean-up, kube-ipvs0's addresses are local,
    but they are service addresses: a NodePort there would outlive the switch as ours."""
    # kube-proxy's dummy interface (index 3) still holds a cluster IP.
    links = FakeLinks([(1, ip_address(V4)), (3, ip_address("10.96.0.10"))], kube_ipvs0=3)
    dp = on_fakes(DataplaneOptions(NODE, families=(Family.V4,)), links=links)
    dp.sync(model_of(node(), NODEPORT, *SLICES).resolve(), full=True)
    assert {str(k) for k in dp._servers.believed if k.port == 30080} == {f"TCP {V4}:30080"}


def test_the_first_sync_over_kube_proxys_table_asks_ipvs_for_nothing() -> None:
    """The switch from kube-proxy: its virtual server for a cluster IP (its address on
    kube-ipvs0) is the one we render, with the same real servers at weight 1 and the
    same scheduler. Our first sync takes it over as it is: no virtual server made
    again or edited, no real server removed, re-added or reweighted, since any of those
    could end or refuse a connection made through kube-proxy's."""
    vip = "198.18.128.60"
    svc = service(ips=(vip,))
    slice_ = eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11")])
    vs = key(vip)
    held = {vs: KernelService(vs, "rr", 0, 0, {
        RsKey(ip_address(a), 8080): KernelDest(1) for a in ("198.18.1.10", "198.18.1.11")})}
    ipvs = FakeIpvs(held)
    links = FakeLinks([(1, ip_address(V4)), (3, ip_address(vip))], kube_ipvs0=3)
    dp = on_fakes(DataplaneOptions(NODE, families=(Family.V4,)), ipvs, links)
    dp.sync(model_of(node(), svc, slice_).resolve(), full=True)
    assert ipvs.ops == []
    assert dp._servers.believed == held

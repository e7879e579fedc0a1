"""`--nodeport-addresses primary`: the node's primary addresses read from its Node object
(upstream's GetNodeHostIPs), `primary` alone or among CIDRs, nftables mode's default,
the flag and kube-proxy's file, the snapshot carrying the addresses, and every mode
following a change of them (iptables through its simulated kernel, IPVS over fake
kernel handles; the nftables and iptables renderers' golden cases are in their own
files)."""

from __future__ import annotations

import logging
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest

from proxy.agent.nodeport_warnings import PrimaryAddressWarnings, warn_unset
from proxy.config.options import ConfigError, parse_args
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.context import context_for
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.ipvs.render import IpvsContext
from proxy.dataplane.xtables.saved import Table, parse_save
from proxy.dataplane.xtables.simulate import SimulatedRunner
from proxy.kube.decode import decode_node
from proxy.kube.ingest import apply_object
from proxy.model.nodeport_addresses import (
    EVERY_ADDRESS,
    listen_view,
    nodeport_cidrs,
    primary_ips,
    unrestricted_by_primary,
)
from proxy.model.types import Family, IPAddress, NodeAddress
from proxy.model.view import node_view
from tests.fakekernel.ipvs import FakeIpvs, FakeLinks, on_fakes
from tests.unit.builders import NODE, ep, eps_slice, model_of, node, service

V4, V4B, V6, V6B = "198.18.0.1", "198.18.1.1", "fd00:18::1", "fd00:18:1::1"
INTERNAL, EXTERNAL = "InternalIP", "ExternalIP"
NODE_IPS = [ip_address(a) for a in (V4, V4B, V6, V6B, "127.0.0.1", "::1")]
NODEPORT = service(type="NodePort", ips=("198.18.128.1", "fd00:198:18::1"),
                   ipFamilies=["IPv4", "IPv6"],
                   ports=({"name": "http", "port": 80, "nodePort": 30080},))
SLICES = (eps_slice("s4", [ep("198.18.1.10")]),
          eps_slice("s6", [ep("fd00:18:1::10")], address_type="IPv6"))


def ips(*texts: str) -> tuple[IPAddress, ...]:
    return tuple(ip_address(t) for t in texts)


def addresses(*pairs: tuple[str, str]) -> tuple[NodeAddress, ...]:
    return tuple(NodeAddress(t, ip_address(a)) for t, a in pairs)


# --- the node's primary addresses ---------------------------------------------------------

@pytest.mark.parametrize(("listed", "primary"), [
    pytest.param([], (), id="no address"),
    pytest.param([(INTERNAL, V4)], (V4,), id="one InternalIP"),
    pytest.param([(EXTERNAL, V4B), (INTERNAL, V4)], (V4,), id="InternalIP before ExternalIP"),
    pytest.param([(INTERNAL, V4), (INTERNAL, V4B)], (V4,), id="the first of a family"),
    pytest.param([(INTERNAL, V6), (INTERNAL, V4)], (V6, V4), id="the first decides the family"),
    pytest.param([(INTERNAL, V4), (EXTERNAL, V6)], (V4, V6),
                 id="the other family from an ExternalIP"),
    pytest.param([(EXTERNAL, V6)], (V6,), id="only an ExternalIP"),
])
def test_primary_addresses_as_upstream_reads_them(listed: list[tuple[str, str]],
                                                  primary: tuple[str, ...]) -> None:
    assert primary_ips(addresses(*listed)) == ips(*primary)


def test_decoding_keeps_the_ip_addresses_in_order_and_records_the_bad_ones() -> None:
    obj = node(addresses=[("Hostname", "node-a"), (EXTERNAL, V6), (INTERNAL, "198.18.0.300"),
                          (INTERNAL, "198.018.000.001"), ("InternalDNS", "node-a.test")])
    decoded, skips = decode_node(obj)
    assert decoded is not None
    assert decoded.addresses == addresses((EXTERNAL, V6), (INTERNAL, V4))
    assert [(s.reason, s.part) for s in skips] == [
        ("invalid-ip", "status.addresses[2]"), ("non-canonical-ip", "status.addresses[3]")]
    # A broken status costs the addresses, never the Node's labels (its zone).
    broken, skips = decode_node({**node(), "status": {"addresses": "198.18.0.1"}})
    assert broken is not None and broken.zone == "zone-a" and broken.addresses == ()
    assert [s.reason for s in skips] == ["malformed"]


# --- the rule ----------------------------------------------------------------------------

def test_primary_alone_among_cidrs_and_without_an_address_of_a_family() -> None:
    primary = ips(V4, V6)
    assert nodeport_cidrs((), True, primary) == (ip_network(f"{V4}/32"),
                                                 ip_network(f"{V6}/128"))
    cidrs = (ip_network("198.18.5.0/24"),)
    assert nodeport_cidrs(cidrs, True, ips(V4)) == (*cidrs, ip_network(f"{V4}/32"))
    assert nodeport_cidrs(cidrs, False, primary) == cidrs
    # A loopback primary address is left out (upstream: "can't determine the node's IP").
    assert nodeport_cidrs((), True, ips("127.0.0.1")) == ()
    # No address of a family and no CIDR of it: that family stays open, as upstream.
    assert unrestricted_by_primary((), True, ips(V4)) == (Family.V6,)
    assert unrestricted_by_primary((), True, ()) == (Family.V4, Family.V6)
    assert unrestricted_by_primary((ip_network("fd00:18::/64"),), True, ips(V4)) == ()
    assert unrestricted_by_primary((), False, ()) == ()
    assert listen_view((), True, ips(V4)) == {
        "nodeport_addresses": ["primary"], "IPv4": [f"{V4}/32"], "IPv6": EVERY_ADDRESS}


def test_every_mode_selects_the_primary_address_among_the_nodes() -> None:
    options = DataplaneOptions(NODE, nodeport_primary=True)
    assert context_for(Family.V4, options, NODE_IPS, ips(V4)).nodeport_ips == ips(V4)
    assert context_for(Family.V6, options, NODE_IPS, ips(V4)).nodeport_ips is None
    assert context_for(Family.V4, options, NODE_IPS, ()).nodeport_ips is None
    mixed = DataplaneOptions(NODE, nodeport_addresses=(ip_network("198.18.1.0/24"),),
                             nodeport_primary=True)
    assert context_for(Family.V4, mixed, NODE_IPS, ips(V4)).nodeport_ips == ips(V4, V4B)
    ipvs = IpvsContext.build(options, NODE_IPS, ips(V4, V6))
    assert ipvs.nodeport_addresses == ips(V4, V6)
    assert IpvsContext.build(options, NODE_IPS, ()).nodeport_addresses == ips(V4, V4B, V6, V6B)


# --- the flag, its default, kube-proxy's file ------------------------------------------------

def test_the_flag_takes_primary_alone_or_among_cidrs() -> None:
    base = ["--hostname-override", "n"]
    cfg = parse_args([*base, "--nodeport-addresses", "primary"])
    assert (cfg.nodeport_addresses, cfg.nodeport_primary) == ((), True)
    cfg = parse_args([*base, "--nodeport-addresses", "198.18.5.0/24,primary"])
    assert (cfg.nodeport_addresses, cfg.nodeport_primary) == (
        (ip_network("198.18.5.0/24"),), True)
    assert cfg.as_dict()["nodeport-addresses"] == ["primary", "198.18.5.0/24"]
    with pytest.raises(ConfigError, match=r"--nodeport-addresses: 'Primary' is not a CIDR"):
        parse_args([*base, "--nodeport-addresses", "Primary"])


@pytest.mark.parametrize(("argv", "primary", "cidrs"), [
    (["--proxy-mode", "nftables"], True, ()),
    (["--proxy-mode", "nftables", "--nodeport-addresses", "0.0.0.0/0,::/0"], False,
     (ip_network("0.0.0.0/0"), ip_network("::/0"))),
    (["--proxy-mode", "iptables"], False, ()),
    (["--proxy-mode", "ipvs"], False, ()),
])
def test_nftables_mode_defaults_to_primary_as_upstream(argv: list[str], primary: bool,
                                                       cidrs: tuple[Any, ...]) -> None:
    cfg = parse_args(["--hostname-override", "n", *argv])
    assert (cfg.nodeport_primary, cfg.nodeport_addresses) == (primary, cidrs)


def test_kube_proxys_file_takes_primary(tmp_path: Path) -> None:
    path = tmp_path / "kube-proxy.yaml"
    path.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"
                    "kind: KubeProxyConfiguration\nmode: ipvs\n"
                    "nodePortAddresses: [primary]\n")
    cfg = parse_args(["--config", str(path), "--hostname-override", "n"])
    assert (cfg.proxy_mode, cfg.nodeport_primary, cfg.nodeport_addresses) == ("ipvs", True, ())
    path.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"
                    "kind: KubeProxyConfiguration\nmode: nftables\n")
    assert parse_args(["--config", str(path), "--hostname-override", "n"]).nodeport_primary


def test_unset_in_iptables_mode_gets_upstreams_hint(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="proxy.agent"):
        warn_unset(parse_args(["--hostname-override", "n"]))
        warn_unset(parse_args(["--hostname-override", "n", "--proxy-mode", "nftables"]))
    assert [r.getMessage() for r in caplog.records] == [
        "nodePortAddresses is unset: NodePorts accept connections on every local address; "
        "consider --nodeport-addresses primary"]


# --- the model, the snapshot, a re-render -------------------------------------------------

def test_an_address_change_asks_for_a_sync_that_carries_the_new_addresses() -> None:
    model = model_of(node(addresses=[(INTERNAL, V4)]), NODEPORT, *SLICES)
    first = model.resolve()
    assert first.primary_ips == ips(V4) and not model.has_dirty
    apply_object(model, node(addresses=[(INTERNAL, V4)], zone="zone-a"))
    assert not model.has_dirty  # the same addresses: nothing to do
    apply_object(model, node(addresses=[(INTERNAL, V4B), (INTERNAL, V6)]))
    assert model.has_dirty and model.dirty == frozenset()  # no service port changed
    second = model.resolve()
    assert second.primary_ips == ips(V4B, V6) and second.changed == frozenset()
    assert second.changed_since(first) == frozenset()  # the ports are the same objects
    view = node_view(model.node_view, model.node, ((), True))
    assert view["primary_ips"] == [V4B, V6]
    assert view["addresses"] == [{"type": INTERNAL, "address": V4B},
                                 {"type": INTERNAL, "address": V6}]
    assert view["nodeports"]["IPv6"] == [f"{V6}/128"]


EMPTY = ("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
         ":POSTROUTING ACCEPT [0:0]\nCOMMIT\n*filter\n:INPUT ACCEPT [0:0]\n"
         ":FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n")


def nodeport_catch_all(runner: SimulatedRunner) -> list[str]:
    """The destinations of the nat rules that send node-addressed packets to NodePorts."""
    rules = runner.kernel[Table.NAT].get("SPX-SERVICES", [])
    return [r.split(" -m")[0] for r in rules if r.endswith("-j SPX-NODEPORTS")]


def test_iptables_follows_the_nodes_new_primary_address_at_once() -> None:
    runners = {f: SimulatedRunner(f, parse_save(EMPTY)) for f in Family}
    dp = IptablesDataPlane(DataplaneOptions(NODE, nodeport_primary=True), runners=runners,
                           addresses=lambda: NODE_IPS, clear_conntrack=False)
    model = model_of(node(addresses=[(INTERNAL, V4)]), NODEPORT, *SLICES)
    dp.sync(model.resolve(), full=True)
    assert nodeport_catch_all(runners[Family.V4]) == [f"-d {V4}/32"]
    assert nodeport_catch_all(runners[Family.V6]) == ["! -d ::1/128"]  # no IPv6 address yet
    apply_object(model, node(addresses=[(INTERNAL, V4B), (EXTERNAL, V6)]))
    report = dp.sync(model.resolve())  # a change sync: rewritten whole, as it must be
    assert report.full
    assert nodeport_catch_all(runners[Family.V4]) == [f"-d {V4B}/32"]
    assert nodeport_catch_all(runners[Family.V6]) == [f"-d {V6}/128"]


def test_ipvs_follows_the_nodes_new_primary_address_at_once() -> None:
    ipvs = FakeIpvs()
    dp = on_fakes(DataplaneOptions(NODE, nodeport_primary=True, families=(Family.V4,)), ipvs,
                  FakeLinks([(1, ip_address(V4)), (2, ip_address(V4B))]))
    model = model_of(node(addresses=[(INTERNAL, V4)]), NODEPORT, *SLICES)
    dp.sync(model.resolve(), full=True)
    nodeports = {str(k) for k in dp._servers.believed if k.port == 30080}
    assert nodeports == {f"TCP {V4}:30080"}
    apply_object(model, node(addresses=[(INTERNAL, V4B)]))
    ipvs.ops.clear()
    assert dp.sync(model.resolve()).full
    assert {str(k) for k in dp._servers.believed if k.port == 30080} == {f"TCP {V4B}:30080"}
    assert f"add-service TCP {V4B}:30080 rr" in ipvs.ops


def test_a_family_primary_leaves_open_is_named_once_when_a_nodeport_needs_it(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = parse_args(["--hostname-override", NODE, "--nodeport-addresses", "primary"])
    warnings = PrimaryAddressWarnings(cfg)
    model = model_of(node(addresses=[(INTERNAL, V4)]), *SLICES)
    with caplog.at_level(logging.INFO, logger="proxy.agent"):
        state = model.resolve()
        warnings.check(state, state.changed)  # no NodePort yet: nothing to say
        apply_object(model, NODEPORT)
        state = model.resolve()
        warnings.check(state, state.changed)
        warnings.check(state, state.changed)  # said once
        apply_object(model, node(addresses=[(INTERNAL, V4), (INTERNAL, V6)]))
        state = model.resolve()
        warnings.check(state, state.changed)
    said = [(r.levelname, r.getMessage(), getattr(r, "family", None)) for r in caplog.records]
    assert said == [
        ("WARNING", "nodePortAddresses primary: the Node has no address of this family, so "
                    "its NodePorts accept connections on every local address", "IPv6"),
        ("INFO", "the Node now has an address of this family: its NodePorts accept "
                 "connections on that address only", "IPv6")]
    assert caplog.records[0].node == NODE  # type: ignore[attr-defined]

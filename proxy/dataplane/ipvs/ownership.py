"""Whose IPVS virtual server is it: ours, kube-proxy's, or nobody's we can prove.

A virtual server is keyed by protocol, address and port only, and kube-proxy's IPVS mode
programs the very keys we program (the same cluster IPs, NodePorts on the same node
addresses). The kernel records no owner, so ownership is read from what each proxy keeps
beside its virtual servers:

- kube-proxy puts every cluster, external and load-balancer IP it serves on its dummy
  interface `kube-ipvs0`, and lists its NodePorts (ports only, for TCP and UDP; address
  and port for SCTP) in its `KUBE-NODE-PORT-*` ipsets;
- we put ours on `spx-ipvs0` and list every virtual server in our SERVICES ipsets.

The rules (`is_ours`, `is_kube_proxys`) give a key to one side only when the other side
has no claim on it; a key both claim (a cluster IP:port while both dummy interfaces hold
the address, during a switch) belongs to neither clean-up: the proxy running afterwards
programs it. Pure, but for `read_claims`, which reads the kernel in the caller's thread's
network namespace.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from ipaddress import ip_address

from proxy.dataplane.common.kube_proxy_objects import IPVS_INTERFACE, ipvs_set_names
from proxy.dataplane.ipvs.kernel import Ipsets, Links
from proxy.dataplane.ipvs.netfilter import parse_ipset_save
from proxy.dataplane.ipvs.render import (
    DUMMY_INTERFACE,
    SetRole,
    VsKey,
    set_name,
    usable_node_address,
)
from proxy.model.types import Family, IPAddress, Protocol


def _protocol(set_name: str) -> Protocol:
    return next(p for p in Protocol if f"-{p.value}" in set_name)


# kube-proxy's NodePort sets (both families'), by the protocol of the ports they list.
KUBE_NODE_PORT_SETS = {name: _protocol(name) for name in ipvs_set_names()
                       if "NODE-PORT-" in name}


@dataclass(frozen=True, slots=True)
class Claims:
    """What one proxy keeps beside its virtual servers: the addresses on its dummy
    interface, the virtual servers its ipsets list, and (kube-proxy) NodePorts by
    protocol and port."""

    addresses: frozenset[IPAddress] = frozenset()
    keys: frozenset[VsKey] = frozenset()
    ports: frozenset[tuple[Protocol, int]] = frozenset()

    def claims(self, key: VsKey) -> bool:
        return (key.address in self.addresses or key in self.keys
                or (key.protocol, key.port) in self.ports)


def is_ours(key: VsKey, ours: Claims, other_addresses: Collection[IPAddress],
            kube_proxy: Claims) -> bool:
    """Ours to delete: listed in our sets, or on our dummy interface's address where no
    other interface of the node (kube-ipvs0 included) holds that address; and never a
    key kube-proxy claims."""
    if kube_proxy.claims(key):
        return False
    return key in ours.keys or (key.address in ours.addresses
                                and key.address not in other_addresses)


def is_kube_proxys(key: VsKey, our_keys: Collection[VsKey], kube_proxy: Claims) -> bool:
    """kube-proxy's to delete: it claims the key and our SERVICES sets, which list every
    virtual server we program, do not (the address alone proves nothing: a port we do
    not serve on a cluster IP we do is kube-proxy's)."""
    return kube_proxy.claims(key) and key not in our_keys


def node_port_claims(sets: dict[str, list[str]]) -> tuple[set[tuple[Protocol, int]],
                                                           set[VsKey]]:
    """kube-proxy's NodePorts from its `KUBE-NODE-PORT-*` sets as `ipset save` lists
    them: (protocol, port) from the port bitmaps, keys from the SCTP hash sets."""
    ports: set[tuple[Protocol, int]] = set()
    keys: set[VsKey] = set()
    for name, protocol in KUBE_NODE_PORT_SETS.items():
        for entry in sets.get(name, ()):
            if entry.isdigit():
                ports.add((protocol, int(entry)))
                continue
            key = parse_set_entry(entry)
            if key is not None:
                keys.add(key)
    return ports, keys


def parse_set_entry(entry: str) -> VsKey | None:
    """`10.96.0.1,tcp:443` (a hash:ip,port entry) as a key; None if it is not one."""
    try:
        address, rest = entry.rsplit(",", 1)
        proto, port = rest.split(":", 1)
        return VsKey(Protocol(proto.upper()), ip_address(address), int(port))
    except ValueError:
        return None


def addresses_of(table: Iterable[tuple[int, IPAddress]], index: int | None) -> frozenset[IPAddress]:
    """The service addresses on interface `index` (None: no such interface)."""
    return frozenset(a for i, a in table if index is not None and i == index
                     and usable_node_address(a))


@dataclass(frozen=True, slots=True)
class NodeClaims:
    """Both proxies' claims on this node, and the addresses of every interface but
    ours (`Claims.addresses` of `ours` are spx-ipvs0's)."""

    ours: Claims
    kube_proxy: Claims
    other_addresses: frozenset[IPAddress]


def read_set_keys(ipsets: Ipsets, names: Iterable[str]) -> set[VsKey]:
    keys: set[VsKey] = set()
    for name in names:
        for entry in parse_ipset_save(ipsets.save(name)).get(name, []):
            key = parse_set_entry(entry)
            if key is not None:
                keys.add(key)
    return keys


def read_claims(links: Links, ipsets: Ipsets, dummy_interface: str = DUMMY_INTERFACE
                ) -> NodeClaims:
    """Both proxies' claims as the kernel has them now: two interface lookups, one
    address dump, and `ipset save` of our SERVICES sets and of kube-proxy's NodePort
    sets that exist."""
    table = links.address_table()
    ours_index = links.index(dummy_interface)
    kube_index = links.index(IPVS_INTERFACE)
    present = set(ipsets.names())
    ports, kube_keys = node_port_claims(parse_ipset_save("".join(
        ipsets.save(name) for name in KUBE_NODE_PORT_SETS if name in present)))
    ours = Claims(addresses_of(table, ours_index), frozenset(read_set_keys(
        ipsets, (set_name(SetRole.SERVICES, family) for family in Family))))
    kube = Claims(addresses_of(table, kube_index), frozenset(kube_keys), frozenset(ports))
    return NodeClaims(ours, kube, frozenset(a for i, a in table if i != ours_index))

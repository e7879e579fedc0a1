"""Which node addresses accept NodePort traffic: `--nodeport-addresses` (CIDRs, the word
`primary`, or both) and the node's primary addresses, read from its Node object. Pure;
every mode, the health-check node ports and the debug dump take the rule from here.

Upstream (kubernetes `pkg/util/node` GetNodeHostIPs, `cmd/kube-proxy/app/server.go`,
`pkg/proxy/util/nodeport_addresses.go`): the node's primary addresses are its first
InternalIP, else its first ExternalIP, and the first address of the other family in the
same order; `primary` stands for them as host CIDRs (a loopback one left out). A family
with no CIDR, or one that matches everything, accepts NodePorts on every local address,
so `primary` on a node whose Node shows no address of a family leaves that family open
on every address, as upstream does. Upstream reads the Node once at start, waiting up
to 30 s for it to have an address (its newest releases exit, to be restarted, when the
addresses change: kubernetes PR 138183); sliceproxy follows the Node as it changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import ip_network
from typing import Any

from proxy.model.types import Family, IPAddress, IPNetwork, NodeAddress

PRIMARY = "primary"
INTERNAL_IP, EXTERNAL_IP = "InternalIP", "ExternalIP"
EVERY_ADDRESS = "every local address"


def parse(items: Iterable[Any]) -> tuple[tuple[IPNetwork, ...], bool]:
    """(CIDRs, whether `primary` was given) from `--nodeport-addresses` values; blanks are
    skipped. ValueError names the first value that is neither (upstream's newest releases
    take `primary` among CIDRs; older ones only alone)."""
    cidrs: list[IPNetwork] = []
    primary = False
    for item in (str(i).strip() for i in items):
        if item == PRIMARY:
            primary = True
        elif item:
            try:
                cidrs.append(ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"{item!r} is not a CIDR (e.g. 198.18.0.0/16) or "
                                 f"{PRIMARY!r}") from None
    return tuple(cidrs), primary


def spelled(cidrs: Iterable[IPNetwork], primary: bool) -> list[str]:
    """The setting as an operator writes it: `primary` first, then the CIDRs."""
    return ([PRIMARY] if primary else []) + [str(c) for c in cidrs]


def primary_ips(addresses: Iterable[NodeAddress]) -> tuple[IPAddress, ...]:
    """The node's primary address and its first of the other family, if any: InternalIP
    addresses before ExternalIP ones, each in the Node's order (GetNodeHostIPs)."""
    listed = list(addresses)
    ordered = [a.address for t in (INTERNAL_IP, EXTERNAL_IP) for a in listed if a.type == t]
    if not ordered:
        return ()
    first = ordered[0]
    other = next((ip for ip in ordered if ip.version != first.version), None)
    return (first,) if other is None else (first, other)


def nodeport_cidrs(cidrs: Iterable[IPNetwork], primary: bool,
                   node_primary: Iterable[IPAddress]) -> tuple[IPNetwork, ...]:
    """The CIDRs NodePorts accept on: `cidrs`, and with `primary` each primary address
    as a host CIDR (a loopback one left out, as upstream)."""
    out = tuple(cidrs)
    if primary:
        out += tuple(ip_network(ip) for ip in node_primary if not ip.is_loopback)
    return out


def of_family(family: Family, cidrs: Iterable[IPNetwork]) -> tuple[IPNetwork, ...] | None:
    """`cidrs` of `family`; None means every local address of the family: no CIDR of it
    (a list of IPv6 CIDRs says nothing about IPv4), or one that matches everything."""
    mine = tuple(c for c in cidrs if Family.of(c) is family)
    if not mine or any(c.prefixlen == 0 for c in mine):
        return None
    return mine


def unrestricted_by_primary(cidrs: Iterable[IPNetwork], primary: bool,
                            node_primary: Iterable[IPAddress]) -> tuple[Family, ...]:
    """The families `primary` was meant to restrict but cannot, the Node having no
    (non-loopback) address of them and no CIDR of them being given: their NodePorts
    accept on every local address."""
    if not primary:
        return ()
    given = tuple(cidrs)
    have = {Family.of(ip) for ip in node_primary if not ip.is_loopback}
    return tuple(f for f in Family if f not in have
                 and not any(Family.of(c) is f for c in given))


def listen_view(cidrs: Iterable[IPNetwork], primary: bool,
                node_primary: Iterable[IPAddress]) -> dict[str, Any]:
    """What NodePorts listen on, for explain and the debug dump: the setting, and per
    family the CIDRs whose local addresses accept them, or EVERY_ADDRESS."""
    given, ips = tuple(cidrs), tuple(node_primary)
    effective = nodeport_cidrs(given, primary, ips)
    out: dict[str, Any] = {"nodeport_addresses": spelled(given, primary)}
    for family in Family:
        mine = of_family(family, effective)
        out[family.label] = EVERY_ADDRESS if mine is None else [str(c) for c in mine]
    return out

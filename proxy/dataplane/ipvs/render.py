"""IPVS rendering (pure): a service port -> virtual servers, dummy-interface addresses
and ipset entries.

One `ResolvedServicePort` becomes one `PortRules`: a virtual server per address the
port is reachable on (its cluster IPs, externalIPs, load-balancer IPs, and the node's
addresses at its NodePort), each with a real server per selected endpoint; the
addresses to put on our dummy interface; and the ipset entries that drive the small,
fixed set of iptables rules (`proxy.dataplane.ipvs.netfilter`) for what IPVS cannot
express: masquerading, Local-policy drops, source ranges, hairpin traffic.

Following upstream's IPVS proxier (pkg/proxy/ipvs/proxier.go). Traffic policy Local:
- cluster IP with internalTrafficPolicy Local: the local set; none here (but endpoints
  elsewhere) -> the filter drops the traffic, as upstream's iptables and nftables modes
  (upstream's IPVS mode gives it the cluster set when the port is also reachable from
  outside: on purpose unlike that);
- NodePort, externalIPs, LB IPs with externalTrafficPolicy Local: the local set while
  there is one. IPVS chooses by destination only, so pods and the node get it too
  (upstream's IPVS mode does the same; its iptables mode short-circuits them to the
  cluster set). With no local endpoint, the virtual server gets the cluster set, as in
  upstream's IPVS mode, so pods and the node reach the service (upstream's short-
  circuit), while the filter drops traffic from outside the cluster CIDRs (upstream's
  IPVS mode lets it through to remote endpoints unmasqueraded, whose replies the client
  discards) and the node's own connections are masqueraded so replies come back here.

Also on purpose, unlike upstream (docs/upstream-differences.md says why):
- NodePort bookkeeping uses exact node-address:port entries (hash:ip,port) instead of
  upstream's bitmap:port sets, so one set covers every protocol and a node address
  outside --nodeport-addresses is not matched.
"""

from __future__ import annotations

import enum
import socket
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from ipaddress import IPv6Address
from typing import NamedTuple

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.context import nodeport_cidrs_for, nodeport_selection
from proxy.dataplane.modes import IPVS
from proxy.model.snapshot import (
    DesiredState,
    EndpointDelta,
    ResolvedServicePort,
    SelectedEndpoint,
)
from proxy.model.types import (
    Balancing,
    Family,
    IPAddress,
    IPNetwork,
    Protocol,
    ServicePortKey,
    TrafficPolicy,
    format_endpoint,
)

# The dummy interface holding every service address we program (upstream: kube-ipvs0);
# declared with the mode (modes.py), where another mode's leftovers' probe reads it.
DUMMY_INTERFACE = IPVS.markers.dummy_interface

# Virtual-server flags (include/uapi/linux/ip_vs.h).
FLAG_PERSISTENT = 0x0001
FLAG_HASHED = 0x0002  # set by the kernel on every service; never ours to compare
# "mh-fallback" / "sh-fallback": a flow whose slot holds a real server at weight 0 (one
# draining) is hashed on to an available one, rather than refused: both schedulers keep
# a weight-0 real server's slots (mh keeps its last weight, sh deals it a bucket).
FLAG_SCHED1 = 0x0008
FLAG_SCHED2 = 0x0010  # "mh-port": the mh scheduler also hashes the source port (upstream)
OUR_FLAGS = FLAG_PERSISTENT | FLAG_SCHED1 | FLAG_SCHED2
# Schedulers whose table follows the order of the kernel's list of real servers: the
# plane keeps that list in one canonical order (order.py), so every node agrees.
ORDERED_SCHEDULERS = frozenset({"mh", "sh"})

# Every real server gets weight 1 (upstream); 0 means "draining".
WEIGHT = 1

IPPROTO = {Protocol.TCP: socket.IPPROTO_TCP, Protocol.UDP: socket.IPPROTO_UDP,
           Protocol.SCTP: 132}
PROTOCOL_OF = {v: k for k, v in IPPROTO.items()}


class VsKey(NamedTuple):
    """What identifies an IPVS virtual server: protocol, address, port."""

    protocol: Protocol
    address: IPAddress
    port: int

    @property
    def family(self) -> Family:
        return Family.of(self.address)

    def order(self) -> tuple[str, int, int, int]:
        """Sort key (IPv4 and IPv6 addresses do not compare with each other)."""
        return (self.protocol.value, self.address.version, int(self.address), self.port)

    def __str__(self) -> str:
        return f"{self.protocol.value} {format_endpoint(self.address, self.port)}"


class RsKey(NamedTuple):
    """A real server of a virtual server: an endpoint's address and port."""

    address: IPAddress
    port: int

    def order(self) -> tuple[int, int, int]:
        return (self.address.version, int(self.address), self.port)

    def __str__(self) -> str:
        return format_endpoint(self.address, self.port)


class VsKind(enum.Enum):
    """Which of the service's addresses a virtual server is on (its policy follows)."""

    CLUSTER_IP = "cluster-ip"
    EXTERNAL_IP = "external-ip"
    LOAD_BALANCER = "load-balancer"
    NODE_PORT = "node-port"


@dataclass(frozen=True, slots=True)
class VirtualServer:
    key: VsKey
    kind: VsKind
    scheduler: str
    flags: int  # FLAG_PERSISTENT and scheduler flags; never FLAG_HASHED
    timeout: int  # persistence (ClientIP affinity) seconds; 0 without affinity
    real_servers: tuple[RsKey, ...]  # sorted; each with weight WEIGHT
    endpoint_set: str  # "cluster" or "local": which set the real servers come from
    drop: bool = False  # Local policy, no local endpoint: the filter drops its traffic
    # External address, policy Local, no local endpoint: only pods and this node may
    # use it (they get the cluster set); the filter drops traffic from outside.
    inside_only: bool = False

    @property
    def persistent(self) -> bool:
        return bool(self.flags & FLAG_PERSISTENT)


class SetRole(enum.Enum):
    """The ipsets the fixed iptables rules match on (one kernel set per role and family)."""

    SERVICES = "SERVICES"  # every virtual server we program: ownership and the VIP filter
    CLUSTER_IP = "CLUSTER-IP"  # cluster IP:port, masqueraded from off-cluster sources
    EXTERNAL_MASQ = "EXT-MASQ"  # externally reachable, Cluster policy: always masqueraded
    DROP = "DROP"  # Local policy with no local endpoint: dropped
    # External address, policy Local, no local endpoint: dropped from outside the
    # cluster CIDRs; the node's own connections are masqueraded.
    INSIDE_ONLY = "INSIDE-ONLY"
    FIREWALL = "FW"  # load-balancer IP:port with source ranges
    FIREWALL_ALLOW = "FW-ALLOW"  # (lb IP:port, allowed source range)
    LOOPBACK = "LOOPBACK"  # (endpoint:port, endpoint): a pod reaching itself, masqueraded
    VIPS = "VIPS"  # addresses on the dummy interface


SET_TYPES = {
    SetRole.SERVICES: "hash:ip,port",
    SetRole.CLUSTER_IP: "hash:ip,port",
    SetRole.EXTERNAL_MASQ: "hash:ip,port",
    SetRole.DROP: "hash:ip,port",
    SetRole.INSIDE_ONLY: "hash:ip,port",
    SetRole.FIREWALL: "hash:ip,port",
    SetRole.FIREWALL_ALLOW: "hash:ip,port,net",
    SetRole.LOOPBACK: "hash:ip,port,ip",
    SetRole.VIPS: "hash:ip",
}

# Our ipsets share the mode's chain prefix (without its dash: SPX-IPVS4-..., SPX-IPVS6-...).
SET_PREFIX = IPVS.markers.chain_prefix.rstrip("-")


def set_name(role: SetRole, family: Family) -> str:
    """Kernel name of a set; ipset names are global across families, so the family is
    part of the name (at most 31 characters)."""
    return f"{SET_PREFIX}{family.value}-{role.value}"


class SetEntry(NamedTuple):
    role: SetRole
    family: Family
    entry: str  # ipset's own spelling, e.g. "198.18.128.10,tcp:80"


@dataclass(frozen=True, slots=True)
class PortRules:
    """Everything one service port (in one family) needs in the kernel."""

    key: ServicePortKey
    virtual_servers: tuple[VirtualServer, ...]
    addresses: tuple[IPAddress, ...]  # for the dummy interface, sorted
    entries: frozenset[SetEntry]
    # The service's sliceproxy.io/traffic-per-endpoint (None: the node's flag decides):
    # whether traffic.py reads its real servers' counts too.
    traffic_per_endpoint: bool | None = None


@dataclass(frozen=True, slots=True)
class IpvsContext:
    """What rendering needs besides the service port: options and the node's addresses.

    `node_addresses` are the node's own addresses (every interface but our dummy one,
    no loopback, no IPv6 link-local): an externalIP or load-balancer IP that is one of
    them is not put on the dummy interface. `nodeport_addresses` are those that accept
    NodePort traffic (--nodeport-addresses, `primary` standing for `primary_ips`, the
    node's primary addresses from its Node object; every address of a family it names
    no CIDR of, as in the other modes and upstream).
    """

    node_name: str
    scheduler: str
    node_addresses: frozenset[IPAddress]
    nodeport_addresses: tuple[IPAddress, ...]
    primary_ips: tuple[IPAddress, ...] = ()

    @staticmethod
    def build(options: DataplaneOptions, node_addresses: Iterable[IPAddress],
              primary_ips: Iterable[IPAddress] = ()) -> IpvsContext:
        usable = frozenset(a for a in node_addresses if usable_node_address(a))
        primary = tuple(primary_ips)
        cidrs = nodeport_cidrs_for(options, primary)
        return IpvsContext(
            node_name=options.node_name,
            scheduler=options.ipvs_scheduler or "rr",
            node_addresses=usable,
            nodeport_addresses=tuple(sorted(
                (a for family in Family for a in _nodeport_addresses(family, cidrs, usable)),
                key=address_order)),
            primary_ips=primary,
        )


def usable_node_address(address: IPAddress) -> bool:
    """Upstream's rule for node addresses in IPVS mode: no loopback, no IPv6 link-local."""
    if address.is_loopback:
        return False
    return not (isinstance(address, IPv6Address) and address.is_link_local)


def _nodeport_addresses(family: Family, cidrs: Iterable[IPNetwork],
                        usable: Iterable[IPAddress]) -> Iterable[IPAddress]:
    """This family's node addresses that accept NodePort traffic, by the rule every mode
    shares (common.context.nodeport_selection: no CIDR of the family means all)."""
    selected = nodeport_selection(family, cidrs, usable)
    return [a for a in usable if Family.of(a) is family] if selected is None else selected


def address_order(address: IPAddress) -> tuple[int, int]:
    return (address.version, int(address))


def _proto(protocol: Protocol) -> str:
    return protocol.value.lower()


def ip_port(address: IPAddress, protocol: Protocol, port: int) -> str:
    return f"{address},{_proto(protocol)}:{port}"


def _endpoints(rsp: ResolvedServicePort, local: bool) -> tuple[SelectedEndpoint, ...]:
    return rsp.local_endpoints if local else rsp.cluster_endpoints


def _real_servers(endpoints: Iterable[SelectedEndpoint]) -> tuple[RsKey, ...]:
    return tuple(sorted({RsKey(e.address, e.port) for e in endpoints}, key=RsKey.order))


def render_port(rsp: ResolvedServicePort, ctx: IpvsContext) -> PortRules:
    """The kernel objects for one service port in one family. Pure."""
    service, port, family = rsp.service, rsp.port, rsp.key.family
    protocol = port.protocol
    internal_local = service.internal_traffic_policy is TrafficPolicy.LOCAL
    external_local = service.external_traffic_policy is TrafficPolicy.LOCAL
    servers: list[VirtualServer] = []
    entries: set[SetEntry] = set()
    addresses: set[IPAddress] = set()

    def add(kind: VsKind, address: IPAddress, vport: int, local: bool) -> None:
        vs = _virtual_server(rsp, ctx, VsKey(protocol, address, vport), kind, local)
        servers.append(vs)
        entries.update(_server_entries(vs, family, local))

    for ip in rsp.cluster_ips:
        add(VsKind.CLUSTER_IP, ip, port.port, internal_local)
        addresses.add(ip)
        entries.add(SetEntry(SetRole.CLUSTER_IP, family, ip_port(ip, protocol, port.port)))
    for ip in _of_family(service.external_ips, family):
        add(VsKind.EXTERNAL_IP, ip, port.port, external_local)
        if ip not in ctx.node_addresses:
            addresses.add(ip)
    for ip in _of_family(service.load_balancer_ips, family):
        add(VsKind.LOAD_BALANCER, ip, port.port, external_local)
        if ip not in ctx.node_addresses:
            addresses.add(ip)
        entries.update(_source_range_entries(rsp, ip))
    if port.node_port:
        for ip in _of_family(ctx.nodeport_addresses, family):
            add(VsKind.NODE_PORT, ip, port.node_port, external_local)

    # Hairpin: a local endpoint reaching itself through a service must be masqueraded,
    # or it would answer itself directly (upstream's KUBE-LOOP-BACK).
    for s in rsp.endpoints:
        if (s.in_cluster or s.in_local) and s.node_name == ctx.node_name:
            entries.add(SetEntry(SetRole.LOOPBACK, family,
                                 f"{s.address},{_proto(protocol)}:{s.port},{s.address}"))
    for ip in addresses:
        entries.add(SetEntry(SetRole.VIPS, family, str(ip)))
    return PortRules(
        key=rsp.key,
        virtual_servers=tuple(servers),
        addresses=tuple(sorted(addresses, key=address_order)),
        entries=frozenset(entries),
        traffic_per_endpoint=rsp.service.traffic_per_endpoint,
    )


def _scheduler(balancing: Balancing, node_scheduler: str) -> str:
    """The kernel's own schedulers for the hashing choices: `mh` is Maglev (with
    FLAG_SCHED2, on the source address and port; its hash keys are fixed in
    ip_vs_mh.c, so every node's kernel agrees), `sh` hashes the source address.
    `random` keeps the node's --ipvs-scheduler, as before there was a choice."""
    if balancing is Balancing.MAGLEV:
        return "mh"
    if balancing is Balancing.SOURCE_HASH:
        return "sh"
    return node_scheduler


def _virtual_server(rsp: ResolvedServicePort, ctx: IpvsContext, key: VsKey, kind: VsKind,
                    local: bool) -> VirtualServer:
    """One address's virtual server; `local`: its traffic policy is Local."""
    flags, timeout = 0, 0
    if rsp.service.affinity_timeout is not None:
        flags, timeout = FLAG_PERSISTENT, rsp.service.affinity_timeout
    scheduler = _scheduler(rsp.balancing, ctx.scheduler)
    if scheduler == "mh":
        flags |= FLAG_SCHED2
    if scheduler in ORDERED_SCHEDULERS:
        flags |= FLAG_SCHED1
    # A Local policy without a local endpoint drops traffic only when endpoints exist
    # elsewhere; with none at all the (empty) virtual server refuses it, as upstream.
    any_endpoints = rsp.has_any_endpoints
    chosen = _endpoints(rsp, local)
    # External traffic with policy Local and no local endpoint: pods and the node get
    # the cluster set (upstream's short-circuit); outside traffic is filtered.
    inside_only = local and kind is not VsKind.CLUSTER_IP and not chosen and any_endpoints
    if inside_only:
        chosen = rsp.cluster_endpoints
    reals = _real_servers(chosen)
    return VirtualServer(
        key=key, kind=kind, scheduler=scheduler, flags=flags, timeout=timeout,
        real_servers=reals,
        endpoint_set="local" if local and not inside_only else "cluster",
        drop=local and not reals and any_endpoints,
        inside_only=inside_only,
    )


def _server_entries(vs: VirtualServer, family: Family, local: bool) -> set[SetEntry]:
    """The ipset entries that drive the fixed iptables rules for one virtual server."""
    entry = ip_port(vs.key.address, vs.key.protocol, vs.key.port)
    out = {SetEntry(SetRole.SERVICES, family, entry)}
    if vs.drop:
        out.add(SetEntry(SetRole.DROP, family, entry))
    if vs.inside_only:
        out.add(SetEntry(SetRole.INSIDE_ONLY, family, entry))
    if vs.kind is not VsKind.CLUSTER_IP and not local:
        # Traffic from outside may come back through another node: masquerade, as
        # upstream does for every Cluster-policy external address.
        out.add(SetEntry(SetRole.EXTERNAL_MASQ, family, entry))
    return out


def _source_range_entries(rsp: ResolvedServicePort, lb_ip: IPAddress) -> set[SetEntry]:
    """loadBalancerSourceRanges of this family: the LB address:port is filtered, and
    each range is allowed through."""
    family, protocol, port = rsp.key.family, rsp.port.protocol, rsp.port.port
    ranges = [c for c in rsp.service.load_balancer_source_ranges if Family.of(c) is family]
    if not ranges:
        return set()
    target = ip_port(lb_ip, protocol, port)
    out = {SetEntry(SetRole.FIREWALL, family, target)}
    out.update(SetEntry(SetRole.FIREWALL_ALLOW, family, f"{target},{net}")
               for cidr in ranges for net in ipset_nets(cidr))
    return out


def ipset_nets(cidr: IPNetwork) -> tuple[IPNetwork, ...]:
    """ipset's hash:*net types refuse a /0; "everywhere" is the two halves of the space."""
    if cidr.prefixlen:
        return (cidr,)
    return tuple(cidr.subnets(prefixlen_diff=1))


def _of_family(addresses: Iterable[IPAddress], family: Family) -> list[IPAddress]:
    return [a for a in addresses if Family.of(a) is family]


def render_all(state: DesiredState, ctx: IpvsContext,
               families: Iterable[Family] = (Family.V4, Family.V6)) -> dict[ServicePortKey,
                                                                          PortRules]:
    wanted = set(families)
    return {key: render_port(rsp, ctx) for key, rsp in state.ports.items()
            if key.family in wanted}



# --- one port's endpoint delta (O(change)) -------------------------------------------------

# Real servers a delta may touch per virtual server before the port is rendered whole:
# each one is a bisect and a memmove of the server's tuple.
PATCH_LIMIT = 64


@dataclass(frozen=True, slots=True)
class RealServerChange:
    """The real servers one virtual server loses and gains, each in RsKey.order."""

    removed: tuple[RsKey, ...]
    added: tuple[RsKey, ...]


@dataclass(frozen=True, slots=True)
class PortChange:
    """A port rendered from its endpoint delta: its new PortRules (the same virtual
    servers and addresses, real servers patched) and what changed in them."""

    rules: PortRules
    real_servers: Mapping[VsKey, RealServerChange]  # only the servers that changed
    entries_removed: frozenset[SetEntry]
    entries_added: frozenset[SetEntry]


def render_change(old: ResolvedServicePort, new: ResolvedServicePort,
                  delta: EndpointDelta, ctx: IpvsContext, rules: PortRules
                  ) -> PortChange | None:
    """What `render_port(new, ctx)` is, given `rules` rendered from `old` and the delta
    between them, in O(change); None when the port must be rendered whole: more than the
    endpoints changed, a Local-policy server without local endpoints before or after
    (its drop and inside-only flags hang on whether endpoints exist anywhere), a large
    delta, or `rules` not matching the delta."""
    by_set = {local: _net_change(delta, local) for local in (False, True)}
    servers: list[VirtualServer] = []
    changed: dict[VsKey, RealServerChange] = {}
    for vs in rules.virtual_servers:
        local = vs.endpoint_set == "local"
        if vs.drop or vs.inside_only:
            return None
        change = by_set[local]
        if not change.removed and not change.added:
            servers.append(vs)
            continue
        reals = _patched(vs.real_servers, change)
        if reals is None or (local and not reals):
            return None
        servers.append(replace(vs, real_servers=reals))
        changed[vs.key] = change
    gone, come = _loopback_change(new, delta, ctx)
    entries = rules.entries - gone | come if gone or come else rules.entries
    return PortChange(PortRules(rules.key, tuple(servers), rules.addresses, entries,
                                rules.traffic_per_endpoint), changed, gone, come)


def _net_change(delta: EndpointDelta, local: bool) -> RealServerChange:
    """The real servers a virtual server drawing from the local (or cluster) set loses
    and gains; an endpoint in both halves of the delta and in the set both times is
    neither."""
    def members(side: tuple[SelectedEndpoint, ...]) -> set[RsKey]:
        return {RsKey(s.address, s.port) for s in side
                if (s.in_local if local else s.in_cluster)}

    removed, added = members(delta.removed), members(delta.added)
    return RealServerChange(tuple(sorted(removed - added, key=RsKey.order)),
                            tuple(sorted(added - removed, key=RsKey.order)))


def _patched(reals: tuple[RsKey, ...], change: RealServerChange) -> tuple[RsKey, ...] | None:
    """`reals` (sorted) without `change.removed` and with `change.added`, still sorted;
    None if the change is too large to patch or does not fit `reals`."""
    if len(change.removed) + len(change.added) > PATCH_LIMIT:
        return None
    out = list(reals)
    for rs in change.removed:
        i = bisect_left(out, rs.order(), key=RsKey.order)
        if i == len(out) or out[i] != rs:
            return None
        del out[i]
    for rs in change.added:
        i = bisect_left(out, rs.order(), key=RsKey.order)
        if i < len(out) and out[i] == rs:
            return None
        out.insert(i, rs)
    return tuple(out)


def _loopback_change(rsp: ResolvedServicePort, delta: EndpointDelta, ctx: IpvsContext
                     ) -> tuple[frozenset[SetEntry], frozenset[SetEntry]]:
    """The hairpin entries (render_port's LOOPBACK) that go and come with the delta."""
    family, proto = rsp.key.family, _proto(rsp.port.protocol)

    def entries(side: tuple[SelectedEndpoint, ...]) -> set[SetEntry]:
        return {SetEntry(SetRole.LOOPBACK, family,
                         f"{s.address},{proto}:{s.port},{s.address}")
                for s in side
                if (s.in_cluster or s.in_local) and s.node_name == ctx.node_name}

    before, after = entries(delta.removed), entries(delta.added)
    return frozenset(before - after), frozenset(after - before)


# --- readable lines (applied_rules, the debug dump) ------------------------------------


def describe_vs(vs: VirtualServer, weights: Mapping[RsKey, int] | None = None) -> list[str]:
    """`TCP 198.18.128.10:80 rr persistent 10800 -> 198.18.1.10:8080 weight 1`, one line
    per real server (and those still draining at weight 0, when `weights` names them)."""
    head = f"{vs.key} {vs.scheduler}"
    if vs.persistent:
        head += f" persistent {vs.timeout}"
    if vs.flags & FLAG_SCHED1:
        head += f" {vs.scheduler}-fallback"
    if vs.flags & FLAG_SCHED2:
        head += " mh-port"
    reals = dict.fromkeys(vs.real_servers, WEIGHT)
    for rs, weight in (weights or {}).items():
        reals.setdefault(rs, weight)
    if not reals:
        why = ("dropped: policy Local and no local endpoint" if vs.drop
               else "no endpoints: connections refused")
        return [f"{head} -> ({why})"]
    lines = []
    for rs in sorted(reals, key=RsKey.order):
        weight = weights.get(rs, reals[rs]) if weights else reals[rs]
        suffix = " (draining)" if rs not in vs.real_servers else ""
        if vs.inside_only:
            suffix += " (pods and this node only: policy Local, no local endpoint)"
        lines.append(f"{head} -> {rs} weight {weight}{suffix}")
    return lines


def describe_entries(rules: PortRules) -> list[str]:
    """The iptables-side decisions for a port, in words, from its ipset entries."""
    lines = []
    for e in sorted(rules.entries, key=lambda e: (e.role.value, e.entry)):
        if e.role is SetRole.CLUSTER_IP:
            lines.append(f"masquerade {e.entry} from outside the cluster CIDRs "
                         "(or all, with --masquerade-all)")
        elif e.role is SetRole.EXTERNAL_MASQ:
            lines.append(f"masquerade {e.entry} (external traffic policy Cluster)")
        elif e.role is SetRole.DROP:
            lines.append(f"drop {e.entry} (traffic policy Local, no local endpoint)")
        elif e.role is SetRole.INSIDE_ONLY:
            lines.append(f"drop {e.entry} from outside the cluster CIDRs (traffic policy "
                         "Local, no local endpoint; pods and this node, masqueraded, use "
                         "the cluster set)")
        elif e.role is SetRole.FIREWALL_ALLOW:
            lines.append(f"allow source range {e.entry} (others dropped)")
        elif e.role is SetRole.LOOPBACK:
            lines.append(f"masquerade hairpin {e.entry}")
    return lines

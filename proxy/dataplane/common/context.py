"""What rendering needs besides the service port: the options as they apply to one family,
and this node's addresses. One rule for `--nodeport-addresses`, used by every mode (its
CIDRs and `primary` resolved by proxy/model/nodeport_addresses.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from proxy.dataplane.base import DataplaneOptions
from proxy.model.nodeport_addresses import nodeport_cidrs, of_family
from proxy.model.types import Family, IPAddress, IPNetwork


@dataclass(frozen=True, slots=True)
class RenderContext:
    """The options as they apply to one family, plus this node's addresses."""

    family: Family
    masquerade_all: bool = False
    local_cidrs: tuple[IPNetwork, ...] = ()  # --cluster-cidr of this family: pods
    # Node addresses that accept NodePorts; None: every local address (addrtype LOCAL).
    nodeport_ips: tuple[IPAddress, ...] | None = None
    # Every address of this node in this family (LB source ranges that contain one
    # also admit traffic the node sends to its own LB IPs, as upstream).
    node_ips: tuple[IPAddress, ...] = ()
    # --traffic-per-endpoint: count each endpoint's connections, for services without
    # the annotation (common/traffic.py).
    traffic_per_endpoint: bool = False

    @property
    def host_mask(self) -> str:
        return "/32" if self.family is Family.V4 else "/128"


def cluster_ip_masquerade(ctx: RenderContext, except_pods: Callable[[IPNetwork], str],
                          unless_pod_chain: str, mark_chain: str) -> tuple[str, str] | None:
    """(source match, target) of the rules marking off-cluster clients of a cluster IP
    for masquerade (they may be answered from another node), in a mode's words: all but
    one pod CIDR's, matched in the rule itself (`except_pods(cidr)`, as upstream writes
    it), or all but several CIDRs', through the mode's `unless_pod_chain`, or all
    (--masquerade-all). None: nothing to mark (no --cluster-cidr of this family and no
    --masquerade-all: pods cannot be told from the outside)."""
    if ctx.masquerade_all:
        return "", mark_chain
    if not ctx.local_cidrs:
        return None
    if len(ctx.local_cidrs) == 1:
        return except_pods(ctx.local_cidrs[0]), mark_chain
    return "", unless_pod_chain


def nodeport_selection(family: Family, cidrs: Iterable[IPNetwork],
                       node_ips: Iterable[IPAddress]) -> tuple[IPAddress, ...] | None:
    """The node addresses of `family` that accept NodePort traffic under
    --nodeport-addresses `cidrs` (`primary` already resolved: `nodeport_cidrs`); None
    means every address of the family.

    As upstream: no CIDR of this family, or a match-everything one, means "all" (a list
    of IPv6 CIDRs says nothing about IPv4). Loopback addresses never serve NodePorts
    (upstream's --iptables-localhost-nodeports=false)."""
    mine = of_family(family, cidrs)
    if mine is None:
        return None
    return tuple(ip for ip in node_ips if Family.of(ip) is family and not ip.is_loopback
                 and any(ip in c for c in mine))


def nodeport_cidrs_for(options: DataplaneOptions,
                     primary_ips: Iterable[IPAddress]) -> tuple[IPNetwork, ...]:
    """The CIDRs NodePorts accept on: --nodeport-addresses, `primary` standing for
    `primary_ips` (the node's primary addresses, DesiredState.primary_ips)."""
    return nodeport_cidrs(options.nodeport_addresses, options.nodeport_primary, primary_ips)


def context_for(family: Family, options: DataplaneOptions,
                node_ips: Sequence[IPAddress] = (),
                primary_ips: Sequence[IPAddress] = ()) -> RenderContext:
    """The per-family view of the options; `node_ips` are this node's addresses,
    `primary_ips` its primary ones (from its Node object)."""
    mine = tuple(ip for ip in node_ips if Family.of(ip) is family)
    cidrs = [c for c in options.cluster_cidrs if Family.of(c) is family]
    nodeport_ips = nodeport_selection(family, nodeport_cidrs_for(options, primary_ips), mine)
    return RenderContext(family, options.masquerade_all, tuple(cidrs), nodeport_ips, mine,
                         options.traffic_per_endpoint)

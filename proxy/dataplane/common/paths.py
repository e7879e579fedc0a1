"""Which paths one service port's traffic takes (pure), whatever rules a data plane writes
them as. The iptables and nftables renderers both start from `plan`, so the two modes
cannot come to disagree on who goes where:

- the cluster path (chain "svc") when cluster endpoints are used, the local path ("svl")
  when local ones are;
- cluster-IP traffic takes the path of the internal traffic policy, external traffic
  (NodePort, externalIP, LB IP) that of the external policy, through an "ext" chain that
  exists while some endpoint exists anywhere;
- LB source ranges put a "fw" chain in front of "ext".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network

from proxy.model.snapshot import ResolvedServicePort, SelectedEndpoint
from proxy.model.types import Family, IPAddress, IPNetwork, TrafficPolicy


@dataclass(frozen=True, slots=True)
class PortPlan:
    # This family's external addresses and source ranges.
    external_ips: tuple[IPAddress, ...]
    lb_ips: tuple[IPAddress, ...]
    ranges: tuple[IPNetwork, ...]
    # Endpoints of each path (empty: the path has no chain).
    cluster_eps: tuple[SelectedEndpoint, ...]
    local_eps: tuple[SelectedEndpoint, ...]
    has_endpoints: bool  # usable endpoints exist somewhere in the cluster
    external_local: bool  # externalTrafficPolicy: Local
    # Chain names (None: no such chain), from the renderer's own naming.
    svc: str | None
    svl: str | None
    internal: str | None  # the path cluster-IP traffic takes
    external_policy: str | None  # the path external traffic takes after "ext"
    ext: str | None
    fw: str | None


def plan(rsp: ResolvedServicePort, chain: Callable[[str], str]) -> PortPlan:
    """`chain(kind)` names this port's chain of kind "svc", "svl", "ext" or "fw"."""
    svc, sp, family = rsp.service, rsp.port, rsp.key.family
    external_ips = tuple(a for a in svc.external_ips if Family.of(a) is family)
    lb_ips = tuple(a for a in svc.load_balancer_ips if Family.of(a) is family)
    ranges = tuple(r for r in svc.load_balancer_source_ranges if Family.of(r) is family)
    cluster_eps = rsp.cluster_endpoints if rsp.uses_cluster else ()
    local_eps = rsp.local_endpoints if rsp.uses_local else ()
    has_endpoints = rsp.has_any_endpoints
    svc_chain = chain("svc") if cluster_eps else None
    svl_chain = chain("svl") if local_eps else None
    external_local = svc.external_traffic_policy is TrafficPolicy.LOCAL
    externally_accessible = bool(sp.node_port or external_ips or lb_ips)
    return PortPlan(
        external_ips, lb_ips, ranges, cluster_eps, local_eps, has_endpoints, external_local,
        svc=svc_chain, svl=svl_chain,
        internal=svl_chain if svc.internal_traffic_policy is TrafficPolicy.LOCAL else svc_chain,
        external_policy=svl_chain if external_local else svc_chain,
        ext=chain("ext") if has_endpoints and externally_accessible else None,
        fw=chain("fw") if has_endpoints and lb_ips and ranges else None,
    )


def sorted_nets(nets: Sequence[IPNetwork]) -> list[IPNetwork]:
    """IPv4 networks, then IPv6, each in order (the two types do not compare)."""
    v4 = sorted(n for n in nets if isinstance(n, IPv4Network))
    v6 = sorted(n for n in nets if isinstance(n, IPv6Network))
    return [*v4, *v6]

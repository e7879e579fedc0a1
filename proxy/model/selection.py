"""Which endpoints of a service port this node may use: the cluster set and the local set.

One pure function, `categorize`, with upstream kube-proxy's meaning
(`pkg/proxy/topology.go`, `CategorizeEndpoints`):

* cluster set: ready endpoints, narrowed by topology when topology applies; when no
  endpoint is ready anywhere, the serving-and-terminating ones (topology ignored);
* local set (traffic policy Local): ready endpoints on this node, else serving-and-
  terminating ones on this node, else none (such traffic is dropped, never sent away).

Which traffic uses which set (`traffic_uses`, `routes`): cluster-IP traffic follows
internalTrafficPolicy; traffic from outside to a NodePort, externalIP or load-balancer
IP follows externalTrafficPolicy; pods and the node itself reaching those external
addresses use the cluster set whatever the policies (upstream's short-circuit), so an
externally reachable port keeps a cluster set even when both policies are Local.

Topology, in order of precedence (the first that is present decides):

1. the `sliceproxy.io/topology-preference` annotation (ours): an ordered list of
   topology keys; the first key whose domain (this node, this node's zone, `*` = any)
   has ready endpoints wins; when no key matches, the whole cluster is used — a
   preference never drops traffic;
2. hints in the slices, exactly as upstream: used only when every ready endpoint has a
   hint and at least one hint names this node (forNodes) or, failing that, this zone
   (forZones); otherwise ignored;
3. `trafficDistribution` from the service spec, for slices without hints (Endpoints
   mode, or controllers that write none), judged from the endpoints' own nodeName and
   zone: PreferSameNode tries this node, then this zone; PreferSameZone and PreferClose
   try this zone; then the whole cluster. (PreferSameNode falls back through the zone
   because that is what the upstream controller's hints give it: node and zone hints.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.model.snapshot import EndpointSet, MergedEndpoint, SelectedEndpoint, Topology
from proxy.model.types import (
    LABEL_HOSTNAME,
    LABEL_ZONE,
    Family,
    Service,
    ServicePort,
    TrafficPolicy,
)

ANY = "*"
_CLUSTER = frozenset({EndpointSet.CLUSTER})
_LOCAL = frozenset({EndpointSet.LOCAL})
_BOTH = _CLUSTER | _LOCAL
# An endpoint's reason is one of a few texts (node and zone names aside): one object for
# each, not one per endpoint (6 MiB of 100,000 equal strings at 10,000 services x 10).
_REASONS: dict[str, str] = {}
_REASONS_MAX = 4096
_NONE: frozenset[EndpointSet] = frozenset()


@dataclass(frozen=True, slots=True)
class NodeView:
    """What selection needs to know about this node."""

    name: str
    zone: str | None = None


@dataclass(slots=True)
class SelectMemo:
    """The `SelectedEndpoint`s of the last `categorize` of one service port, by endpoint
    object (each held, so an id can never name another), and what every endpoint's
    verdict depends on besides the endpoint itself (`params`). Next time, an endpoint
    that is the very same object, under the same params, gets the same verdict object."""

    params: tuple[object, ...] | None = None
    selected: dict[int, SelectedEndpoint] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Selection:
    endpoints: tuple[SelectedEndpoint, ...]
    topology: Topology
    uses_cluster: bool
    uses_local: bool


def _externally_accessible(service: Service, port: ServicePort, family: Family | None) -> bool:
    external = [*service.external_ips, *service.load_balancer_ips]
    if family is not None:
        external = [ip for ip in external if Family.of(ip) is family]
    return bool(port.node_port or external)


def traffic_uses(
    service: Service, port: ServicePort, family: Family | None = None
) -> tuple[bool, bool]:
    """(uses cluster set, uses local set): upstream's UsesClusterEndpoints and
    UsesLocalEndpoints (pkg/proxy/serviceport.go).

    An externally reachable port keeps its cluster set even when both policies are
    Local: pods and the node itself reaching its NodePort, externalIPs or load-balancer
    IPs are short-circuited to the cluster set, as if they went out to a load balancer
    and came back in. Like upstream, external reachability is judged per IP family
    (`family`; None: any family's addresses count).
    """
    externally_accessible = _externally_accessible(service, port, family)
    internal_local = service.internal_traffic_policy is TrafficPolicy.LOCAL
    external_local = service.external_traffic_policy is TrafficPolicy.LOCAL
    uses_cluster = not internal_local or externally_accessible
    uses_local = internal_local or (external_local and externally_accessible)
    return uses_cluster, uses_local


class Routes(NamedTuple):
    """Which set each kind of traffic to a service port uses (None: no such traffic)."""

    cluster_ip: EndpointSet
    external: EndpointSet | None  # from outside, to NodePort / externalIPs / LB IPs
    external_from_inside: EndpointSet | None  # from pods and this node, to the same


def routes(service: Service, port: ServicePort, family: Family | None = None) -> Routes:
    internal = (EndpointSet.LOCAL if service.internal_traffic_policy is TrafficPolicy.LOCAL
                else EndpointSet.CLUSTER)
    if not _externally_accessible(service, port, family):
        return Routes(internal, None, None)
    external = (EndpointSet.LOCAL if service.external_traffic_policy is TrafficPolicy.LOCAL
                else EndpointSet.CLUSTER)
    return Routes(internal, external, EndpointSet.CLUSTER)


def categorize(
    endpoints: Sequence[MergedEndpoint],
    service: Service,
    port: ServicePort,
    node: NodeView,
    family: Family | None = None,
    memo: SelectMemo | None = None,
) -> Selection:
    """`memo`: reuse (and refresh) the verdicts of an earlier call for the same port."""
    uses_cluster, uses_local = traffic_uses(service, port, family)
    ready = [ep for ep in endpoints if ep.ready]
    fallback = [ep for ep in endpoints if not ep.ready and ep.serving and ep.terminating]

    if uses_cluster:
        topology, keep = _choose_topology(service, ready, node)
    else:
        topology = Topology("cluster", "none", "cluster set unused: internal policy Local, "
                            "no external address")
        keep = _keep_all
    cluster_fallback = uses_cluster and not ready and bool(fallback)

    local_ready = any(ep.ready and ep.node_name == node.name for ep in endpoints)

    # Every input of an endpoint's verdict but the endpoint: the topology mode decides
    # `keep` (with the node's name and zone) and the topology clause of the reason.
    params = (uses_cluster, uses_local, topology.mode, cluster_fallback, local_ready, node)
    known = memo.selected if memo is not None and memo.params == params else {}
    selected: list[SelectedEndpoint] = []
    for ep in endpoints:
        hit = known.get(id(ep))
        if hit is not None and hit.endpoint is ep:
            selected.append(hit)
            continue
        sets: set[EndpointSet] = set()
        parts: list[str] = []
        if uses_cluster:
            in_cluster, why = _cluster_verdict(ep, keep, cluster_fallback, topology)
            if in_cluster:
                sets.add(EndpointSet.CLUSTER)
            parts.append(f"cluster: {why}")
        if uses_local:
            in_local, why = _local_verdict(ep, node.name, local_ready)
            if in_local:
                sets.add(EndpointSet.LOCAL)
            parts.append(f"local: {why}")
        selected.append(SelectedEndpoint(ep, _frozen(sets), _shared("; ".join(parts))))
    if memo is not None:
        memo.params = params
        memo.selected = {id(s.endpoint): s for s in selected}
    return Selection(tuple(selected), topology, uses_cluster, uses_local)


def _frozen(sets: set[EndpointSet]) -> frozenset[EndpointSet]:
    # Share the four possible values instead of allocating one per endpoint.
    if not sets:
        return _NONE
    if len(sets) == 2:
        return _BOTH
    return _CLUSTER if EndpointSet.CLUSTER in sets else _LOCAL


def _keep_all(ep: MergedEndpoint) -> bool:
    return True


def _cluster_verdict(
    ep: MergedEndpoint,
    keep: Callable[[MergedEndpoint], bool],
    use_fallback: bool,
    topology: Topology,
) -> tuple[bool, str]:
    if ep.ready:
        if keep(ep):
            return True, "ready" + _topology_clause(ep, topology)
        return False, "ready, but outside the preferred topology" + _where(ep)
    if ep.serving and ep.terminating:
        if use_fallback:
            return True, "serving and terminating, used because no endpoint is ready"
        return False, "terminating (ready endpoints exist)"
    return False, _not_usable(ep)


def _local_verdict(ep: MergedEndpoint, node_name: str, local_ready: bool) -> tuple[bool, str]:
    if ep.node_name != node_name:
        return False, "not on this node"
    if ep.ready:
        return True, "ready on this node"
    if ep.serving and ep.terminating:
        if local_ready:
            return False, "terminating (ready local endpoints exist)"
        return True, "serving and terminating on this node, used because none is ready here"
    return False, _not_usable(ep)


def _shared(reason: str) -> str:
    """`reason`, or the equal text already made (a bounded table: the names in some
    reasons are the cluster's)."""
    got = _REASONS.get(reason)
    if got is not None:
        return got
    if len(_REASONS) < _REASONS_MAX:
        _REASONS[reason] = reason
    return reason


def _not_usable(ep: MergedEndpoint) -> str:
    if ep.terminating:
        return "terminating and not serving"
    if ep.serving:
        return "not ready"
    return "not ready, not serving"


def _where(ep: MergedEndpoint) -> str:
    return f" (node {ep.node_name or '?'}, zone {ep.zone or '?'})"


def _topology_clause(ep: MergedEndpoint, topology: Topology) -> str:
    match topology.mode:
        case "hints-node":
            return ", hinted for this node"
        case "hints-zone":
            return ", hinted for this zone"
        case "prefer-node":
            return ", on this node"
        case "prefer-zone":
            return f", in this zone ({ep.zone})"
        case _:
            return ""


# --- topology --------------------------------------------------------------------------

_Keep = Callable[[MergedEndpoint], bool]


def _choose_topology(
    service: Service, ready: list[MergedEndpoint], node: NodeView
) -> tuple[Topology, _Keep]:
    if service.topology_preference is not None:
        return _by_preference(service.topology_preference, ready, node)
    if any(ep.zone_hints or ep.node_hints for ep in ready):
        return _by_hints(ready, node)
    td = service.traffic_distribution
    if td in ("PreferSameNode", "PreferSameZone", "PreferClose"):
        return _by_distribution(td, ready, node)
    requested = "none"
    if td:
        requested = f"trafficDistribution={td}"
        return Topology("cluster", requested, f"unknown trafficDistribution {td!r}; "
                        "using the whole cluster"), _keep_all
    if service.topology_mode and service.topology_mode.lower() not in ("", "disabled"):
        requested = f"topology-mode={service.topology_mode}"
        return Topology("cluster", requested, "no endpoint carries hints yet; "
                        "using the whole cluster"), _keep_all
    return Topology("cluster", requested, "no topology requested"), _keep_all


def _on_node(node: NodeView) -> _Keep:
    return lambda ep: ep.node_name == node.name


def _in_zone(zone: str) -> _Keep:
    return lambda ep: ep.zone == zone


def _by_preference(
    keys: tuple[str, ...], ready: list[MergedEndpoint], node: NodeView
) -> tuple[Topology, _Keep]:
    requested = "annotation " + ",".join(keys)
    notes: list[str] = []
    if not keys:
        return Topology("cluster", requested, "empty preference; using the whole cluster"), \
            _keep_all
    for key in keys:
        # The counts compare inline: twice as fast as calling `keep` for each endpoint.
        if key == LABEL_HOSTNAME:
            mode, keep, where = "prefer-node", _on_node(node), f"on node {node.name}"
            count = sum(1 for ep in ready if ep.node_name == node.name)
        elif key == LABEL_ZONE:
            zone = node.zone
            if zone is None:
                notes.append(f"{key}: this node has no zone label")
                continue
            mode, keep, where = "prefer-zone", _in_zone(zone), f"in zone {zone}"
            count = sum(1 for ep in ready if ep.zone == zone)
        elif key == ANY:
            notes.append("*: any endpoint")
            return Topology("cluster", requested, "; ".join(notes)), _keep_all
        else:
            notes.append(f"{key}: unsupported key, ignored")
            continue
        if count:
            return Topology(mode, requested, f"{key}: {count} ready endpoint(s) {where}"), keep
        notes.append(f"{key}: none ready {where}")
    notes.append("no key matched; falling back to the whole cluster")
    return Topology("cluster", requested, "; ".join(notes)), _keep_all


def _by_hints(ready: list[MergedEndpoint], node: NodeView) -> tuple[Topology, _Keep]:
    # Upstream topologyModeFromHints, with its reasons kept for the operator.
    all_node_hints = all(ep.node_hints for ep in ready)
    all_zone_hints = all(ep.zone_hints for ep in ready)
    notes: list[str] = []
    if all_node_hints:
        if any(node.name in ep.node_hints for ep in ready):
            return Topology("hints-node", "hints", f"node hints name {node.name}"), \
                lambda ep: node.name in ep.node_hints
        notes.append(f"no endpoint is hinted for node {node.name}")
    if all_zone_hints:
        zone = node.zone
        if zone is not None and any(zone in ep.zone_hints for ep in ready):
            return Topology("hints-zone", "hints", f"zone hints name {zone}"), \
                lambda ep: zone in ep.zone_hints
        if zone is None:
            notes.append("this node has no topology.kubernetes.io/zone label")
        else:
            notes.append(f"no endpoint is hinted for zone {zone}")
    else:
        notes.append("some ready endpoints have no zone hint")
    return Topology("cluster", "hints", "hints ignored: " + "; ".join(notes)), _keep_all


def _by_distribution(
    td: str, ready: list[MergedEndpoint], node: NodeView
) -> tuple[Topology, _Keep]:
    requested = f"trafficDistribution={td}"
    notes: list[str] = []
    if td == "PreferSameNode":
        count = sum(1 for ep in ready if ep.node_name == node.name)
        if count:
            return Topology("prefer-node", requested,
                            f"{count} ready endpoint(s) on node {node.name}"), _on_node(node)
        notes.append(f"none ready on node {node.name}")
    zone = node.zone
    if zone is None:
        notes.append("this node has no zone label")
    else:
        count = sum(1 for ep in ready if ep.zone == zone)
        if count:
            notes.append(f"{count} ready endpoint(s) in zone {zone}")
            return Topology("prefer-zone", requested, "; ".join(notes)), _in_zone(zone)
        notes.append(f"none ready in zone {zone}")
    notes.append("using the whole cluster")
    return Topology("cluster", requested, "; ".join(notes)), _keep_all

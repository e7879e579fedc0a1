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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from proxy.model.shared import SharedValues
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
_shared: SharedValues[str] = SharedValues(4096)
_NONE: frozenset[EndpointSet] = frozenset()


@dataclass(frozen=True, slots=True)
class NodeView:
    """What selection needs to know about this node."""

    name: str
    zone: str | None = None


@dataclass(slots=True)
class Census:
    """Counts over a port's merged endpoints: all that its topology, its fallbacks and
    so every endpoint's verdict depend on besides the endpoint itself. Counts, not
    lists, so that a port keeping its census between resolutions (`incremental`) can
    add and take away the endpoints that changed instead of counting all again."""

    node: NodeView
    ready: int = 0
    fallback: int = 0  # not ready, but serving and terminating
    ready_here: int = 0  # ready on this node
    ready_in_zone: int = 0  # ready in this node's zone (0 when the node has none)
    ready_hinted: int = 0  # ready with a node or a zone hint
    ready_node_hinted: int = 0  # ready with a node hint
    ready_zone_hinted: int = 0  # ready with a zone hint
    ready_hinted_here: int = 0  # ready, a node hint naming this node
    ready_hinted_zone: int = 0  # ready, a zone hint naming this node's zone

    @staticmethod
    def of(endpoints: Iterable[MergedEndpoint | SelectedEndpoint], node: NodeView) -> Census:
        census = Census(node)
        for ep in endpoints:
            census.count(ep)
        return census

    def count(self, ep: MergedEndpoint | SelectedEndpoint, n: int = 1) -> None:
        """Count `ep` in (n=1) or take it out again (n=-1)."""
        # Its copy's fields read at once (each by name is two property calls).
        ready, serving, terminating, node_name, zone = ep.copy.state
        if not ready:
            if serving and terminating:
                self.fallback += n
            return
        self.ready += n
        node = self.node
        if node_name == node.name:
            self.ready_here += n
        if zone == node.zone and zone is not None:
            self.ready_in_zone += n
        zone_hints, node_hints = ep.copy.hints
        if node_hints:
            self.ready_node_hinted += n
            if node.name in node_hints:
                self.ready_hinted_here += n
        if zone_hints:
            self.ready_zone_hinted += n
            if node.zone in zone_hints:
                self.ready_hinted_zone += n
        if node_hints or zone_hints:
            self.ready_hinted += n


class Verdicts(NamedTuple):
    """Every input of an endpoint's verdict but the endpoint: equal `Verdicts` give an
    equal endpoint an equal `SelectedEndpoint`."""

    uses_cluster: bool
    uses_local: bool
    mode: str  # the topology mode: which ready endpoints the cluster set keeps
    cluster_fallback: bool  # no endpoint ready: serving and terminating ones serve
    local_ready: bool  # some endpoint is ready on this node
    node: NodeView


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
) -> Selection:
    topology, verdicts = decide(service, port, node, family, Census.of(endpoints, node))
    return Selection(select_all(endpoints, verdicts), topology,
                     verdicts.uses_cluster, verdicts.uses_local)


def select_all(endpoints: Iterable[MergedEndpoint],
               verdicts: Verdicts) -> tuple[SelectedEndpoint, ...]:
    """`select` of each endpoint. Most endpoints of a port differ only in what no
    verdict reads (address, port; without topology, node and zone but for "this node
    or not"): the sets and reason are worked out once for each combination of what a
    verdict does read, which halves the selection of a cold start."""
    seen: dict[tuple[object, ...], SelectedEndpoint] = {}
    out: list[SelectedEndpoint] = []
    here = verdicts.node.name
    # Without topology a verdict reads an endpoint's conditions and whether it is on
    # this node (the local set); with it, its node, zone and hints too (and reasons
    # name them).
    plain = verdicts.mode == "cluster"
    for ep in endpoints:
        copy = ep.copy
        state = copy.state  # (ready, serving, terminating, node name, zone)
        what = ((*state[:3], state[3] == here) if plain else (state, copy.hints))
        like = seen.get(what)
        if like is None:
            out.append(seen.setdefault(what, select(ep, verdicts)))
        else:
            out.append(like.like(ep))
    return tuple(out)


_UNUSED = Topology("cluster", "none", "cluster set unused: internal policy Local, "
                   "no external address")


def decide(service: Service, port: ServicePort, node: NodeView, family: Family | None,
           census: Census) -> tuple[Topology, Verdicts]:
    """The port's topology and what every endpoint's verdict depends on, from the
    `census` of its endpoints (O(1) in their number)."""
    uses_cluster, uses_local = traffic_uses(service, port, family)
    topology = _choose_topology(service, census, node) if uses_cluster else _UNUSED
    cluster_fallback = uses_cluster and not census.ready and census.fallback > 0
    # Only a port with a local set reads local_ready: for others its flips are no change.
    local_ready = uses_local and census.ready_here > 0
    return topology, Verdicts(uses_cluster, uses_local, topology.mode, cluster_fallback,
                              local_ready, node)


def select(ep: MergedEndpoint, verdicts: Verdicts) -> SelectedEndpoint:
    """`ep`'s sets and the reason, for each set in use."""
    sets: set[EndpointSet] = set()
    parts: list[str] = []
    if verdicts.uses_cluster:
        in_cluster, why = _cluster_verdict(ep, verdicts)
        if in_cluster:
            sets.add(EndpointSet.CLUSTER)
        parts.append(f"cluster: {why}")
    if verdicts.uses_local:
        in_local, why = _local_verdict(ep, verdicts.node.name, verdicts.local_ready)
        if in_local:
            sets.add(EndpointSet.LOCAL)
        parts.append(f"local: {why}")
    return SelectedEndpoint.of(ep, _frozen(sets), _shared("; ".join(parts)))


def _frozen(sets: set[EndpointSet]) -> frozenset[EndpointSet]:
    # Share the four possible values instead of allocating one per endpoint.
    if not sets:
        return _NONE
    if len(sets) == 2:
        return _BOTH
    return _CLUSTER if EndpointSet.CLUSTER in sets else _LOCAL


def _in_topology(ep: MergedEndpoint, mode: str, node: NodeView) -> bool:
    """Whether the topology `mode` keeps the ready endpoint `ep` in the cluster set."""
    match mode:
        case "hints-node":
            return node.name in ep.node_hints
        case "hints-zone":
            return node.zone in ep.zone_hints
        case "prefer-node":
            return ep.node_name == node.name
        case "prefer-zone":
            return ep.zone == node.zone
        case _:
            return True


def _cluster_verdict(ep: MergedEndpoint, verdicts: Verdicts) -> tuple[bool, str]:
    if ep.ready:
        if _in_topology(ep, verdicts.mode, verdicts.node):
            return True, "ready" + _topology_clause(ep, verdicts.mode)
        return False, "ready, but outside the preferred topology" + _where(ep)
    if ep.serving and ep.terminating:
        if verdicts.cluster_fallback:
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


def _not_usable(ep: MergedEndpoint) -> str:
    if ep.terminating:
        return "terminating and not serving"
    if ep.serving:
        return "not ready"
    return "not ready, not serving"


def _where(ep: MergedEndpoint) -> str:
    return f" (node {ep.node_name or '?'}, zone {ep.zone or '?'})"


def _topology_clause(ep: MergedEndpoint, mode: str) -> str:
    match mode:
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


def _choose_topology(service: Service, census: Census, node: NodeView) -> Topology:
    if service.topology_preference is not None:
        return _by_preference(service.topology_preference, census, node)
    if census.ready_hinted:
        return _by_hints(census, node)
    td = service.traffic_distribution
    if td in ("PreferSameNode", "PreferSameZone", "PreferClose"):
        return _by_distribution(td, census, node)
    requested = "none"
    if td:
        requested = f"trafficDistribution={td}"
        return Topology("cluster", requested, f"unknown trafficDistribution {td!r}; "
                        "using the whole cluster")
    if service.topology_mode and service.topology_mode.lower() not in ("", "disabled"):
        requested = f"topology-mode={service.topology_mode}"
        return Topology("cluster", requested, "no endpoint carries hints yet; "
                        "using the whole cluster")
    return _NO_TOPOLOGY


# Most ports': one object for all of them (64 bytes a port).
_NO_TOPOLOGY = Topology("cluster", "none", "no topology requested")


def _by_preference(keys: tuple[str, ...], census: Census, node: NodeView) -> Topology:
    requested = "annotation " + ",".join(keys)
    notes: list[str] = []
    if not keys:
        return Topology("cluster", requested, "empty preference; using the whole cluster")
    for key in keys:
        if key == LABEL_HOSTNAME:
            mode, where, count = "prefer-node", f"on node {node.name}", census.ready_here
        elif key == LABEL_ZONE:
            if node.zone is None:
                notes.append(f"{key}: this node has no zone label")
                continue
            mode, where, count = "prefer-zone", f"in zone {node.zone}", census.ready_in_zone
        elif key == ANY:
            notes.append("*: any endpoint")
            return Topology("cluster", requested, "; ".join(notes))
        else:
            notes.append(f"{key}: unsupported key, ignored")
            continue
        if count:
            return Topology(mode, requested, f"{key}: {count} ready endpoint(s) {where}")
        notes.append(f"{key}: none ready {where}")
    notes.append("no key matched; falling back to the whole cluster")
    return Topology("cluster", requested, "; ".join(notes))


def _by_hints(census: Census, node: NodeView) -> Topology:
    # Upstream topologyModeFromHints, with its reasons kept for the operator. Called
    # only when some ready endpoint is hinted, so "every ready endpoint" is not vacuous.
    notes: list[str] = []
    if census.ready_node_hinted == census.ready:
        if census.ready_hinted_here:
            return Topology("hints-node", "hints", f"node hints name {node.name}")
        notes.append(f"no endpoint is hinted for node {node.name}")
    if census.ready_zone_hinted == census.ready:
        zone = node.zone
        if zone is not None and census.ready_hinted_zone:
            return Topology("hints-zone", "hints", f"zone hints name {zone}")
        if zone is None:
            notes.append("this node has no topology.kubernetes.io/zone label")
        else:
            notes.append(f"no endpoint is hinted for zone {zone}")
    else:
        notes.append("some ready endpoints have no zone hint")
    return Topology("cluster", "hints", "hints ignored: " + "; ".join(notes))


def _by_distribution(td: str, census: Census, node: NodeView) -> Topology:
    requested = f"trafficDistribution={td}"
    notes: list[str] = []
    if td == "PreferSameNode":
        if census.ready_here:
            return Topology("prefer-node", requested,
                            f"{census.ready_here} ready endpoint(s) on node {node.name}")
        notes.append(f"none ready on node {node.name}")
    zone = node.zone
    if zone is None:
        notes.append("this node has no zone label")
    else:
        if census.ready_in_zone:
            notes.append(f"{census.ready_in_zone} ready endpoint(s) in zone {zone}")
            return Topology("prefer-zone", requested, "; ".join(notes))
        notes.append(f"none ready in zone {zone}")
    notes.append("using the whole cluster")
    return Topology("cluster", requested, "; ".join(notes))

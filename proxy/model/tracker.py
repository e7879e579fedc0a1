"""The model's state: cached inputs, which service ports are dirty, and resolution.

Applying an input only records it and marks the service ports whose result may have
changed ("dirty"); nothing is computed until `resolve()`, which re-resolves just the
dirty ports and returns a new immutable `DesiredState` whose `changed` names the ports
whose result actually differs. Re-applying an identical object marks nothing.

A port's new resolution carries `delta`, how its endpoints differ from the previous
one, when nothing else changed (`_with_delta`); large ports find it in O(change)
(`incremental.PortIndex`), small ones by comparing the two.

An endpoint "source" is one EndpointSlice, or one legacy Endpoints object (which
decodes into several pseudo-slices): sources are replaced whole, and may move from one
service to another when a slice's service-name label changes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from proxy.model import skips as why
from proxy.model.balancing import choose
from proxy.model.incremental import PortIndex, PortResolution, endpoint_changes
from proxy.model.merge import merge_port
from proxy.model.nodeport_addresses import primary_ips
from proxy.model.selection import NodeView, categorize
from proxy.model.skips import Skip, clip, shown
from proxy.model.snapshot import (
    DesiredState,
    EndpointDelta,
    ResolvedServicePort,
    same_but_endpoints,
)
from proxy.model.types import (
    Balancing,
    EndpointSlice,
    Family,
    IPAddress,
    Node,
    Protocol,
    Service,
    ServicePort,
    ServicePortKey,
    ServiceType,
)

ServiceRef = tuple[str, str]  # (namespace, name)
SourceRef = tuple[str, str]  # (namespace, "EndpointSlice/<name>" or "Endpoints/<name>")
ObjectRef = tuple[str, str, str]  # (kind, namespace, name)
# A destination a service port claims: (IP, protocol, port) for its cluster, external
# and load-balancer IPs alike (one rule or virtual server matches them all), or
# (None, protocol, nodePort).
Claim = tuple[IPAddress | None, Protocol, int]

# Skip records kept per object; every skip is counted. A slice with 100,000 bad
# endpoints costs ten records and a count, not 100,000 records in memory and the dump.
RECORDS_PER_OBJECT = 10
# Service ports with at least this many endpoint copies keep an `incremental.PortIndex`
# between resolutions: one endpoint changed in a 50,000-endpoint service costs O(change)
# instead of merging and selecting all of them again. Smaller ports are cheap to redo,
# and an index for every one of them would cost memory for nothing.
MEMO_MIN_ENDPOINTS = 256


@dataclass(frozen=True, slots=True)
class SkipGroup:
    """What was skipped from one object: its first records and a count per reason."""

    records: tuple[Skip, ...]
    counts: tuple[tuple[str, int], ...]  # (reason, how many), sorted by reason
    # When it was recorded (a counter shared by all groups, newest highest): not part of
    # what was skipped, so two models holding the same input compare equal.
    seq: int = field(compare=False)

    @staticmethod
    def of(skips: Iterable[Skip], seq: int) -> SkipGroup:
        counts: Counter[str] = Counter()
        records: list[Skip] = []
        for s in skips:
            counts[s.reason] += 1
            if len(records) < RECORDS_PER_OBJECT:
                records.append(s)
        return SkipGroup(tuple(records), tuple(sorted(counts.items())), seq)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.counts)



def ignored_reason(service: Service, proxy_name: str | None) -> Skip | None:
    """Why a well-formed service is not ours to proxy, or None if it is."""
    reason, detail = "", ""
    if service.type is ServiceType.EXTERNAL_NAME:
        reason, detail = why.EXTERNAL_NAME, "ExternalName services are DNS-only"
    elif service.headless:
        reason, detail = why.HEADLESS, "clusterIP is None"
    elif service.proxy_name is not None and service.proxy_name != (proxy_name or None):
        reason = why.OTHER_PROXY
        detail = (f"service-proxy-name is {shown(service.proxy_name)}, "
                  f"ours is {proxy_name or ''!r}")
    elif not service.cluster_ips:
        reason, detail = why.NO_CLUSTER_IP, "no valid cluster IP"
    if not reason:
        return None
    return Skip("Service", service.namespace, service.name, reason, detail)


def _claims(service: Service | None) -> dict[Claim, tuple[str, ServicePort]]:
    return {} if service is None else claims_of(service)


def claims_of(service: Service) -> dict[Claim, tuple[str, ServicePort]]:
    """Every destination `service` claims -> (its role, the port). Within one service
    the decoder already keeps an address in one role and a port number once."""
    out: dict[Claim, tuple[str, ServicePort]] = {}
    for port in service.ports:
        for role, ips in (("cluster IP", service.cluster_ips),
                          ("load-balancer IP", service.load_balancer_ips),
                          ("external IP", service.external_ips)):
            for ip in ips:
                out.setdefault((ip, port.protocol, port.port), (role, port))
        if port.node_port:
            out.setdefault((None, port.protocol, port.node_port), ("NodePort", port))
    return out


def _claim_text(claim: Claim, role: str) -> str:
    ip, protocol, port = claim
    if ip is None:
        return f"{role} {port}/{protocol.value}"
    where = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"{role} {where}:{port}/{protocol.value}"


def _without(lost: frozenset[Claim], service: Service, port: ServicePort,
             cluster_ips: tuple[IPAddress, ...]
             ) -> tuple[Service, ServicePort, tuple[IPAddress, ...]]:
    """A service port without the destinations another service won from it."""
    def kept(ip: IPAddress) -> bool:
        return (ip, port.protocol, port.port) not in lost

    external = tuple(filter(kept, service.external_ips))
    balancer = tuple(filter(kept, service.load_balancer_ips))
    if external != service.external_ips or balancer != service.load_balancer_ips:
        service = replace(service, external_ips=external, load_balancer_ips=balancer)
    if port.node_port and (None, port.protocol, port.node_port) in lost:
        port = replace(port, node_port=0)
    return service, port, tuple(filter(kept, cluster_ips))


def service_keys(service: Service) -> Iterator[ServicePortKey]:
    for family in service.families():
        for port in service.ports:
            yield ServicePortKey(service.namespace, service.name, port.name, family)


class ClusterModel:
    def __init__(self, node_name: str, proxy_name: str | None = None,
                 balancing: Balancing = Balancing.RANDOM) -> None:
        self.node_name = node_name
        self.proxy_name = proxy_name or None
        self.balancing = balancing  # --default-balancing: for services that name none
        self._node = NodeView(node_name)
        self._node_obj: Node | None = None
        self._primary_ips: tuple[IPAddress, ...] = ()
        self._services: dict[ServiceRef, Service] = {}  # ours only
        self._ignored: dict[ServiceRef, SkipGroup] = {}
        self._sources: dict[SourceRef, tuple[str, tuple[EndpointSlice, ...]]] = {}
        # Each service's sources, sorted: a tuple, not a dict (a dict of one took 224
        # bytes a service); their slices are in _sources.
        self._by_service: dict[ServiceRef, tuple[str, ...]] = {}
        self._decode_skips: dict[ObjectRef, SkipGroup] = {}
        # Destinations claimed by our services, for arbitration between services that
        # claim the same one (a hostile or broken server; see claims_of). The holders
        # are a tuple: nearly every destination has one (a set each was 0.2 KB a service).
        self._claims: dict[Claim, tuple[ServiceRef, ...]] = {}
        self._lost: dict[ServiceRef, frozenset[Claim]] = {}
        self._conflicts: dict[ServiceRef, SkipGroup] = {}
        self._skip_seq = 0
        self._dirty: set[ServicePortKey] = set()
        self._state = DesiredState()
        self._memos: dict[ServicePortKey, PortIndex] = {}
        # Resolving ahead (before the first resolve, `resolve_ahead`): the ports whose
        # endpoints have arrived, in order, and their resolutions, not yet in `_state`.
        self._ahead: deque[ServicePortKey] | None = None
        self._resolved_ahead: dict[ServicePortKey, ResolvedServicePort | None] = {}

    # --- inputs ----------------------------------------------------------------------

    def apply_service(self, service: Service) -> None:
        ref = service.key
        skip = ignored_reason(service, self.proxy_name)
        if skip is not None:
            group = SkipGroup.of((skip,), self._skip_seq + 1)
            if group != self._ignored.get(ref):
                self._skip_seq += 1
                self._ignored[ref] = group
            self.delete_service(*ref, keep_ignored=True)
            return
        self._ignored.pop(ref, None)
        old = self._services.get(ref)
        if old == service:
            return
        self._services[ref] = service
        if old is not None:
            self._dirty.update(service_keys(old))
        self._dirty.update(service_keys(service))
        self._set_claims(ref, old, service)

    def delete_service(self, namespace: str, name: str, keep_ignored: bool = False) -> None:
        ref = (namespace, name)
        if not keep_ignored:
            self._ignored.pop(ref, None)
        old = self._services.pop(ref, None)
        if old is not None:
            self._dirty.update(service_keys(old))
            self._set_claims(ref, old, None)

    def _set_claims(self, ref: ServiceRef, was: Service | None, now: Service | None) -> None:
        """`ref`'s claims from those of `was` to those of `now`, and arbitrate again
        wherever that changed who claims what: the service whose (namespace, name) sorts
        first keeps a destination, as the IPVS index decides, so the outcome never depends
        on arrival order. A service's claims are not kept but made again from it (a
        dict each: 27 MiB at 100,000 services)."""
        old = _claims(was)
        new = _claims(now)
        touched = old.keys() ^ new.keys()
        for claim in old.keys() - new.keys():
            holders = tuple(r for r in self._claims[claim] if r != ref)
            if holders:
                self._claims[claim] = holders
            else:
                del self._claims[claim]
        for claim in new.keys() - old.keys():
            self._claims[claim] = (*self._claims.get(claim, ()), ref)
        affected = {ref}
        for claim in touched:
            affected.update(self._claims.get(claim, ()))
        for other in affected:
            self._arbitrate(other)

    def _arbitrate(self, ref: ServiceRef) -> None:
        claims = _claims(self._services.get(ref))
        lost: dict[Claim, ServiceRef] = {}
        for claim in claims:
            holders = self._claims[claim]
            if len(holders) > 1 and (winner := min(holders)) != ref:
                lost[claim] = winner
        if frozenset(lost) != self._lost.get(ref, frozenset()):
            if lost:
                self._lost[ref] = frozenset(lost)
            else:
                self._lost.pop(ref, None)
            service = self._services.get(ref)
            if service is not None:
                self._dirty.update(service_keys(service))
        if not lost:  # most services (SkipGroup.of makes a Counter: 2 % of a list)
            self._conflicts.pop(ref, None)
            return
        skips = sorted(
            (Skip("Service", ref[0], ref[1], why.CONFLICT,
                  f"{_claim_text(claim, claims[claim][0])} is also claimed by "
                  f"{winner[0]}/{winner[1]}, which keeps it",
                  f"ports[{claims[claim][1].name or claims[claim][1].port}]")
             for claim, winner in lost.items()), key=lambda s: (s.part, s.detail))
        group = SkipGroup.of(skips, self._skip_seq + 1)
        if group != self._conflicts.get(ref):
            self._skip_seq += 1
            self._conflicts[ref] = group

    def apply_slice(self, sl: EndpointSlice) -> None:
        self.apply_source(sl.namespace, f"EndpointSlice/{sl.name}", sl.service_name, (sl,))

    def delete_slice(self, namespace: str, name: str) -> None:
        self.delete_source(namespace, f"EndpointSlice/{name}")

    def apply_endpoints(self, namespace: str, name: str, slices: tuple[EndpointSlice, ...]) -> None:
        """A legacy Endpoints object, decoded into pseudo-slices (possibly none)."""
        self.apply_source(namespace, f"Endpoints/{name}", name, slices)

    def delete_endpoints(self, namespace: str, name: str) -> None:
        self.delete_source(namespace, f"Endpoints/{name}")

    def apply_source(
        self, namespace: str, source: str, service_name: str, slices: tuple[EndpointSlice, ...]
    ) -> None:
        ref = (namespace, source)
        new = (service_name, slices)
        old = self._sources.get(ref)
        if old == new:
            return
        if old is not None:
            self._unlink(namespace, source, *old)
        self._sources[ref] = new
        group = (namespace, service_name)
        self._by_service[group] = tuple(sorted((*self._by_service.get(group, ()), source)))
        self._mark_slices(namespace, service_name, slices)

    def delete_source(self, namespace: str, source: str) -> None:
        old = self._sources.pop((namespace, source), None)
        if old is not None:
            self._unlink(namespace, source, *old)

    def _unlink(
        self, namespace: str, source: str, service_name: str, slices: tuple[EndpointSlice, ...]
    ) -> None:
        group = (namespace, service_name)
        rest = tuple(s for s in self._by_service.get(group, ()) if s != source)
        if rest:
            self._by_service[group] = rest
        else:
            self._by_service.pop(group, None)
        self._mark_slices(namespace, service_name, slices)

    def _mark_slices(
        self, namespace: str, service_name: str, slices: Iterable[EndpointSlice]
    ) -> None:
        service = self._services.get((namespace, service_name))
        if service is None:
            return  # kept; the service's arrival marks all its ports
        touched = {(sp.name, sl.family) for sl in slices for sp in sl.ports}
        for key in service_keys(service):
            if (key.port, key.family) in touched:
                self._dirty.add(key)
                if self._ahead is not None:
                    self._ahead.append(key)

    def set_node(self, node: Node) -> None:
        """This node's own Node object; topology labels feed selection, and its primary
        addresses the next snapshot (a change of them asks for a sync: `has_dirty`)."""
        if node.name != self.node_name:
            return
        self._node_obj = node
        self._primary_ips = primary_ips(node.addresses)
        view = NodeView(self.node_name, node.zone)
        if view != self._node:
            self._node = view
            self.mark_all_dirty()

    def set_skips(self, kind: str, namespace: str, name: str, skips: Sequence[Skip]) -> bool:
        """Remember what the decoder dropped from one object (replacing earlier records).
        True when that changed what is recorded (an identical object re-applied, as at a
        relist, changes nothing and stays where it was in the "recent" order)."""
        ref = (kind, clip(namespace), clip(name))
        if not skips:  # most objects (SkipGroup.of makes a Counter: 2 % of a list)
            return self._decode_skips.pop(ref, None) is not None
        group = SkipGroup.of(skips, self._skip_seq + 1)
        if group == self._decode_skips.get(ref):
            return False
        self._skip_seq += 1
        self._decode_skips[ref] = group
        return True

    def mark_all_dirty(self) -> None:
        for service in self._services.values():
            self._dirty.update(service_keys(service))

    # --- outputs ---------------------------------------------------------------------

    @property
    def state(self) -> DesiredState:
        return self._state

    @property
    def node(self) -> Node | None:
        return self._node_obj

    @property
    def node_view(self) -> NodeView:
        return self._node

    @property
    def primary_ips(self) -> tuple[IPAddress, ...]:
        """The node's primary addresses as its Node object says now (the snapshot's
        follow at the next `resolve`)."""
        return self._primary_ips

    @property
    def dirty(self) -> frozenset[ServicePortKey]:
        return frozenset(self._dirty)

    @property
    def resolved_ahead(self) -> int:
        """Ports resolved ahead of the next `resolve` (`resolve_ahead`)."""
        return len(self._resolved_ahead)

    @property
    def has_dirty(self) -> bool:
        """Some service port, or the node's primary addresses, await a resolve: asked on
        every event, so O(1) (`dirty` copies the set: under churn held back by the CPU
        budget that was O(backlog) per event)."""
        return bool(self._dirty) or self._primary_ips != self._state.primary_ips

    def _skip_groups(self) -> Iterator[SkipGroup]:
        yield from self._decode_skips.values()
        yield from self._ignored.values()
        yield from self._conflicts.values()

    def skipped(self) -> list[Skip]:
        """The skip records kept (at most RECORDS_PER_OBJECT per object), sorted."""
        out = [s for group in self._skip_groups() for s in group.records]
        return sorted(out, key=lambda s: (s.kind, s.namespace, s.name, s.part, s.reason))

    def skip_counts(self) -> dict[tuple[str, str], int]:
        """(kind, reason) -> how many things are skipped now, records kept or not."""
        out: Counter[tuple[str, str]] = Counter()
        for group in self._skip_groups():
            kind = group.records[0].kind
            for reason, n in group.counts:
                out[(kind, reason)] += n
        return dict(out)

    def skip_objects(self) -> int:
        """How many objects have something skipped (or are not ours to proxy)."""
        # A service that lost a destination may have had parts skipped by the decoder
        # too: one object. (An ignored service claims nothing, so never conflicts.)
        conflicted = sum(1 for ns, name in self._conflicts
                         if ("Service", clip(ns), clip(name)) not in self._decode_skips)
        return len(self._decode_skips) + len(self._ignored) + conflicted

    def recent_skips(self, limit: int) -> list[Skip]:
        """Up to `limit` records, from the objects whose records changed last first."""
        out: list[Skip] = []
        for group in sorted(self._skip_groups(), key=lambda g: g.seq, reverse=True):
            out.extend(group.records[:limit - len(out)])
            if len(out) >= limit:
                break
        return out

    def resolve(self, full: bool = False) -> DesiredState:
        """Resolve the dirty service ports (every port if `full`) into a new snapshot,
        with what was resolved ahead (and stayed clean since)."""
        if full:
            self.mark_all_dirty()
            self._dirty.update(self._state.ports)
        updates, self._resolved_ahead, self._ahead = self._resolved_ahead, {}, None
        updates.update((key, self.resolve_key(key)) for key in self._dirty)
        for key, value in updates.items():
            if value is None:
                self._memos.pop(key, None)
        self._dirty.clear()
        self._state = self._state.evolve(updates, self._primary_ips)
        return self._state

    def port_counts(self) -> dict[Family, int]:
        """How many service ports each family has (resolved or not). O(services)."""
        return dict(Counter(k.family for svc in self._services.values()
                            for k in service_keys(svc)))

    def resolve_ahead(self, limit: int) -> list[ResolvedServicePort]:
        """Before the first sync, while endpoints are still listing: resolve up to
        `limit` dirty ports whose endpoints have arrived (those dirty when this was first
        called, then as their endpoints arrive), keeping the results for the next
        `resolve`, which ends resolving ahead. The cold start's resolution is then
        done while the agent waits for the API server's lists. A port whose endpoints
        arrive again is dirty again and resolved again. What it resolved (ports gone
        left out): empty when none is waiting."""
        if self._ahead is None:
            self._ahead = deque(k for k in self._dirty
                                if (k.namespace, k.name) in self._by_service)
        done: list[ResolvedServicePort] = []
        tried = 0
        while self._ahead and tried < limit:
            key = self._ahead.popleft()
            if key in self._dirty:
                rsp = self._resolved_ahead[key] = self.resolve_key(key)
                self._dirty.discard(key)  # only once resolved: a failure leaves it dirty
                tried += 1
                if rsp is not None:
                    done.append(rsp)
        return done

    def resolve_key(self, key: ServicePortKey) -> ResolvedServicePort | None:
        """The key's resolution; the previous one itself when nothing changed, so its
        token stays; else a new one with the endpoint delta from it when only the
        endpoints changed (ResolvedServicePort.delta)."""
        service = self._services.get((key.namespace, key.name))
        if service is None:
            return None
        port = next((p for p in service.ports if p.name == key.port), None)
        if port is None or key.family not in service.families():
            return None
        sources = self._sources
        slices = [sl for source in self._by_service.get((key.namespace, key.name), ())
                  for sl in sources[key.namespace, source][1]]
        cluster_ips = service.cluster_ips  # the service's own tuple where it is one family
        if any(Family.of(ip) is not key.family for ip in cluster_ips):
            cluster_ips = tuple(ip for ip in cluster_ips if Family.of(ip) is key.family)
        lost = self._lost.get((key.namespace, key.name))
        if lost:
            service, port, cluster_ips = _without(lost, service, port, cluster_ips)
        previous = self._state.get(key)
        index = self._index_for(key, port, slices)
        if index is None:
            res = self._resolve_small(slices, service, port, key.family)
        else:
            res = index.resolve(slices, service, port, self._node)
        resolved = ResolvedServicePort(
            key=key,
            service=service,
            port=port,
            cluster_ips=cluster_ips,
            uses_cluster=res.uses_cluster,
            uses_local=res.uses_local,
            endpoints=res.endpoints,
            topology=res.topology,
            conflicts=res.conflicts,
            balancing=choose(service, self.balancing),
        )
        resolved = _with_delta(resolved, previous, res, index)
        if index is not None:
            index.base = resolved.token
        return resolved

    def _index_for(self, key: ServicePortKey, port: ServicePort,
                   slices: list[EndpointSlice]) -> PortIndex | None:
        """The port's index if it is large enough to keep one (a new one when its port
        name, protocol or family changed), else None (and any index dropped)."""
        if sum(len(sl.endpoints) for sl in slices) < MEMO_MIN_ENDPOINTS:
            self._memos.pop(key, None)
            return None
        tag = (port.name, port.protocol, key.family)
        index = self._memos.get(key)
        if index is None or index.tag != tag:
            index = self._memos[key] = PortIndex(tag, self._node)
        return index

    def _resolve_small(self, slices: list[EndpointSlice], service: Service,
                       port: ServicePort, family: Family) -> PortResolution:
        """Merge and select from scratch; removed and added are left empty (the
        delta, if any, is found by comparing with the previous resolution)."""
        merged, conflicts = merge_port(slices, port.name, port.protocol, family)
        sel = categorize(merged, service, port, self._node, family)
        return PortResolution(sel.endpoints, sel.topology, sel.uses_cluster,
                              sel.uses_local, conflicts, (), ())


def _with_delta(new: ResolvedServicePort, previous: ResolvedServicePort | None,
                res: PortResolution, index: PortIndex | None) -> ResolvedServicePort:
    """`previous` if `new` equals it; else `new`, with its endpoint delta from
    `previous` when only the endpoints differ and the delta is known exactly: from the
    index when its last resolution became `previous`, by comparison for a small port.

    No delta (data planes render the port whole) when anything else differs. The
    topology's reason is the exception: it is text for the dump that names a count
    under a preference ("3 ready endpoint(s) in zone a"), so it changes with every
    ready endpoint in that domain, and no data plane renders it; its mode decides the
    verdicts, which the delta carries. Nor when the index is new (first resolution, a
    port grown past MEMO_MIN_ENDPOINTS, a protocol changed)."""
    if previous is None or not same_but_endpoints(new, previous):
        return new
    if index is not None:
        if res.since is not previous.token:
            # A new index (a port grown large, another protocol), or `previous` made
            # without it: its changes are not from `previous`. Rare, so compare whole.
            if new == previous:
                index.adopt(previous.endpoints)
                return previous
            return new
        removed, added = res.removed, res.added
    elif new.endpoints == previous.endpoints:
        removed, added = (), ()
    else:
        removed, added = endpoint_changes(previous.endpoints, new.endpoints)
    if not removed and not added and new.topology == previous.topology:
        return previous
    # An empty delta: only the topology's reason changed; nothing to render.
    delta = EndpointDelta(base=previous.token, removed=removed, added=added)
    return replace(new, delta=delta)

"""The desired state: what every service port should do on this node.

A `DesiredState` is immutable. The resolver builds a new one from the previous one
plus the dirty service ports, so a data plane can keep the last one it applied and
ask `changed_since(last)` which keys to re-render on a partial sync: the state's own
`changed` when it was evolved straight from `last` (O(changes)), a scan of both
otherwise (a state skipped in between, or one built by hand).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from proxy.model.frozen import fast_init, slot_setter
from proxy.model.layered import Layered, layer
from proxy.model.types import (
    Balancing,
    Endpoint,
    IPAddress,
    Protocol,
    Service,
    ServicePort,
    ServicePortKey,
    format_endpoint,
)


class _CopyFields:
    """An endpoint's fields as its chosen copy (`copy`, an `Endpoint`) holds them, and
    its text (address:port)."""

    __slots__ = ()
    copy: Endpoint
    port: int

    def __str__(self) -> str:
        return format_endpoint(self.address, self.port)

    @property
    def address(self) -> IPAddress:
        return self.copy.address

    @property
    def packed(self) -> bytes:
        return self.copy.packed

    @property
    def ready(self) -> bool:
        return self.copy.ready

    @property
    def serving(self) -> bool:
        return self.copy.serving

    @property
    def terminating(self) -> bool:
        return self.copy.terminating

    @property
    def node_name(self) -> str | None:
        return self.copy.node_name

    @property
    def zone(self) -> str | None:
        return self.copy.zone

    @property
    def zone_hints(self) -> tuple[str, ...]:
        return self.copy.zone_hints

    @property
    def node_hints(self) -> tuple[str, ...]:
        return self.copy.node_hints


@fast_init
@dataclass(frozen=True, slots=True)
class MergedEndpoint(_CopyFields):
    """One endpoint of a service port after merging all slices and de-duplicating: the
    chosen copy (`copy`, the slice's own `Endpoint`), at `port`, listed by `sources`.

    The copy is held, not its fields copied: 64 bytes an endpoint, a million of them at
    100,000 services x 10, and 4 fields for the merge to make. Its fields read as the
    copy's."""

    copy: Endpoint
    port: int
    sources: tuple[str, ...]  # names of the slices that listed it, sorted
    conflict: bool = False  # its copies disagreed on conditions, node or zone


@dataclass(frozen=True, slots=True)
class Conflict:
    """Copies of one endpoint that disagree; `chosen` names the slice that won."""

    endpoint: str  # "ip:port"
    slices: tuple[str, ...]
    fields: tuple[str, ...]  # which of ready/serving/terminating/node/zone differ
    chosen: str


class EndpointSet(enum.Enum):
    CLUSTER = "cluster"
    LOCAL = "local"

    # Members are singletons compared by identity: hashed by it too, in C (Enum's own
    # hashes the name in Python, and every `in_cluster` of every endpoint asks).
    __hash__ = object.__hash__


# What a selected endpoint shares with the others of its port selected alike: (port,
# sources, conflict, selected_for, reason).
Selection = tuple[int, tuple[str, ...], bool, frozenset[EndpointSet], str]


@dataclass(frozen=True, slots=True, init=False)
class SelectedEndpoint(_CopyFields):
    """A merged endpoint (`endpoint`) and the sets this node may send it traffic in,
    and why. The merged endpoint's copy is held here, not the merged endpoint: one object
    an endpoint, not two. Its port, sources, conflict, sets and reason are one tuple
    (`selection`), shared by the endpoints of its port selected alike (`like`): two
    fields, 48 bytes an endpoint where six took 80 (30 MiB at 100,000 x 10)."""

    copy: Endpoint
    selection: Selection

    def __init__(self, copy: Endpoint, port: int, sources: tuple[str, ...], conflict: bool,
                 selected_for: frozenset[EndpointSet], reason: str) -> None:
        _set_copy(self, copy)
        _set_selection(self, (port, sources, conflict, selected_for, reason))

    @staticmethod
    def of(ep: MergedEndpoint, selected_for: frozenset[EndpointSet],
           reason: str) -> SelectedEndpoint:
        return SelectedEndpoint(ep.copy, ep.port, ep.sources, ep.conflict, selected_for,
                                reason)

    def like(self, ep: MergedEndpoint) -> SelectedEndpoint:
        """`ep` in this one's sets for this one's reason (a hot path: most endpoints of
        a cold start), sharing this one's selection where its port, sources and conflict
        are this one's too."""
        selection = self.selection
        port, sources, conflict, selected_for, reason = selection
        if ep.port != port or ep.sources is not sources or ep.conflict is not conflict:
            return SelectedEndpoint.of(ep, selected_for, reason)
        out: SelectedEndpoint = _new_selected(SelectedEndpoint)
        _set_copy(out, ep.copy)
        _set_selection(out, selection)
        return out

    @property
    def port(self) -> int:  # type: ignore[override]  # a field in MergedEndpoint
        return self.selection[0]

    @property
    def sources(self) -> tuple[str, ...]:
        return self.selection[1]

    @property
    def conflict(self) -> bool:
        return self.selection[2]

    @property
    def selected_for(self) -> frozenset[EndpointSet]:
        return self.selection[3]

    @property
    def reason(self) -> str:
        return self.selection[4]

    @property
    def endpoint(self) -> MergedEndpoint:
        """Made at each call: read `address`, `port` and the rest from this one."""
        return MergedEndpoint(self.copy, self.port, self.sources, self.conflict)

    @property
    def in_cluster(self) -> bool:
        return EndpointSet.CLUSTER in self.selection[3]

    @property
    def in_local(self) -> bool:
        return EndpointSet.LOCAL in self.selection[3]


_set_copy = slot_setter(SelectedEndpoint, "copy")
_set_selection = slot_setter(SelectedEndpoint, "selection")
_new_selected = object.__new__


@dataclass(frozen=True, slots=True)
class Topology:
    """Which topology narrowing applied to the cluster set, and why.

    `mode` is one of: "cluster" (no narrowing), "hints-node", "hints-zone",
    "prefer-node", "prefer-zone". `requested` says what the service asked for.
    """

    mode: str
    requested: str
    reason: str


@fast_init
@dataclass(frozen=True, slots=True)
class EndpointDelta:
    """How a port's endpoints differ from one earlier resolution of the same port, when
    nothing but its endpoints changed: what a data plane needs to re-render only the
    endpoints that changed (O(change)) instead of the whole port (O(service)).

    "Nothing but its endpoints": service, port, cluster IPs, the sets used, conflicts
    and the topology's mode are the same; the topology's reason (dump text with counts
    in it) may differ, so a data plane must not render it.

    `base` is the earlier `ResolvedServicePort.token` (a token, not the port: a chain of
    deltas must not keep every earlier endpoint tuple alive). An endpoint whose
    conditions, node, zone, hints or selection changed is in both: its old
    `SelectedEndpoint` in `removed`, its new one in `added`.
    """

    base: object
    removed: tuple[SelectedEndpoint, ...]
    added: tuple[SelectedEndpoint, ...]


@fast_init
@dataclass(frozen=True, slots=True)
class ResolvedServicePort:
    key: ServicePortKey
    service: Service
    port: ServicePort
    cluster_ips: tuple[IPAddress, ...]  # this family's cluster IPs
    uses_cluster: bool  # some traffic to this port uses the cluster set
    uses_local: bool  # some traffic to this port uses the local set (policy Local)
    endpoints: tuple[SelectedEndpoint, ...]  # every merged endpoint, sorted by address, port
    topology: Topology
    conflicts: tuple[Conflict, ...] = ()
    # How a new connection picks its endpoint: the service's annotation, else the node's
    # --default-balancing (balancing.choose).
    balancing: Balancing = Balancing.RANDOM
    # Identity of this resolution, and how its endpoints differ from the previous one
    # (None: unknown, or more than the endpoints changed). Not part of equality.
    token: object = field(default_factory=object, compare=False, repr=False)
    delta: EndpointDelta | None = field(default=None, compare=False, repr=False)

    def endpoint_delta(self, earlier: ResolvedServicePort | None) -> EndpointDelta | None:
        """The endpoint changes from `earlier` to this, if only endpoints changed and the
        model recorded them against exactly `earlier`; None means re-render the port whole.
        The promise is checked here too (O(1) of the endpoints): a data plane trusting a
        wrong one would keep wrong rules until the next full sync."""
        if earlier is None or self.delta is None or self.delta.base is not earlier.token:
            return None
        return self.delta if same_but_endpoints(earlier, self) else None

    @property
    def cluster_endpoints(self) -> tuple[SelectedEndpoint, ...]:
        return tuple(s for s in self.endpoints if s.in_cluster)

    @property
    def local_endpoints(self) -> tuple[SelectedEndpoint, ...]:
        return tuple(s for s in self.endpoints if s.in_local)

    @property
    def has_any_endpoints(self) -> bool:
        """Usable endpoints exist somewhere in the cluster (upstream `hasAnyEndpoints`)."""
        return any(s.ready or (s.serving and s.terminating) for s in self.endpoints)


def _differs(old: ResolvedServicePort | None, new: ResolvedServicePort) -> bool:
    if old is None or old is new:
        return old is None
    # A delta from `old` names what changed (the model records none when nothing did):
    # no need to compare 50,000 endpoints to find that out.
    return (new.delta is not None and new.delta.base is old.token) or old != new


class DesiredState:
    """Every service port this node proxies, plus what changed since the previous state.

    Read-only by contract: `ports` is a read-only view. The resolver derives the next
    state with `evolve` in O(changes): the states share a base dict, each with the
    changes since over it (layered.py), folded into a new base now and then.
    """

    __slots__ = ("_base", "_datagram", "_over", "_parent", "_token", "changed", "conflicts",
                 "datagram_ports", "generation", "ports", "primary_ips")

    def __init__(
        self,
        ports: dict[ServicePortKey, ResolvedServicePort] | None = None,
        changed: frozenset[ServicePortKey] = frozenset(),
        generation: int = 0,
        parent: object | None = None,
        primary_ips: tuple[IPAddress, ...] = (),
        overlay: dict[ServicePortKey, object] | None = None,
        size: int = 0,
        conflicts: int | None = None,
        datagram: _Layers | None = None,
    ) -> None:
        """`ports`, with `overlay` and its `size` over it if given (layered.py): never
        written again. `conflicts`: their endpoints in conflict, if known; `datagram`:
        the layers of `datagram_ports`, if known."""
        self._base = ports if ports is not None else {}
        self._over = overlay or {}
        # A plain dict's view while nothing is layered over it: lookups at C speed.
        self.ports: Mapping[ServicePortKey, ResolvedServicePort] = \
            Layered(self._base, self._over, size) if self._over \
            else MappingProxyType(self._base)
        # Keys added, removed or changed relative to the previous snapshot.
        self.changed = changed
        # Endpoints in conflict over every port (a metric read at each scrape): kept by
        # `evolve` in O(changes), as summing 100,000 ports took 50-80 ms of the loop.
        self.conflicts = sum(len(rsp.conflicts) for rsp in self.ports.values()) \
            if conflicts is None else conflicts
        # The UDP and SCTP ports alone (conntrack is reconciled for them: a walk of every
        # port was 80-100 ms of the data plane's thread at 100,000 in the agent, each
        # object a cache miss), layered as `ports` and kept by `evolve` in O(changes).
        if datagram is None:
            dg = {k: rsp for k, rsp in self.ports.items() if rsp.port.protocol in DATAGRAM}
            datagram = (dg, {}, len(dg))
        self._datagram = datagram
        self.datagram_ports: Mapping[ServicePortKey, ResolvedServicePort] = \
            Layered(*datagram) if datagram[1] else MappingProxyType(datagram[0])
        self.generation = generation
        # Lineage by token, not by reference: a state holding its parent would keep
        # every earlier snapshot alive.
        self._token = object()
        self._parent = parent
        # This node's primary addresses, from its Node object (the primary family first;
        # empty while unknown): `--nodeport-addresses primary` stands for them.
        self.primary_ips = primary_ips

    def evolve(
        self,
        updates: dict[ServicePortKey, ResolvedServicePort | None],
        primary_ips: tuple[IPAddress, ...] | None = None,
    ) -> DesiredState:
        """The next state: `updates` maps a key to its new value, or None to remove it;
        `primary_ips` replaces the node's primary addresses (None keeps them)."""
        primary = self.primary_ips if primary_ips is None else primary_ips
        if not updates:
            return DesiredState(self._base, frozenset(), self.generation + 1, self._token,
                                primary, self._over, len(self.ports), self.conflicts,
                                self._datagram)
        base, over, size, changed = layer(self._base, self._over, len(self.ports), updates,
                                          _differs)
        # A changed key holds its update now (None: removed).
        conflicts = self.conflicts + sum(_conflicts(updates[k]) - _conflicts(self.ports.get(k))
                                         for k in changed)
        datagram = layer(*self._datagram, self._datagram_updates(updates, changed),
                         _not_same)[:3]
        return DesiredState(base, frozenset(changed), self.generation + 1, self._token,
                            primary, over, size, conflicts, datagram)

    def _datagram_updates(self, updates: dict[ServicePortKey, ResolvedServicePort | None],
                          changed: set[ServicePortKey]
                          ) -> dict[ServicePortKey, ResolvedServicePort | None]:
        """`updates` for `datagram_ports`: what is or was UDP or SCTP alone (a start's
        100,000 TCP ports add nothing there)."""
        held = self.datagram_ports
        out: dict[ServicePortKey, ResolvedServicePort | None] = {}
        for key in changed:
            rsp = updates[key]
            if rsp is not None and rsp.port.protocol in DATAGRAM:
                out[key] = rsp
            elif key in held:
                out[key] = None  # gone, or no longer UDP or SCTP
        return out

    def changed_since(self, earlier: DesiredState | None) -> frozenset[ServicePortKey]:
        """Keys whose entry differs from `earlier`'s (None: every key). Unchanged entries
        are the same objects in both (`evolve` keeps them), so identity decides."""
        if earlier is self:
            return frozenset()
        if earlier is None:
            return frozenset(self.ports)
        if self._parent is earlier._token:
            return self.changed
        mine, theirs = self.ports, earlier.ports
        return frozenset(k for k in mine.keys() | theirs.keys()
                         if mine.get(k) is not theirs.get(k))

    def __iter__(self) -> Iterator[ResolvedServicePort]:
        return iter(self.ports.values())

    def __len__(self) -> int:
        return len(self.ports)

    def get(self, key: ServicePortKey) -> ResolvedServicePort | None:
        return self.ports.get(key)


def _conflicts(rsp: ResolvedServicePort | None) -> int:
    return 0 if rsp is None else len(rsp.conflicts)


DATAGRAM = frozenset({Protocol.UDP, Protocol.SCTP})  # a flow is a conntrack entry
# A layered mapping's base, overlay and size (layered.py).
_Layers = tuple[dict[ServicePortKey, "ResolvedServicePort"], dict[ServicePortKey, object], int]


def _not_same(old: ResolvedServicePort | None, new: ResolvedServicePort) -> bool:
    return old is not new


def same_but_endpoints(a: ResolvedServicePort, b: ResolvedServicePort) -> bool:
    """Everything but the endpoints (and the topology's reason, dump text) is equal: when
    the model may record an `EndpointDelta` between the two (`EndpointDelta`'s doc)."""
    return (a.key == b.key and a.service == b.service and a.port == b.port
            and a.cluster_ips == b.cluster_ips and a.uses_cluster == b.uses_cluster
            and a.uses_local == b.uses_local and a.topology.mode == b.topology.mode
            and a.topology.requested == b.topology.requested and a.conflicts == b.conflicts
            and a.balancing is b.balancing)

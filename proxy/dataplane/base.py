"""The contract between the agent and a data plane (iptables, nftables or IPVS).

The agent owns one data plane and calls it from one dedicated worker thread (never
from the event loop): data planes are plain blocking code, and pyroute2's netlink
sockets, which must stay on one thread, live there too (FINDINGS: its async classes do
not run on uvloop and its sync calls fail inside a running loop).

A data plane keeps the last `DesiredState` it applied successfully and works out for
itself what differs (entries of two snapshots are shared objects, so an unchanged
service port is the same object in both): a resolve whose apply failed is never lost,
because the next sync still compares against what is really in the kernel's rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family, IPAddress, IPNetwork, ServicePortKey


@dataclass(frozen=True, slots=True)
class DataplaneOptions:
    """What the data planes need from the configuration (kube-proxy's flags)."""

    node_name: str
    # --cluster-cidr: traffic to a service from outside these is masqueraded.
    cluster_cidrs: tuple[IPNetwork, ...] = ()
    # --masquerade-all: masquerade every packet sent to a service IP.
    masquerade_all: bool = False
    # --nodeport-addresses: node addresses that accept NodePort traffic, as CIDRs, and
    # whether `primary` was given (the node's primary addresses, which each snapshot
    # carries: DesiredState.primary_ips); neither = every local address.
    nodeport_addresses: tuple[IPNetwork, ...] = ()
    nodeport_primary: bool = False
    # Families to program; a family whose tools or kernel support are missing is
    # dropped at start-up with a log line, not at every sync.
    families: tuple[Family, ...] = (Family.V4, Family.V6)
    # iptables only: "restore" (iptables-restore, both back ends and families) or
    # "iptc" (python-iptables; legacy IPv4 tables only, IPv6 still goes through restore).
    iptables_applier: str = "restore"
    # IPVS only.
    ipvs_scheduler: str = "rr"
    # IPVS only: how long a real server that left keeps weight 0 for its open
    # connections before it is deleted anyway.
    ipvs_drain_timeout: float = 900.0
    # --fail-fast: reset TCP flows to endpoints that left, for services without the
    # sliceproxy.io/fail-fast annotation (common/fail_fast.py).
    fail_fast: bool = False
    # --traffic-per-endpoint: count each endpoint's new connections, for services without
    # the sliceproxy.io/traffic-per-endpoint annotation (common/traffic.py).
    traffic_per_endpoint: bool = False


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What one successful sync did, for logs, metrics and the debug dump."""

    full: bool
    # Service ports whose rules were (re)written, and those whose rules were removed.
    written: tuple[ServicePortKey, ...] = ()
    removed: tuple[ServicePortKey, ...] = ()
    # Size of what was sent to the kernel: iptables-restore lines, or netlink calls.
    operations: int = 0
    # Seconds spent in the kernel-facing step alone (restore binary, netlink calls).
    apply_seconds: float = 0.0
    # Stale conntrack entries cleared after the apply, and the same by reason
    # (conntrack.py's after a change, conntrack_reconcile.py's after a first or full sync).
    conntrack_cleared: int = 0
    conntrack_deleted: dict[str, int] = field(default_factory=dict)
    # TCP flows to endpoints that left, reset (common/fail_fast.py; opt-in).
    flows_reset: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    # What to add to the counters only this mode has (modes.py declares them), by name:
    # the agent counts them without knowing which mode it runs.
    counted: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Counted:
    """What the kernel counted: new connections (a UDP or SCTP flow is one), and where
    the mode's counters see every packet (IPVS), packets and bytes both ways."""

    connections: int
    packets: int | None = None
    bytes: int | None = None

    def __add__(self, other: Counted) -> Counted:
        return Counted(self.connections + other.connections,
                       _plus(self.packets, other.packets), _plus(self.bytes, other.bytes))


def _plus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


NOTHING = Counted(0)


@dataclass(frozen=True, slots=True)
class PortTraffic:
    """One service port's traffic (common/traffic.py): in total, and by endpoint
    (address, port) where the port is counted per endpoint (None where it is not)."""

    total: Counted
    endpoints: Mapping[tuple[IPAddress, int], Counted] | None = None


# A Counted as kept: its connections alone (nftables, iptables), else all three as an
# exact tuple of numbers, which the collector stops tracking at its first look.
Packed = int | tuple[int, int | None, int | None]
# A port's reading as kept: its key, its total, and its endpoints' where counted.
PackedPort = tuple[ServicePortKey, Packed, Mapping[tuple[IPAddress, int], Packed] | None]


class TrafficByPort(Mapping[ServicePortKey, PortTraffic]):
    """A reading's ports, kept as plain numbers by port and given as `PortTraffic` when
    asked. Why: a reading of 100,000 ports kept as objects (a PortTraffic and a Counted
    each) is 200,000 objects the collector tracks, so each reading set off about two full
    collections, each of which scans what the process has not frozen: 93-191 ms apiece
    in the agent at 100,000 services x 10, on the event loop's thread (bench/RESULTS.md).
    Ints and tuples of numbers are not tracked; only a port counted per endpoint keeps
    one tracked dict (its endpoints' addresses are tracked objects, shared with the
    plan's)."""

    __slots__ = ("_endpoints", "_totals")

    def __init__(self) -> None:
        self._totals: dict[ServicePortKey, Packed] = {}
        self._endpoints: dict[ServicePortKey, dict[tuple[IPAddress, int], Packed]] = {}

    def add_connections(self, key: ServicePortKey, connections: int) -> None:
        """`key` counted in total only, connections only (the common case, no object)."""
        self._totals[key] = connections

    def add(self, key: ServicePortKey, traffic: PortTraffic) -> None:
        self._totals[key] = _pack(traffic.total)
        if traffic.endpoints is not None:
            self._endpoints[key] = {ep: _pack(c) for ep, c in traffic.endpoints.items()}
        else:
            self._endpoints.pop(key, None)

    def __getitem__(self, key: ServicePortKey) -> PortTraffic:
        total = _unpack(self._totals[key])
        endpoints = self._endpoints.get(key)
        return PortTraffic(total, None if endpoints is None else {
            ep: _unpack(c) for ep, c in endpoints.items()})

    def __iter__(self) -> Iterator[ServicePortKey]:
        return iter(self._totals)

    def __len__(self) -> int:
        return len(self._totals)

    def __contains__(self, key: object) -> bool:
        return key in self._totals

    def packed(self) -> Iterator[PackedPort]:
        """Each port as kept, with no object made (server/traffic.py's text: making a
        PortTraffic for each of 100,000 ports doubled its 0.13 s)."""
        endpoints = self._endpoints
        for key, total in self._totals.items():
            yield key, total, endpoints.get(key)


def packed_ports(ports: Mapping[ServicePortKey, PortTraffic]) -> Iterator[PackedPort]:
    """`ports` as `TrafficByPort.packed` gives them, whatever mapping holds them."""
    if isinstance(ports, TrafficByPort):
        return ports.packed()
    return ((key, _pack(pt.total), None if pt.endpoints is None else {
        ep: _pack(c) for ep, c in pt.endpoints.items()}) for key, pt in ports.items())


def unpacked(p: Packed) -> tuple[int, int | None, int | None]:
    """A kept count's connections, packets and bytes (None where not counted)."""
    return (p, None, None) if isinstance(p, int) else p


def _pack(c: Counted) -> Packed:
    if c.packets is None and c.bytes is None:
        return c.connections
    return (c.connections, c.packets, c.bytes)


def _unpack(p: Packed) -> Counted:
    return Counted(p) if isinstance(p, int) else Counted(*p)


TrafficRead = Callable[[], Mapping[ServicePortKey, PortTraffic]]
# What a reading on a thread of its own calls where it can pause: to offer the
# interpreter's lock, or to wait for a change's sync (common/priority.py).
GiveWay = Callable[[], None]


def offer_lock() -> None:
    """A reading's pause with nothing to wait for: the interpreter's lock offered to any
    thread waiting for it."""
    time.sleep(0)


def read_now(plane: DataPlane) -> TrafficRead:
    """`traffic_reader` for a mode whose reading needs the data plane's thread: read
    now, the function returns that reading."""
    ports = plane.traffic()
    return lambda: ports


class ApplyError(Exception):
    """An apply failed; the kernel still holds the previously applied rules.

    `offending` is the line or operation the kernel refused, when known; `counted`, as
    SyncReport's, what the failure adds to the mode's own counters. The data plane has
    already arranged for its next sync to be a full one.
    """

    def __init__(self, message: str, offending: str | None = None,
                 counted: Mapping[str, int] | None = None) -> None:
        super().__init__(message)
        self.offending = offending
        self.counted = dict(counted or {})


class DataPlane(Protocol):
    @property
    def mode(self) -> str:
        """The mode's name, as proxy/dataplane/modes.py declares it."""
        ...

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        """Make the kernel match `state`. Blocking; raises ApplyError on failure.

        `full` rewrites everything we own (start-up, periodic resync, after a failure);
        otherwise only what differs from the last successfully applied state.
        """
        ...

    def render_ahead(self, ports: Sequence[ResolvedServicePort],
                     expected: Mapping[Family, int],
                     primary_ips: Sequence[IPAddress] = ()) -> None:
        """Before the first sync, while the cluster still lists: render `ports` (resolved
        ahead, ClusterModel.resolve_ahead) now, for the first sync to take those that
        are still what it applies. `expected`: how many service ports each family will
        have; `primary_ips`: the node's primary addresses, as the first snapshot will
        carry them. May do nothing. Blocking, on the data plane's thread, as `sync`."""
        ...

    def traffic(self) -> Mapping[ServicePortKey, PortTraffic]:
        """What the kernel has counted for each service port applied, read now: totals
        since the port was first programmed, kept across rule rewrites and agent restarts
        where the kernel keeps them (common/traffic.py). Blocking, as `sync`."""
        ...

    def traffic_reader(self, give_way: GiveWay = offer_lock) -> TrafficRead:
        """`traffic` in two steps: this call, on the data plane's thread, takes what the
        reading needs (cheap); the function it returns reads the kernel, on any thread,
        while this one goes on (nftables mode: ~0.7 s of reading counters at 100,000
        ports), calling `give_way` where it can pause (common/priority.py). Where a
        mode's reading needs its thread, it reads here (`read_now`)."""
        ...

    def applied_rules(self, key: ServicePortKey) -> Sequence[str]:
        """Human-readable lines of what is programmed for one service port, as of the
        last successful sync (iptables rules, or IPVS virtual/real servers)."""
        ...

    def housekeeping(self) -> Mapping[str, int] | None:
        """Periodic work between syncs (IPVS: delete drained real servers; iptables and
        nftables: reconcile conntrack with the rules, every CONNTRACK_RECONCILE_PERIOD).
        Returns the conntrack entries it deleted, by reason, if any."""
        ...

    def housekeeping_pending(self) -> bool:
        """Whether the last `housekeeping` left work it does a part at a time (nftables:
        input marks), so that a change never waits for all of it: the sync loop then
        calls it again as soon as no sync is due."""
        ...

    def begin_resync(self, repair: bool) -> bool:
        """Whether the mode does the periodic resync (--sync-period), or the repair
        after drift (`repair`), as housekeeping parts, changes going between them
        (nftables: a table a part): if so, it has queued them, and the sync asking is
        partial; if not, that sync is full."""
        ...

    def watch_drift(self, notify: Callable[[str], None]) -> None:
        """Start noticing changes to our rules made by other processes: `notify(reason)`,
        from any thread, when one may have happened. A data plane that cannot notice
        does nothing (its full resync still repairs)."""
        ...

    def check_drift(self) -> list[str]:
        """How the kernel differs from what was last applied ([] when it does not); the
        next sync repairs it when it does. Blocking, as `sync`."""
        ...

    def cleanup(self) -> None:
        """Remove everything sliceproxy owns in this network namespace (--cleanup)."""
        ...

    def close(self) -> None:
        """Release sockets and handles; leaves the rules in place."""
        ...


def housekeep_all(dp: DataPlane) -> None:
    """Every part of `dp`'s housekeeping at once, as an agent left idle ends up doing
    (for tests and benches; the sync loop lets changes go between the parts)."""
    dp.housekeeping()
    while dp.housekeeping_pending():
        dp.housekeeping()


def rules_digest(rules: Sequence[str]) -> int:
    """Stands for a chain's rules in a data plane's kept state. 64 bits of SipHash over
    each rule, mixed by the tuple's hash: two different rule lists of one chain name
    compare equal with a chance of about 2^-64 per change."""
    return hash(tuple(rules))

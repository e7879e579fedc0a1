"""Immutable value types for the API objects sliceproxy reads.

Decoders in `proxy.kube.decode` build these from API JSON; everything downstream
(merging, selection, rendering) only ever sees these. They are frozen and slotted:
cheap to hold by the hundred thousand, safe to share between snapshots, and
comparable, so "did this object change?" is a plain `==`.

Metadata that changes on every write (resourceVersion, uid) is excluded from
equality: re-applying an object whose meaning did not change must mark nothing dirty.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any, NamedTuple

from proxy.model.frozen import fast_init, slot_setter
from proxy.model.shared import SharedValues

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

LABEL_HOSTNAME = "kubernetes.io/hostname"
LABEL_ZONE = "topology.kubernetes.io/zone"
LABEL_REGION = "topology.kubernetes.io/region"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
ANNOTATION_TOPOLOGY_MODE = "service.kubernetes.io/topology-mode"
ANNOTATION_TOPOLOGY_HINTS = "service.kubernetes.io/topology-aware-hints"
ANNOTATION_TOPOLOGY_PREFERENCE = "sliceproxy.io/topology-preference"
ANNOTATION_BALANCING = "sliceproxy.io/balancing"
ANNOTATION_FAIL_FAST = "sliceproxy.io/fail-fast"
ANNOTATION_TRAFFIC_PER_ENDPOINT = "sliceproxy.io/traffic-per-endpoint"

DEFAULT_AFFINITY_TIMEOUT = 10800


class Protocol(enum.Enum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    __hash__ = object.__hash__  # as EndpointSet's (snapshot.py): by identity, in C


class Family(enum.IntEnum):
    V4 = 4
    V6 = 6

    # Enum's own __hash__ is a Python function; keys holding a Family are hashed on every
    # snapshot update, so use int's C-level hash (equal to hash(4) / hash(6)).
    __hash__ = int.__hash__

    @property
    def label(self) -> str:
        """The API's spelling (`IPv4`/`IPv6`), as in addressType and ipFamilies."""
        return "IPv4" if self is Family.V4 else "IPv6"

    @staticmethod
    def of(address: IPAddress | IPNetwork) -> Family:
        return Family.V4 if address.version == 4 else Family.V6


class TrafficPolicy(enum.Enum):
    CLUSTER = "Cluster"
    LOCAL = "Local"


class Balancing(enum.Enum):
    """How a service port picks an endpoint for a new connection (proxy/model/balancing.py)."""

    RANDOM = "random"  # kube-proxy's: uniform at random, per connection
    MAGLEV = "maglev"  # consistent hashing of the source address and port
    SOURCE_HASH = "source-hash"  # hashing of the source address

    __hash__ = object.__hash__


class ServiceType(enum.Enum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"
    EXTERNAL_NAME = "ExternalName"


@fast_init
@dataclass(frozen=True, slots=True)
class ServicePort:
    name: str  # "" when the service has a single unnamed port
    protocol: Protocol
    port: int
    node_port: int = 0  # 0: none allocated


@fast_init
@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    type: ServiceType
    # Empty for headless services (clusterIP: None) and ExternalName.
    cluster_ips: tuple[IPAddress, ...]
    ports: tuple[ServicePort, ...]
    headless: bool = False
    external_ips: tuple[IPAddress, ...] = ()
    load_balancer_ips: tuple[IPAddress, ...] = ()
    load_balancer_source_ranges: tuple[IPNetwork, ...] = ()
    # None: no session affinity; otherwise ClientIP affinity with this timeout (seconds).
    affinity_timeout: int | None = None
    internal_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    external_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    health_check_node_port: int = 0
    traffic_distribution: str | None = None
    # service.kubernetes.io/topology-mode (or the older topology-aware-hints) as given.
    topology_mode: str | None = None
    # sliceproxy.io/topology-preference, split on commas, stripped; None when absent.
    topology_preference: tuple[str, ...] | None = None
    # sliceproxy.io/balancing; None when absent or invalid: the node's --default-balancing.
    balancing: Balancing | None = None
    # sliceproxy.io/fail-fast ("true"/"false"); None when absent or invalid: the node's
    # --fail-fast (dataplane/common/fail_fast.py).
    fail_fast: bool | None = None
    # sliceproxy.io/traffic-per-endpoint ("true"/"false"); None when absent or invalid:
    # the node's --traffic-per-endpoint (dataplane/common/traffic.py).
    traffic_per_endpoint: bool | None = None
    # Value of the service-proxy-name label; services for another proxy are not ours.
    proxy_name: str | None = None
    uid: str = field(default="", compare=False)
    resource_version: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def families(self) -> tuple[Family, ...]:
        """Families in clusterIPs order (the primary family first), without repeats."""
        seen: list[Family] = []
        for ip in self.cluster_ips:
            fam = Family.of(ip)
            if fam not in seen:
                seen.append(fam)
        return tuple(seen)


# An endpoint's conditions, node and zone: (ready, serving, terminating, node name, zone).
State = tuple[bool, bool, bool, str | None, str | None]
# An endpoint's hints: (hints.forZones, hints.forNodes), each sorted.
Hints = tuple[tuple[str, ...], tuple[str, ...]]
_NO_HINTS: Hints = ((), ())
# States and hints, each one object for every endpoint with the same.
_STATES: SharedValues[State] = SharedValues(1 << 16)
_HINTS: SharedValues[Hints] = SharedValues(1 << 16)


@dataclass(frozen=True, slots=True, init=False, repr=False)
class Endpoint:
    """One endpoint of one EndpointSlice (its first address only).

    Three fields: a million endpoints at 100,000 services x 10, and an object of eight
    fields takes 96 bytes where three take 64. Its conditions, node and zone are one
    tuple (`state`), its hints another (`hints`), each shared by every endpoint with the
    same (shared.py); read them by name (`ready` ... `node_hints`). Its address is held
    packed (`packed`: 4 or 16 bytes, network order), one object of 37 or 49 bytes where
    an `ipaddress` object and its integer took 84 or 100 (48 MiB at 100,000 x 10 IPv6),
    hashed and compared in C; `address` makes the object when asked."""

    packed: bytes
    state: State
    hints: Hints

    def __init__(self, address: IPAddress, ready: bool = True, serving: bool = True,
                 terminating: bool = False, node_name: str | None = None,
                 zone: str | None = None, zone_hints: tuple[str, ...] = (),
                 node_hints: tuple[str, ...] = ()) -> None:
        # The slots set through their descriptors (frozen: frozen.py says why).
        _set_packed(self, address.packed)
        _set_state(self, _STATES((ready, serving, terminating, node_name, zone)))
        _set_hints(self, _HINTS((zone_hints, node_hints))
                   if zone_hints or node_hints else _NO_HINTS)

    @staticmethod
    def of_packed(packed: bytes, ready: bool, serving: bool, terminating: bool,
                  node_name: str | None, zone: str | None = None) -> Endpoint:
        """An endpoint without hints from its address's packed bytes (the decoders' fast
        path: no address object made)."""
        ep: Endpoint = _new_endpoint(Endpoint)
        _set_packed(ep, packed)
        _set_state(ep, _STATES((ready, serving, terminating, node_name, zone)))
        _set_hints(ep, _NO_HINTS)
        return ep

    def __repr__(self) -> str:
        return f"Endpoint(address={self.address!r}, state={self.state!r}, hints={self.hints!r})"

    @property
    def address(self) -> IPAddress:
        """Made at each call: key and compare by `packed` where it is hot."""
        packed = self.packed
        return IPv4Address(packed) if len(packed) == 4 else IPv6Address(packed)

    def changed(self, **fields: Any) -> Endpoint:
        """This endpoint with `fields` (any of `__init__`'s) changed: what
        `dataclasses.replace` does for a dataclass whose fields `__init__` takes."""
        ready, serving, terminating, node_name, zone = self.state
        zone_hints, node_hints = self.hints
        return Endpoint(**{"address": self.address, "ready": ready, "serving": serving,
                           "terminating": terminating, "node_name": node_name,
                           "zone": zone, "zone_hints": zone_hints,
                           "node_hints": node_hints, **fields})

    @property
    def ready(self) -> bool:
        return self.state[0]

    @property
    def serving(self) -> bool:
        return self.state[1]

    @property
    def terminating(self) -> bool:
        return self.state[2]

    @property
    def node_name(self) -> str | None:
        return self.state[3]

    @property
    def zone(self) -> str | None:
        return self.state[4]

    @property
    def zone_hints(self) -> tuple[str, ...]:
        return self.hints[0]

    @property
    def node_hints(self) -> tuple[str, ...]:
        return self.hints[1]


_set_packed = slot_setter(Endpoint, "packed")
_new_endpoint = object.__new__
_set_state = slot_setter(Endpoint, "state")
_set_hints = slot_setter(Endpoint, "hints")


@fast_init
@dataclass(frozen=True, slots=True)
class SlicePort:
    name: str
    protocol: Protocol
    port: int


@fast_init
@dataclass(frozen=True, slots=True)
class EndpointSlice:
    """An EndpointSlice, or one family of one subset of a legacy Endpoints object."""

    namespace: str
    name: str
    service_name: str
    family: Family
    ports: tuple[SlicePort, ...]
    endpoints: tuple[Endpoint, ...]
    resource_version: str = field(default="", compare=False)


class NodeAddress(NamedTuple):
    """One of a Node's `status.addresses` that is an IP: its type (`InternalIP` or
    `ExternalIP`) and the address."""

    type: str
    address: IPAddress


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    labels: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs
    # status.addresses of type InternalIP and ExternalIP, in the Node's order (the order
    # decides the primary addresses: model/nodeport_addresses.py).
    addresses: tuple[NodeAddress, ...] = ()

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None

    @property
    def zone(self) -> str | None:
        return self.label(LABEL_ZONE) or None


class ServicePortKey(NamedTuple):
    """One service port in one IP family: the unit of resolution and rendering."""

    namespace: str
    name: str
    port: str  # the service port's name, "" if unnamed
    family: Family

    @property
    def service(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        port = f":{self.port}" if self.port else ""
        return f"{self.namespace}/{self.name}{port} ({self.family.label})"


def format_endpoint(address: IPAddress, port: int) -> str:
    """`ip:port`, IPv6 in brackets: the spelling used in explain and the debug dump."""
    if address.version == 6:
        return f"[{address}]:{port}"
    return f"{address}:{port}"

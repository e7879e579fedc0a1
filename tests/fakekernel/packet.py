"""What the packet tracers take and give: the first packet of a connection, and every
way it can end (with its probability, where rules pick at random).

Shared by the iptables and nftables tracers so one table of behaviour cases runs
against both modes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network

from proxy.model.types import IPAddress


class TraceError(Exception):
    """The tracer met something it does not model: it refuses rather than guess."""


class Verdict(enum.Enum):
    ACCEPT = "accept"  # delivered (to an endpoint if DNATed, else where it was going)
    DROP = "drop"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Packet:
    """The first packet of a new connection. `local`: sent by the node itself (the
    output path); otherwise it arrives from outside on an interface (prerouting).
    `sport`: the source port, which only hashing rules (nftables `jhash`) read."""

    source: IPAddress
    destination: IPAddress
    port: int
    protocol: str = "tcp"
    local: bool = False
    sport: int = 40000

    @classmethod
    def of(cls, source: str, destination: str, port: int, protocol: str = "tcp",
           local: bool = False, sport: int = 40000) -> Packet:
        return cls(ip_address(source), ip_address(destination), port, protocol, local,
                   sport)


@dataclass(frozen=True, slots=True)
class Node:
    """What the tracer needs of the node: its own addresses (`addrtype LOCAL`,
    `fib ... type local`; loopback is always local), which also decide whether a
    packet is delivered to the node (input) or routed on (forward)."""

    addresses: frozenset[IPAddress]

    @classmethod
    def of(cls, *addresses: str) -> Node:
        return cls(frozenset(ip_address(a) for a in addresses))

    def is_local(self, ip: IPAddress) -> bool:
        return ip in self.addresses or ip.is_loopback


@dataclass(frozen=True, slots=True)
class Outcome:
    """One way the packet ends."""

    verdict: Verdict
    endpoint: str | None  # "ip:port" or "[ip6]:port" it was DNATed to; None if not
    masquerade: bool
    probability: float
    # Affinity records (iptables `recent` lists, nftables timeout sets) the connection
    # leaves: pass them to the next trace from the same source.
    remembered: frozenset[str] = frozenset()
    # Named counters the connection counted into, in order (nftables `counter name`).
    counted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Walk:
    """A packet on one of its ways through the rules: what has been done to it so far,
    and how likely this way is."""

    packet: Packet
    probability: float = 1.0
    endpoint: str | None = None  # DNATed to, as the rule wrote it
    mark: int = 0
    masquerade: bool = False
    remembered: frozenset[str] = frozenset()
    counted: tuple[str, ...] = ()

    @property
    def destination(self) -> IPAddress:
        """Where the packet goes now (after DNAT)."""
        if self.endpoint is None:
            return self.packet.destination
        return ip_address(self.endpoint.rsplit(":", 1)[0].strip("[]"))

    @property
    def dport(self) -> int:
        return self.packet.port if self.endpoint is None else int(self.endpoint.rsplit(":", 1)[1])

    def outcome(self, verdict: Verdict) -> Outcome:
        return Outcome(verdict, self.endpoint, self.masquerade, self.probability,
                       self.remembered, self.counted)


@dataclass(frozen=True, slots=True)
class Trace:
    outcomes: tuple[Outcome, ...]
    path: tuple[str, ...] = field(default=(), compare=False)  # rules matched, for messages

    def endpoints(self) -> dict[str, float]:
        """Endpoint -> probability of reaching it (accepted, DNATed outcomes only)."""
        out: dict[str, float] = {}
        for o in self.outcomes:
            if o.verdict is Verdict.ACCEPT and o.endpoint is not None:
                out[o.endpoint] = out.get(o.endpoint, 0.0) + o.probability
        return out

    def _one(self, values: Iterable[object], what: str) -> object:
        found = set(values)
        if len(found) != 1:
            raise AssertionError(f"outcomes disagree on {what}: {self.outcomes}")
        return found.pop()

    @property
    def verdict(self) -> Verdict:
        value = self._one((o.verdict for o in self.outcomes), "the verdict")
        assert isinstance(value, Verdict)
        return value

    @property
    def masquerade(self) -> bool:
        return bool(self._one((o.masquerade for o in self.outcomes), "masquerade"))

    def outcome_at(self, endpoint: str) -> Outcome:
        """The (first) outcome reaching `endpoint`."""
        return next(o for o in self.outcomes if o.endpoint == endpoint)


def address_in(ip: IPAddress, text: str) -> bool:
    """Whether `ip` is the address or in the CIDR `text` (other family: never)."""
    net = ip_network(text, strict=False)
    return ip.version == net.version and ip in net

"""Digests of the model's values that are the same in every process (pure).

A data plane restarting over rules it wrote may keep a service port's rules without
rendering them again when the kernel holds the digest of what they were rendered from
and the digest of what they would be rendered from now is the same
(dataplane/nftables/restart.py). So a digest must be equal for equal values in any two
processes, and (but for a 128-bit collision) differ for any two values a renderer could
tell apart: it covers every field that takes part in equality, none chosen by hand.

Python's own `hash` and `repr` do neither: `hash` is salted per process (so is the
order of a frozenset of strings), and a ResolvedServicePort's `repr` or pickle cost
more than rendering the port (40-70 us against ~80). Here each value is flattened into
marshal's types (fields read by C getters), then marshalled and hashed: ~28 us a port of
10 endpoints.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import marshal
import operator
from collections.abc import Callable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

from proxy.model.snapshot import (
    Conflict,
    EndpointSet,
    ResolvedServicePort,
    SelectedEndpoint,
    Topology,
)
from proxy.model.types import Endpoint, Service, ServicePort

_PLAIN = frozenset({int, str, bool, float, type(None), bytes})


def _compared(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.compare]


# The fields of each model class that take part in its equality, read in one C call.
_FIELDS: dict[type, Callable[[Any], tuple[Any, ...]]] = {
    cls: operator.attrgetter(*_compared(cls))
    for cls in (Service, ServicePort, Topology, Conflict)
}
# A selected endpoint's copy's fields (its address packed), read in one C call; then its
# selection (`_selection`).
_ENDPOINT = operator.attrgetter(*(f"copy.{name}" for name in _compared(Endpoint)))
# A port's fields but its endpoints and service (flattened on their own).
_PORT_FIELDS = [name for name in _compared(ResolvedServicePort)
                if name not in ("endpoints", "service")]
_PORT = operator.attrgetter(*_PORT_FIELDS)


def flat(value: Any) -> Any:
    """`value` as marshal's types: plain values as they are, tuples element by element,
    model dataclasses and named tuples as (class name, their compared fields), enums
    and addresses as (class name, their value). TypeError for anything else: a value
    this cannot spell must not be digested as if it were something else."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is tuple:
        return tuple(map(flat, value))
    if kind is IPv4Address or kind is IPv6Address:
        return (kind.__name__, value._ip)  # its integer, read in C
    fields = _FIELDS.get(kind)
    if fields is not None:
        return (kind.__name__, *map(flat, fields(value)))
    if isinstance(value, enum.Enum):
        return (kind.__name__, flat(value.value))
    if isinstance(value, tuple):  # a NamedTuple (ServicePortKey, NodeAddress)
        return (kind.__name__, *map(flat, value))
    if isinstance(value, IPv4Network | IPv6Network):
        return (kind.__name__, str(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (kind.__name__, *(flat(getattr(value, name)) for name in _compared(kind)))
    raise TypeError(f"no stable digest for {kind.__name__}")


def _selection(s: SelectedEndpoint) -> tuple[object, ...]:
    # The sets in a fixed order: a frozenset of enum members iterates in an order of
    # their ids.
    port, sources, conflict, selected_for, reason = s.selection
    return (port, sources, conflict,
            (EndpointSet.CLUSTER in selected_for, EndpointSet.LOCAL in selected_for), reason)


class ResolutionDigests:
    """`of(rsp)`: 16 bytes of BLAKE2b over every compared field of a resolved port.
    A service's part is made once for all its ports (the last service seen is kept)."""

    __slots__ = ("_service", "_service_bytes")

    def __init__(self) -> None:
        self._service: Service | None = None
        self._service_bytes = b""

    def of(self, rsp: ResolvedServicePort, salt: bytes = b"") -> bytes:
        service = rsp.service
        if service is not self._service:
            self._service, self._service_bytes = service, marshal.dumps(flat(service))
        endpoints = [(_ENDPOINT(s), *_selection(s)) for s in rsp.endpoints]
        h = hashlib.blake2b(salt, digest_size=16)
        h.update(self._service_bytes)
        h.update(marshal.dumps((flat(_PORT(rsp)), endpoints)))
        return h.digest()

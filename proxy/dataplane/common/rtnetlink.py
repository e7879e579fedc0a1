"""rtnetlink for interface addresses (NETLINK_ROUTE): message encoding and decoding
(pure) and a socket. Shared by every mode: the rule-based planes read this node's
addresses on every sync (`node_addresses`), IPVS also puts service addresses on its
dummy interface and watches them (ipvs/drift.py).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv6Address, ip_address

from proxy.dataplane.common.netlink import NetlinkSocket, nla, parse_attrs
from proxy.dataplane.common.netlink_constants import (
    IFA_ADDRESS,
    IFA_F_NODAD,
    IFA_LOCAL,
    NETLINK_ROUTE,
    NLM_F_CREATE,
    NLM_F_EXCL,
    RTM_DELADDR,
    RTM_GETADDR,
    RTM_NEWADDR,
)
from proxy.model.types import IPAddress

# --- messages (pure) --------------------------------------------------------

IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, pad, type, index, flags, change


def address_body(index: int, address: IPv4Address | IPv6Address) -> bytes:
    """An ifaddrmsg for `address`/max on interface `index` (no duplicate address detection:
    a service address is ours alone)."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    attrs = nla(IFA_ADDRESS, address.packed)
    if address.version == 4:
        attrs = nla(IFA_LOCAL, address.packed) + attrs
    return IFADDR.pack(family, address.max_prefixlen, IFA_F_NODAD, 0, index) + attrs


def decode_address(payload: bytes) -> tuple[int, IPv4Address | IPv6Address] | None:
    """(interface index, address) of an RTM_NEWADDR message."""
    if len(payload) < IFADDR.size:
        return None
    family, _plen, _flags, _scope, index = IFADDR.unpack_from(payload)
    attrs = parse_attrs(payload[IFADDR.size:])
    raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
    if raw is None or family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return index, address_of(raw, family)


class RouteSocket(NetlinkSocket):
    """rtnetlink, for interface addresses: pyroute2 needs ~0.3 ms to parse each address
    message and ~4 ms to add one (measured on the host; 10,000 service addresses are a
    3 s dump and a 43 s first sync); these are plain structs."""

    def __init__(self) -> None:
        super().__init__(NETLINK_ROUTE)

    @property
    def port_id(self) -> int:
        """This socket's netlink port id: the kernel announces the changes it requests
        (RTM_NEWADDR, RTM_DELADDR to the address groups) under it."""
        port: int = self._sock.getsockname()[0]
        return port

    def addresses(self) -> list[tuple[int, IPv4Address | IPv6Address]]:
        """(interface index, address) of every address of every interface."""
        out = []
        for family in (socket.AF_INET, socket.AF_INET6):
            for reply in self.dump_raw(RTM_GETADDR, IFADDR.pack(family, 0, 0, 0, 0)):
                found = decode_address(reply.payload)
                if found is not None:
                    out.append(found)
        return out

    def change_addresses(self, index: int, add: Sequence[IPv4Address | IPv6Address],
                         remove: Sequence[IPv4Address | IPv6Address]) -> list[int]:
        """Add then remove host addresses on interface `index`; one errno each, in order
        (EEXIST for an address already there, EADDRNOTAVAIL for one already gone)."""
        requests = [(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, address_body(index, a))
                    for a in add]
        requests += [(RTM_DELADDR, 0, address_body(index, a)) for a in remove]
        return self.execute_raw(requests)


def address_of(raw: bytes, af: int) -> IPv4Address | IPv6Address:
    """An address attribute: the kernel sends a 16-byte union for both families."""
    return ip_address(raw[:4] if af == socket.AF_INET else raw[:16])


def node_addresses() -> list[IPAddress]:
    """Every address on this network namespace's interfaces. Asked on every sync, so
    read with our own rtnetlink dump: pyroute2's IPRoute took 2.7 ms per call (its
    asyncio loop and parser), a tenth of a one-service sync at 10,000 services."""
    sock = RouteSocket()
    try:
        found = {address for _index, address in sock.addresses()}
    finally:
        sock.close()
    return sorted(found, key=lambda ip: (ip.version, ip.packed))

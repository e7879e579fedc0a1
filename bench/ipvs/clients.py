"""The two netlink clients the IPVS benchmark compares, behind one interface: pyroute2's
IPVS and IPRoute APIs used as FINDINGS describes (one call per object), and ours
(`proxy.dataplane.ipvs.kernel`: IpvsTable and Links, the exact calls the data plane
makes, requests batched many to a datagram).

Kernel-touching: only for bench/ipvs/guest.py inside the kernel lab. Each client opens
its sockets in the calling thread's network namespace, and must be used from that thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from ipaddress import IPv4Address, ip_address
from typing import Any, Protocol

from pyroute2 import IPVS, IPRoute, IPVSDest, IPVSService

from bench.ipvs.workload import Dest, Service, Table
from proxy.dataplane.ipvs.diff import FWD_MASQ, Op, OpKind
from proxy.dataplane.ipvs.kernel import IpvsTable, Links
from proxy.dataplane.ipvs.netlink import request
from proxy.dataplane.ipvs.render import (
    FLAG_HASHED,
    IPPROTO,
    PROTOCOL_OF,
    WEIGHT,
    RsKey,
    VirtualServer,
    VsKey,
)
from proxy.model.types import format_endpoint

AddressTable = set[tuple[int, str]]  # (interface index, address)


class Client(Protocol):
    name: str

    def program(self, servers: Sequence[VirtualServer]) -> None:
        """Create every virtual server with its real servers, in an empty table."""

    def dump(self) -> Table:
        """The whole IPVS table: the services, then each service's real servers."""

    def swap(self, vs: VsKey, add: RsKey, remove: RsKey) -> None:
        """One service's real servers change: one added, one deleted."""

    def add_addresses(self, index: int, addresses: Sequence[IPv4Address]) -> None:
        """Host (/32) addresses onto interface `index`."""

    def dump_addresses(self) -> AddressTable:
        """Every address of every interface, both families."""

    def close(self) -> None: ...


class Ours:
    name = "ours"

    def __init__(self, dummy: str) -> None:
        self._ipvs = IpvsTable()
        try:
            self._links = Links(dummy)
        except BaseException:
            self._ipvs.close()
            raise

    def close(self) -> None:
        self._ipvs.close()
        self._links.close()

    def program(self, servers: Sequence[VirtualServer]) -> None:
        # One batched exchange, as the plane sends a sync's operations
        # (VirtualServers.sync, proxy/dataplane/ipvs/virtual_servers.py).
        ops = program_ops(servers)
        _check_codes(self._ipvs.apply_many(ops), ops)

    def dump(self) -> Table:
        return {str(key): Service(s.scheduler, s.flags, s.timeout,
                                  {str(rs): Dest(d.fwd_method, d.weight)
                                   for rs, d in s.dests.items()})
                for key, s in self._ipvs.services().items()}

    def swap(self, vs: VsKey, add: RsKey, remove: RsKey) -> None:
        ops = [Op(OpKind.ADD_DEST, vs, rs=add, weight=WEIGHT), Op(OpKind.DEL_DEST, vs, rs=remove)]
        _check_codes(self._ipvs.apply_many(ops), ops)

    def add_addresses(self, index: int, addresses: Sequence[IPv4Address]) -> None:
        _check_codes(self._links.change(index, addresses, ()), addresses)

    def dump_addresses(self) -> AddressTable:
        return {(i, str(a)) for i, a in self._links.address_table()}


class Pyroute2:
    name = "pyroute2"

    def __init__(self) -> None:
        self._ipvs = IPVS()
        try:
            self._ipr = IPRoute()
        except BaseException:
            self._ipvs.close()
            raise

    def close(self) -> None:
        self._ipvs.close()
        self._ipr.close()

    def program(self, servers: Sequence[VirtualServer]) -> None:
        for vs in servers:
            service = _service(vs.key, vs.scheduler)
            self._ipvs.service("add", service=service)
            for rs in vs.real_servers:
                self._ipvs.dest("add", service=service, dest=_dest(rs))

    def dump(self) -> Table:
        table: Table = {}
        for msg in self._ipvs.service("dump"):
            def svc(name: str, m: Any = msg) -> Any:
                return m.get_nested("IPVS_CMD_ATTR_SERVICE", f"IPVS_SVC_ATTR_{name}")

            if svc("ADDR") is None:
                continue  # a firewall-mark service: not ours
            protocol = PROTOCOL_OF[int(svc("PROTOCOL"))].value
            key = f"{protocol} {format_endpoint(ip_address(svc('ADDR')), int(svc('PORT')))}"
            # The dest dump's key as pyroute2's documentation builds it. Values are read
            # from the raw attributes: from_message (0.9.7) leaves fwd_method and flags at
            # its defaults whatever the kernel reports.
            service = IPVSService.from_message(msg)
            dests = {}
            for d in self._ipvs.dest("dump", service=service):
                def dest(name: str, m: Any = d) -> Any:
                    return m.get_nested("IPVS_CMD_ATTR_DEST", f"IPVS_DEST_ATTR_{name}")

                rs = format_endpoint(ip_address(dest("ADDR")), int(dest("PORT")))
                dests[rs] = Dest(int(dest("FWD_METHOD")), int(dest("WEIGHT")))
            table[key] = Service(str(svc("SCHED_NAME")),
                                 int(svc("FLAGS")["flags"]) & ~FLAG_HASHED,
                                 int(svc("TIMEOUT")), dests)
        return table

    def swap(self, vs: VsKey, add: RsKey, remove: RsKey) -> None:
        service = _service(vs)
        self._ipvs.dest("add", service=service, dest=_dest(add))
        self._ipvs.dest("del", service=service, dest=_dest(remove))

    def add_addresses(self, index: int, addresses: Sequence[IPv4Address]) -> None:
        for address in addresses:
            self._ipr.addr("add", index=index, address=str(address), prefixlen=32)

    def dump_addresses(self) -> AddressTable:
        out = set()
        for msg in self._ipr.get_addr():
            address = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
            if address is not None:
                out.add((int(msg["index"]), str(ip_address(address))))
        return out


def program_ops(servers: Sequence[VirtualServer]) -> list[Op]:
    ops = []
    for vs in servers:
        ops.append(Op(OpKind.ADD_SERVICE, vs.key, service=vs))
        ops.extend(Op(OpKind.ADD_DEST, vs.key, rs=rs, weight=WEIGHT) for rs in vs.real_servers)
    return ops


def encode_program(servers: Sequence[VirtualServer]) -> list[tuple[int, bytes]]:
    """Our client's Python side of `program` alone: the requests built and encoded, with
    no kernel involved (to tell how much of its time is the kernel's)."""
    return [request(op) for op in program_ops(servers)]


def _service(key: VsKey, scheduler: str = "rr") -> Any:
    return IPVSService(addr=str(key.address), port=key.port, protocol=IPPROTO[key.protocol],
                       sched_name=scheduler)


def _dest(rs: RsKey) -> Any:
    # IPVSDest defaults to direct routing (fwd_method 3): masquerading must be asked for.
    return IPVSDest(addr=str(rs.address), port=rs.port, fwd_method=FWD_MASQ, weight=WEIGHT)


def _check_codes(codes: Sequence[int], what: Sequence[object]) -> None:
    """Our client returns an errno per request where pyroute2 raises: raise alike."""
    for code, item in zip(codes, what, strict=True):
        if code:
            raise OSError(code, f"{os.strerror(code)}: {item}")

"""The kernel-facing side of the IPVS data plane: IPVS and links over netlink (pyroute2),
ipsets through the `ipset` binary, IPVS sysctls.

Everything here runs on the data plane's one worker thread, in the network namespace
that thread is in: pyroute2 sockets are bound to the thread's namespace when opened, and
so are child processes and /proc/sys/net. Nothing here decides anything; callers pass
the operations (`diff.Op`) or text (`netfilter`) to carry out.
"""

from __future__ import annotations

import logging
import socket
import subprocess
from ipaddress import ip_address
from pathlib import Path
from typing import Any

from pyroute2 import IPVS, IPRoute, IPVSDest, IPVSService

from proxy.dataplane.ipvs.diff import KernelDest, KernelService, Op, OpKind
from proxy.dataplane.ipvs.render import (
    FLAG_HASHED,
    IPPROTO,
    PROTOCOL_OF,
    RsKey,
    VirtualServer,
    VsKey,
    v6_netmask,
)
from proxy.model.types import Family, IPAddress

log = logging.getLogger(__name__)

FLAGS_MASK = 0xFFFF
V4_NETMASK = "255.255.255.255"
_V6_NETMASK = v6_netmask()

# Upstream's IPVS proxier sets these: conntrack entries for IPVS connections (needed for
# iptables masquerading), dropping connections whose real server is gone instead of
# black-holing them, expiring affinity templates of weight-0 real servers, forwarding.
SYSCTLS = {
    "net/ipv4/vs/conntrack": "1",
    "net/ipv4/vs/expire_nodest_conn": "1",
    "net/ipv4/vs/expire_quiescent_template": "1",
    "net/ipv4/ip_forward": "1",
}


def ensure_sysctls() -> list[str]:
    """Set SYSCTLS in this thread's network namespace; returns the ones that failed."""
    failed = []
    for name, value in SYSCTLS.items():
        path = Path("/proc/sys") / name
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError as exc:
            log.warning("cannot set sysctl", extra={"sysctl": name, "error": str(exc)})
            failed.append(name)
    return failed


def _af(family: Family) -> int:
    return socket.AF_INET if family is Family.V4 else socket.AF_INET6


def _service(key: VsKey, vs: VirtualServer | None = None) -> IPVSService:
    fields: dict[str, Any] = {
        "af": _af(key.family),
        "protocol": IPPROTO[key.protocol],
        "addr": str(key.address),
        "port": key.port,
    }
    if vs is not None:
        fields.update(
            sched_name=vs.scheduler,
            flags={"flags": vs.flags, "mask": FLAGS_MASK},
            timeout=vs.timeout,
            # The kernel wants a netmask on every full service entry; IPv6 takes a prefix
            # length there (see render.v6_netmask). pyroute2 only fills in IPv4's.
            netmask=V4_NETMASK if key.family is Family.V4 else _V6_NETMASK,
        )
    return IPVSService(**fields)


def _dest(rs: RsKey, weight: int = 0) -> IPVSDest:
    # fwd_method=0: masquerading (DNAT). pyroute2's default, 3, is direct routing.
    return IPVSDest(addr=str(rs.address), port=rs.port, fwd_method=0, weight=weight)


def _attrs(msg: Any, nested: str) -> dict[str, Any]:
    """The attributes of a dump message's nested service or destination, by name, read in
    one pass (pyroute2's get_nested walks the message again for every attribute)."""
    nla = msg.get_attr(nested)
    return dict(nla["attrs"]) if nla is not None else {}


def _flags(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    return int(value.get("flags") or 0)


class IpvsTable:
    """The IPVS table of this thread's network namespace."""

    def __init__(self) -> None:
        self._ipvs = IPVS()
        self.calls = 0  # netlink requests made, for SyncReport.operations
        self.writes = 0  # of which changed the table successfully

    def close(self) -> None:
        self._ipvs.close()

    def services(self) -> dict[VsKey, KernelService]:
        """Every address/port virtual server with its real servers (fwmark ones skipped)."""
        out: dict[VsKey, KernelService] = {}
        self.calls += 1
        for msg in self._ipvs.service("dump"):
            attrs = _attrs(msg, "IPVS_CMD_ATTR_SERVICE")
            key = self._key(attrs)
            if key is None:
                continue
            dests = self.dests(key)
            out[key] = KernelService(
                key=key,
                scheduler=str(attrs.get("IPVS_SVC_ATTR_SCHED_NAME") or ""),
                flags=_flags(attrs.get("IPVS_SVC_ATTR_FLAGS")) & ~FLAG_HASHED,
                timeout=int(attrs.get("IPVS_SVC_ATTR_TIMEOUT") or 0),
                dests=dests,
            )
        return out

    @staticmethod
    def _key(attrs: dict[str, Any]) -> VsKey | None:
        addr = attrs.get("IPVS_SVC_ATTR_ADDR")
        port = attrs.get("IPVS_SVC_ATTR_PORT")
        proto = attrs.get("IPVS_SVC_ATTR_PROTOCOL")
        if addr is None or not port or proto not in PROTOCOL_OF:
            return None  # a firewall-mark service: never ours
        return VsKey(PROTOCOL_OF[proto], ip_address(addr), int(port))

    def dests(self, key: VsKey) -> dict[RsKey, KernelDest]:
        """The real servers of one virtual server (none if it does not exist: the kernel
        answers a dump for a missing service with an empty list)."""
        self.calls += 1
        out = {}
        for msg in self._ipvs.dest("dump", service=_service(key)):
            attrs = _attrs(msg, "IPVS_CMD_ATTR_DEST")
            addr = attrs.get("IPVS_DEST_ATTR_ADDR")
            if addr is None:
                continue
            out[RsKey(ip_address(addr), int(attrs.get("IPVS_DEST_ATTR_PORT") or 0))] = \
                KernelDest(
                    weight=int(attrs.get("IPVS_DEST_ATTR_WEIGHT") or 0),
                    # Only the low bits are the method; pyroute2's IPVSDest.from_message
                    # ignores the attribute and reports its default, 3 (direct routing).
                    fwd_method=int(attrs.get("IPVS_DEST_ATTR_FWD_METHOD") or 0) & 0x7,
                    active=int(attrs.get("IPVS_DEST_ATTR_ACTIVE_CONNS") or 0),
                    inactive=int(attrs.get("IPVS_DEST_ATTR_INACT_CONNS") or 0),
                )
        return out

    def apply(self, op: Op) -> None:
        """Carry out one operation; raises pyroute2's NetlinkError on failure."""
        self.calls += 1
        kind = op.kind
        if kind is OpKind.ADD_SERVICE:
            self._ipvs.service("add", service=_service(op.vs, op.service))
        elif kind is OpKind.SET_SERVICE:
            self._ipvs.service("set", service=_service(op.vs, op.service))
        elif kind is OpKind.DEL_SERVICE:
            self._ipvs.service("del", service=_service(op.vs))
        else:
            assert op.rs is not None, op
            if kind is OpKind.ADD_DEST:
                self._ipvs.dest("add", service=_service(op.vs), dest=_dest(op.rs, op.weight))
            elif kind in (OpKind.SET_DEST, OpKind.DRAIN_DEST):
                # "set", never "update": pyroute2 maps "update" to a DELETE.
                self._ipvs.dest("set", service=_service(op.vs), dest=_dest(op.rs, op.weight))
            else:
                self._ipvs.dest("del", service=_service(op.vs), dest=_dest(op.rs))
        self.writes += 1


def _msg_address(msg: Any) -> IPAddress | None:
    value = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
    return ip_address(value) if value else None


class Links:
    """The dummy interface holding service addresses, and the node's own addresses."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ipr = IPRoute()
        self.calls = 0

    def close(self) -> None:
        self._ipr.close()

    def index(self) -> int | None:
        self.calls += 1
        found = self._ipr.link_lookup(ifname=self.name)
        return int(found[0]) if found else None

    def ensure(self) -> int:
        """Create the dummy interface if missing, bring it up; its index."""
        index = self.index()
        if index is None:
            self.calls += 1
            self._ipr.link("add", ifname=self.name, kind="dummy")
            index = self.index()
            assert index is not None, self.name
            log.info("created dummy interface", extra={"interface": self.name})
        self.calls += 1
        self._ipr.link("set", index=index, state="up")
        return index

    def delete(self) -> bool:
        index = self.index()
        if index is None:
            return False
        self.calls += 1
        self._ipr.link("del", index=index)
        return True

    def addresses(self, index: int) -> set[IPAddress]:
        self.calls += 1
        return {a for msg in self._ipr.get_addr(index=index)
                if (a := _msg_address(msg)) is not None}

    def node_addresses(self, exclude: int | None) -> set[IPAddress]:
        """Addresses of every interface but `exclude` (our dummy one)."""
        self.calls += 1
        return {a for msg in self._ipr.get_addr()
                if msg.get("index") != exclude and (a := _msg_address(msg)) is not None}

    def add_address(self, index: int, address: IPAddress) -> None:
        self.calls += 1
        self._ipr.addr("add", index=index, address=str(address),
                       prefixlen=address.max_prefixlen)

    def del_address(self, index: int, address: IPAddress) -> None:
        self.calls += 1
        self._ipr.addr("del", index=index, address=str(address),
                       prefixlen=address.max_prefixlen)


class IpsetError(RuntimeError):
    def __init__(self, message: str, offending: str | None = None) -> None:
        super().__init__(message)
        self.offending = offending


class Ipsets:
    """The `ipset` binary: bulk changes go through one `ipset restore` each."""

    def __init__(self, binary: str = "ipset", timeout: float = 30.0) -> None:
        self.binary = binary
        self.timeout = timeout

    def _run(self, *args: str, text: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.binary, *args], input=text, capture_output=True,
                              text=True, timeout=self.timeout, check=False)

    def restore(self, text: str) -> None:
        if not text:
            return
        result = self._run("restore", text=text)
        if result.returncode != 0:
            err = result.stderr.strip()
            offending = None
            # "ipset v7.17: Error in line 3: ..." names the line of the input.
            if "line " in err:
                try:
                    number = int(err.split("line ", 1)[1].split(":", 1)[0])
                    offending = text.splitlines()[number - 1]
                except (ValueError, IndexError):
                    offending = None
            raise IpsetError(f"ipset restore failed: {err}", offending)

    def save(self, name: str) -> str:
        """`ipset save NAME`, or "" if there is no such set."""
        result = self._run("save", name)
        return result.stdout if result.returncode == 0 else ""

    def names(self) -> list[str]:
        result = self._run("list", "-n")
        if result.returncode != 0:
            raise IpsetError(f"ipset list failed: {result.stderr.strip()}")
        return result.stdout.split()

    def destroy(self, name: str) -> None:
        result = self._run("destroy", name)
        if result.returncode != 0:
            raise IpsetError(f"ipset destroy {name} failed: {result.stderr.strip()}")

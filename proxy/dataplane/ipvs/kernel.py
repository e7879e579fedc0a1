"""The kernel-facing side of the IPVS data plane: IPVS over our own netlink client
(`netlink.py`), links and addresses over pyroute2, ipsets through the `ipset` binary,
IPVS sysctls.

Everything here runs on the data plane's one worker thread, in the network namespace
that thread is in: pyroute2 sockets are bound to the thread's namespace when opened, and
so are child processes and /proc/sys/net. Nothing here decides anything; callers pass
the operations (`diff.Op`) or text (`netfilter`) to carry out.
"""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from pyroute2 import IPRoute

from proxy.dataplane.base import Counted
from proxy.dataplane.common.netlink import NetlinkError, nested
from proxy.dataplane.common.netlink_constants import IFF_UP
from proxy.dataplane.common.netlink_constants import IPVS_CMD_ATTR_DEST as ATTR_DEST
from proxy.dataplane.common.netlink_constants import IPVS_CMD_ATTR_SERVICE as ATTR_SERVICE
from proxy.dataplane.common.netlink_constants import IPVS_CMD_GET_DEST as CMD_GET_DEST
from proxy.dataplane.common.netlink_constants import IPVS_CMD_GET_SERVICE as CMD_GET_SERVICE
from proxy.dataplane.common.node_settings import IPVS_SYSCTLS
from proxy.dataplane.common.rtnetlink import RouteSocket
from proxy.dataplane.ipvs.diff import KernelDest, KernelService, Op
from proxy.dataplane.ipvs.netlink import (
    IpvsSocket,
    RawVsKey,
    decode_dest,
    decode_dest_stats,
    decode_service,
    decode_service_stats,
    request,
    service_key_attrs,
)
from proxy.dataplane.ipvs.render import RsKey, VsKey
from proxy.model.types import Family, IPAddress

log = logging.getLogger(__name__)

# Upstream's IPVS proxier sets these (why: common/node_settings.py, which the
# --init-only step writes them from; here the agent tries again where it may).
SYSCTLS = {name: str(value) for name, value in IPVS_SYSCTLS.items()}


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


class IpvsTable:
    """The IPVS table of this thread's network namespace (over `netlink.IpvsSocket`)."""

    def __init__(self) -> None:
        self._nl = IpvsSocket()
        self.calls = 0  # netlink requests made, for SyncReport.operations
        self.writes = 0  # of which changed the table successfully

    def close(self) -> None:
        self._nl.close()

    def services(self) -> dict[VsKey, KernelService]:
        """Every address/port virtual server with its real servers (fwmark ones skipped)."""
        self.calls += 1
        out: dict[VsKey, KernelService] = {}
        for attrs in self._nl.dump(CMD_GET_SERVICE):
            svc = decode_service(attrs.get(ATTR_SERVICE, b""))
            if svc is not None:
                out[svc.key] = KernelService(svc.key, svc.scheduler, svc.flags, svc.timeout,
                                             self.dests(svc.key))
        return out

    def service_keys(self) -> dict[VsKey, KernelService]:
        """Every address/port virtual server without its real servers: one dump, for a
        cheap look at which exist (a drift check)."""
        self.calls += 1
        out: dict[VsKey, KernelService] = {}
        for attrs in self._nl.dump(CMD_GET_SERVICE):
            svc = decode_service(attrs.get(ATTR_SERVICE, b""))
            if svc is not None:
                out[svc.key] = svc
        return out

    def service_stats(self) -> dict[RawVsKey, Counted]:
        """Every address/port virtual server's statistics, by `netlink.raw_key`: one dump."""
        self.calls += 1
        out: dict[RawVsKey, Counted] = {}
        for attrs in self._nl.dump_one(CMD_GET_SERVICE, ATTR_SERVICE):
            found = decode_service_stats(attrs)
            if found is not None:
                out[found[0]] = found[1]
        return out

    def dest_stats(self, key: VsKey) -> dict[RsKey, Counted]:
        """The statistics of one virtual server's real servers (none if it does not
        exist): a dump of its own."""
        af = socket.AF_INET if key.family is Family.V4 else socket.AF_INET6
        out: dict[RsKey, Counted] = {}
        for attrs in self._dest_dump(key):
            found = decode_dest_stats(attrs, af)
            if found is not None:
                out[found[0]] = found[1]
        return out

    def missing(self, keys: Sequence[VsKey]) -> list[VsKey]:
        """Which of `keys` the table lacks: one GET per key (no dump, nothing decoded),
        batched into one exchange; the cheap look of `sample.TableSampler`."""
        if not keys:
            return []
        self.calls += len(keys)
        codes = self._nl.execute([(CMD_GET_SERVICE, nested(ATTR_SERVICE, service_key_attrs(k)))
                                  for k in keys])
        for code in codes:
            if code and code not in (errno.ESRCH, errno.ENOENT):
                raise NetlinkError(code, "get virtual server")
        return [k for k, code in zip(keys, codes, strict=True) if code]

    def dests(self, key: VsKey) -> dict[RsKey, KernelDest]:
        """The real servers of one virtual server (none if it does not exist)."""
        af = socket.AF_INET if key.family is Family.V4 else socket.AF_INET6
        out = {}
        for attrs in self._dest_dump(key):
            found = decode_dest(attrs, af)
            if found is not None:
                out[found[0]] = found[1]
        return out

    def _dest_dump(self, key: VsKey) -> list[bytes]:
        """The nested destination attribute of each of one virtual server's real servers:
        a dump of its own (the kernel dumps real servers one service at a time); none if
        the virtual server does not exist."""
        self.calls += 1
        try:
            return self._nl.dump_one(CMD_GET_DEST, ATTR_DEST,
                                     nested(ATTR_SERVICE, service_key_attrs(key)))
        except NetlinkError as exc:
            if exc.code in (errno.ENOENT, errno.ESRCH):
                return []
            raise

    def apply(self, op: Op) -> None:
        """Carry out one operation; raises NetlinkError on failure."""
        (code,) = self.apply_many([op])
        if code:
            raise NetlinkError(code, str(op))

    def apply_many(self, ops: Sequence[Op]) -> list[int]:
        """Carry out operations in order, batched; one errno per operation (0: done)."""
        codes = self._nl.execute([request(op) for op in ops])
        self.calls += len(ops)
        self.writes += sum(1 for c in codes if not c)
        return codes


class Links:
    """The dummy interface holding service addresses, and the addresses of every
    interface. The link itself goes through pyroute2 (a few calls per full sync);
    addresses, by the thousand, through our own rtnetlink socket."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ipr = IPRoute()
        self._rt = RouteSocket()
        self.calls = 0

    def close(self) -> None:
        self._ipr.close()
        self._rt.close()

    def index(self, name: str | None = None) -> int | None:
        """The index of our dummy interface (or of interface `name`); None if absent."""
        self.calls += 1
        found = self._ipr.link_lookup(ifname=name or self.name)
        return int(found[0]) if found else None

    def ensure(self) -> int:
        """Create the dummy interface if missing, bring it up; its index."""
        index = self.index()
        if index is None:
            self.calls += 1
            self._ipr.link("add", ifname=self.name, kind="dummy")
            index = self.index()
            assert index is not None, self.name
            log.info("created dummy interface %s", self.name, extra={"interface": self.name})
        self.calls += 1
        self._ipr.link("set", index=index, state="up")
        return index

    def state(self) -> tuple[int, bool] | None:
        """(index, whether it is up) of the dummy interface; None if there is none."""
        index = self.index()
        if index is None:
            return None
        self.calls += 1
        found = self._ipr.link("get", index=index)
        return index, bool(int(found[0]["flags"]) & IFF_UP)

    @property
    def port_id(self) -> int:
        """The netlink port id our address changes are announced with."""
        return self._rt.port_id

    def delete(self) -> bool:
        index = self.index()
        if index is None:
            return False
        self.calls += 1
        self._ipr.link("del", index=index)
        return True

    def address_table(self) -> list[tuple[int, IPAddress]]:
        """(interface index, address) for every address in the namespace."""
        self.calls += 2  # one dump per family
        return self._rt.addresses()

    def addresses(self, index: int) -> set[IPAddress]:
        return {a for i, a in self.address_table() if i == index}

    def node_addresses(self, exclude: int | None) -> set[IPAddress]:
        """Addresses of every interface but `exclude` (our dummy one)."""
        return {a for i, a in self.address_table() if i != exclude}

    def change(self, index: int, add: Sequence[IPAddress],
               remove: Sequence[IPAddress]) -> list[int]:
        """Add, then remove, host addresses on `index`; one errno each, in that order."""
        self.calls += len(add) + len(remove)
        return self._rt.change_addresses(index, add, remove)


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

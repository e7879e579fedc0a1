"""Noticing that someone else changed what the IPVS data plane owns, between syncs.

The IPVS plane owns four kinds of kernel state; each is watched the cheapest way the
kernel allows, and a report only asks for a check (`IpvsDataPlane.check_drift`), which
reads back and compares; only a real difference costs a full sync:

- its few iptables rules: the iptables plane's watchers, shared (`NftablesListener` on
  nf_tables, `LegacyCanary` on legacy x_tables; see iptables/drift_watch.py);
- its dummy interface and the service addresses on it: `LinkListener` below, on
  rtnetlink's link and address multicast groups (an address deleted or added by someone
  else, the interface deleted, renamed or set down). The kernel announces an address
  change under the port id of the socket that asked for it, so our own changes (our
  `RouteSocket`) are told apart without reading anything back;
- its ipsets: ipset announces nothing; the check looks at their presence;
- the IPVS table itself: IPVS announces nothing either (no multicast group, no
  generation counter). The check compares which virtual servers exist when it runs for
  another reason; otherwise a foreign `ipvsadm` change is repaired at the next full
  resync (--sync-period).
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address

from proxy.dataplane.ipvs.netlink import RTM_DELADDR, RTM_NEWADDR, decode_address
from proxy.dataplane.ipvs.render import usable_node_address
from proxy.dataplane.netlink import Reply, parse_attrs, replies

log = logging.getLogger(__name__)

NETLINK_ROUTE = 0
# Legacy multicast group bits of rtnetlink (bind's groups mask): links, IPv4 and IPv6
# interface addresses.
RTMGRP_LINK, RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR = 0x1, 0x10, 0x100
RTM_NEWLINK, RTM_DELLINK = 16, 17
IFLA_IFNAME = 3
IFF_UP = 0x1
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, pad, type, index, flags, change
LISTEN_BUFFER = 4 << 20
POLL = 0.5  # how often the listener thread looks at its stop flag

Notify = Callable[[str], None]


def _ifname(payload: bytes) -> str | None:
    raw = parse_attrs(payload[_IFINFO.size:]).get(IFLA_IFNAME)
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace") if raw is not None else None


def link_change(msg: Reply, name: str, index: int | None,
                ours: Callable[[int], bool]) -> str | None:
    """What an rtnetlink announcement says someone else did to our dummy interface
    `name` (index `index`, when we know it), or None when it says nothing of the kind.
    Link-local and loopback addresses are not ours: the kernel adds and removes those by
    itself."""
    if msg.kind in (RTM_NEWADDR, RTM_DELADDR):
        found = decode_address(msg.payload)
        if found is None or index is None or found[0] != index or ours(msg.port_id):
            return None
        address: IPv4Address | IPv6Address = found[1]
        if not usable_node_address(address):
            return None
        if msg.kind == RTM_DELADDR:
            return f"address {address} deleted from {name}"
        return f"address {address} added to {name}"
    if msg.kind in (RTM_NEWLINK, RTM_DELLINK) and len(msg.payload) >= _IFINFO.size:
        _family, _type, link, flags, _change = _IFINFO.unpack_from(msg.payload)
        label = _ifname(msg.payload)
        if link != index and label != name:
            return None
        if msg.kind == RTM_DELLINK:
            return f"interface {name} deleted"
        if link != index or ours(msg.port_id):
            # A new interface of that name is one our full sync is creating (it is
            # announced down first): the data plane learns its index when it is up.
            return None
        if label is not None and label != name:
            return f"interface {name} renamed to {label}"
        if not flags & IFF_UP:
            return f"interface {name} is down"
    return None


class LinkListener:
    """A thread reading rtnetlink's link and address announcements; `notify` for each
    that says someone else changed our dummy interface (`link_change`). `index()` is
    the interface's index as the data plane last saw it (it changes when the interface
    is re-created); `ours(port_id)` tells our own sockets."""

    def __init__(self, name: str, index: Callable[[], int | None],
                 ours: Callable[[int], bool], notify: Notify) -> None:
        self.name = name
        self._index, self._ours, self._notify = index, ours, notify
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        try:
            self._sock.bind((0, RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR))
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, 33, LISTEN_BUFFER)  # SO_RCVBUFFORCE
            except OSError:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, LISTEN_BUFFER)
            self._sock.settimeout(POLL)
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._run, name="rtnetlink-listener",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close()

    def _run(self) -> None:
        buffer = bytearray(1 << 16)
        while not self._stop.is_set():
            try:
                size = self._sock.recv_into(buffer)
            except TimeoutError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self._notify("rtnetlink announcements were lost (receive buffer full)")
                    continue
                if self._stop.is_set():
                    return
                log.error("rtnetlink listener stopped; foreign changes to the dummy "
                          "interface are repaired at the next full sync only",
                          extra={"error": str(exc)})
                return
            index = self._index()
            for msg in replies(bytes(buffer[:size])):
                reason = link_change(msg, self.name, index, self._ours)
                if reason is not None:
                    self._notify(reason)

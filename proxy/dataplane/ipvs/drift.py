"""Noticing that someone else changed what the IPVS data plane owns, between syncs.

The IPVS plane owns four kinds of kernel state; each is watched the cheapest way the
kernel allows, and a report only asks for a check (`IpvsDataPlane.check_drift`), which
reads back and compares; only a real difference costs a full sync:

- its few iptables rules: the iptables plane's watchers, shared (`NftablesListener` on
  nf_tables, `LegacyCanary` on legacy x_tables; see common/drift_watch.py);
- its dummy interface and the service addresses on it: `LinkListener` below, on
  rtnetlink's link and address multicast groups (an address deleted or added by someone
  else, the interface deleted, renamed or set down). The kernel announces an address
  change under the port id of the socket that asked for it, so our own changes (our
  `RouteSocket`) are told apart without reading anything back;
- its ipsets: ipset announces nothing; the check looks at their presence;
- the IPVS table itself: IPVS announces nothing either (no multicast group, no
  generation counter). `sample.TableSampler` asks for a few of our virtual servers
  twice a second, so a flush is noticed at once; the check compares which virtual
  servers exist. A change to a virtual server's real servers or scheduler alone is
  repaired at the next full resync (--sync-period).
"""

from __future__ import annotations

from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address

from proxy.dataplane.common.netlink import MulticastListener, Reply, parse_attrs, replies
from proxy.dataplane.common.netlink_constants import (
    IFF_UP,
    IFLA_IFNAME,
    NETLINK_ROUTE,
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTMGRP_IPV4_IFADDR,
    RTMGRP_IPV6_IFADDR,
    RTMGRP_LINK,
)
from proxy.dataplane.common.rtnetlink import IFINFO, decode_address
from proxy.dataplane.ipvs.render import usable_node_address

LISTEN_BUFFER = 4 << 20

Notify = Callable[[str], None]


def _ifname(payload: bytes) -> str | None:
    raw = parse_attrs(payload[IFINFO.size:]).get(IFLA_IFNAME)
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
    if msg.kind in (RTM_NEWLINK, RTM_DELLINK) and len(msg.payload) >= IFINFO.size:
        _family, _type, link, flags, _change = IFINFO.unpack_from(msg.payload)
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


class LinkListener(MulticastListener):
    """A thread reading rtnetlink's link and address announcements; `notify` for each
    that says someone else changed our dummy interface (`link_change`). `index()` is
    the interface's index as the data plane last saw it (it changes when the interface
    is re-created); `ours(port_id)` tells our own sockets."""

    def __init__(self, name: str, index: Callable[[], int | None],
                 ours: Callable[[int], bool], notify: Notify) -> None:
        self.name = name
        self._index, self._ours, self._notify = index, ours, notify
        super().__init__(NETLINK_ROUTE,
                         groups=RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR,
                         buffer=LISTEN_BUFFER, name="rtnetlink-listener",
                         stopped="rtnetlink listener stopped; foreign changes to the dummy "
                                 "interface are repaired at the next full sync only")

    def _lost(self) -> None:
        self._notify("rtnetlink announcements were lost (receive buffer full)")

    def _feed(self, datagram: bytes) -> None:
        index = self._index()
        for msg in replies(datagram):
            reason = link_change(msg, self.name, index, self._ours)
            if reason is not None:
                self._notify(reason)

"""Failing fast the TCP connections of an endpoint that left its service (opt-in: the
node's --fail-fast, a service's `sliceproxy.io/fail-fast` annotation).

When a pod is deleted or its node dies, a client holding a connection to it through a
service hears nothing: a client waiting in recv() sends nothing either, and one that
sends retransmits into a dead address for minutes (ICMP errors do not end an
established TCP socket). Deleting the conntrack entry alone changes neither: the
client still sends nothing (measured: silent). So, for each conntrack entry DNATed to
the endpoint from one of the service port's addresses, in the node's network namespace:

1. the entry is made liberal in both directions (IP_CT_TCP_FLAG_BE_LIBERAL, a ctnetlink
   update): an out-of-window segment is then still the flow's and NATed; without it the
   segment below is INVALID, goes un-NATed, and the client never answers (measured);
2. a bare ACK with an out-of-window sequence number is sent from a raw socket as the
   entry's reply direction (from the endpoint to the reply tuple's destination: the
   client, or the masquerade address): conntrack un-NATs it, so it reaches the client
   from the service's address, and the client's kernel answers an unacceptable segment
   with an ACK of its own sequence numbers (at most one per 500 ms per socket:
   net.ipv4.tcp_invalid_ratelimit);
3. that ACK is DNATed to the dead endpoint by the entry and meets `reject with tcp
   reset` in our own small nf_tables table (forward and output, for host-network
   clients), for DNATed packets of exactly those flows (client and endpoint addresses
   and ports, in a set whose elements expire after REJECT_SECONDS): the RST's sequence
   number is the client's own acknowledgement, in window, so the client's socket fails
   with ECONNRESET (measured: 25-91 ms after the removal; with the real agent, 33-49 ms
   after the slice was written: docs/reliability.md).

"Left" (`vanished`): the endpoint got traffic of a TCP service port before the change
and none after, and is no longer in the port's slices, or is terminating and no longer
serving. A terminating endpoint that still serves keeps its connections (its pod is
draining them), and so does one that is only not ready (a failing readiness probe).
UDP and SCTP flows of such endpoints are conntrack.py's: their entries are deleted and
the next datagram goes to a live endpoint.

The table is ours alone (`inet sliceproxy-fail-fast`), beside iptables (legacy or nft)
and IPVS rules as beside our nftables mode's tables; it is made the first time a flow
is reset and holds nothing but short-lived set elements.
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from proxy.dataplane.common import processes
from proxy.dataplane.common.conntrack import frontends, gone_endpoints
from proxy.dataplane.common.ctnetlink import IPPROTO_TCP, ConntrackSocket, CtEntry
from proxy.dataplane.common.naming import port_name
from proxy.dataplane.common.netlink_constants import IPS_SRC_NAT
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import (
    Family,
    IPAddress,
    Protocol,
    Service,
    ServicePortKey,
    format_endpoint,
)

log = logging.getLogger(__name__)

TABLE = "sliceproxy-fail-fast"
# How long a provoked flow's packets are answered with a reset: the provoked ACK comes
# back in milliseconds; this also catches the client's own retransmissions of data sent
# just before.
REJECT_SECONDS = 10
_SET = {Family.V4: "gone4", Family.V6: "gone6"}
_TCP_ACK = 0x10


@dataclass(frozen=True, slots=True)
class Vanished:
    """An endpoint that left a TCP service port: its flows from `frontends` are ended."""

    service: str  # ns/name:port, for logs
    family: Family
    endpoint: IPAddress
    port: int
    # (address, port) the service port was reachable on; address None: any (NodePort).
    frontends: tuple[tuple[IPAddress | None, int], ...]


def enabled(service: Service, default: bool) -> bool:
    """The service's annotation, else the node's --fail-fast."""
    return default if service.fail_fast is None else service.fail_fast


def vanished(old: ResolvedServicePort | None, new: ResolvedServicePort | None,
             default: bool) -> list[Vanished]:
    """The endpoints whose flows to end when one service port goes from `old` to `new`
    (None: absent)."""
    if old is None or old.port.protocol is not Protocol.TCP:
        return []
    if not enabled((new or old).service, default):
        return []
    gone = gone_endpoints(old, new)
    if not gone:
        return []
    still = {} if new is None or new.port.protocol is not Protocol.TCP else {
        (s.endpoint.address, s.endpoint.port): s.endpoint for s in new.endpoints}
    out = []
    for address, port in sorted(gone, key=lambda e: (e[0].packed, e[1])):
        now = still.get((address, port))
        if now is not None and not (now.terminating and not now.serving):
            continue  # still listed: draining, or only not ready
        out.append(Vanished(port_name(old.key), old.key.family, address, port,
                            tuple(frontends(old))))
    return out


def vanished_between(old: Mapping[ServicePortKey, ResolvedServicePort],
                     new: Mapping[ServicePortKey, ResolvedServicePort],
                     keys: Iterable[ServicePortKey], default: bool) -> list[Vanished]:
    out: list[Vanished] = []
    for key in keys:
        before, after = old.get(key), new.get(key)
        if before is not after:
            out += vanished(before, after, default)
    return out


def flows_of(entries: Iterable[CtEntry], gone: Sequence[Vanished]
             ) -> list[tuple[CtEntry, Vanished]]:
    """The TCP entries DNATed to an endpoint in `gone` from one of its service port's
    addresses (another service using the same endpoint keeps its flows)."""
    by_endpoint: dict[tuple[IPAddress, int], list[Vanished]] = {}
    for v in gone:
        by_endpoint.setdefault((v.endpoint, v.port), []).append(v)
    out = []
    for entry in entries:
        if entry.protocol != IPPROTO_TCP or not entry.dnat:
            continue
        for v in by_endpoint.get((entry.reply_src, entry.reply_sport), ()):
            if any(dport == entry.dport and dst in (None, entry.dst)
                   for dst, dport in v.frontends):
                out.append((entry, v))
                break
    return out


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def provoking_ack(src: IPAddress, sport: int, dst: IPAddress, dport: int, seq: int,
                  ack: int) -> bytes:
    """A bare TCP ACK from src:sport to dst:dport, IP header included (for IPPROTO_RAW)."""
    v4 = isinstance(src, IPv4Address)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, _TCP_ACK, 1024, 0, 0)
    if v4:
        pseudo = src.packed + dst.packed + struct.pack("!BBH", 0, IPPROTO_TCP, len(tcp))
    else:
        pseudo = src.packed + dst.packed + struct.pack("!I3xB", len(tcp), IPPROTO_TCP)
    tcp = tcp[:16] + struct.pack("!H", _checksum(pseudo + tcp)) + tcp[18:]
    if v4:
        head = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64,
                           IPPROTO_TCP, 0, src.packed, dst.packed)
        return head[:10] + struct.pack("!H", _checksum(head)) + head[12:] + tcp
    return struct.pack("!IHBB16s16s", 6 << 28, len(tcp), IPPROTO_TCP, 64, src.packed,
                       dst.packed) + tcp


def table_script() -> str:
    """Our table, made anew (its sets empty) in one transaction. A set's element is one
    flow as its client's packets show it after DNAT: client address and port, endpoint
    address and port (so another service's flows to the same pod are never touched)."""
    chains = "".join(
        f"  chain {hook} {{\n    type filter hook {hook} priority -10; policy accept;\n"
        + "".join(f"    ct status dnat {ip} saddr . tcp sport . {ip} daddr . tcp dport "
                  f"@{_SET[family]} reject with tcp reset\n"
                  for family, ip in ((Family.V4, "ip"), (Family.V6, "ip6")))
        + "  }\n" for hook in ("forward", "output"))
    sets = "".join(
        f"  set {_SET[family]} {{\n    type {addr} . inet_service . {addr} . inet_service; "
        "flags timeout;\n  }\n"
        for family, addr in ((Family.V4, "ipv4_addr"), (Family.V6, "ipv6_addr")))
    return (f"add table inet {TABLE}\ndelete table inet {TABLE}\n"
            f"table inet {TABLE} {{\n{sets}{chains}}}\n")


def elements_script(flows: Iterable[CtEntry]) -> str:
    lines = sorted({f"add element inet {TABLE} {_SET[e.family]} {{ {e.src} . {e.sport} . "
                    f"{e.reply_src} . {e.reply_sport} timeout {REJECT_SECONDS}s }}\n"
                    for e in flows})
    return "".join(lines)


# --- kernel -----------------------------------------------------------------------------


def remove_table() -> bool:
    """--cleanup: delete our table, if there is one; whether it was there."""
    try:
        done = processes.run_recorded(["nft", "delete", "table", "inet", TABLE], "",
                                      timeout=30.0)
    except OSError:
        return False  # no nft: no table of ours either
    return done.returncode == 0


class FailFast:
    """Ends the flows of vanished endpoints, in the calling thread's network namespace
    (the data plane's thread; needs CAP_NET_ADMIN and CAP_NET_RAW)."""

    def __init__(self) -> None:
        self._table_made = False

    def end(self, gone: Sequence[Vanished]) -> int:
        """End the TCP flows to `gone`; how many were provoked. Failures are logged, never
        raised: the rules are already in place, this only hurries the clients."""
        if not gone:
            return 0
        try:
            return self._end(gone)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("failing fast the flows of vanished endpoints failed",
                        extra={"error": str(exc), "endpoints": len(gone)})
            return 0

    def _nft(self, script: str) -> None:
        done = processes.run_recorded(["nft", "-f", "-"], script, timeout=30.0)
        if done.returncode:
            raise OSError(f"nft: {done.stderr.strip()[:300]}")

    def _reject(self, elements: str) -> None:
        try:
            self._nft(elements if self._table_made else table_script() + elements)
        except OSError:
            if not self._table_made:
                raise
            self._nft(table_script() + elements)  # someone flushed our table
        self._table_made = True

    def _end(self, gone: Sequence[Vanished]) -> int:
        families = sorted({v.family for v in gone}, key=lambda f: f.label)
        sock = ConntrackSocket()
        try:
            hits = [h for family in families
                    for h in flows_of(sock.dump(family, (IPPROTO_TCP,)), gone)]
            if not hits:
                return 0
            entries = [entry for entry, _ in hits]
            # The reject first: the client's answer may come back within microseconds.
            self._reject(elements_script(entries))
            codes = sock.make_liberal(entries)
            targets = [(entry, v, self._reply_destination(sock, entry))
                       for (entry, v), code in zip(hits, codes, strict=True) if not code]
        finally:
            sock.close()
        sent = self._provoke(targets)
        log.info("reset the flows of endpoints that left", extra={
            "endpoints": sorted({f"{v.service} {format_endpoint(v.endpoint, v.port)}"
                                 for v in gone}), "flows": sent})
        return sent

    @staticmethod
    def _reply_destination(sock: ConntrackSocket, entry: CtEntry
                           ) -> tuple[IPAddress, int] | None:
        """Where the endpoint's replies go: the client itself, unless the flow was
        masqueraded (then the kernel is asked for the reply tuple)."""
        if not entry.status & IPS_SRC_NAT:
            return entry.src, entry.sport
        found = sock.reply_tuple(entry)
        if found is None:
            return None
        _proto, _src, _sport, dst, dport = found
        address = IPv4Address(dst) if entry.family is Family.V4 else IPv6Address(dst)
        return address, dport

    @staticmethod
    def _provoke(targets: Sequence[tuple[CtEntry, Vanished, tuple[IPAddress, int] | None]]
                 ) -> int:
        sent = 0
        socks: dict[Family, socket.socket] = {}
        try:
            for entry, v, destination in targets:
                if destination is None:
                    continue
                sock = socks.get(entry.family)
                if sock is None:
                    af = socket.AF_INET if entry.family is Family.V4 else socket.AF_INET6
                    sock = socks[entry.family] = socket.socket(af, socket.SOCK_RAW,
                                                               socket.IPPROTO_RAW)
                dst, dport = destination
                # Two, half the sequence space apart: a window is under 2 GiB, so one
                # of them is out of it whatever the client's numbers.
                seq, ack = secrets.randbits(32), secrets.randbits(32)
                for number in (seq, (seq + (1 << 31)) & 0xFFFFFFFF):
                    sock.sendto(provoking_ack(entry.reply_src, entry.reply_sport, dst,
                                              dport, number, ack), (str(dst), 0))
                sent += 1
                log.debug("reset a flow to a vanished endpoint", extra={
                    "service": v.service, "client": f"{entry.src}:{entry.sport}",
                    "destination": f"{entry.dst}:{entry.dport}",
                    "endpoint": f"{entry.reply_src}:{entry.reply_sport}",
                    "segment_to": format_endpoint(dst, dport)})
        finally:
            for sock in socks.values():
                sock.close()
        return sent

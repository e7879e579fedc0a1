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
3. that ACK, of a flow conntrack DNATed to the dead endpoint, meets `reject with tcp
   reset` in our own small nf_tables table (prerouting before DNAT, so the reset comes
   from the service's address even where the kernel sends it straight back out of a
   bridge port; output after DNAT, for host-network clients), for exactly those flows
   (client and endpoint addresses and ports, in a set whose elements expire after
   REJECT_SECONDS): the RST's sequence number is the client's own acknowledgement, in
   window, so the client's socket fails with ECONNRESET (measured: 25-91 ms after the
   removal; with the real agent, 33-49 ms after the slice was written; on real nodes,
   from `kubectl delete pod`: docs/reliability.md).

In IPVS mode (`FailFast(ipvs=True)`) the flows are IPVS connections. With
net.ipv4.vs.conntrack=1 (node_settings.py) each keeps a conntrack entry whose original
tuple is client -> service address and port and whose reply tuple IPVS rewrote to come
from the real server, without NAT (no IPS_DST_NAT; kernel lab: status 0x19e, the
masquerade's bits alone), so an entry is the endpoint's when its reply comes from the
endpoint and it was sent to one of the port's addresses (`proxied`). The real server of
a TCP endpoint that left drains at weight 0, its connections kept: an idle client hears
nothing. Each flow is ended in its frontend form, as the client's socket knows it:

1. the flow (client address and port, service address and port) is put in our table's
   set, where `reject with tcp reset` meets the client's packets in input (priority
   -10) and output (-150, host-network clients: after conntrack's -200): both before
   IPVS's own hooks (input 98, output -99 and -98), while the service's address is
   still the destination; after them the packet would go on to the dead real server;
2. a bare out-of-window ACK is sent from the service's address and port to the client
   from a raw socket, untracked by the same table (output at priority raw). Tracked,
   it is a new flow whose reply tuple is the IPVS connection's original one, and it
   never reaches the client's socket (kernel lab: no reset). No liberal entry needed;
3. the client's challenge ACK meets the reject; the RST (from the service's address,
   its sequence number the client's acknowledgement) fails the socket with ECONNRESET
   (kernel lab, emulated: 3-6 ms after the segment; from the removal, see
   docs/reliability.md). Without the opt-in the client hears nothing.

"Left" (`vanished`): the endpoint got traffic of a TCP service port before the change
and none after, and is no longer in the port's slices, or is terminating and no longer
serving. A terminating endpoint that still serves keeps its connections (its pod is
draining them), and so does one that is only not ready (a failing readiness probe).
UDP and SCTP flows of such endpoints are conntrack.py's: their entries are deleted and
the next datagram goes to a live endpoint.

The table is ours alone (`inet sliceproxy-fail-fast`), beside iptables (legacy or nft)
and IPVS rules as beside our nftables mode's tables; it is made the first time a flow
is reset, with the chains of the mode's form, and holds nothing but short-lived set
elements.
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
        (s.packed, s.port): s.endpoint for s in new.endpoints}
    out = []
    for address, port in sorted(gone, key=lambda e: (e[0].packed, e[1])):
        now = still.get((address.packed, port))
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


def proxied(entry: CtEntry, ipvs: bool) -> bool:
    """Whether `entry` is a flow a service sent elsewhere: DNATed by our rules, or in
    IPVS mode answered by another address than the one the client asked (IPVS alters
    the reply tuple without NAT: no IPS_DST_NAT)."""
    return entry.reply_src != entry.dst if ipvs else entry.dnat


def flows_of(entries: Iterable[CtEntry], gone: Sequence[Vanished], ipvs: bool = False
             ) -> list[tuple[CtEntry, Vanished]]:
    """The TCP entries sent to an endpoint in `gone` from one of its service port's
    addresses (`proxied`; another service using the same endpoint keeps its flows)."""
    by_endpoint: dict[tuple[IPAddress, int], list[Vanished]] = {}
    for v in gone:
        by_endpoint.setdefault((v.endpoint, v.port), []).append(v)
    out = []
    for entry in entries:
        if entry.protocol != IPPROTO_TCP or not proxied(entry, ipvs):
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
    return tcp_segment(src, sport, dst, dport, seq, ack, _TCP_ACK)


def tcp_segment(src: IPAddress, sport: int, dst: IPAddress, dport: int, seq: int, ack: int,
                flags: int) -> bytes:
    """A TCP segment without payload and with `flags`, IP header and checksums included."""
    v4 = isinstance(src, IPv4Address)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, 1024, 0, 0)
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


_FLOW = "{ip} saddr . tcp sport . {ip} daddr . tcp dport @{set}"
_FLOW_BACK = "{ip} daddr . tcp dport . {ip} saddr . tcp sport @{set}"  # its other way
_RESET = f"{_FLOW} reject with tcp reset"
# A client's packet before DNAT: its own address and port, and the endpoint conntrack
# chose (the entry's reply source).
_FLOW_TO = ("ct direction original ct status dnat {ip} saddr . tcp sport . "
            "ct reply {ip} saddr . ct reply proto-src @{set} reject with tcp reset")


def _chain(name: str, hook: str, priority: str, rule: str) -> str:
    rules = "".join(f"    {rule.format(ip=ip, set=_SET[family])}\n"
                    for family, ip in ((Family.V4, "ip"), (Family.V6, "ip6")))
    return (f"  chain {name} {{\n    type filter hook {hook} priority {priority}; "
            f"policy accept;\n{rules}  }}\n")


def table_script(ipvs: bool = False) -> str:
    """Our table, made anew (its sets empty) in one transaction. A set's element is one
    flow: client address and port, then endpoint address and port (conntrack's reply
    source before DNAT, the packet's destination after: another service's flows to the
    same pod are never touched), or in IPVS mode, before IPVS, the service's address and
    port as the client's packets show them."""
    if ipvs:
        # Input and output before IPVS's hooks (98; -99 and -98): the service's address
        # is still the destination, and IPVS would send the packet on to the dead real
        # server (or drop it: expire_nodest_conn). Output after conntrack's -200. The
        # provoking segments go untracked: as a new flow, their reply tuple would be the
        # IPVS connection's original one (kernel lab: they never reached the client).
        chains = (_chain("input", "input", "-10", _RESET)
                  + _chain("output", "output", "-150", _RESET)
                  + _chain("provoke", "output", "raw", f"{_FLOW_BACK} notrack"))
    else:
        # Forwarded clients' packets in prerouting, before DNAT (-100): the reset leaves
        # from the service's address, which the client's socket knows, also where the
        # kernel sends it straight out of the bridge port the packet came in on, with no
        # NAT on that way (pods behind a bridge with br_netfilter: real nodes; a reset
        # from the endpoint's address, rejected in forward, never reached the client).
        # Host-network clients' in output, after DNAT.
        chains = (_chain("prerouting", "prerouting", "-150", _FLOW_TO)
                  + _chain("output", "output", "-10", f"ct status dnat {_RESET}"))
    sets = "".join(
        f"  set {_SET[family]} {{\n    type {addr} . inet_service . {addr} . inet_service; "
        "flags timeout;\n  }\n"
        for family, addr in ((Family.V4, "ipv4_addr"), (Family.V6, "ipv6_addr")))
    return (f"add table inet {TABLE}\ndelete table inet {TABLE}\n"
            f"table inet {TABLE} {{\n{sets}{chains}}}\n")


def elements_script(flows: Iterable[CtEntry], ipvs: bool = False) -> str:
    lines = sorted({f"add element inet {TABLE} {_SET[e.family]} {{ {e.src} . {e.sport} . "
                    + (f"{e.dst} . {e.dport}" if ipvs else f"{e.reply_src} . {e.reply_sport}")
                    + f" timeout {REJECT_SECONDS}s }}\n"
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


# A flow to provoke: its entry, the endpoint that left, the segment's source, and its
# destination (None: not known).
Target = tuple[CtEntry, Vanished, tuple[IPAddress, int], tuple[IPAddress, int] | None]


class FailFast:
    """Ends the flows of vanished endpoints, in the calling thread's network namespace
    (the data plane's thread; needs CAP_NET_ADMIN and CAP_NET_RAW). `ipvs`: the flows
    are IPVS connections (the IPVS mode), not DNATed ones."""

    def __init__(self, ipvs: bool = False) -> None:
        self.ipvs = ipvs
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
            self._nft(elements if self._table_made else table_script(self.ipvs) + elements)
        except OSError:
            if not self._table_made:
                raise
            self._nft(table_script(self.ipvs) + elements)  # someone flushed our table
        self._table_made = True

    def _end(self, gone: Sequence[Vanished]) -> int:
        families = sorted({v.family for v in gone}, key=lambda f: f.label)
        sock = ConntrackSocket()
        try:
            hits = [h for family in families
                    for h in flows_of(sock.dump(family, (IPPROTO_TCP,)), gone, self.ipvs)]
            if not hits:
                return 0
            # The reject first: the client's answer may come back within microseconds.
            self._reject(elements_script((entry for entry, _ in hits), self.ipvs))
            targets = self._targets(sock, hits)
        finally:
            sock.close()
        sent = self._provoke(targets)
        log.info("reset the flows of endpoints that left", extra={
            "endpoints": sorted({f"{v.service} {format_endpoint(v.endpoint, v.port)}"
                                 for v in gone}), "flows": sent})
        return sent

    def _targets(self, sock: ConntrackSocket, hits: Sequence[tuple[CtEntry, Vanished]]
                 ) -> list[Target]:
        """Where each flow's provoking segments go from. IPVS: from the service's address
        to the client, untracked (our table's provoke chain), as the client's socket
        knows its peer. Else as the endpoint's reply, made liberal first."""
        if self.ipvs:
            return [(e, v, (e.dst, e.dport), (e.src, e.sport)) for e, v in hits]
        codes = sock.make_liberal([entry for entry, _ in hits])
        return [(e, v, (e.reply_src, e.reply_sport), self._reply_destination(sock, e))
                for (e, v), code in zip(hits, codes, strict=True) if not code]

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
    def _provoke(targets: Sequence[Target]) -> int:
        sent = 0
        socks: dict[Family, socket.socket] = {}
        try:
            for entry, v, (src, sport), destination in targets:
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
                    sock.sendto(provoking_ack(src, sport, dst, dport, number, ack),
                                (str(dst), 0))
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

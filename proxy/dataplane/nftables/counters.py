"""Reading our named counters: a traffic reading (common/traffic.py) asks for each
counter of its plan by name, GET_BATCH requests to a datagram (common/netlink.py's
`get_each`); the data plane's own look at every counter of a family (what it may
delete) is one dump.

A reading does not dump, for two reasons. The kernel fills each 32 KiB message of a
dump by walking the family's objects from the first to where the last message ended
(`nf_tables_dump_obj`; its table filter comes after that skip): O(n^2 / counters a
message), 0.96 s of kernel time at 100,000 counters, 9.6 us each, against 0.5 at
12,500. And a commit between a dump's messages (NLM_F_DUMP_INTR) makes the walk skip
counters still there when it deleted ones before the dump's place: a reading runs on a
thread of its own beside the data plane's commits (apply.py's `traffic_reader`), and a
skipped counter would read as a reset. A get by name is found in the kernel's hash of
names: ~3 us of kernel time each at any count, whatever commits land between.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from proxy.dataplane.base import Counted, GiveWay, PortTraffic, TrafficByPort, offer_lock
from proxy.dataplane.common.netlink import NetlinkSocket
from proxy.dataplane.common.netlink_constants import NFNL_SUBSYS_NFTABLES, NFT_MSG_GETOBJ
from proxy.dataplane.common.traffic import port_traffic
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.transaction import KeptPort
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger("proxy.dataplane.nftables.apply")  # the mode's one logger

Counts = dict[tuple[str, str], int]  # (table, counter) -> packets counted
_GETOBJ = NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETOBJ
# Ports mapped (or counters decoded) between two pauses of a reading, where it offers
# the interpreter's lock or gives way to a change (common/priority.py), ~0.4 ms of
# Python: mapping 100,000 ports is ~0.4 s with no system call, during which a sync on
# the data plane's thread got the lock back only at each switch interval, after each of
# its own system calls (changes beside a reading at 100,000, back to back: p99 5.4-8.3
# ms at 500 ports or none, 2.7-3.3 ms at 100; bench/nftables/reading_beside.py).
YIELD_EVERY = 100
# What a traffic reading reads: each family's applied ports as the data plane kept them
# when the reading began (a copy of the dict; of a KeptPort it reads only its table and
# counters, which are never changed in place: a new KeptPort replaces the old).
Plan = Sequence[tuple[Family, Mapping[ServicePortKey, KeptPort]]]


class CounterReader(Protocol):
    """What a reading reads counters with: its own, usable from any thread."""

    def read(self, family: Family, keys: Iterable[tuple[str, str]],
             give_way: GiveWay = offer_lock) -> list[int | None]: ...

    def close(self) -> None: ...


class SocketReader:
    """`read_named` on a netlink socket of the reader's own (made in the network
    namespace of our tables: a socket stays in the one it was made in)."""

    def __init__(self, sock: NetlinkSocket) -> None:
        self._sock = sock

    def read(self, family: Family, keys: Iterable[tuple[str, str]],
             give_way: GiveWay = offer_lock) -> list[int | None]:
        return read_named(self._sock, family, keys, give_way)

    def close(self) -> None:
        self._sock.close()


def read_traffic(reader: CounterReader, plan: Plan, give_way: GiveWay = offer_lock
                 ) -> TrafficByPort:
    """Each port of `plan` with what its named counters (render.py) hold: the port's
    own, and its endpoints' where they are counted one by one (a counter gone since the
    plan was taken reads 0). Any thread; `reader` is the reading's own, closed here;
    `give_way` is called every YIELD_EVERY ports or counters. A family the kernel
    refuses to read is logged and left out."""
    out = TrafficByPort()
    try:
        for family, ports in plan:
            keys = ((kept.table, name) for kept in ports.values() for name, _ in kept.counters)
            try:
                counted = reader.read(family, keys, give_way)
            except OSError as exc:
                log.warning("cannot read our nftables counters", extra={
                    "family": family.label, "error": str(exc)})
                continue
            packets = iter(counted)  # in the order of `keys`: the same walk of `ports`
            for i, (key, kept) in enumerate(ports.items()):
                counters = kept.counters
                if len(counters) == 1 and counters[0][1] is None:  # the port's own only
                    out.add_connections(key, next(packets) or 0)
                else:
                    out.add(key, _port_traffic(counters, packets))
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    give_way()
    finally:
        reader.close()
    return out


def _port_traffic(counters: Sequence[tuple[str, tuple[IPAddress, int] | None]],
                  packets: Iterator[int | None]) -> PortTraffic:
    total: Counted | None = None
    endpoints: list[tuple[tuple[IPAddress, int], Counted]] = []
    for _name, endpoint in counters:
        n = Counted(next(packets) or 0)
        if endpoint is None:
            total = n
        else:
            endpoints.append((endpoint, n))
    return port_traffic(total, endpoints if endpoints else None)


def read_named(sock: NetlinkSocket, family: Family, keys: Iterable[tuple[str, str]],
               give_way: GiveWay = offer_lock) -> list[int | None]:
    """The packets each named counter of `keys` ((table, name), of `family`) has
    counted, in their order; None for one that does not exist. OSError (NetlinkError)
    if the kernel refuses. `give_way` is called every YIELD_EVERY counters."""
    out: list[int | None] = []
    packets = wire.counter_packets
    for i, body in enumerate(sock.get_each(_GETOBJ, wire.counter_requests(family, keys))):
        out.append(None if body is None else packets(body))
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            give_way()
    return out

def read_counters(sock: NetlinkSocket, family: Family, tables: Collection[str]) -> Counts:
    """The named counters of `tables` in `family`, from one dump (a commit between its
    messages can make it skip some: see above). OSError (NetlinkError) if the kernel
    refuses."""
    found: Counts = {}
    decode = wire.decode_counter
    for data, start, end in sock.dump_messages(_GETOBJ, wire.dump_request(family)):
        counter = decode(data, start, end)
        if counter is not None and counter[0] in tables:
            found[counter[0], counter[1]] = counter[2]
    return found

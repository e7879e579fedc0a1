"""Reading our named counters (the traffic readings, common/traffic.py): one dump of
the family's objects, and, where a commit landed between the dump's messages
(NLM_F_DUMP_INTR), a request by name for each counter wanted that the dump did not
return. The kernel resumes each message of a dump at an index into its list of
objects, so a deletion before that index makes the walk skip one; new objects go at
the end and skip nothing. A reading beside the data plane's commits (on a thread of
its own, apply.py's `traffic_reader`) is interrupted whenever one lands during it: a
counter it skipped would read as a reset."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

from proxy.dataplane.base import Counted, GiveWay, PortTraffic, offer_lock
from proxy.dataplane.common.netlink import NetlinkSocket
from proxy.dataplane.common.netlink_constants import NFNL_SUBSYS_NFTABLES, NFT_MSG_GETOBJ
from proxy.dataplane.common.traffic import port_traffic
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.render import OUR_TABLES
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

    def read(self, family: Family, tables: Collection[str],
             wanted: Callable[[], Iterable[tuple[str, str]]] | None = None,
             give_way: GiveWay = offer_lock) -> Counts: ...

    def close(self) -> None: ...


class SocketReader:
    """`read_counters` on a netlink socket of the reader's own (made in the network
    namespace of our tables: a socket stays in the one it was made in)."""

    def __init__(self, sock: NetlinkSocket) -> None:
        self._sock = sock

    def read(self, family: Family, tables: Collection[str],
             wanted: Callable[[], Iterable[tuple[str, str]]] | None = None,
             give_way: GiveWay = offer_lock) -> Counts:
        return read_counters(self._sock, family, tables, wanted, give_way)

    def close(self) -> None:
        self._sock.close()


def read_traffic(reader: CounterReader, plan: Plan, give_way: GiveWay = offer_lock
                 ) -> dict[ServicePortKey, PortTraffic]:
    """Each port of `plan` with what its named counters (render.py) hold: the port's
    own, and its endpoints' where they are counted one by one. Any thread; `reader` is
    the reading's own, closed here; `give_way` is called every YIELD_EVERY ports or
    counters. A family the kernel refuses to dump is logged and left out."""
    out: dict[ServicePortKey, PortTraffic] = {}
    try:
        for family, ports in plan:
            def wanted(ports: Mapping[ServicePortKey, KeptPort] = ports
                       ) -> Iterable[tuple[str, str]]:
                return ((kept.table, name) for kept in ports.values()
                        for name, _ in kept.counters)

            try:
                counted = reader.read(family, OUR_TABLES, wanted, give_way)
            except OSError as exc:
                log.warning("cannot read our nftables counters", extra={
                    "family": family.label, "error": str(exc)})
                continue
            for i, (key, kept) in enumerate(ports.items()):
                out[key] = _port_traffic(kept, counted)
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    give_way()
            _let_go(counted, give_way)
    finally:
        reader.close()
    return out


def _let_go(counted: Counts, give_way: GiveWay) -> None:
    """Empties `counted` a part at a time, pausing between: its 100,000 keys freed at
    once held the interpreter's lock for 20-30 ms (a change waited for that)."""
    while counted:
        for _ in range(min(len(counted), 100 * YIELD_EVERY)):
            counted.popitem()
        give_way()


def _port_traffic(kept: KeptPort, counted: Mapping[tuple[str, str], int]) -> PortTraffic:
    total: Counted | None = None
    endpoints: list[tuple[tuple[IPAddress, int], Counted]] = []
    for name, endpoint in kept.counters:
        n = Counted(counted.get((kept.table, name), 0))
        if endpoint is None:
            total = n
        else:
            endpoints.append((endpoint, n))
    return port_traffic(total, endpoints if endpoints else None)


def read_counters(sock: NetlinkSocket, family: Family, tables: Collection[str],
                  wanted: Callable[[], Iterable[tuple[str, str]]] | None = None,
                  give_way: GiveWay = offer_lock) -> Counts:
    """The named counters of `tables` in `family`, from one dump; if a commit interrupted
    it, each of `wanted()` ((table, name)) it did not return is asked for by name (one
    that no longer exists is left out). OSError (NetlinkError) if the kernel refuses.
    `give_way` is called every YIELD_EVERY counters decoded."""
    found: Counts = {}
    decode = wire.decode_counter
    for i, (data, start, end) in enumerate(
            sock.dump_messages(_GETOBJ, wire.dump_request(family))):
        counter = decode(data, start, end)
        if counter is not None and counter[0] in tables:
            found[counter[0], counter[1]] = counter[2]
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            give_way()
    if sock.interrupted and wanted is not None:
        missing = []  # a walk of every port (0.2 s at 100,000): the lock offered on the way
        for i, key in enumerate(wanted()):
            if key not in found:
                missing.append(key)
            if i % (10 * YIELD_EVERY) == 0:
                give_way()
        for table, name in missing:
            packets = read_counter(sock, family, table, name)
            if packets is not None:
                found[table, name] = packets
        log.debug("a commit came during the counters' dump; the ones it missed read by name",
                  extra={"family": family.label, "read_by_name": len(missing)})
    return found


def read_counter(sock: NetlinkSocket, family: Family, table: str, name: str) -> int | None:
    """The packets named counter `name` of `table` has counted; None if there is none."""
    reply = sock.get(_GETOBJ, wire.counter_request(family, table, name))
    counter = None if reply is None else wire.decode_counter(reply.payload)
    return None if counter is None else counter[2]

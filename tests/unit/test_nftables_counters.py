"""A traffic reading in nftables mode (proxy/dataplane/nftables/counters.py): the
counters read by name, in the order asked, are given back to their ports and
endpoints, a counter gone since the plan was taken reads 0, a family the kernel
refuses is left out, and the reading kept costs the cyclic collector nothing per port."""

from __future__ import annotations

import gc
import ipaddress
from collections.abc import Iterable

from proxy.dataplane.base import Counted, GiveWay, PortTraffic, offer_lock
from proxy.dataplane.nftables.counters import read_traffic
from proxy.dataplane.nftables.transaction import KeptPort
from proxy.model.types import Family, IPAddress, ServicePortKey

A, B = ipaddress.IPv4Address("198.18.0.10"), ipaddress.IPv4Address("198.18.0.9")
WEB = ServicePortKey("ns", "web", "http", Family.V4)
DB = ServicePortKey("ns", "db", "sql", Family.V4)
GONE = ServicePortKey("ns", "gone", "http", Family.V4)


def _kept(table: str, counters: tuple[tuple[str, tuple[IPAddress, int] | None], ...]
          ) -> KeptPort:
    return KeptPort(table=table, chains=(), rendered=(), sets=(), slots=(), counters=counters)


class _Reader:
    """The kernel's counters by (table, name); a family in `refused` is refused."""

    def __init__(self, held: dict[tuple[str, str], int], refused: Iterable[Family] = ()) -> None:
        self.held, self.refused = held, set(refused)
        self.asked: list[tuple[str, str]] = []
        self.closed = False

    def read(self, family: Family, keys: Iterable[tuple[str, str]],
             give_way: GiveWay = offer_lock) -> list[int | None]:
        if family in self.refused:
            raise OSError(1, "refused")
        keys = list(keys)
        self.asked += keys
        return [self.held.get(key) for key in keys]

    def close(self) -> None:
        self.closed = True


def test_each_counter_read_goes_back_to_its_port_and_endpoint() -> None:
    plan = [(Family.V4, {
        WEB: _kept("t1", (("web-cnt", None), ("web-a", (A, 80)), ("web-b", (B, 80)))),
        DB: _kept("t2", (("db-a", (A, 5432)),)),  # counted per endpoint only
        GONE: _kept("t1", (("gone-cnt", None),)),
    })]
    reader = _Reader({("t1", "web-cnt"): 7, ("t1", "web-a"): 3, ("t1", "web-b"): 4,
                      ("t2", "db-a"): 5, ("t1", "db-a"): 99})
    read = read_traffic(reader, plan, lambda: None)
    assert read == {
        WEB: PortTraffic(Counted(7), {(A, 80): Counted(3), (B, 80): Counted(4)}),
        DB: PortTraffic(Counted(5), {(A, 5432): Counted(5)}),
        GONE: PortTraffic(Counted(0)),  # its counter deleted since the plan was taken
    }
    assert reader.asked == [("t1", "web-cnt"), ("t1", "web-a"), ("t1", "web-b"),
                            ("t2", "db-a"), ("t1", "gone-cnt")]
    assert reader.closed


def test_a_family_the_kernel_refuses_is_left_out() -> None:
    v6 = ServicePortKey("ns", "web", "http", Family.V6)
    plan = [(Family.V6, {v6: _kept("t6", (("c6", None),))}),
            (Family.V4, {WEB: _kept("t1", (("web-cnt", None),))})]
    reader = _Reader({("t1", "web-cnt"): 2, ("t6", "c6"): 1}, refused=[Family.V6])
    assert read_traffic(reader, plan, lambda: None) == {WEB: PortTraffic(Counted(2))}
    assert reader.closed


def test_a_kept_reading_adds_no_object_the_collector_tracks_per_port() -> None:
    """Each tracked object a kept reading holds joins the collector's oldest generation
    and brings its next full collection nearer (93-191 ms each at 100,000 services in
    the agent, two per reading when each port was kept as objects)."""
    n = 5000
    ports = {ServicePortKey("ns", f"s{i}", "http", Family.V4): _kept("t1", ((f"c{i}", None),))
             for i in range(n)}
    reader = _Reader({("t1", f"c{i}"): i for i in range(n)})
    was_on = gc.isenabled()
    gc.disable()  # no collection between the two counts
    try:
        before = len(gc.get_objects())
        read = read_traffic(reader, [(Family.V4, ports)], lambda: None)
        reader.asked.clear()  # the names it was asked for: this test's, not the reading's
        added = len(gc.get_objects()) - before
    finally:
        if was_on:
            gc.enable()
    assert read[ServicePortKey("ns", "s4321", "http", Family.V4)] == PortTraffic(Counted(4321))
    assert added < 50
